"""mlx-vlm (>= 0.5)'s Qwen3-VL-MoE language model (a copy of Qwen3-VL's): each row of a batched prefill at its own positions.

Bug
    Those of ``mlx-vlm-qwen3-vl-prefill-positions`` (its docstring has the details), in the
    separate copy of the Qwen3-VL language model that Qwen3-VL-MoE has: a left-padded row of a
    batched prefill without positions placed ``padding`` positions late, and a prefill given
    positions losing its ``rope_deltas`` for the first decode step (< 0.6.5).

Fix
    The same wrapper of ``LanguageModel.__call__`` (``mechanisms/vlm_positions.py``).

Retire
    As ``mlx-vlm-qwen3-vl-prefill-positions``.

Metal
    Same modules and kernels as the stock forward; only the position ids differ.
"""

from mlx_lm_patches.mechanisms.vlm_positions import prefill_positions_patch

apply, probe, scenario = prefill_positions_patch("mlx_vlm.models.qwen3_vl_moe.language", "qwen3_vl_moe")

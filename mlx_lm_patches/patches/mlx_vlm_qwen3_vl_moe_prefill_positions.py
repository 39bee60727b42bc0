"""mlx-vlm (>= 0.5)'s Qwen3-VL-MoE language model (a copy of Qwen3-VL's): each row of a batched prefill at its own positions.

Bug
    Those of ``mlx-vlm-qwen3-vl-prefill-positions`` (its docstring has the details), in the
    separate copy of the Qwen3-VL language model that Qwen3-VL-MoE has: a left-padded row of a
    batched prefill without positions placed ``padding`` positions late, and a prefill given
    positions losing its ``rope_deltas`` for the first decode step (< 0.6.5).

Fix
    The same wrapper of ``LanguageModel.__call__`` (``mechanisms/vlm_positions.py``).

Affected
    mlx-vlm >= 0.5.0 (the probe decides). Measured with tiny models, prompts of 5/9/13 tokens
    inserted one by one into mlx-vlm's ``BatchGenerator``: wrong on 0.5.0, 0.6.0 and 0.6.4,
    exact with the fix.

Upstream
    https://github.com/Blaizzy/mlx-vlm/blob/v0.6.0/mlx_vlm/models/qwen3_vl_moe/language.py
    (``LanguageModel.__call__``); the deltas kept from
    https://github.com/Blaizzy/mlx-vlm/blob/v0.6.5/mlx_vlm/models/qwen3_vl_moe/language.py.

Retire
    As ``mlx-vlm-qwen3-vl-prefill-positions``.

Metal
    Same modules and kernels as the stock forward; only the position ids differ.
"""

from mlx_lm_patches.mechanisms.vlm_positions import prefill_positions_patch

apply, probe, scenario = prefill_positions_patch("mlx_vlm.models.qwen3_vl_moe.language", "qwen3_vl_moe")

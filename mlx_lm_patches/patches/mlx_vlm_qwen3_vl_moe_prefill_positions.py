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

LANGUAGE = "mlx_vlm.models.qwen3_vl_moe.language"
apply, probe = prefill_positions_patch(LANGUAGE, "qwen3_vl_moe")


def scenario():
    """The tiny random-weight model: prompts of 5, 9 and 13 tokens inserted one by one into
    mlx-vlm's ``BatchGenerator``, and its language model prefilling a padded batch without
    positions, equal each prompt alone."""
    from mlx_lm_patches.selftest.vlm.positions import prefill_positions_scenario

    return prefill_positions_scenario(LANGUAGE, "qwen3_vl_moe")

"""mlx-vlm (>= 0.5)'s Qwen3.5 language model (and Qwen3.5-MoE's, its subclass): each row of a batched prefill at its own positions.

Bug
    The two position bugs of ``mlx-vlm-qwen3-vl-prefill-positions`` (its docstring has the
    details), in this language model: a batched prefill of left-padded rows on empty batch
    caches without ``position_ids`` places a padded row's prompt ``padding`` positions late
    (mlx-vlm's own ``BatchGenerator`` feeds rows so up to 0.6.3), and a prefill given positions
    leaves ``_rope_deltas`` unset so the first decode step recomputes positions from 0 (0.6.4's
    generator hands them over; < 0.6.5). Every shorter prompt of a batch is answered wrong
    (silently).

Fix
    The same wrapper of ``LanguageModel.__call__``
    (``mlx_lm_patches/mechanisms/vlm_positions.py``, ``prefill_positions_call``).

Retire
    As ``mlx-vlm-qwen3-vl-prefill-positions``.

Metal
    Same modules and kernels as the stock forward; only the position ids differ.
"""

from mlx_lm_patches.mechanisms.vlm_positions import prefill_positions_patch

LANGUAGE = "mlx_vlm.models.qwen3_5.language"
apply, probe = prefill_positions_patch(LANGUAGE, "qwen3_5")


def scenario():
    """The tiny random-weight model: prompts of 5, 9 and 13 tokens inserted one by one into
    mlx-vlm's ``BatchGenerator``, and its language model prefilling a padded batch without
    positions, equal each prompt alone."""
    from mlx_lm_patches.selftest.vlm.positions import prefill_positions_scenario

    return prefill_positions_scenario(LANGUAGE, "qwen3_5")

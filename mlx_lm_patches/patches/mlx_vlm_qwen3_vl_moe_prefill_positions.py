"""mlx-vlm (>= 0.5)'s Qwen3-VL-MoE language model (a copy of Qwen3-VL's): each row of a batched prefill at its own positions.

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

import sys

from mlx_lm_patches.mechanisms import vlm_positions

MODULE = "mlx_vlm.models.qwen3_vl_moe.language"


def apply(p):
    p.wrap(f"{MODULE}:LanguageModel.__call__", vlm_positions.prefill_positions_call)


def probe():
    from mlx_lm_patches.demos.tiny_vlm_models import prefill_positions_problem

    return prefill_positions_problem(sys.modules[MODULE], "qwen3_vl_moe")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3-VL-MoE: prompts of 5, 9 and 13 tokens inserted one by one
    into mlx-vlm's ``BatchGenerator``, and its language model prefilling a padded batch without
    positions, equal each prompt alone."""
    from mlx_lm_patches.demos.tiny_vlm_models import prefill_positions_scenario

    return prefill_positions_scenario(sys.modules[MODULE], "qwen3_vl_moe")

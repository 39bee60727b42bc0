"""mlx-vlm's Qwen3-VL language model decodes in batches: per-row positions, padding masked.

Bug
    mlx-vlm (<= 0.4.x) batches Qwen3-VL with mlx-lm's ``BatchKVCache``, whose ``offset`` is a
    per-row ``mx.array``. ``LanguageModel.__call__`` reduces it to ``offset[0].item()``: every
    row gets row 0's rotary positions. And ``Qwen3VLModel.__call__`` builds its mask with
    ``create_attention_mask(h, cache)`` from the cache *list*, which has no ``make_mask``, so the
    left padding is never masked. Batched text generation with prompts of different lengths
    (mlx-vlm's ``BatchGenerator``, mlx-lm's ``BatchGenerator`` driving the language model) is
    silently wrong on every row. Once the padding is masked, the attention's
    ``mask[..., :L + cache.offset + 1]`` raises "Slice indices must be integers or None" (<= 0.4.0),
    as in Qwen3.5.

Fix
    With per-row offsets: ``LanguageModel.__call__`` passes ``position_ids`` ``offset[row] + t``
    (text only; image/video positions at different row offsets are refused),
    ``Qwen3VLModel.__call__`` gets the mask of the first layer's batch cache (its left padding),
    and the attention runs the stock code with a read-only view of the cache whose ``offset`` is
    the int padded length. Single-sequence calls run the stock code. See
    ``mlx_lm_patches/mechanisms/vlm_positions.py``.

Retire
    When mlx-vlm < 0.5.0 is no longer supported.

Metal
    Same modules and kernels as the stock forward; only the position ids, the mask and the int
    the mask slice reads differ.
"""

import sys

from mlx_lm_patches.mechanisms import vlm_positions

MODULE = "mlx_vlm.models.qwen3_vl.language"


def apply(p):
    vlm_positions.wrap_qwen3_vl_language(p, MODULE, "Qwen3VLModel")


def probe():
    """Evidence that a one-layer Qwen3-VL language model gives a left-padded row of a
    ``BatchKVCache`` batch something else than the row alone (or raises)."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import batched_rows_problem

    return batched_rows_problem(sys.modules[MODULE], "qwen3_vl")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3-VL: prompts of 5, 9 and 13 tokens through mlx-vlm's
    ``BatchGenerator`` and mlx-lm's equal each prompt alone through mlx-vlm's ``generate_step``."""
    from mlx_lm_patches.selftest.vlm.batching import scenario_outcome

    return scenario_outcome("qwen3_vl", only=("mlx-vlm", "mlx-lm"), before_rows=True)

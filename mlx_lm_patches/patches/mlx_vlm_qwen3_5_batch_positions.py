"""mlx-vlm's Qwen3.5 language model decodes in batches: per-row positions, no mask-slice crash.

Bug
    mlx-vlm (<= 0.4.x) batches Qwen3.5 / Qwen3.5-MoE with mlx-lm's ``BatchKVCache``, whose
    ``offset`` is a per-row ``mx.array``. ``Qwen3_5Attention.__call__`` then computes
    ``kv_seq_len = L + cache.offset + 1`` and slices ``mask[..., :kv_seq_len]``: every batched
    forward (mlx-vlm's ``BatchGenerator`` / ``batch_generate``, or mlx-lm's ``BatchGenerator``
    driving the language model) raises ``ValueError: Slice indices must be integers or None``
    (mlx-vlm <= 0.4.0). Past that, ``LanguageModel.__call__`` reduces the offset to
    ``offset[0].item()``: every row gets row 0's rotary positions, silently wrong as soon as the
    rows differ in length (<= 0.4.4).

Fix
    With per-row offsets: ``LanguageModel.__call__`` passes ``position_ids`` ``offset[row] + t``
    (text only; image/video positions at different row offsets are refused), and the attention
    runs the stock code with a read-only view of the cache whose ``offset`` is the int padded
    length (the mask slice then keeps the whole mask; ``update_and_fetch`` goes to the cache
    itself). Single-sequence calls run the stock code. See ``mlx_lm_patches/mechanisms/vlm_positions.py``.
    Exact batched Qwen3.5 also needs ``mlx-vlm-gated-delta-advance``.

Retire
    When mlx-vlm < 0.5.0 is no longer supported.

Metal
    Same modules and kernels as the stock forward; only the position ids and the int the mask
    slice reads differ.
"""

import sys

from mlx_lm_patches.mechanisms import vlm_positions

MODULE = "mlx_vlm.models.qwen3_5.language"


def apply(p):
    p.wrap(f"{MODULE}:LanguageModel.__call__",
           vlm_positions.language_model_call(lambda language_model: language_model.model.fa_idx))
    p.wrap(f"{MODULE}:Qwen3_5Attention.__call__", vlm_positions.attention_call)


def probe():
    """Evidence that a one-layer Qwen3.5 language model (attention only) raises, or gives a
    left-padded row of a ``BatchKVCache`` batch something else than the row alone."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import batched_rows_problem

    return batched_rows_problem(sys.modules[MODULE], "qwen3_5")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5: prompts of 5, 9 and 13 tokens through mlx-vlm's
    ``BatchGenerator`` equal each prompt alone through mlx-vlm's ``generate_step``."""
    from mlx_lm_patches.selftest.vlm.batching import scenario_outcome

    return scenario_outcome("qwen3_5", only=("mlx-vlm", "mlx-lm"), before_rows=True)

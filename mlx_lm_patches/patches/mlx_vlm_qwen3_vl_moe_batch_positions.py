"""mlx-vlm's Qwen3-VL-MoE language model decodes in batches: per-row positions, padding masked.

Bug
    mlx-vlm (<= 0.4.x) ships Qwen3-VL-MoE as a copy of its Qwen3-VL language model (MoE blocks in
    place of the MLPs) with the same batching bugs: with mlx-lm's ``BatchKVCache`` (a per-row
    ``offset``) ``LanguageModel.__call__`` gives every row row 0's rotary positions,
    ``Qwen3VLMoEModel.__call__`` builds its mask from the cache list (left padding never
    masked), and once it is masked the attention's ``mask[..., :L + cache.offset + 1]`` raises.
    Batched text generation of prompts of different lengths (mlx-vlm's ``BatchGenerator``,
    mlx-lm's ``BatchGenerator`` driving the language model) is silently wrong.

Fix
    The Qwen3-VL fix (``mlx-vlm-qwen3-vl-batch-positions``) on this module's classes: per-row
    ``position_ids`` ``offset[row] + t`` for text (image/video rows at different offsets are
    refused), the first layer's batch-cache mask, and the stock attention on a read-only view
    whose ``offset`` is the int padded length. See ``mlx_lm_patches/mechanisms/vlm_positions.py``.

Retire
    When mlx-vlm < 0.5.0 is no longer supported.

Metal
    Same modules and kernels as the stock forward; only the position ids, the mask and the int
    the mask slice reads differ.
"""

import sys

from mlx_lm_patches.mechanisms import vlm_positions

MODULE = "mlx_vlm.models.qwen3_vl_moe.language"


def apply(p):
    vlm_positions.wrap_qwen3_vl_language(p, MODULE, "Qwen3VLMoEModel")


def probe():
    """Evidence that a two-layer Qwen3-VL-MoE language model gives a left-padded row of a
    ``BatchKVCache`` batch something else than the row alone (or raises)."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import batched_rows_problem

    return batched_rows_problem(sys.modules[MODULE], "qwen3_vl_moe")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3-VL-MoE: prompts of 5, 9 and 13 tokens through mlx-vlm's
    ``BatchGenerator`` and mlx-lm's equal each prompt alone through mlx-vlm's ``generate_step``."""
    from mlx_lm_patches.selftest.vlm.batching import scenario_outcome

    return scenario_outcome("qwen3_vl_moe", only=("mlx-vlm", "mlx-lm"), before_rows=True)

"""mlx-vlm (>= 0.5)'s Qwen3-VL language model: each row of a batched prefill at its own positions.

Bug
    Two ways the rotary positions of a batch drift from each row's own (see
    ``mlx_lm_patches/mechanisms/vlm_positions.py``, ``prefill_positions_call``):

    * A prefill of left-padded rows on empty batch caches without ``position_ids`` (mlx-vlm's
      own ``BatchGenerator`` from 0.5.0 to 0.6.3 feeds its rows so, one request per row)
      computes positions with ``get_rope_index`` on the padded token matrix and no mask: every
      row gets 0 ... width - 1, so a padded row's prompt sits ``padding`` positions late while
      its decode steps use its own length (``offset[row] + rope_deltas``, deltas 0): every
      shorter prompt of a batch is answered wrong from its second token (silently).
    * A prefill given ``position_ids`` and ``rope_deltas`` (0.6.4's ``BatchGenerator`` hands
      each row's from ``get_input_embeddings``) leaves ``_rope_deltas`` unset, so the first
      decode step recomputes positions from 0 and places its token at position 0 (< 0.6.5).

Fix
    ``LanguageModel.__call__``: a ``rope_deltas`` it is given becomes ``_rope_deltas`` (what
    0.6.5 does); a batched prefill of two or more rows on empty batch caches with neither
    ``position_ids`` nor a mask gets each row's own positions (``t - padding[row]``) and
    ``rope_deltas`` 0; such a prefill whose tokens include image or video placeholders is
    refused with an error. mlx-vlm's forward runs with them; every other call is stock.

Retire
    When mlx-vlm's language model builds positions from its batch cache's left padding (as
    0.6's Qwen3.5 does for its mask), and mlx-vlm < 0.6.5 is no longer supported.

Metal
    Same modules and kernels as the stock forward; only the position ids differ.
"""

from mlx_lm_patches.mechanisms.vlm_positions import prefill_positions_patch

LANGUAGE = "mlx_vlm.models.qwen3_vl.language"
apply, probe = prefill_positions_patch(LANGUAGE, "qwen3_vl")


def scenario():
    """The tiny random-weight model: prompts of 5, 9 and 13 tokens inserted one by one into
    mlx-vlm's ``BatchGenerator``, and its language model prefilling a padded batch without
    positions, equal each prompt alone."""
    from mlx_lm_patches.selftest.vlm.positions import prefill_positions_scenario

    return prefill_positions_scenario(LANGUAGE, "qwen3_vl")

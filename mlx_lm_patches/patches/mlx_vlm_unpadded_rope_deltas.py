"""mlx-vlm's ``batch_generate``: a row stripped of its padding keeps a rotary offset of the row alone.

Bug
    mlx-vlm 0.7's ``batch_generate`` tokenizes the prompts into one left-padded batch and calls
    ``get_input_embeddings(input_ids, mask=attention_mask)``. For a text-only batch, Qwen-VL
    style models (Qwen3.5 / Qwen3.5-MoE, Qwen3-VL, ...) compute each row's ``rope_deltas`` as
    ``max(position) + 1 - padded width``: the row's positions start at its first real token, so
    a row with ``k`` padding tokens gets ``-k``, which is right *while the padding is in the
    row*. ``BatchGenerator.insert(..., attention_mask=)`` then strips the padding
    (``_unpad_batch_prompts``: tokens and every sequence-aligned tensor, ``position_ids``
    included) but keeps ``rope_deltas``; the generator re-pads on its own terms, so from the
    first decode step a shorter row sits ``k`` positions behind itself (silently wrong: the
    same prompt alone, or in a batch of equal lengths, decodes differently). Image rows are
    right by luck: their deltas are computed over the unmasked tokens only.

Fix
    After the stock ``_unpad_batch_prompts``, a row whose padding was stripped gets the
    ``rope_deltas`` its own remaining ``position_ids`` imply, ``max(position) + 1 - length``:
    exactly what ``get_input_embeddings`` gives that row alone (text rows: 0; image rows:
    unchanged). Rows that were not stripped, and rows without ``position_ids``, are left as
    they are.

Retire
    When ``_unpad_batch_prompts`` (or the models' ``get_rope_index``) makes the deltas of a
    stripped row the row's own: the probe then reports it not needed.

Metal
    Python-side bookkeeping of one small array per row; no kernel differs.
"""

import sys

MODULE = "mlx_vlm.generate.ar"


def _own_deltas(rows, width, prompt_kwargs):
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.vlm_positions import own_rope_deltas

    for ids, kwargs in zip(rows, prompt_kwargs):
        deltas, positions = kwargs.get("rope_deltas"), kwargs.get("position_ids")
        if len(ids) == width or not isinstance(deltas, mx.array) or not isinstance(positions, mx.array):
            continue
        kwargs["rope_deltas"] = own_rope_deltas(positions, len(ids), deltas)


def _width(prompts, attention_mask):
    shape = getattr(attention_mask, "shape", None)
    return shape[-1] if shape else None


def _unpad_keeping_own_deltas(wrapped, instance, args, kwargs):
    rows, prompt_kwargs = wrapped(*args, **kwargs)
    attention_mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    width = _width(args[0] if args else kwargs.get("prompts"), attention_mask)
    if width is not None:
        _own_deltas(rows, width, prompt_kwargs)
    return rows, prompt_kwargs


def apply(p):
    p.wrap(f"{MODULE}:_unpad_batch_prompts", _unpad_keeping_own_deltas)


def probe():
    """Evidence that ``_unpad_batch_prompts`` strips a padded row's columns but keeps the
    ``rope_deltas`` computed against the padded width."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import unpadded_deltas_problem

    return unpadded_deltas_problem(sys.modules[MODULE])


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5: prompts of 5, 9 and 13 tokens fed to mlx-vlm's
    ``BatchGenerator`` as ``batch_generate`` feeds them (one padded batch, its attention mask
    and embeddings) equal each prompt alone through mlx-vlm's ``generate_step``."""
    from mlx_lm_patches.selftest.vlm.batch_generate import batch_generate_scenario

    return batch_generate_scenario("qwen3_5", "stripped")

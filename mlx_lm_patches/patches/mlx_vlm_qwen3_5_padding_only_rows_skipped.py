"""mlx-vlm 0.6.0 - 0.6.4's Qwen3.5: a batched chunk that is only padding for a row no longer crashes.

Bug
    Qwen3.5's language model (``Qwen3_5Model``, also Qwen3.5-MoE's) runs a left-padded batch
    row by row on 0.6.0 - 0.6.4, each row from its first real token, then merges the rows'
    caches. A chunk that holds only padding for a row leaves that row nothing to run, and the
    model raises ("[reshape] Cannot infer the shape of an empty array"). mlx-vlm's
    ``BatchGenerator`` prefills in chunks of ``prefill_step_size`` (2048 by default) and ends a
    chunk at each prefix-cache snapshot, so any batch whose longest prompt is longer than a
    shorter one by at least a chunk - a short chat beside a long document, through
    ``mlx_vlm.batch_generate``, its server, its speculative server prefill, or an engine calling
    the model - fails (loud; stock, and with our other fixes).

Fix
    What mlx-vlm 0.6.5 does, around the model's own call: the per-row call of such a row (no
    tokens) returns no hidden states and leaves the row's caches as they are (the model pads its
    output to the chunk with zeros, as for any padding), and after the merge every batch cache
    that counts positions per row gets the offsets the chunk implies (``offset + chunk``; the
    merge would put the padding-only row at 0, i.e. out of its padding) and the matching
    ``left_padding``. Rows with real tokens run the stock row path unchanged.

Retire
    When mlx-vlm < 0.6.5 is no longer supported.

Metal
    Python-side bookkeeping (an empty row skipped, offsets set); the same kernels for every row
    that runs.
"""

LANGUAGE = "mlx_vlm.models.qwen3_5.language"


def _skipping_padding_only_rows(wrapped, instance, args, kwargs):
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.calls import bind_arguments

    given = bind_arguments(wrapped, args, kwargs).arguments
    embeds, inputs = given.get("inputs_embeds"), given.get("inputs")
    length = (embeds if embeds is not None else inputs).shape[1]
    if length == 0:  # the row loop's call for a row this chunk holds only padding of
        width = embeds.shape[-1] if embeds is not None else instance.embed_tokens.weight.shape[-1]
        dtype = embeds.dtype if embeds is not None else mx.float32
        return mx.zeros((inputs.shape[0] if embeds is None else embeds.shape[0], 0, width), dtype=dtype)
    cache = given.get("cache")
    before = _offsets_if_padding_only_rows(instance, cache, length)
    out = wrapped(*args, **kwargs)
    for i, offsets in (before or {}).items():
        entry = cache[i]
        if all(hasattr(entry, name) for name in ("offset", "left_padding", "_idx")):
            entry.offset = offsets + length
            entry.left_padding = entry._idx - entry.offset
    return out


def _offsets_if_padding_only_rows(model, cache, length):
    """Each batch cache's per-row offsets before the call, if the call is a batched chunk (with
    rows still in their padding) that holds only padding for some row; else ``None``."""
    import mlx.core as mx

    if not cache or length < 2:
        return None
    first = cache[getattr(model, "fa_idx", 0)]
    offsets = getattr(first, "offset", None)
    if not isinstance(offsets, mx.array) or offsets.ndim == 0 or offsets.size < 2:
        return None
    if not bool(mx.any(-offsets >= length).item()):
        return None
    rows = offsets.size
    return {i: entry.offset[:rows] for i, entry in enumerate(cache)
            if isinstance(getattr(entry, "offset", None), mx.array) and entry.offset.ndim > 0}


def apply(p):
    p.wrap(f"{LANGUAGE}:Qwen3_5Model.__call__", _skipping_padding_only_rows)


def probe():
    """Evidence that Qwen3.5's model runs a padded chunk row by row without a case for a row the
    chunk holds only padding of."""
    import importlib

    from mlx_lm_patches.engine import bytecode

    try:
        language = importlib.import_module(LANGUAGE)
        # read from the code object, not the source (an install may ship bytecode only)
        found = bytecode.tokens(language.Qwen3_5Model.__call__)
    except (ImportError, AttributeError, TypeError):
        return None
    row_by_row = any(isinstance(t, str) and "_extract_row_cache" in t for t in found)
    # ``pad == h.shape[1]``: the case of a row the chunk holds only padding of
    padding_only_case = bytecode.contains(found, [lambda t: isinstance(t, str) and t.endswith("pad"),
                                                  "h", "shape", 1, "=="])
    if not row_by_row or padding_only_case:
        return None
    return ("mlx_vlm's Qwen3_5Model runs a padded chunk row by row from each row's first real "
            "token, with no case for a row the chunk holds only padding of")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5: prompts of 5, 9 and 13 tokens inserted one by one
    into mlx-vlm's ``BatchGenerator`` with ``prefill_step_size=3`` (the first chunks are padding
    only for the shorter rows) equal each prompt alone."""
    from mlx_lm_patches.selftest.vlm.batching import scenario_outcome

    return scenario_outcome("qwen3_5", only=("mlx-vlm",), prefill_step_size=3)

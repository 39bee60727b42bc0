"""Per-row positions for mlx-vlm's Qwen3.5 / Qwen3-VL language models in batched generation.

mlx-vlm (<= 0.4.x) batches these models with mlx-lm's ``BatchKVCache``, whose ``offset`` is a
per-row ``mx.array`` (negative by the row's left padding during the prefill). Their code wants
an int:

* ``LanguageModel.__call__`` reduces it to ``offset[0].item()`` and builds every row's rotary
  positions from row 0's offset;
* the attention computes ``kv_seq_len = L + cache.offset + 1`` and slices
  ``mask[..., :kv_seq_len]`` (mlx-vlm <= 0.4.0), which raises "Slice indices must be integers or
  None" as soon as the mask is an array (always, with a batch cache);
* without ``position_ids`` the attention calls ``mx.arange(cache.offset, cache.offset + L)``.

The wrappers here give each row the positions it has alone - ``offset[row] + t``, so a
left-padded row's tokens sit at 0 ... len - 1 and its decode steps follow its own length - and
let the attention see an int offset (the batch cache's padded length, for which the mask slice
keeps the whole mask) through a read-only view. No cache offset is ever assigned.

Text only: when image or video positions are in play (``pixel_values``, or non-zero
``_rope_deltas``), rows at one offset keep mlx-vlm's own computation (row 0's offset is every
row's), and rows at different offsets are refused with an error rather than decoded at wrong
positions.
"""

from mlx_lm_patches.mechanisms import rope_rows


class BatchedVisionPositions(NotImplementedError):
    """Batched rows at different positions with image/video rotary positions."""


def _bind(args, kwargs, names):
    call = dict(zip(names, args))
    call.update(kwargs)
    return call


def per_row_position_ids(offset, length):
    """``(3, B, L)`` rotary positions ``offset[row] + t`` (the three M-RoPE axes agree for text)."""
    import mlx.core as mx

    positions = offset[:, None] + mx.arange(length)[None, :]
    return mx.broadcast_to(positions[None], (3,) + positions.shape)


def _text_only(language_model, pixel_values) -> bool:
    import mlx.core as mx

    if pixel_values is not None:
        return False
    deltas = getattr(language_model, "_rope_deltas", None)
    return deltas is None or not mx.any(deltas != 0).item()


def language_model_call(attention_cache_index):
    """Wrapper of ``LanguageModel.__call__(inputs, inputs_embeds=None, mask=None, cache=None,
    **kwargs)``: per-row ``position_ids`` when the attention cache holds per-row offsets.
    ``attention_cache_index(instance)``: which cache entry holds an attention layer's offset."""

    def wrapper(wrapped, instance, args, kwargs):

        call = _bind(args, kwargs, ("inputs", "inputs_embeds", "mask", "cache"))
        cache = call.get("cache")
        if not cache or call.get("position_ids") is not None:
            return wrapped(*args, **kwargs)
        attention_cache = cache[attention_cache_index(instance)]
        offset = getattr(attention_cache, "offset", None)
        if not rope_rows.is_row_offsets(offset):
            return wrapped(*args, **kwargs)
        if not _text_only(instance, call.get("pixel_values")):
            if len(set(offset.tolist())) > 1:
                raise BatchedVisionPositions(
                    "mlx-lm-patches: batched rows at different positions with image or video "
                    "rotary positions are not supported by this mlx-vlm's Qwen3 language model "
                    "(it would use row 0's position for every row); batch text-only prompts, or "
                    "image prompts of one length")
            return wrapped(*args, **kwargs)
        length = call["inputs"].shape[1] if call.get("inputs") is not None else call["inputs_embeds"].shape[1]
        return wrapped(*args, **dict(kwargs, position_ids=per_row_position_ids(offset, length)))

    return wrapper


def mask_from_batch_cache(module_name):
    """Wrapper of a Qwen3-VL style ``Model.__call__(inputs, inputs_embeds=None, mask=None,
    cache=None, ...)`` that builds its mask from the cache *list* (no ``make_mask``, so left
    padding is never masked): with per-row offsets and no mask given, the mask of the first
    layer's batch cache, through ``create_attention_mask`` of ``module_name``."""
    import sys

    def wrapper(wrapped, instance, args, kwargs):
        call = _bind(args, kwargs, ("inputs", "inputs_embeds", "mask", "cache"))
        cache = call.get("cache")
        first = cache[0] if cache else None
        if call.get("mask") is not None or not rope_rows.is_row_offsets(getattr(first, "offset", None)):
            return wrapped(*args, **kwargs)
        hidden = call["inputs_embeds"] if call.get("inputs_embeds") is not None else call["inputs"]
        call["mask"] = sys.modules[module_name].create_attention_mask(hidden, first)
        return wrapped(**call)

    return wrapper


def wrap_qwen3_vl_language(p, module_name: str, model_class: str) -> None:
    """The Qwen3-VL fix on a module of its language model (Qwen3-VL, and its MoE copy):
    per-row positions in ``LanguageModel.__call__``, the batch cache's mask in
    ``<model_class>.__call__``, an int offset for the stock attention."""
    p.wrap(f"{module_name}:LanguageModel.__call__", language_model_call(lambda language_model: 0))
    p.wrap(f"{module_name}:{model_class}.__call__", mask_from_batch_cache(module_name))
    p.wrap(f"{module_name}:Attention.__call__", attention_call)


class IntOffsetView:
    """A batch cache as mlx-vlm's attention expects it: ``offset`` an int (the cache's padded
    length, so ``mask[..., :L + offset + 1]`` keeps the whole mask), everything else - above all
    ``update_and_fetch`` - the cache itself. Nothing is written to the cache through the view."""

    __slots__ = ("_cache", "offset")

    def __init__(self, cache, offset: int):
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "offset", offset)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_cache"), name)

    def __setattr__(self, name, value):
        raise AttributeError(f"read-only view of {type(self._cache).__name__}: cannot set {name}")


def attention_call(wrapped, instance, args, kwargs):
    """Wrapper of the attention ``__call__(x, mask=None, cache=None, position_ids=None)``: with a
    per-row offset, per-row positions (if none were given) and an int-offset view of the cache."""
    import mlx.core as mx

    call = _bind(args, kwargs, ("x", "mask", "cache", "position_ids"))
    cache = call.get("cache")
    offset = getattr(cache, "offset", None) if cache is not None else None
    if not rope_rows.is_row_offsets(offset):
        return wrapped(*args, **kwargs)
    x, mask, position_ids = call["x"], call.get("mask"), call.get("position_ids")
    if position_ids is None:
        position_ids = per_row_position_ids(offset, x.shape[1])
    padded = getattr(cache, "_idx", None)
    if not isinstance(padded, int):
        padded = mask.shape[-1] if isinstance(mask, mx.array) else 0
    return wrapped(x, mask, IntOffsetView(cache, padded), position_ids)


def own_rope_deltas(position_ids, length: int, rope_deltas):
    """The ``rope_deltas`` of a row whose real tokens have ``position_ids`` (sequence on the last
    axis, padding excluded) and number ``length``: ``max(position) + 1 - length``, what
    ``get_rope_index`` gives the row alone (0 for text; the image/video shift otherwise), in
    the shape and dtype of the row's ``rope_deltas``."""
    import mlx.core as mx

    own = position_ids.max().astype(mx.int64) + 1 - length
    return mx.broadcast_to(own, rope_deltas.shape).astype(rope_deltas.dtype)


def _attention_batch_cache(cache, rows: int):
    """The first attention batch cache of ``rows`` rows in ``cache`` (recurrent caches have no
    ``keys``), or None."""
    import mlx.core as mx

    for entry in cache or ():
        padding = getattr(entry, "left_padding", None)
        if isinstance(padding, mx.array) and hasattr(entry, "keys"):
            return entry if padding.ndim == 1 and padding.size == rows else None
    return None


def _text_deltas(language_model) -> bool:
    import mlx.core as mx

    deltas = getattr(language_model, "_rope_deltas", None)
    return isinstance(deltas, mx.array) and not mx.any(deltas != 0).item()


def _vision_token_ids(language_model):
    config = getattr(language_model, "config", None)
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return {int(v) for v in (getattr(config, n, None) for n in names) if isinstance(v, int)}


def prefill_positions_call(wrapped, instance, args, kwargs):
    """Wrapper of ``LanguageModel.__call__(inputs, inputs_embeds=None, mask=None, cache=None,
    **kwargs)`` of mlx-vlm (>= 0.5)'s Qwen3.5 / Qwen3-VL language models:

    * a ``rope_deltas`` the call is given becomes the model's ``_rope_deltas`` (as from mlx-vlm
      0.6.5), so the decode steps after a prefill given its positions continue from them
      instead of recomputing positions from 0;
    * a prefill of two or more rows that starts on empty batch caches and is given neither
      ``position_ids`` nor a mask gets each row's own positions (its real tokens at 0 ... n - 1,
      the left padding before them) and text rows' ``rope_deltas`` 0, so the decode steps
      (``offset[row] + rope_deltas``) continue where the row alone would. Rows holding image or
      video tokens are refused there (their positions need the image grids, which this call
      does not see);
    * a later chunk of such a prefill (``prefill_step_size``) while some row is still in its
      padding (a negative offset) gets ``offset[row] + t``: Qwen3.5 clamps the offsets at 0,
      which moves the rest of that row's prompt.

    Everything else runs the stock code unchanged."""
    import mlx.core as mx

    call = _bind(args, kwargs, ("inputs", "inputs_embeds", "mask", "cache"))
    if isinstance(call.get("rope_deltas"), mx.array):
        instance._rope_deltas = call["rope_deltas"]
    inputs = call.get("inputs")
    if (inputs is None or inputs.ndim != 2 or inputs.shape[0] < 2 or call.get("mask") is not None
            or call.get("position_ids") is not None or call.get("attention_mask") is not None):
        return wrapped(*args, **kwargs)
    batch_cache = _attention_batch_cache(call.get("cache"), inputs.shape[0])
    if batch_cache is None:
        return wrapped(*args, **kwargs)
    if batch_cache.keys is not None:
        # a later prefill chunk of text rows, some still in their padding: positions from the
        # (negative) offsets as they are (Qwen3.5 clamps them at 0, shifting the rows' tokens)
        offset = getattr(batch_cache, "offset", None)
        if inputs.shape[1] > 1 and rope_rows.is_row_offsets(offset) and _text_deltas(instance) \
                and mx.any(offset < 0).item():
            return wrapped(*args, **dict(kwargs, position_ids=per_row_position_ids(offset, inputs.shape[1])))
        return wrapped(*args, **kwargs)
    padding = batch_cache.left_padding
    vision = _vision_token_ids(instance)
    if vision and not vision.isdisjoint(inputs.reshape(-1).tolist()):
        raise BatchedVisionPositions(
            "mlx-lm-patches: this mlx-vlm prefills batched image or video prompts at the padded "
            "batch's positions, not each prompt's own (wrong answers); send such prompts one at "
            "a time")
    positions = per_row_position_ids(-padding, inputs.shape[1])
    instance._position_ids = positions
    instance._rope_deltas = mx.zeros((inputs.shape[0], 1), dtype=mx.int32)
    return wrapped(*args, **dict(kwargs, position_ids=positions))


def prefill_positions_patch(module_name: str, model_type: str):
    """``apply`` and ``probe`` of a ``mlx-vlm-*-prefill-positions`` patch on the language module
    ``module_name`` (the tiny ``model_type`` model for the probe; the patch's scenario is the
    self-test kit's ``prefill_positions_scenario``)."""
    import sys

    def apply(p):
        p.wrap(f"{module_name}:LanguageModel.__call__", prefill_positions_call)

    def probe():
        """Evidence that a two-layer language model prefilling two rows (one left-padded) on
        mlx-vlm's empty batch caches without positions, or prefilled with handed positions and
        then decoding, places a row's token elsewhere than the row alone."""
        from mlx_lm_patches.mechanisms.probing.vlm_problems import prefill_positions_problem

        return prefill_positions_problem(sys.modules[module_name], model_type)

    return apply, probe

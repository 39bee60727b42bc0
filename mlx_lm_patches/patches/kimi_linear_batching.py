"""kimi_linear batches on mlx-lm <= 0.30.6: tuple cache slots and the short-conv ``lengths`` bug.

Bug
    kimi_linear keeps its three short-convolution states as one tuple in ``cache[0]``. Before
    0.30.7 the batching methods of ``ArraysCache`` (``filter``, ``extend``, ``extract``,
    ``merge``) treat every slot as an array, so batched generation fails as soon as rows are
    joined, split or handed back (``concatenate(): incompatible function arguments``, ``tuple
    indices must be integers``). And ``ShortConv1d.__call__`` reads ``cache.lengths`` - a name
    that does not exist in that function - whenever ``lengths`` is passed:
    ``NameError: name 'cache' is not defined``.

Fix
    * The four ``ArraysCache`` batching methods see tuple slots as what they are: the method is
      applied to each array of the tuple, and the tuple rebuilt. Array slots are untouched.
    * ``ShortConv1d.__call__`` gets ``lengths=None`` when every row's length equals the number of
      new tokens (rows prefilled alone, as ``batch-prefill-per-row`` does): then the state the
      ``lengths`` branch would keep is exactly the last ``kernel_size - 1`` inputs, which the
      ``lengths=None`` branch keeps. Other calls are passed through unchanged.

Retire
    When 0.30.6 drops out of the supported range.

Metal
    Python-side bookkeeping; the model's own kernels run unchanged.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"
KIMI = "mlx_lm.models.kimi_linear"


class _TupleSlots:
    """Run an ArraysCache method with each tuple slot split into one slot per element."""

    def __init__(self, cache):
        self.cache = cache
        self.layout = [len(s) if isinstance(s, tuple) else None for s in cache.cache]

    def flatten(self, slots):
        flat = []
        for slot, n in zip(slots, self.layout):
            flat.extend(slot if n is not None else (slot,))
        return flat

    def unflatten(self, flat):
        slots, i = [], 0
        for n in self.layout:
            if n is None:
                slots.append(flat[i])
                i += 1
            else:
                slots.append(tuple(flat[i:i + n]))
                i += n
        return slots


def _has_tuples(cache) -> bool:
    return any(isinstance(s, tuple) for s in getattr(cache, "cache", ()))


def _flattened(cache, layout):
    cache.cache = layout.flatten(cache.cache)


def _tuple_aware(wrapped, instance, args, kwargs):
    """filter/extend/extract on a cache holding tuple slots."""
    others = [a for a in args if _has_tuples(a)]
    if not _has_tuples(instance):
        return wrapped(*args, **kwargs)
    layout = _TupleSlots(instance)
    _flattened(instance, layout)
    for other in others:
        _flattened(other, _TupleSlots(other))
    try:
        result = wrapped(*args, **kwargs)
    finally:
        instance.cache = layout.unflatten(instance.cache)
        for other in others:
            other.cache = layout.unflatten(other.cache)
    if hasattr(result, "cache") and result is not instance:
        result.cache = layout.unflatten(result.cache)
    return result


def _merge(wrapped, instance, args, kwargs):
    caches = list(args[0] if args else kwargs["caches"])
    with_tuples = [c for c in caches if _has_tuples(c)]
    if not with_tuples:
        return wrapped(*args, **kwargs)
    layout = _TupleSlots(with_tuples[0])
    flat = [len(layout.flatten(c.cache)) for c in with_tuples]
    for c in caches:
        c.cache = layout.flatten(c.cache) if _has_tuples(c) else [None] * flat[0]
    try:
        merged = wrapped(caches)
    finally:
        for c in caches:
            c.cache = layout.unflatten(c.cache)
    merged.cache = layout.unflatten(merged.cache)
    return merged


def _short_conv(wrapped, instance, args, kwargs):
    x = args[0] if args else kwargs["x"]
    lengths = args[3] if len(args) > 3 else kwargs.get("lengths")
    if lengths is not None and all(int(n) == x.shape[1] for n in lengths.tolist()):
        if len(args) > 3:
            args = args[:3] + (None,) + args[4:]
        else:
            kwargs = dict(kwargs, lengths=None)
    return wrapped(*args, **kwargs)


def probe():
    import mlx.core as mx

    cache = sys.modules[CACHE].ArraysCache(2)
    cache[0] = (mx.zeros((2, 1)), mx.ones((2, 1)))
    cache[1] = mx.zeros((2, 1))
    try:
        cache.filter(mx.array([1]))
    except Exception as exc:
        return f"ArraysCache.filter of a cache with a tuple slot raises {type(exc).__name__}"
    return None


def apply(p):
    arrays_cache = p.module(CACHE).ArraysCache
    for name in ("filter", "extend", "extract"):
        if name in vars(arrays_cache):
            p.wrap(f"{CACHE}:ArraysCache.{name}", _tuple_aware)
    if "merge" in vars(arrays_cache):
        p.wrap(f"{CACHE}:ArraysCache.merge", _merge)
    p.wrap(f"{KIMI}:ShortConv1d.__call__", _short_conv)


def scenario():
    """kimi_linear batched: different lengths, a late insert, pre-filled prompt caches."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batching_situations, prefill
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "kimi_linear" not in available_model_types():
        return Outcome.not_applicable("no kimi_linear in this mlx-lm")
    model = build_tiny_model("kimi_linear", seed=1)
    probe_cache = make_prompt_cache(model)
    prefill(model, prompt_tokens(3), probe_cache)
    if not any(isinstance(s, tuple) for c in probe_cache for s in getattr(c, "cache", ())):
        return Outcome.not_applicable("this kimi_linear keeps no tuples in its cache slots")
    problem = batching_situations(model, "kimi_linear")
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, "kimi_linear batches exactly", ["kimi_linear: 3 situations x 3 prompts exact"])

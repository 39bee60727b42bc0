"""``ArraysCache()`` without ``size``: the cache sizes itself on first write.

Bug
    ``ArraysCache.__init__(self, size, left_padding=None)`` requires ``size`` in every release.
    Downstream code that papered over the removal of ``MambaCache`` with
    ``MambaCache = ArraysCache`` (vllm-mlx, vllm-metal, forks) then fails with
    ``TypeError: ArraysCache.__init__() missing 1 required positional argument: 'size'`` - in
    vllm-mlx's continuous batching this became an endless error loop.

Fix
    Wrap ``ArraysCache.__init__``: when ``size`` is missing, ``None`` or ``0``, the cache gets an
    empty slot list that grows when a slot is first written; reading a slot not written yet gives
    ``None``, exactly what a sized, fresh cache gives. So models (which test ``cache[0] is None``
    and then write ``cache[0]``, ``cache[1]``), ``empty()``, ``state``, saving and loading,
    ``merge`` (which builds ``cls(len(cache))``) and ``extract`` all behave as with the right
    size. Calls that pass a size are untouched. The one thing an unsized cache cannot do is be
    unpacked before its first write (kimi_linear does ``conv_state, ssm_state = cache``): its
    number of slots is unknown then, so iterating it raises a ``TypeError`` saying to pass
    ``size=`` - never a guess. (``ArraysCache.__iter__`` is added for that; for sized caches it
    iterates the slots exactly as Python's sequence protocol did.)

Retire
    When mlx-lm's ``ArraysCache`` accepts being built without a size in every supported release.

Metal
    Python-side bookkeeping only; the model forward and its kernels are unchanged.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"


class AutoSizedSlots(list):
    """Cache slots that grow when written; an unwritten slot reads as ``None``."""

    def __getitem__(self, index):
        if isinstance(index, int) and index >= len(self):
            return None
        return super().__getitem__(index)

    def __setitem__(self, index, value):
        if isinstance(index, int) and index >= len(self):
            self.extend([None] * (index + 1 - len(self)))
        super().__setitem__(index, value)


def _init_wrapper(wrapped, instance, args, kwargs):
    if args:
        size, rest = args[0], args[1:]
    else:
        size, rest = kwargs.pop("size", None), ()
    if size is None or size == 0:
        wrapped(0, *rest, **kwargs)
        instance.cache = AutoSizedSlots()
        return None
    return wrapped(size, *rest, **kwargs)


def _iter(self):
    slots = self.cache
    if isinstance(slots, AutoSizedSlots) and not slots:
        raise TypeError(
            "this ArraysCache was built without a size and nothing was written to it yet, so "
            "its number of slots is unknown and it cannot be unpacked; build it with "
            "ArraysCache(size=n) (the model's make_cache() shows n)"
        )
    return iter(list(slots))


def probe():
    arrays_cache = sys.modules[CACHE].ArraysCache
    try:
        cache = arrays_cache()
        cache[1] = None
        cache[0]
        cache.state
    except Exception as exc:
        return f"ArraysCache() raises {type(exc).__name__}: {exc}"
    return None


def apply(p):
    p.wrap(f"{CACHE}:ArraysCache.__init__", _init_wrapper)
    if "__iter__" not in vars(p.module(CACHE).ArraysCache):
        p.set(f"{CACHE}:ArraysCache.__iter__", _iter)


def _unsized_caches(model):
    """The model's prompt cache with every recurrent cache rebuilt without a size (same class:
    mamba <= 0.30.5 only stores its state in a ``MambaCache``)."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    def unsized(cache):
        twin = type(cache).__new__(type(cache))
        ArraysCache.__init__(twin)
        return twin

    return [unsized(c) if isinstance(c, ArraysCache) else c for c in make_prompt_cache(model)]


def scenario():
    """Code that builds recurrent caches as ``ArraysCache()`` decodes and saves exactly."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, round_trip_prompt_cache
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    try:
        from mlx_lm.models.cache import ArraysCache

        MambaCache = ArraysCache  # the downstream alias for releases without MambaCache
        MambaCache()
        ArraysCache(left_padding=[1, 0])
    except Exception as exc:
        return Outcome.failure("ArraysCache() without size", exc)
    details = []
    make_cache = _unsized_caches
    for model_type in [t for t in ("qwen3_next", "lfm2", "nemotron_h") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=4)
        prompt = prompt_tokens(11, seed=4)
        problem = greedy(model, prompt).compare(greedy(model, prompt, prompt_cache=make_cache(model)))
        if problem is None:
            problem = round_trip_prompt_cache(model, prompt, make_cache=make_cache)
        if problem:
            return Outcome.failure(f"{model_type} with ArraysCache() layers: {problem}")
        details.append(f"{model_type}: decode and save/load/continue exact with ArraysCache() layers")
    return Outcome(True, "ArraysCache() sizes itself; decoding and prompt-cache files exact", details)

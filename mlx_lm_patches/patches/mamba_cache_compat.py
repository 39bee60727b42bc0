"""``MambaCache``: importable and constructible with every calling convention, on every release.

Bug
    Downstream code (vllm-mlx, vllm-metal, forks, user code) builds recurrent caches with
    ``from mlx_lm.models.cache import MambaCache``, written against different releases:

    * mlx-lm <= 0.30.5 defines ``MambaCache(ArraysCache)`` with ``__init__(self,
      left_padding=None)``: ``MambaCache(size=2)`` raises ``TypeError`` and ``MambaCache(2)``
      silently stores ``left_padding=array(2)``, which later fails in ``make_mask`` with
      ``Too many indices for array with 0 dimensions`` (this is also what 0.30.4-0.30.5
      ``ArraysCache.merge`` does, as it builds ``cls(n_state)``).
    * mlx-lm >= 0.30.6 removed the class: ``ImportError: cannot import name 'MambaCache'``.

Fix
    On releases without it, add ``MambaCache`` to ``mlx_lm.models.cache`` as an ``ArraysCache``
    subclass; on releases with it, wrap its ``__init__``. Either way it accepts
    ``MambaCache()``, ``MambaCache(left_padding=[...])``, ``MambaCache([...])`` (the <= 0.30.5
    positional form), ``MambaCache(size=n)``, ``MambaCache(n)`` (an int is a size) and
    subclasses calling ``super().__init__(left_padding=...)`` or ``super().__init__(size=2,
    ...)``. The default size is 2 (conv state, SSM state). Saved prompt caches that name
    ``MambaCache`` load again on >= 0.30.6, because the class is back in the module that
    ``load_prompt_cache`` resolves class names in.

Retire
    When every supported release either has a ``MambaCache`` accepting all the conventions
    above, or downstream code no longer imports it: narrow ``affected`` in compat_matrix.yaml
    then delete this module.

Metal
    Pure Python construction logic; no kernel is involved.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms.mamba_cache_class import mark_restored

CACHE = "mlx_lm.models.cache"
_DEFAULT_SIZE = 2


def _normalize(args, kwargs):
    """Map every historical calling convention to ``(size, left_padding)``."""
    kwargs = dict(kwargs)
    size = kwargs.pop("size", None)
    left_padding = kwargs.pop("left_padding", None)
    if kwargs:
        raise TypeError(
            f"MambaCache() got unexpected keyword argument(s) {', '.join(sorted(kwargs))}; "
            "accepted: size, left_padding"
        )
    args = list(args)
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        if size is not None:
            raise TypeError("MambaCache() got the size both positionally and as size=")
        size = args.pop(0)
    if args:
        if left_padding is not None:
            raise TypeError("MambaCache() got left_padding both positionally and by name")
        left_padding = args.pop(0)
    if args:
        raise TypeError(
            f"MambaCache() takes at most a size and a left_padding; got {len(args)} more"
        )
    if size is None:
        size = _DEFAULT_SIZE
    if not isinstance(size, int) or size < 1:
        raise TypeError(f"MambaCache size must be a positive int, got {size!r}")
    return size, left_padding


def _make_class(arrays_cache):
    class MambaCache(arrays_cache):
        """An ``ArraysCache`` for Mamba-style layers (default two slots: conv and SSM state).

        Restored by mlx-lm-patches (removed from mlx-lm in 0.30.6). Accepts ``MambaCache()``,
        ``MambaCache(size=n)``, ``MambaCache(n)``, ``MambaCache(left_padding=[...])``.
        """

        def __init__(self, *args, **kwargs):
            size, left_padding = _normalize(args, kwargs)
            super().__init__(size, left_padding=left_padding)

    MambaCache.__module__ = CACHE
    MambaCache.__qualname__ = "MambaCache"
    mark_restored(MambaCache)
    return MambaCache


def _init_wrapper(wrapped, instance, args, kwargs):
    """``MambaCache.__init__`` of releases <= 0.30.5: take sizes as well as left_padding."""
    size, left_padding = _normalize(args, kwargs)
    if size == _DEFAULT_SIZE:
        return wrapped(left_padding=left_padding)
    cache_module = sys.modules[CACHE]
    return cache_module.ArraysCache.__init__(instance, size, left_padding=left_padding)


def _conventions(cls):
    """(description, constructor, expected size, expected left padding) for each convention."""

    class SubclassLeftPadding(cls):  # vllm-mlx's BatchMambaCache pattern
        def __init__(self, left_padding=None):
            super().__init__(left_padding=left_padding)

    class SubclassSized(cls):
        def __init__(self, left_padding=None):
            super().__init__(size=2, left_padding=left_padding)

    return [
        ("MambaCache()", lambda: cls(), 2, None),
        ("MambaCache(left_padding=[1, 0])", lambda: cls(left_padding=[1, 0]), 2, [1, 0]),
        ("MambaCache([2, 0])", lambda: cls([2, 0]), 2, [2, 0]),
        ("MambaCache(size=2)", lambda: cls(size=2), 2, None),
        ("MambaCache(size=3)", lambda: cls(size=3), 3, None),
        ("MambaCache(2)", lambda: cls(2), 2, None),
        ("MambaCache(1, [0, 3])", lambda: cls(1, [0, 3]), 1, [0, 3]),
        ("subclass: super().__init__(left_padding=...)", lambda: SubclassLeftPadding([1, 0]), 2, [1, 0]),
        ("subclass: super().__init__(size=2, left_padding=...)", lambda: SubclassSized([0, 1]), 2, [0, 1]),
    ]


def _check_conventions(cls):
    """``None`` if every convention builds the right cache, else the first problem."""
    for description, build, size, left_padding in _conventions(cls):
        try:
            cache = build()
        except Exception as exc:
            return f"{description} raises {type(exc).__name__}: {exc}"
        got_padding = getattr(cache, "left_padding", None)
        got_padding = None if got_padding is None else got_padding.tolist()
        if len(cache.cache) != size or any(c is not None for c in cache.cache):
            return f"{description} builds {len(cache.cache)} slots {cache.cache!r}, expected {size} empty"
        if got_padding != left_padding:
            return f"{description} sets left_padding={got_padding!r}, expected {left_padding!r}"
    return None


def probe():
    cache_module = sys.modules[CACHE]
    cls = vars(cache_module).get("MambaCache")
    if cls is None:
        return "mlx_lm.models.cache has no MambaCache (removed in 0.30.6)"
    return _check_conventions(cls)


def apply(p):
    cache_module = p.module(CACHE)
    if "MambaCache" in vars(cache_module):
        p.wrap(f"{CACHE}:MambaCache.__init__", _init_wrapper)
    else:
        p.set(f"{CACHE}:MambaCache", _make_class(cache_module.ArraysCache))


def scenario():
    """Downstream code builds ``MambaCache`` objects and decodes a hybrid model with them."""
    try:
        from mlx_lm.models.cache import MambaCache
    except ImportError as exc:
        return Outcome.failure("from mlx_lm.models.cache import MambaCache", exc)
    problem = _check_conventions(MambaCache)
    if problem:
        return Outcome.failure(problem)
    return _decode_with_mamba_caches(MambaCache)


def _decode_with_mamba_caches(mamba_cache):
    """Greedy decoding with every recurrent cache swapped for a ``MambaCache`` is exact."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    types = [t for t in ("nemotron_h", "qwen3_next", "mamba2") if t in available_model_types()]
    if not types:
        return Outcome.failure("no tiny hybrid model with a two-slot recurrent cache available")
    details = []
    for model_type in types[:2]:
        model = build_tiny_model(model_type, seed=1)
        prompt = prompt_tokens(12)
        reference = greedy(model, prompt)
        cache = make_prompt_cache(model)
        swapped = 0
        for i, layer_cache in enumerate(cache):
            if isinstance(layer_cache, ArraysCache):
                cache[i] = mamba_cache(size=len(layer_cache.cache))
                swapped += 1
        got = greedy(model, prompt, prompt_cache=cache)
        problem = reference.compare(got)
        if problem:
            return Outcome.failure(f"{model_type} decoding with MambaCache layers: {problem}")
        details.append(f"{model_type}: {swapped} MambaCache layers, {len(got.tokens)} tokens exact")
    return Outcome(True, "MambaCache imports, builds with every convention, decodes exactly", details)

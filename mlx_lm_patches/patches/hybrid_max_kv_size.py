"""``max_kv_size`` bounds a hybrid's attention layers, as it bounds a dense model's.

Bug
    ``make_prompt_cache(model, max_kv_size)`` returns ``model.make_cache()`` unchanged for every
    model that has ``make_cache`` - every hybrid - so ``generate_step(..., max_kv_size=n)``,
    ``stream_generate``/``generate``, ``mlx_lm.generate --max-kv-size``, ``mlx_lm.chat``,
    ``mlx_lm.cache_prompt --max-kv-size`` and ``BatchGenerator(max_kv_size=n)`` keep every
    attention position: memory grows with the sequence, silently. A dense model gets
    ``RotatingKVCache(max_size=n, keep=4)`` per layer.

Fix
    Wrap ``make_prompt_cache`` (and the copies ``mlx_lm.generate``, ``mlx_lm.chat`` and
    ``mlx_lm.cache_prompt`` take by name): when ``max_kv_size`` is given and the model's own
    cache holds recurrent state (an ``ArraysCache`` anywhere, ``CacheList`` entries included),
    each plain ``KVCache`` becomes ``RotatingKVCache(max_size=max_kv_size, keep=4)`` - what
    mlx-lm builds for a dense model. Recurrent caches, sliding-window layers the model already
    rotates and every other cache class are left as the model made them; models without
    recurrent state (``gemma3``, ``longcat_flash``) keep mlx-lm's documented behaviour.
    ``max_kv_size`` of 4 or less (nothing beyond the 4 kept positions) is refused with a
    ``ValueError`` for a hybrid. With the window, results are those of mlx-lm's own rotating
    cache: equal to unbounded decoding while the sequence fits, bounded memory after.
    ``BatchGenerator`` builds its caches elsewhere on 0.31.x: ``_make_cache`` (0.31.1 - 0.31.2)
    gives a hybrid's plain attention layers ``BatchRotatingKVCache(max_kv_size, ...)`` as it
    gives a dense model's, and ``BatchGenerator._make_new_cache`` (0.31.3) bounds those inside
    a ``CacheList`` too (``keep=0``, as that release does for the others).

Retire
    When ``make_prompt_cache`` gives a hybrid's attention layers a rotating cache for
    ``max_kv_size`` in every supported release.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome, missing
from mlx_lm_patches.mechanisms.calls import bind_arguments

CACHE = "mlx_lm.models.cache"
KEEP = 4  # what mlx-lm keeps for a dense model


def _has_recurrent(caches, arrays_cache) -> bool:
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if isinstance(cache, arrays_cache):
            return True
        if isinstance(inner, (list, tuple)) and _has_recurrent(inner, arrays_cache):
            return True
    return False


def _bounded(cache, max_kv_size, module):
    if type(cache) is module.KVCache:
        return module.RotatingKVCache(max_size=max_kv_size, keep=KEEP)
    if type(cache) is module.CacheList:
        return module.CacheList(*(_bounded(c, max_kv_size, module) for c in cache.caches))
    return cache


def bounded_prompt_cache(caches, max_kv_size):
    """``caches`` (a model's fresh ``make_cache()``) with every plain ``KVCache`` rotating at
    ``max_kv_size`` when it holds recurrent state; else ``caches`` itself."""
    module = sys.modules[CACHE]
    if max_kv_size is None or not _has_recurrent(caches, module.ArraysCache):
        return caches
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size <= KEEP:
        raise ValueError(
            f"max_kv_size must be an integer above {KEEP} (the first {KEEP} positions are always "
            f"kept), got {max_kv_size!r}"
        )
    return [_bounded(cache, max_kv_size, module) for cache in caches]


def _make_prompt_cache(wrapped, instance, args, kwargs):
    caches = wrapped(*args, **kwargs)
    try:
        bound = bind_arguments(wrapped, args, kwargs).arguments
    except TypeError:
        return caches
    if not hasattr(bound.get("model"), "make_cache"):
        return caches
    return bounded_prompt_cache(caches, bound.get("max_kv_size"))


def _batch_caches(wrapped, instance, args, kwargs):
    """0.31.1 - 0.31.2 ``_make_cache(model, left_padding, max_kv_size)``: a model with
    ``make_cache`` gets batch caches without a window; a hybrid's plain attention layers get
    ``BatchRotatingKVCache(max_kv_size, left_padding)``, what a dense model gets there."""
    caches = wrapped(*args, **kwargs)
    bound = bind_arguments(wrapped, args, kwargs).arguments
    model, window = bound.get("model"), bound.get("max_kv_size")
    if window is None or not hasattr(model, "make_cache"):
        return caches
    module = sys.modules[CACHE]
    made = model.make_cache()
    if bounded_prompt_cache(made, window) is made:
        return caches

    def one(batch, fresh):
        if type(fresh) is module.KVCache:
            return module.BatchRotatingKVCache(window, bound["left_padding"])
        if type(fresh) is module.CacheList and type(batch) is module.CacheList:
            return module.CacheList(*(one(b, f) for b, f in zip(batch.caches, fresh.caches)))
        return batch

    return [one(b, f) for b, f in zip(caches, made)]


def _new_batch_cache(wrapped, instance, args, kwargs):
    """0.31.3 ``BatchGenerator._make_new_cache``: it gives top-level ``KVCache`` layers a
    ``RotatingKVCache(max_kv_size)`` itself but leaves those inside a ``CacheList`` (falcon_h1)
    unbounded; they get the same window."""
    caches = wrapped(*args, **kwargs)
    window = getattr(instance, "max_kv_size", None)
    if window is None or bounded_prompt_cache(caches, window) is caches:
        return caches
    module = sys.modules[CACHE]

    def one(cache):
        if type(cache) is module.KVCache:
            return module.RotatingKVCache(max_size=window)
        if type(cache) is module.CacheList:
            return module.CacheList(*(one(c) for c in cache.caches))
        return cache

    return [one(c) for c in caches]


class _HybridStub:
    """The smallest model with a hybrid's ``make_cache``: one recurrent and one attention layer."""

    layers = (None, None)

    def make_cache(self):
        module = sys.modules[CACHE]
        return [module.ArraysCache(2), module.KVCache()]


def probe():
    gone = missing(f"{CACHE}:make_prompt_cache", f"{CACHE}:RotatingKVCache")
    if gone:
        return gone
    caches = sys.modules[CACHE].make_prompt_cache(_HybridStub(), max_kv_size=16)
    if type(caches[1]) is sys.modules[CACHE].KVCache:
        return "make_prompt_cache(hybrid, max_kv_size=16) keeps a plain KVCache for the attention layer"
    return None


def apply(p):
    p.wrap(f"{CACHE}:make_prompt_cache", _make_prompt_cache)
    for module in ("mlx_lm.generate", "mlx_lm.chat", "mlx_lm.cache_prompt"):
        p.wrap_if_present(f"{module}:make_prompt_cache", _make_prompt_cache)
    p.wrap_if_present("mlx_lm.generate:_make_cache", _batch_caches)
    p.wrap_if_present("mlx_lm.generate:BatchGenerator._make_new_cache", _new_batch_cache)


def positions_held(caches) -> int:
    """The most attention positions any layer of ``caches`` holds (``KVCache``: its offset;
    rotating caches: the rows of their buffer)."""
    from mlx_lm_patches.mechanisms.caches import attention_caches

    held = 0
    for cache in attention_caches(caches):
        keys = getattr(cache, "keys", None)
        if keys is None:
            continue
        rows = keys.shape[-2] if hasattr(cache, "max_size") else int(cache.offset)
        held = max(held, rows)
    return held


def scenario():
    """``generate_step(max_kv_size=24)`` on hybrids of each recurrent kind, through caches
    from ``make_prompt_cache(model, 24)``: positions held bounded; while the sequence fits,
    the unbounded tokens and log-probabilities."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    window, details = 24, []
    for model_type in [t for t in ("qwen3_next", "nemotron_h", "falcon_h1") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=3)
        prompt = prompt_tokens(12, seed=3)
        caches = make_prompt_cache(model, max_kv_size=window)
        got = greedy(model, prompt, max_tokens=20, prompt_cache=caches)
        held = positions_held(caches)
        if held > window:
            return Outcome.failure(
                f"{model_type}: {held} attention positions held after {len(prompt) + 20} tokens "
                f"with max_kv_size={window}"
            )
        fits = window - len(prompt)
        problem = greedy(model, prompt, max_tokens=fits).compare(
            type(got)(got.tokens[:fits], got.logprobs[:fits]))
        if problem:
            return Outcome.failure(f"{model_type} within the window: {problem}")
        details.append(f"{model_type}: {held} positions held, exact within the window")
    return Outcome(True, f"max_kv_size={window} bounds every hybrid's attention layers", details)

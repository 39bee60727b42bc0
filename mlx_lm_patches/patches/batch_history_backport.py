"""Batched generation continuing from hybrid prompt caches on mlx-lm <= 0.30.2.

Bug
    ``BatchGenerator.insert(prompts, caches=...)`` continues each prompt from a pre-filled
    prompt cache. Before 0.30.4, mlx-lm cannot do that for hybrid models: ``_merge_caches``
    raises ``ValueError: <class 'MambaCache'> does not yet support batching with history``;
    and for purely recurrent models (mamba, mamba2) ``cache_length`` reports 0 for a filled
    cache, so the supplied cache is silently replaced by a fresh one and the history is lost.

Fix
    Three small backports, used by ``batch-prefill-per-row``, which prefills every hybrid prompt
    alone on these releases:

    * ``_merge_caches`` of a *single* prompt's cache also accepts ``ArraysCache`` and ``CacheList``
      layers (a copy of the row: the caller's cache is not modified). Several rows with recurrent
      history are still refused as before - batching them would need padding the recurrent
      layers cannot honour here.
    * ``ArraysCache`` and ``CacheList`` get ``prepare``/``finalize``: no-ops for recurrent state
      (one row, no padding), forwarded to the children of a ``CacheList``.
    * ``cache_length`` counts a recurrent cache that holds state as history.

Retire
    When 0.30.2 drops out of the supported range.

Metal
    Python-side bookkeeping; the model forward is mlx-lm's own.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome, missing

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def _holds_state(c) -> bool:
    cm = sys.modules[CACHE]
    if isinstance(c, cm.ArraysCache):
        return any(s is not None for s in c.cache)
    return any(_holds_state(sub) for sub in getattr(c, "caches", ()))


def _has_recurrent(c) -> bool:
    cm = sys.modules[CACHE]
    return isinstance(c, cm.ArraysCache) or any(_has_recurrent(s) for s in getattr(c, "caches", ()))


def _single_row_batch_cache(c):
    cm = sys.modules[CACHE]
    if isinstance(c, cm.ArraysCache):
        row = type(c).__new__(type(c))
        row.cache = list(c.cache)
        row.left_padding = None
        row.lengths = None
        return row
    if isinstance(c, cm.CacheList):
        return cm.CacheList(*(_single_row_batch_cache(sub) for sub in c.caches))
    if isinstance(c, cm.RotatingKVCache):
        return cm.BatchRotatingKVCache.merge([c])
    return cm.BatchKVCache.merge([c])


def _merge_caches(wrapped, instance, args, kwargs):
    caches = args[0] if args else kwargs["caches"]
    if len(caches) == 1 and any(_has_recurrent(c) for c in caches[0]):
        return [_single_row_batch_cache(c) for c in caches[0]]
    return wrapped(*args, **kwargs)


def _cache_length(wrapped, instance, args, kwargs):
    length = wrapped(*args, **kwargs)
    cache = args[0] if args else kwargs["cache"]
    if length == 0 and any(_holds_state(c) for c in cache):
        return 1
    return length


def _arrays_prepare(self, *args, **kwargs):
    pass


def _arrays_finalize(self):
    pass


def _list_prepare(self, *args, **kwargs):
    for c in self.caches:
        if hasattr(c, "prepare"):
            c.prepare(*args, **kwargs)


def _list_finalize(self):
    for c in self.caches:
        if hasattr(c, "finalize"):
            c.finalize()


def probe():
    cm = sys.modules[CACHE]
    if hasattr(cm.ArraysCache, "merge"):
        return None
    gone = missing(f"{GENERATE}:_merge_caches")
    if gone is not None:
        return gone
    row = cm.ArraysCache(1)
    import mlx.core as mx

    row[0] = mx.zeros((1, 2))
    try:
        sys.modules[GENERATE]._merge_caches([[row]])
    except Exception as exc:
        return f"_merge_caches of a recurrent prompt cache raises {type(exc).__name__}: {exc}"
    return None


def apply(p):
    cm = p.module(CACHE)
    p.wrap(f"{GENERATE}:_merge_caches", _merge_caches)
    p.wrap(f"{CACHE}:cache_length", _cache_length)
    for cls, prepare, finalize in ((cm.ArraysCache, _arrays_prepare, _arrays_finalize),
                                   (cm.CacheList, _list_prepare, _list_finalize)):
        if not hasattr(cls, "prepare"):
            p.set(f"{CACHE}:{cls.__name__}.prepare", prepare)
        if not hasattr(cls, "finalize"):
            p.set(f"{CACHE}:{cls.__name__}.finalize", finalize)


def scenario():
    """Prompts continuing from pre-filled prompt caches, batched: equal to single decoding."""
    from mlx_lm.models.cache import ArraysCache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy, split_prefilled
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if hasattr(ArraysCache, "merge"):
        return Outcome.not_applicable("this mlx-lm batches recurrent history itself (see batch-prefill-per-row)")
    details = []
    for model_type in [t for t in ("qwen3_next", "nemotron_h", "mamba", "falcon_h1") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        prompts = [prompt_tokens(n, seed=n) for n in (7, 10, 13)]
        caches, rest = split_prefilled(model, prompts, (3, 6, 4))
        try:
            got = batched_greedy(model, rest, caches=caches)
        except Exception as exc:
            return Outcome.failure(f"{model_type}: BatchGenerator with prompt caches", exc)
        for i, (prompt, decoded) in enumerate(zip(prompts, got)):
            problem = greedy(model, prompt).compare(decoded)
            if problem:
                return Outcome.failure(f"{model_type}: prompt {i} continued from its cache: {problem}")
        details.append(f"{model_type}: 3 prompts continued from their caches exactly")
    return Outcome(True, "batched continuation of hybrid prompt caches is exact", details)

"""Prompt-cache files of models whose layers use ``CacheList`` load again (mlx-lm < 0.31.1).

Bug
    ``CacheList`` (a layer holding several caches: falcon_h1's Mamba + attention, baichuan_m1,
    longcat_flash_ngram) has no ``meta_state`` and no ``from_state`` of its own before mlx-lm
    0.31.1. ``load_prompt_cache`` rebuilds each layer with ``cls.from_state``, which makes the
    object with ``__new__`` and then assigns ``state``; ``CacheList``'s state setter walks
    ``self.caches``, which was never set: ``AttributeError: 'CacheList' object has no attribute
    'caches'``. Saving works, so every saved prompt cache of these models is unloadable
    (``mlx_lm.cache_prompt`` then ``generate --prompt-cache-file``, or the server's cache files).

Fix
    Give ``CacheList`` a ``meta_state`` that records, per child, its class name, its own
    ``meta_state`` and how many entries of the (flat) ``state`` list are its own, and a
    ``from_state`` that rebuilds the children from that record (class names resolved in
    ``mlx_lm.models.cache``, as ``load_prompt_cache`` does). The saved tensors are unchanged.
    0.31.1 did the same with a nested ``state``; the file format of each release is kept.

Retire
    When 0.30.7 drops out of the supported range.

Metal
    Python-side bookkeeping only.
"""

import sys

from mlx_lm_patches.engine.contract import missing

CACHE = "mlx_lm.models.cache"


def _meta_state(self):
    names = [type(c).__name__ for c in self.caches]
    metas = [c.meta_state for c in self.caches]
    lengths = [str(len(c.state)) for c in self.caches]
    return [names, metas, lengths]


def _set_meta_state(self, value):
    for child, meta in zip(self.caches, value[1]):
        child.meta_state = meta


def _from_state(cls, state, meta_state):
    names, metas, lengths = meta_state
    classes = vars(sys.modules[CACHE])
    children, start = [], 0
    for name, meta, length in zip(names, metas, lengths):
        n = int(length)
        children.append(classes[name].from_state(list(state[start:start + n]), meta))
        start += n
    obj = cls.__new__(cls)
    obj.caches = tuple(children)
    return obj


def probe():
    gone = missing(f"{CACHE}:ArraysCache")
    if gone is not None:
        return gone
    cache_module = sys.modules[CACHE]
    import mlx.core as mx

    child = cache_module.ArraysCache(1)
    child[0] = mx.zeros((1, 2))
    saved = cache_module.CacheList(child)
    try:
        loaded = type(saved).from_state(saved.state, saved.meta_state)
        loaded.state
    except Exception as exc:
        return f"CacheList.from_state(state, meta_state) raises {type(exc).__name__}: {exc}"
    return None


def apply(p):
    p.set(f"{CACHE}:CacheList.meta_state", property(_meta_state, _set_meta_state))
    p.set(f"{CACHE}:CacheList.from_state", classmethod(_from_state))


def scenario():
    """Save, load and continue a prompt cache of every model family that uses CacheList."""
    from mlx_lm_patches.selftest.scenarios import round_trip_families
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model, cache_kinds

    models = [(t, build_tiny_model(t, seed=6)) for t in available_model_types()]
    return round_trip_families([(t, m) for t, m in models if "CacheList" in cache_kinds(m)], seed=6,
                               summary="prompt caches with CacheList layers round-trip exactly")

"""Recurrent caches can be taken out of a batch on mlx-lm <= 0.30.2 (``extract``).

Bug
    ``BatchGenerator`` hands every finished sequence its own prompt cache with
    ``[c.extract(i) for c in batch.cache]``. Before 0.30.4, ``ArraysCache`` (and ``MambaCache``)
    and ``CacheList`` have no ``extract``: batched generation of any hybrid model crashes with
    ``AttributeError: 'MambaCache' object has no attribute 'extract'`` the moment the first
    sequence finishes.

Fix
    Add ``ArraysCache.extract(i)`` - a cache of the same class holding row ``i`` of every slot
    (``None`` stays ``None``), with no padding bookkeeping - and ``CacheList.extract(i)``, which
    extracts each child. The class is kept because some models only store state in a
    ``MambaCache`` (``isinstance`` checks in mamba.py <= 0.30.5).

Retire
    When 0.30.2 drops out of the supported range.

Metal
    Array slicing only.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"


def _arrays_extract(self, idx):
    row = type(self).__new__(type(self))
    row.cache = [None if s is None else s[idx:idx + 1] for s in self.cache]
    row.left_padding = None
    row.lengths = None
    return row


def _cache_list_extract(self, idx):
    return type(self)(*(c.extract(idx) for c in self.caches))


def probe():
    cm = sys.modules[CACHE]
    missing = [cls.__name__ for cls in (cm.ArraysCache, cm.CacheList) if not hasattr(cls, "extract")]
    if missing:
        return f"{' and '.join(missing)} have no extract()"
    return None


def apply(p):
    cm = p.module(CACHE)
    if not hasattr(cm.ArraysCache, "extract"):
        p.set(f"{CACHE}:ArraysCache.extract", _arrays_extract)
    if not hasattr(cm.CacheList, "extract"):
        p.set(f"{CACHE}:CacheList.extract", _cache_list_extract)


def scenario():
    """Batched decoding of hybrid models through BatchGenerator until every sequence finishes,
    each finished sequence's prompt cache then continuing exactly on its own."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    details = []
    for model_type in [t for t in ("qwen3_next", "nemotron_h", "falcon_h1") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        prompts = [prompt_tokens(7, seed=s) for s in (5, 9)]  # equal lengths: no padding involved
        try:
            got = batched_greedy(model, prompts, max_tokens=4)
        except Exception as exc:
            return Outcome.failure(f"{model_type}: BatchGenerator", exc)
        for i, (prompt, decoded) in enumerate(zip(prompts, got)):
            problem = greedy(model, prompt, max_tokens=4).compare(decoded)
            if problem:
                return Outcome.failure(f"{model_type}: batched prompt {i}: {problem}")
        details.append(f"{model_type}: 2 prompts batched to completion exactly")
    return Outcome(True, "hybrid batches run to completion and hand back their caches", details)

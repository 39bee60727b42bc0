"""A mamba sequence taken out of a batch keeps its ``MambaCache`` (mlx-lm 0.30.4 - 0.30.5).

Bug
    ``ArraysCache.extract(i)`` (new in 0.30.4) always builds a plain ``ArraysCache``. For a
    ``MambaCache`` that changes the class, and mamba.py's mixer only writes its state into a
    ``MambaCache`` (``if isinstance(cache, MambaCache): cache[0] = ...``): decoding continued
    from an extracted cache never updates the recurrent state - silently wrong tokens. That is
    the cache ``BatchGenerator`` hands back for every finished sequence: ``mlx_lm.server``
    stores it in its prompt cache, so the next turn of a conversation with a mamba model is
    wrong; so is continuing ``batch_generate(..., return_prompt_caches=True)``.

Fix
    ``extract`` returns an instance of the cache's own class (``MambaCache`` for a
    ``MambaCache``) holding the same row - what this package's backport of ``extract`` does on
    older releases (``arrays-cache-extract``).

Retire
    When 0.30.5 drops out of the supported range.

Metal
    Class of a Python object only.
"""

import importlib
import sys

from mlx_lm_patches.engine.contract import NotNeeded, Outcome

CACHE = "mlx_lm.models.cache"


def _same_class(wrapped, instance, args, kwargs):
    row = wrapped(*args, **kwargs)
    cls = type(instance)
    if type(row) is not cls and isinstance(row, sys.modules[CACHE].ArraysCache):
        kept = cls.__new__(cls)
        kept.__dict__.update(row.__dict__)
        return kept
    return row


def probe():
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.mamba_cache_class import restored

    cm = sys.modules[CACHE]
    mamba_cache = getattr(cm, "MambaCache", None)
    if mamba_cache is None or not hasattr(cm.ArraysCache, "extract"):
        return None
    if restored(mamba_cache):
        # mamba-cache-compat's class on a release without one: this mamba.py does not ask
        # for the class, so whichever extract returns is written to (decided as on stock)
        return NotNeeded("this mlx-lm has no MambaCache of its own (mamba's mixer writes to any cache)")
    cache = cm.ArraysCache.__new__(mamba_cache)
    cache.cache, cache.left_padding, cache.lengths = [mx.zeros((2, 1)), mx.zeros((2, 1))], None, None
    row = cache.extract(0)
    if not isinstance(row, mamba_cache):
        return f"MambaCache.extract returns a {type(row).__name__}: mamba's mixer never writes to it"
    return None


def apply(p):
    p.wrap(f"{CACHE}:ArraysCache.extract", _same_class)


def scenario():
    """A mamba prompt decoded by ``BatchGenerator``; decoding continued from the cache it hands
    back for the finished sequence equals greedy decoding of the whole sequence."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import _batched_one, greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "mamba" not in available_model_types():
        return Outcome.not_applicable("no mamba model in this mlx-lm")
    if not hasattr(importlib.import_module(CACHE).ArraysCache, "extract"):
        # before 0.30.4 recurrent caches cannot leave a batch at all: arrays-cache-extract
        return Outcome.not_applicable("ArraysCache has no extract in this mlx-lm")
    model = build_tiny_model("mamba", seed=1)
    prompt = prompt_tokens(12, seed=4)
    try:
        first, cache = _batched_one(model, prompt, None, 4, 2048)
        more = prompt_tokens(5, seed=9)
        got = greedy(model, more, max_tokens=4, prompt_cache=cache)
    except Exception as exc:
        return Outcome.failure("mamba: continuing a batched sequence's cache", exc)
    problem = greedy(model, prompt + first.tokens + more, max_tokens=4).compare(got)
    if problem:
        return Outcome.failure(f"mamba: continuing the cache of a finished batched sequence: {problem}")
    return Outcome(True, "a finished batched mamba sequence's cache continues exactly")

"""Prompt caches of hybrid models load again on mlx-lm 0.30.4.

Bug
    mlx-lm 0.30.4 added batching attributes to ``ArraysCache`` (``left_padding``, ``lengths``)
    but sets them only in ``__init__``. ``load_prompt_cache`` rebuilds caches with
    ``from_state``, which creates the object with ``cls.__new__`` and never calls ``__init__``;
    the first forward after loading then raises ``AttributeError: 'MambaCache' object has no
    attribute 'left_padding'`` (``make_mask``). Every hybrid model's saved prompt cache is
    unusable (``mlx_lm.cache_prompt`` + ``generate --prompt-cache-file``).

Fix
    Give ``ArraysCache`` class-level defaults ``left_padding = None`` and ``lengths = None``,
    which is what 0.30.5 does per instance in ``__new__``. Instance values set by ``__init__``
    or batching methods shadow them as before; nothing else changes.

Retire
    When 0.30.4 drops out of the supported range.

Metal
    Attribute defaults only; no kernel involved.
"""

import sys


CACHE = "mlx_lm.models.cache"


def probe():
    arrays_cache = sys.modules[CACHE].ArraysCache
    bare = arrays_cache.__new__(arrays_cache)  # what from_state builds
    missing = [name for name in ("left_padding", "lengths") if not hasattr(bare, name)]
    if missing and hasattr(arrays_cache, "make_mask") and hasattr(arrays_cache, "prepare"):
        return f"ArraysCache rebuilt by from_state lacks {', '.join(missing)}"
    return None


def apply(p):
    arrays_cache = p.module(CACHE).ArraysCache
    for name in ("left_padding", "lengths"):
        if name not in vars(arrays_cache):
            p.set(f"{CACHE}:ArraysCache.{name}", None)


def scenario():
    """Save a hybrid model's prompt cache, load it, continue decoding: exact vs cold."""
    from mlx_lm_patches.selftest.scenarios import round_trip_families
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    types = [t for t in ("qwen3_next", "nemotron_h") if t in available_model_types()]
    return round_trip_families([(t, build_tiny_model(t, seed=2)) for t in types], seed=2,
                               summary="hybrid prompt caches round-trip through save/load exactly")

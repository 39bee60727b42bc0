"""Reading mlx-lm cache objects: the one home of the helpers every mechanism needs.

mlx-lm is not imported here: the cache module is taken from ``sys.modules`` when a helper runs
(it is always loaded by then, since there is a cache to read).
"""

import sys
from typing import Optional


def arrays_cache_class():
    """mlx-lm's ``ArraysCache`` (the base of every recurrent cache, ``MambaCache`` included)."""
    return sys.modules["mlx_lm.models.cache"].ArraysCache


def flat_caches(caches) -> list:
    """The leaf caches of a prompt cache, with ``CacheList`` entries expanded in order."""
    out = []
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if isinstance(inner, (list, tuple)):
            out.extend(flat_caches(inner))
        else:
            out.append(cache)
    return out


def recurrent_caches(caches) -> list:
    """The leaves of ``caches`` that hold recurrent state (``ArraysCache`` instances)."""
    arrays_cache = arrays_cache_class()
    return [c for c in flat_caches(caches) if isinstance(c, arrays_cache)]


def attention_caches(caches) -> list:
    """The leaves of ``caches`` that are not recurrent (KV caches and their kin)."""
    arrays_cache = arrays_cache_class()
    return [c for c in flat_caches(caches) if not isinstance(c, arrays_cache)]


def has_recurrent_state(caches) -> bool:
    return bool(recurrent_caches(caches))


def rotating_cache_class():
    """mlx-lm's ``RotatingKVCache`` (sliding-window attention of one sequence)."""
    return sys.modules["mlx_lm.models.cache"].RotatingKVCache


def kept_caches(caches) -> list:
    """The leaves of ``caches`` whose past a ``trim`` cannot bring back, so a rollback has to
    keep it: recurrent states (``ArraysCache``) and sliding windows (``RotatingKVCache``, which
    overwrites its oldest keys once it holds ``max_size`` tokens and is then not trimmable)."""
    kinds = (arrays_cache_class(), rotating_cache_class())
    return [c for c in flat_caches(caches) if isinstance(c, kinds)]


def arrays(value):
    """Every ``mx.array`` in a slot value (an array, or nested lists/tuples of them)."""
    import mlx.core as mx

    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from arrays(item)


def _token_ids(value) -> bool:
    import mlx.core as mx

    return isinstance(value, mx.array) and value.ndim == 2 and mx.issubdtype(value.dtype, mx.integer)


def widened_token_ids(values) -> list:
    """``values`` (one slot's arrays, ``None`` for a row without one), each 2-D array of token
    ids narrower than the widest padded on the left with id 0; anything else unchanged. The only
    such slot in mlx-lm is longcat_flash_ngram's n-gram context, the last ``min(seen, n - 1)``
    ids of a row, which reads id 0 before a sequence's start: padded, it computes the same."""
    import mlx.core as mx

    present = [v for v in values if v is not None]
    if len(present) < 2 or not all(_token_ids(v) for v in present):
        return list(values)
    width = max(v.shape[1] for v in present)
    return [v if v is None or v.shape[1] == width
            else mx.concatenate([mx.zeros((v.shape[0], width - v.shape[1]), dtype=v.dtype), v], axis=1)
            for v in values]


def int_offset(cache) -> Optional[int]:
    """A cache's ``offset`` when it is one number for every row (single sequence, or a batch
    cache that keeps a scalar), else ``None`` (per-row ``mx.array`` offsets, no offset at all)."""
    offset = getattr(cache, "offset", None)
    return offset if isinstance(offset, int) and not isinstance(offset, bool) else None


def same_objects(live, kept) -> bool:
    """Whether two slot lists hold the very same objects, in order (identity, not equality:
    mlx-lm replaces a slot's array whenever it advances the state)."""
    return len(live) == len(kept) and all(a is b for a, b in zip(live, kept))

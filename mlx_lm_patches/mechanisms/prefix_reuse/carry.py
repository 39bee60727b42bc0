"""Trails carried through mlx-lm's batching methods (merge, extend, filter, extract), so they
follow the rows through ``BatchGenerator``."""

from typing import Optional

from mlx_lm_patches.mechanisms.caches import arrays_cache_class, recurrent_caches
from mlx_lm_patches.mechanisms.prefix_reuse.trails import batch_size, row_trails, set_trails, trails


def _indices(batch_indices) -> Optional[list]:
    try:
        return [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist") else batch_indices)]
    except (TypeError, ValueError):
        return None


def carry_merge(wrapped, instance, args, kwargs):
    caches = args[0] if args else kwargs.get("caches")
    rows = [(row_trails(c, 1) if isinstance(c, arrays_cache_class()) else [None])[0] for c in caches or ()]
    merged = wrapped(*args, **kwargs)
    if isinstance(merged, arrays_cache_class()) and any(r is not None for r in rows):
        set_trails(merged, rows)
    return merged


def carry_extend(wrapped, instance, args, kwargs):
    other = args[0] if args else kwargs.get("other")
    mine, theirs = trails(instance), trails(other) if isinstance(other, arrays_cache_class()) else None
    n_mine, n_theirs = batch_size(instance), batch_size(other) if other is not None else None
    result = wrapped(*args, **kwargs)
    if mine is None and theirs is None:
        set_trails(instance, None)
    elif n_mine is not None and n_theirs is not None:
        set_trails(instance, (mine or [None] * n_mine) + (theirs or [None] * n_theirs))
    else:
        set_trails(instance, None)
    return result


def carry_filter(wrapped, instance, args, kwargs):
    rows = trails(instance)
    keep = _indices(args[0] if args else kwargs.get("batch_indices"))
    result = wrapped(*args, **kwargs)
    if rows is not None:
        set_trails(instance, [rows[i] for i in keep] if keep is not None and all(0 <= i < len(rows) for i in keep) else None)
    return result


def carry_extract(wrapped, instance, args, kwargs):
    rows = trails(instance)
    idx = args[0] if args else kwargs.get("idx")
    result = wrapped(*args, **kwargs)
    if rows is not None and isinstance(idx, int) and 0 <= idx < len(rows) and isinstance(result, arrays_cache_class()):
        set_trails(result, [rows[idx]])
    return result


def copy_row_trails(batch_caches, row_caches, i: int) -> None:
    """Give row ``i``'s trails to the single-row caches built from a batch (same layout)."""
    for batch, row in zip(recurrent_caches(batch_caches), recurrent_caches(row_caches)):
        rows = trails(batch)
        set_trails(row, [rows[i]] if rows is not None and i < len(rows) else None)

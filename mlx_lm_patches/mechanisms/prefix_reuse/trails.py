"""Trails: per batch row of a recurrent cache, the tokens it saw, the states kept at positions
within them, and the slots after its last observed pass; reading them back as checkpoints."""

from typing import List, Optional, Tuple

from mlx_lm_patches.mechanisms.caches import (
    arrays, arrays_cache_class, attention_caches, flat_caches, int_offset, recurrent_caches, same_objects)


ATTR = "_mlx_lm_patches_trails"  # on ArraysCache objects: one Trail (or None) per batch row


class Trail:
    """One batch row of one recurrent cache: see the module docstring. Immutable and shared:
    copies of a cache share its trails (``deepcopy`` returns the trail itself)."""

    __slots__ = ("tokens", "marks", "after")

    def __init__(self, tokens: tuple, marks: tuple = (), after=None):
        self.tokens = tokens  # tuple of ints: a prefix of what the row has seen
        self.marks = marks  # ((position, slots), ...) ascending; slots: this layer's state there
        self.after = after  # slots right after the row saw exactly `tokens`, or None

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __repr__(self):
        return f"<Trail {len(self.tokens)} tokens, checkpoints at {[p for p, _ in self.marks]}>"


def slots_of(cache):
    slots = cache.cache
    return type(slots)(slots)


def batch_size(cache) -> Optional[int]:
    """Rows of a recurrent cache: from its slots, else from its padding bookkeeping (``None``
    while it is empty and has none)."""
    for slot in cache.cache:
        for array in arrays(slot):
            return array.shape[0]
    for name in ("left_padding", "lengths"):
        value = getattr(cache, name, None)
        if value is not None and getattr(value, "ndim", 0) == 1:
            return value.shape[0]
    return None


def trails(cache) -> Optional[list]:
    """The per-row trails of a recurrent cache, if they still match its rows."""
    rows = cache.__dict__.get(ATTR)
    if rows is None:
        return None
    size = batch_size(cache)
    if size is not None and size != len(rows):
        return None  # rows changed by a method that does not carry trails: forget them
    return rows


def set_trails(cache, rows) -> None:
    if rows is None or all(r is None for r in rows):
        cache.__dict__.pop(ATTR, None)
    else:
        cache.__dict__[ATTR] = list(rows)


def row_trails(cache, n: int) -> list:
    """``n`` trails for a cache (``None`` where unknown)."""
    rows = trails(cache)
    return list(rows) if rows is not None and len(rows) == n else [None] * n


def is_empty(caches) -> bool:
    """Nothing processed yet: every recurrent slot empty, every attention offset 0."""
    arrays_cache = arrays_cache_class()
    for cache in flat_caches(caches):
        if isinstance(cache, arrays_cache):
            if any(True for slot in cache.cache for _ in arrays(slot)):
                return False
        elif int_offset(cache) != 0:
            return False
    return True


def exact_history(caches) -> Optional[tuple]:
    """The tokens a single-sequence cache list holds, when that is known for certain: ``()`` for
    an empty cache; a trail's tokens while every recurrent slot is still the object recorded
    after its last pass and every attention cache's offset equals their count; else ``None``."""
    leaves = recurrent_caches(caches)
    if not leaves:
        return None
    if is_empty(caches):
        return ()
    rows = [trails(leaf) for leaf in leaves]
    if any(r is None or len(r) != 1 or r[0] is None for r in rows):
        return None
    tokens = rows[0][0].tokens
    for leaf, (trail,) in zip(leaves, rows):
        if trail.tokens is not tokens or trail.after is None or not same_objects(leaf.cache, trail.after):
            return None
    for cache in attention_caches(caches):
        if int_offset(cache) != len(tokens):
            return None
    return tokens


def checkpoints(caches) -> List[Tuple[int, tuple, list]]:
    """Kept states of a single-sequence cache list usable as a whole: ``(position, tokens,
    states)`` with one slot list per recurrent cache, ascending. A position counts only if
    every recurrent cache kept it, from the same tokens."""
    leaves = recurrent_caches(caches)
    rows = [trails(leaf) for leaf in leaves]
    if not leaves or any(r is None or len(r) != 1 or r[0] is None for r in rows):
        return []
    first = rows[0][0]
    out = []
    for pos, slots in first.marks:
        states = [slots]
        for (trail,) in rows[1:]:
            if trail.tokens is not first.tokens and trail.tokens[:pos] != first.tokens[:pos]:
                return out
            found = next((s for p, s in trail.marks if p == pos), None)
            if found is None:
                break
            states.append(found)
        else:
            out.append((pos, first.tokens, states))
    return out


def retained_nbytes(cache) -> int:
    """Bytes of kept states a recurrent cache holds beyond its live state."""
    rows = cache.__dict__.get(ATTR) or ()
    live = {id(a) for a in arrays(cache.cache)}
    seen, total = set(), 0
    for trail in rows:
        if trail is None:
            continue
        for _, slots in trail.marks:
            for array in arrays(slots):
                if id(array) not in live and id(array) not in seen:
                    seen.add(id(array))
                    total += array.nbytes
    return total

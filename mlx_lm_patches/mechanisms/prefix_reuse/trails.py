"""Trails: per batch row of a recurrent cache, the tokens it saw, the states kept at positions
within them, and the slots after its last observed pass; reading them back as checkpoints."""

from typing import List, Optional, Tuple

from mlx_lm_patches.mechanisms.caches import (
    arrays, arrays_cache_class, attention_caches, flat_caches, int_offset, recurrent_caches, same_objects)


ATTR = "_mlx_lm_patches_trails"  # on ArraysCache objects: one Trail (or None) per batch row


class TokenStore:
    """The tokens of one sequence, append-only and shared by the logs of its prefixes: a
    materialised prefix (``ids``) and the token arrays appended since (``pending``), read only
    when a log's ids are asked for. Appending is O(1) (a list append), so a decode step costs
    the same at any length."""

    __slots__ = ("ids", "pending", "length")

    def __init__(self, ids: tuple = (), pending: Optional[list] = None):
        self.ids, self.pending = ids, pending if pending is not None else []
        self.length = len(ids) + sum(a.shape[-1] for a in self.pending)

    def materialise(self) -> tuple:
        if self.pending:
            import mlx.core as mx

            self.ids = self.ids + tuple(mx.concatenate([a.reshape(-1) for a in self.pending]).tolist())
            self.pending = []
        return self.ids


class TokenLog:
    """The tokens a row has seen: the first ``length`` tokens of a :class:`TokenStore`, appended
    to without reading them (a forward pass records its tokens without waiting for them: decode
    steps feed tokens that are still being computed). Immutable: ``extended`` gives a new log,
    appending to the store in place when this log is its end (no copy), else forking a store
    of its own (two sequences going on from one shared prefix)."""

    __slots__ = ("store", "length", "_ids")

    def __init__(self, base: tuple = ()):
        self.store = TokenStore(tuple(base))
        self.length, self._ids = self.store.length, None

    @classmethod
    def view(cls, store: TokenStore, length: int) -> "TokenLog":
        log = object.__new__(cls)
        log.store, log.length, log._ids = store, length, None
        return log

    def extended(self, piece) -> "TokenLog":
        """This log followed by ``piece`` (a 1-D ``mx.array`` of token ids)."""
        store, n = self.store, piece.shape[-1]
        if store.length == self.length:
            store.pending.append(piece)
            store.length += n
            return TokenLog.view(store, self.length + n)
        return TokenLog.view(self._fork(piece), self.length + n)

    def _fork(self, piece) -> TokenStore:
        store = self.store
        if self.length <= len(store.ids):
            return TokenStore(store.ids[: self.length], [piece])
        pending, held = [], len(store.ids)
        for array in store.pending:
            if held == self.length:
                break
            pending.append(array)
            held += array.shape[-1]
        return TokenStore(store.ids, pending + [piece])

    def ids(self) -> tuple:
        if self._ids is None:
            ids = self.store.materialise()
            self._ids = ids if len(ids) == self.length else ids[: self.length]
        return self._ids

    def __len__(self):
        return self.length


class Trail:
    """One batch row of one recurrent cache: see the module docstring. Immutable and shared:
    copies of a cache share its trails (``deepcopy`` returns the trail itself)."""

    __slots__ = ("log", "marks", "after")

    def __init__(self, tokens, marks: tuple = (), after=None):
        self.log = tokens if isinstance(tokens, TokenLog) else TokenLog(tuple(tokens))
        self.marks = marks  # ((position, slots), ...) ascending; slots: this layer's state there
        self.after = after  # slots right after the row saw exactly `tokens`, or None

    @property
    def tokens(self) -> tuple:
        """What the row has seen (a prefix of its content: tokens are only ever appended)."""
        return self.log.ids()

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __repr__(self):
        return f"<Trail {len(self.log)} tokens, checkpoints at {[p for p, _ in self.marks]}>"


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


def known_log(caches, leaves=None) -> Optional[TokenLog]:
    """The log of what a single-sequence cache list holds, when that is known for certain,
    without reading any token: an empty log for an empty cache; the trails' shared log while
    every recurrent slot is still the object recorded after its last pass and every attention
    cache's offset equals its length; else ``None``."""
    leaves = recurrent_caches(caches) if leaves is None else leaves
    if not leaves:
        return None
    rows = [leaf.__dict__.get(ATTR) for leaf in leaves]
    if any(r is None or len(r) != 1 or r[0] is None for r in rows):
        return TokenLog() if is_empty(caches) else None
    log = rows[0][0].log
    for leaf, (trail,) in zip(leaves, rows):
        if trail.log is not log or trail.after is None or not same_objects(leaf.cache, trail.after):
            return None
    if not offsets_agree(caches, len(log)):
        return None
    return log


def offsets_agree(caches, length: int) -> bool:
    """Whether the attention caches of a single-sequence cache list hold ``length`` tokens: an
    ``int`` offset equal to it, or (a batch cache of one row, as ``BatchGenerator`` makes)
    nothing to check beyond the row being unpadded."""
    for cache in attention_caches(caches):
        offset = int_offset(cache)
        if offset is None:
            if not unpadded_single_row(cache):
                return False
        elif offset != length:
            return False
    return True


def unpadded_single_row(cache) -> bool:
    """A batch cache of one row without left padding (read only when padding is kept)."""
    padding = getattr(cache, "left_padding", None)
    if padding is None:
        return False
    try:
        return padding.size == 1 and int(padding.reshape(-1)[0].item()) == 0
    except (AttributeError, TypeError, ValueError):
        return False


def exact_history(caches) -> Optional[tuple]:
    """The tokens a single-sequence cache list holds, when that is known for certain (see
    :func:`known_log`)."""
    log = known_log(caches)
    return None if log is None else log.ids()


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
            if trail.log is not first.log and trail.tokens[:pos] != first.tokens[:pos]:
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

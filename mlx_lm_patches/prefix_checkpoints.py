"""Exact prefix reuse for hybrid models: recurrent states kept at positions of the prefill.

An attention cache (``KVCache``) holding tokens ``0..n`` can be cut back to any shorter prefix.
A recurrent cache (``ArraysCache``) holds one state, the one after *all* its tokens: the state
after a shorter prefix is gone unless it was kept. So a cached prompt that a new request
diverges from is useless to a hybrid model unless the recurrent states at some earlier positions
were kept when it was computed. This module keeps them, and uses them only where they are exact.

Checkpoints
    While a single sequence is prefilled (a batch of one, as mlx-lm's ``generate_step`` and the
    per-row prefill of hybrid rows in ``BatchGenerator`` do), a :class:`Recorder` stands in for
    the model: it cuts the passes also at powers of two (32, 64, 128, ...; at most one extra cut
    per doubling of the prompt) and, after each multi-token pass, keeps the recurrent states by
    reference (mlx arrays are immutable and models replace their cache slots). With prefill
    chunks of ``s`` tokens, a kept state lies at or before any position ``d`` and at least at
    ``d/2`` (and at ``d - s`` or later); :func:`thin` keeps that property when it bounds the
    count (``MLX_LM_PATCHES_PREFIX_CHECKPOINTS``, default 8 per sequence).

Trails
    Each recurrent cache carries, per batch row, a :class:`Trail`: the first tokens the row has
    seen (a prefix of its content: tokens are only ever appended), the kept states of this layer
    at positions within them, and - while it is known - the exact slot objects after the last
    observed pass (so "this cache holds exactly these tokens" can be checked by identity: any
    forward pass replaces the slots). Trails ride along when mlx-lm merges, extends, filters,
    extracts or deep-copies caches, so they follow the rows through ``BatchGenerator``.

Use
    A kept state is used only for a token sequence that starts with the tokens it was computed
    from (checked token by token), together with attention caches cut back to exactly the same
    position; otherwise it is not used. Nothing is ever reset or approximated: a cache that
    cannot be restored exactly is simply not reused (the request is prefilled from an earlier
    exact state, or cold).
"""

import sys
from typing import List, Optional, Sequence, Tuple

from .journal import _arrays, _kv_offset, flat_caches, recurrent_caches

ATTR = "_mlx_lm_patches_trails"  # on ArraysCache objects: one Trail (or None) per batch row
DEFAULT_MAX_CHECKPOINTS = 8
FIRST_CUT = 32
CHAIN_FLOOR = 256

_lru_seen = False  # an LRUPromptCache was created in this process


# -- settings ---------------------------------------------------------------------------------


def max_checkpoints(environ=None) -> int:
    """``MLX_LM_PATCHES_PREFIX_CHECKPOINTS``: most kept states per sequence (0 turns it off)."""
    from .env import PREFIX_CHECKPOINTS, non_negative_int

    return non_negative_int(PREFIX_CHECKPOINTS, DEFAULT_MAX_CHECKPOINTS, environ)


def note_prompt_cache_created() -> None:
    global _lru_seen
    _lru_seen = True


def keeping() -> bool:
    """Whether a prefill into a prompt cache the caller holds keeps states at the ends of its
    passes (no extra cuts, so the passes are mlx-lm's own): unless
    ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``. Such a cache may be stored in a prompt-cache store
    later; it carries at most that many states."""
    return max_checkpoints() > 0


def capturing() -> bool:
    """Whether prefills also cut passes at powers of two, and ``BatchGenerator`` prefills hybrid
    rows one at a time to keep states: once an ``LRUPromptCache`` exists in the process (as in
    ``mlx_lm.server``), or whenever ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS`` is set explicitly;
    never with ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``."""
    import os

    from .env import PREFIX_CHECKPOINTS

    if max_checkpoints() == 0:
        return False
    return _lru_seen or bool(os.environ.get(PREFIX_CHECKPOINTS, "").strip())


# -- trails -----------------------------------------------------------------------------------


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


def _arrays_cache():
    return sys.modules["mlx_lm.models.cache"].ArraysCache


def _slots(cache):
    slots = cache.cache
    return type(slots)(slots)


def _same_slots(cache, slots) -> bool:
    live = cache.cache
    return len(live) == len(slots) and all(a is b for a, b in zip(live, slots))


def batch_size(cache) -> Optional[int]:
    """Rows of a recurrent cache: from its slots, else from its padding bookkeeping (``None``
    while it is empty and has none)."""
    for arrays in cache.cache:
        for array in _arrays(arrays):
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
    arrays_cache = _arrays_cache()
    for cache in flat_caches(caches):
        if isinstance(cache, arrays_cache):
            if any(True for slot in cache.cache for _ in _arrays(slot)):
                return False
        elif _kv_offset(cache) != 0:
            return False
    return True


def _kv_leaves(caches):
    arrays_cache = _arrays_cache()
    return [c for c in flat_caches(caches) if not isinstance(c, arrays_cache)]


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
        if trail.tokens is not tokens or trail.after is None or not _same_slots(leaf, trail.after):
            return None
    for cache in _kv_leaves(caches):
        if _kv_offset(cache) != len(tokens):
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
    live = {id(a) for a in _arrays(cache.cache)}
    seen, total = set(), 0
    for trail in rows:
        if trail is None:
            continue
        for _, slots in trail.marks:
            for array in _arrays(slots):
                if id(array) not in live and id(array) not in seen:
                    seen.add(id(array))
                    total += array.nbytes
    return total


def thin(marks: Sequence, limit: int) -> tuple:
    """At most ``limit`` of ``marks`` (ascending by position). In order of priority: the newest;
    a chain down from it, each the oldest within a factor of two of the previous, so that every
    position ``d`` has a kept state in ``[d/2, d]``, down to ``CHAIN_FLOOR`` tokens; the newest
    of the others (small gaps near the end, where requests usually diverge); the chain below the
    floor (a state there saves few tokens); the rest, newest first."""
    marks = tuple(marks)
    if len(marks) <= limit:
        return marks
    if limit <= 0:
        return ()
    positions = [m[0] for m in marks]
    newest = len(marks) - 1
    chain, i = [], newest
    while i > 0:
        i = next(j for j in range(i) if 2 * positions[j] >= positions[i] or j == i - 1)
        chain.append(i)
    high = [j for j in chain if positions[j] >= CHAIN_FLOOR]
    low = [j for j in chain if positions[j] < CHAIN_FLOOR]
    others = [j for j in reversed(range(newest)) if j not in chain]
    order = [newest] + high + [j for j in others if positions[j] >= CHAIN_FLOOR] + low + others
    keep = set()
    for j in order:
        if len(keep) == limit:
            break
        keep.add(j)
    return tuple(marks[j] for j in sorted(keep))


def cut_points(start: int, end: int) -> List[int]:
    """Powers of two (from ``FIRST_CUT``) strictly between ``start`` and ``end``."""
    out, p = [], FIRST_CUT
    while p < end:
        if p > start:
            out.append(p)
        p *= 2
    return out


# -- recording --------------------------------------------------------------------------------


class Recorder:
    """Stands in for ``model`` while one sequence (a batch of one) goes through it from a known
    history: cuts multi-token passes at :func:`cut_points` (``cut``), keeps the recurrent
    states after each, and publishes trails on the caches (:meth:`publish`, :meth:`close`). A
    pass it cannot follow (another cache list, a batch of several rows, embeddings instead of
    token ids) stops the recording; what was kept stays valid. Everything else is the model's
    own."""

    def __init__(self, model, history: Sequence[int], limit: Optional[int] = None, cut: bool = True):
        self._model = model
        self.cut = cut
        self.tokens = list(history)
        self._pending = []  # token arrays of single-token passes, read when published
        self.caches = None
        self.leaves = []
        self.marks = []  # (position, [slots per recurrent cache])
        self.limit = max_checkpoints() if limit is None else limit
        self.stopped = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        if not self._follows(inputs, cache, kwargs):
            self.stop()
            return self._model(inputs, cache=cache, **kwargs)
        if inputs.shape[1] == 1:
            self._pending.append(inputs[0])
            return self._model(inputs, cache=cache)
        self._flush()
        start, length = len(self.tokens), inputs.shape[1]
        cuts = cut_points(start, start + length) if self.cut else []
        bounds = [p - start for p in cuts] + [length]
        outputs, lo = [], 0
        for hi in bounds:
            piece = inputs[:, lo:hi]
            outputs.append(self._model(piece, cache=cache))
            mx.eval([c.state for c in cache])
            self.tokens.extend(piece[0].tolist())
            self.marks.append((len(self.tokens), [_slots(c) for c in self.leaves]))
            lo = hi
        self.marks = list(thin(self.marks, self.limit))
        self.publish()
        if len(outputs) == 1:
            return outputs[0]
        if all(isinstance(o, mx.array) and o.ndim == 3 for o in outputs):
            return mx.concatenate(outputs, axis=1)
        return outputs[-1]

    def _follows(self, inputs, cache, kwargs) -> bool:
        import mlx.core as mx

        if self.stopped or kwargs or cache is None:
            return False
        if not (isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[0] == 1):
            return False
        if self.caches is None:
            self._start(cache)
        return cache is self.caches and [id(c) for c in recurrent_caches(cache)] == [id(c) for c in self.leaves]

    def _start(self, caches):
        """First pass: follow these caches, keeping the states they already carry that were
        computed from this history."""
        self.caches = caches
        self.leaves = recurrent_caches(caches)
        self.marks = [
            (pos, states)
            for pos, tokens, states in checkpoints(caches)
            if pos <= len(self.tokens) and list(tokens[:pos]) == self.tokens[:pos]
        ]

    def _flush(self):
        if self._pending:
            import mlx.core as mx

            self.tokens.extend(mx.concatenate(self._pending).tolist())
            self._pending = []

    def publish(self, exact: bool = True) -> None:
        """Put the trails on the caches: the tokens seen, the kept states, and (while every pass
        was followed) the slots as they are now."""
        if self.caches is None:
            return
        self._flush()
        tokens = tuple(self.tokens)
        for j, leaf in enumerate(self.leaves):
            marks = tuple((pos, states[j]) for pos, states in self.marks)
            after = _slots(leaf) if exact and not self.stopped else None
            set_trails(leaf, [Trail(tokens, marks, after)])

    def stop(self) -> None:
        if not self.stopped and self.caches is not None:
            self.publish(exact=False)
        self.stopped = True

    def close(self) -> None:
        if not self.stopped:
            self.publish()


# -- carrying trails through mlx-lm's batching methods ----------------------------------------


def _indices(batch_indices) -> Optional[list]:
    try:
        return [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist") else batch_indices)]
    except (TypeError, ValueError):
        return None


def carry_merge(wrapped, instance, args, kwargs):
    caches = args[0] if args else kwargs.get("caches")
    rows = [(row_trails(c, 1) if isinstance(c, _arrays_cache()) else [None])[0] for c in caches or ()]
    merged = wrapped(*args, **kwargs)
    if isinstance(merged, _arrays_cache()) and any(r is not None for r in rows):
        set_trails(merged, rows)
    return merged


def carry_extend(wrapped, instance, args, kwargs):
    other = args[0] if args else kwargs.get("other")
    mine, theirs = trails(instance), trails(other) if isinstance(other, _arrays_cache()) else None
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
    if rows is not None and isinstance(idx, int) and 0 <= idx < len(rows) and isinstance(result, _arrays_cache()):
        set_trails(result, [rows[idx]])
    return result


def copy_row_trails(batch_caches, row_caches, i: int) -> None:
    """Give row ``i``'s trails to the single-row caches built from a batch (same layout)."""
    for batch, row in zip(recurrent_caches(batch_caches), recurrent_caches(row_caches)):
        rows = trails(batch)
        set_trails(row, [rows[i]] if rows is not None and i < len(rows) else None)


# -- reuse from a prompt-cache store ----------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def settle(caches, key: Sequence[int]) -> None:
    """A cache list about to be stored under ``key``: keep only the states computed from a
    prefix of ``key``, at most the configured number, as one trail per recurrent cache."""
    _restate(caches, key, exact=False)


def mark_exact(caches, tokens: Sequence[int]) -> None:
    """``caches`` hold exactly ``tokens`` (e.g. a prompt cache just fetched for them): record
    that, keeping the states computed from a prefix of ``tokens``."""
    _restate(caches, tokens, exact=True)


def _restate(caches, tokens, exact):
    leaves = recurrent_caches(caches)
    if not leaves:
        return
    tokens = tuple(tokens)
    usable = [(pos, states) for pos, seen, states in checkpoints(caches)
              if pos <= len(tokens) and tuple(seen[:pos]) == tokens[:pos]]
    if not exact:
        usable = thin(usable, max_checkpoints())
    for j, leaf in enumerate(leaves):
        marks = tuple((pos, states[j]) for pos, states in usable)
        if exact:
            set_trails(leaf, [Trail(tokens, marks, _slots(leaf))])
        else:
            set_trails(leaf, [Trail(tokens, marks, None)] if marks else None)


def restored_copy(caches, key: Sequence[int], position: int, states, kept) -> Optional[list]:
    """A copy of ``caches`` (which hold exactly ``key``) taken back to ``position``: recurrent
    caches set to the kept ``states``, attention caches cut to the same position. ``None``
    (nothing changed) if any attention cache cannot be cut there exactly."""
    import copy

    kv = _kv_leaves(caches)
    for cache in kv:
        if _kv_offset(cache) != len(key) or not cache.is_trimmable():
            return None
    memo = {}
    for leaf in recurrent_caches(caches):  # the live states are replaced below: do not copy them
        for array in _arrays(leaf.cache):
            memo[id(array)] = array
    out = copy.deepcopy(caches, memo)
    for cache in _kv_leaves(out):
        cache.trim(len(key) - position)
        if _kv_offset(cache) != position:
            return None
        _drop_trimmed_buffer(cache)
    for leaf, slots in zip(recurrent_caches(out), states):
        leaf.cache = type(leaf.cache)(slots)
        if hasattr(leaf, "left_padding"):
            leaf.left_padding = None
        if hasattr(leaf, "lengths"):
            leaf.lengths = None
    tokens = tuple(key[:position])
    for j, leaf in enumerate(recurrent_caches(out)):
        marks = tuple((pos, st[j]) for pos, st in kept)
        set_trails(leaf, [Trail(tokens, marks, _slots(leaf))])
    return out


def _drop_trimmed_buffer(cache) -> None:
    """A sliding-window cache cut back before it wrapped around keeps the cut keys in its buffer
    (``_idx`` marks the end); mlx-lm <= 0.30.2 merges such a cache into a batch by its offset
    and fails on the longer buffer. Keep exactly the first ``offset`` entries."""
    keys = getattr(cache, "keys", None)
    if hasattr(cache, "_idx") and hasattr(cache, "max_size") and hasattr(keys, "shape"):
        if keys.shape[2] > cache.offset:
            cache.keys = keys[..., : cache.offset, :]
            cache.values = cache.values[..., : cache.offset, :]
            cache._idx = cache.offset


def best_restore(entries, tokens: Sequence[int], better_than: int):
    """From ``entries`` (``(key, caches)`` pairs of a prompt-cache store), the cache list taken
    back to the longest kept position ``c`` with ``better_than < c <= len(tokens) - 1`` whose
    tokens ``tokens`` starts with: ``(copy, c)``, or ``None``."""
    candidates = []
    limit_all = len(tokens) - 1
    for key, caches in entries:
        if not recurrent_caches(caches):
            continue
        limit = min(common_prefix(key, tokens), limit_all)
        if limit <= better_than:
            continue
        kept = checkpoints(caches)
        for pos, seen, states in reversed(kept):
            if better_than < pos <= limit and tuple(seen[:pos]) == tuple(tokens[:pos]):
                candidates.append((pos, key, caches, states, [(p, s) for p, _, s in kept if p <= pos]))
                break
    for pos, key, caches, states, kept in sorted(candidates, key=lambda c: -c[0]):
        restored = restored_copy(caches, key, pos, states, kept)
        if restored is not None:
            return restored, pos
    return None

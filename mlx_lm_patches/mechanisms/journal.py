"""Exact rollback of a hybrid (or sliding-window) model's prompt cache: a journal of its recent
forward passes.

Attention caches (``KVCache`` and kin) go back in time by dropping their last keys and values.
A recurrent layer's cache (``ArraysCache``: gated-delta, Mamba SSM, short-conv, RG-LRU, RWKV
states) holds one state that each forward pass replaces; the state of ``n`` tokens ago is gone
unless it was kept. Setting it to zero ("reset", mlx-lm PR #1254) is *not* a rollback: it changes
every later token. A sliding-window cache (``RotatingKVCache``) is the same once it is full: it
overwrites its oldest keys in place, and its ``trim`` can no longer go back (``is_trimmable()`` is
false); mlx-lm's speculative loop then silently keeps rejected tokens.

A :class:`Journal` makes one model's cache list go back exactly:

* before every forward pass through the model (``journal.forward``) it keeps the recurrent
  states as they were - by reference: mlx arrays are immutable and every mlx-lm model replaces
  its cache slots rather than writing into them - and each sliding window's keys, values and
  positions (views taken before the pass: the window's in-place writes replace the cache's
  arrays, not those views), together with the token ids of the pass;
* ``journal.trim(cache, n)`` finds the newest kept state at or before the target position,
  restores it in every recurrent and sliding-window layer, trims every other attention cache to
  the same position, and
  re-runs the tokens between that state and the target through the model's own forward: the
  same computation a cold prefill of those tokens does, so the result equals it. With
  ``fuse=True`` (the speculative loop) the re-run is fused into the next forward pass (the
  tokens are put in front of its inputs and their outputs cut off), so a rejected draft costs no
  extra model call; :meth:`Journal.flush` runs it on its own when the caches are looked at
  before that (the journal is detached, ``speculative-cache-sync`` measures them). A fused
  re-run leaves no kept state between its tokens and the pass's own, so a rollback in the next
  round re-runs them again: a re-run longer than ``window`` tokens is run at once instead (without
  that bound, every round that rejects a draft made the next verify pass one token longer). A
  draft model decodes one token per pass, so its trims land exactly on a kept state and replay
  nothing - unless the bound below left no state there (``resync``). Gated-delta layers of the
  Qwen3-Next layout and Mamba-2 layers give their states after each token of a verify pass too
  (``mechanisms/step_states.py``); where every kept cache is one, each is kept as a state of its
  own, and a trim into a pass replays nothing either.
* The whole cache list moves as a unit, or not at all: if any layer cannot reach the target
  (no kept state that old, a plain cache that cannot drop that many keys, a forward that
  bypassed the journal), nothing is touched and the trim reports 0 - or, for callers that ignore
  the return value (mlx-lm's speculative loop), raises :class:`RollbackRefused`.

Kept states are bounded: a journal keeps what a trim of up to ``window`` tokens needs and never
more than ``max_snapshots`` (env ``MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS``). Their bytes are added to
``ArraysCache.nbytes`` while the journal is attached. A main model's journal (``resync=False``)
refuses a window that needs more states than that (the speculative loop drafts fewer tokens
instead, see ``recurrent-rollback``). A draft's journal (``resync=True``) never refuses for the bound: when it has to drop
a kept state it keeps the oldest one (the anchor every trim within the window starts from) and
gives the dropped state's tokens to the kept state before it, so a trim the bound leaves no state
for goes back to an older one and re-runs more tokens - still the draft's own forward from a
state it really had, so still what a cold prefill computes; only slower. (Where nothing exact is
possible - a forward it did not see - a draft's trim changes nothing and reports 0, as stock
mlx-lm does for a draft: the main model verifies every token.)
"""

import contextlib
import threading
import weakref
from typing import List, Optional

from mlx_lm_patches.engine.env import ROLLBACK_SNAPSHOTS as SNAPSHOTS_ENV
from mlx_lm_patches.mechanisms.caches import (
    arrays, arrays_cache_class, flat_caches, int_offset, kept_caches, same_objects)
from mlx_lm_patches.mechanisms.step_states import StepStates


_journals = weakref.WeakKeyDictionary()  # recurrent cache object -> its Journal
_lock = threading.Lock()


class RollbackRefused(RuntimeError):
    """A cache list could not go back exactly; nothing was changed."""


def max_snapshots(environ=None) -> int:
    """The snapshot bound from ``MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS``."""
    from mlx_lm_patches.engine.env import ROLLBACK_SNAPSHOTS, setting

    return setting(ROLLBACK_SNAPSHOTS, environ)


def draft_budget(num_draft: int, longest: int, said: set) -> int:
    """``num_draft`` capped so that a hybrid main model's rollback stays within the kept states:
    a round of ``k`` draft tokens needs ``k + 2`` of them (``MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS``).
    Capped before the first token, with one warning per setting not yet in ``said`` (the
    caller's record), instead of refusing in the middle of a generation. ``longest``: the longest
    round asked for."""
    import logging

    limit = max_snapshots()
    allowed = max(limit - 2, 0)
    if longest <= allowed:
        return num_draft
    if (num_draft, allowed) not in said:
        said.add((num_draft, allowed))
        logging.getLogger("mlx_lm_patches").warning(
            "mlx-lm-patches: num_draft_tokens=%d capped to %d: exact rollback of a hybrid main "
            "model keeps at most %s=%d recurrent states, and a round of k draft tokens needs "
            "k + 2 (raise the setting to draft more)", num_draft, allowed, SNAPSHOTS_ENV, limit)
    return allowed


def journal_of(caches) -> Optional["Journal"]:
    """The journal every kept cache in ``caches`` belongs to, if they share one."""
    found = {id(_journals.get(c)): _journals.get(c) for c in kept_caches(caches)}
    if len(found) != 1:
        return None
    return next(iter(found.values()))


def journal_of_cache(cache) -> Optional["Journal"]:
    try:
        return _journals.get(cache)
    except TypeError:
        return None


def _slots(cache):
    """What a kept cache's state is made of. A recurrent cache: its slot list (copied, same
    container type, e.g. the auto-sized slots of ``ArraysCache()``) and its batching bookkeeping.
    A sliding window: views of its keys and values (a write into the window replaces the
    cache's arrays; these views keep the old ones) and its positions."""
    if not isinstance(cache, arrays_cache_class()):
        keys, values = cache.keys, cache.values
        return (None if keys is None else keys[...], None if values is None else values[...],
                cache.offset, cache._idx)
    slots = cache.cache
    return (type(slots)(slots), getattr(cache, "left_padding", None), getattr(cache, "lengths", None))


def _restore(cache, saved):
    if not isinstance(cache, arrays_cache_class()):
        keys, values, cache.offset, cache._idx = saved
        cache.keys = None if keys is None else keys[...]
        cache.values = None if values is None else values[...]
        return
    slots, left_padding, lengths = saved
    cache.cache = type(slots)(slots)
    if hasattr(cache, "left_padding"):
        cache.left_padding = left_padding
    if hasattr(cache, "lengths"):
        cache.lengths = lengths


def _unchanged(cache, saved) -> bool:
    """Whether ``cache`` still holds the state ``saved`` from it after the last pass."""
    if not isinstance(cache, arrays_cache_class()):
        return (cache.offset, cache._idx) == saved[2:]
    return same_objects(cache.cache, saved[0])


class _Snapshot:
    __slots__ = ("pos", "states", "tokens")

    def __init__(self, pos, states, tokens):
        self.pos = pos  # tokens seen before this pass
        self.states = states  # one _slots() tuple per kept cache, in order
        self.tokens = tokens  # mx.array [batch, T] fed in this pass


class Journal:
    """Keeps one cache list able to go back exactly; see the module docstring.

    ``model`` is the real model (called for passes and replays); ``caches`` its prompt cache;
    ``window`` the largest trim the caller will ask for; ``strict`` makes a refused trim raise;
    ``fuse`` leaves the re-run of trimmed-over tokens to the next :meth:`forward` (only for
    callers that run every pass on these caches through the journal, as the speculative loop's
    stand-in does).
    """

    def __init__(self, model, caches, window: int, strict: bool = False, limit: Optional[int] = None,
                 fuse: bool = False, resync: bool = False):
        self.model = model
        self.window = max(int(window), 0)
        self.strict = strict
        self.fuse = fuse  # re-run trimmed-over tokens with the next pass instead of at once
        self.resync = resync  # a draft's: over the bound, merge kept states rather than refuse
        self.limit = limit or max_snapshots()
        if not resync and self.window + 1 > self.limit:
            raise RollbackRefused(
                f"exact rollback of up to {self.window} tokens keeps up to {self.window + 1} "
                f"recurrent states, more than {SNAPSHOTS_ENV}={self.limit}; raise that setting "
                f"or draft fewer tokens"
            )
        self.caches = caches
        self.recurrent = kept_caches(caches)  # recurrent states and sliding windows
        # states between a pass's tokens can be kept (mechanisms/step_states.py): no sliding window
        self._steppable = all(isinstance(c, arrays_cache_class()) for c in self.recurrent)
        self.pos = 0  # tokens the caches hold
        self._pending = None  # token ids [1, k] a trim went back over, re-run by the next pass
        self._paused = False  # see paused()
        self._snapshots: List[_Snapshot] = []
        self._after = None  # recurrent states right after the last journaled pass
        self._base = self._kv_bases(caches)
        self.refusal = None  # why the last trim was refused
        with _lock:
            for cache in self.recurrent:
                _journals[cache] = self

    # -- attaching --------------------------------------------------------------------------
    def detach(self) -> None:
        """Stop journaling: the caches go back to stock behaviour (not trimmable)."""
        self.flush()
        with _lock:
            for cache in self.recurrent:
                if _journals.get(cache) is self:
                    del _journals[cache]
        self._snapshots.clear()

    def covers(self, caches) -> bool:
        return [id(c) for c in kept_caches(caches)] == [id(c) for c in self.recurrent]

    @property
    def position(self) -> int:
        """Tokens the caches stand for: those they hold and those a trim will re-run."""
        return self.pos + (0 if self._pending is None else self._pending.shape[1])

    def flush(self) -> None:
        """Re-run now the tokens the last trim went back over (normally the next forward pass
        does it): afterwards the caches hold all :attr:`position` tokens."""
        if self._pending is not None:
            import mlx.core as mx

            pending, self._pending = self._pending, None
            self.forward(pending, self.caches)
            mx.eval([c.state for c in self.caches])

    @contextlib.contextmanager
    def paused(self):
        """Within the block forward passes keep nothing (plain decoding between speculative
        rounds: nothing there is ever rolled back); only the position is counted. What was kept
        before is dropped: no trim can go back into or past the block."""
        self.flush()
        self._forget("the caches moved on without a journal (plain decoding)")
        self._after = None
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    # -- forward passes ---------------------------------------------------------------------
    def forward(self, inputs, cache, **kwargs):
        """``model(inputs, cache=cache, **kwargs)``, keeping the states it replaces."""
        import mlx.core as mx

        if self._paused:
            out = self.model(inputs, cache=cache, **kwargs)
            self.pos += inputs.shape[1]
            return out

        journaled = (
            isinstance(inputs, mx.array) and inputs.ndim == 2 and not kwargs and self.covers(cache)
        )
        if not journaled:
            self.flush()
            self._forget("a forward pass the journal cannot replay (not token ids)")
            out = self.model(inputs, cache=cache, **kwargs)
            self._after = None
            return out
        if not self._consistent(cache):
            if self._pending is not None and self.resync:
                self._pending = None  # a draft left ahead, as stock leaves it (see the docstring)
            if self._pending is not None:
                raise RollbackRefused("the caches changed outside the journal before the tokens a "
                                      "rollback went back over were re-run; they cannot be re-run now")
            self._rebase(cache)
        replayed = 0
        if self._pending is not None:
            replayed = self._pending.shape[1]
            inputs = mx.concatenate([self._pending.astype(inputs.dtype), inputs], axis=1)
            self._pending = None
        before = [_slots(c) for c in self.recurrent]
        self._snapshots.append(_Snapshot(self.pos, before, inputs))
        # a verify pass's states between its tokens (not a prompt's: a trim never goes that far)
        steps = StepStates(self.model) if self._steppable and 1 < inputs.shape[1] <= self.window + 1 else None
        with steps if steps else contextlib.nullcontext():
            out = self.model(inputs, cache=cache)
        if steps:
            self._keep_steps(steps, cache, before, inputs)
        self.pos += inputs.shape[1]
        self._after = [_slots(c) for c in self.recurrent]
        self._prune()
        if replayed and isinstance(out, mx.array) and out.ndim >= 2 and out.shape[1] == inputs.shape[1]:
            out = out[:, replayed:]
        return out

    def _keep_steps(self, steps, caches, before, inputs):
        """Where every kept cache is a gated-delta or Mamba-2 layer whose states after each token
        of the pass were recorded (``mechanisms/step_states.py``), keep those as states of their
        own: a trim into the pass then restores the state at its target and re-runs nothing."""
        saved = {id(c): (s[0], s[1]) for c, s in zip(self.recurrent, before)}
        after = steps.after(caches, [saved.get(id(c)) for c in flat_caches(caches)], range(1, inputs.shape[1]))
        if after is None:
            return
        self._snapshots[-1].tokens = inputs[:, :1]
        for j in range(1, inputs.shape[1]):
            states = [(slots, padding, None) for slots, padding in filter(None, after[j])]
            self._snapshots.append(_Snapshot(self.pos + j, states, inputs[:, j:j + 1]))

    def _prune(self):
        # Keep every snapshot a trim of up to `window` tokens may need: those at or after
        # pos - window, plus the newest one before it.
        horizon = self.pos - self.window
        first = 0
        for i, snap in enumerate(self._snapshots):
            if snap.pos <= horizon:
                first = i
        del self._snapshots[:first]
        excess = len(self._snapshots) - self.limit
        if excess > 0 and not self.resync:
            del self._snapshots[:excess]
        for _ in range(max(excess, 0) if self.resync else 0):
            self._merge_away()

    def _merge_away(self):
        """Drop one kept state, not the oldest (the anchor), choosing the one whose loss leaves
        the shortest re-run between its neighbours; its pass's tokens go to the kept state before
        it, so every position after the anchor stays reachable. The newest goes while it is
        close to the one before, so older states age until one can become the next anchor (with
        two states: the anchor and one that ages, a re-run of at most twice the window)."""
        import mlx.core as mx

        snaps = self._snapshots
        candidates = range(1, len(snaps))

        def gap(i):
            after = snaps[i + 1].pos if i + 1 < len(snaps) else self.pos
            return after - snaps[i - 1].pos

        i = min(candidates, key=gap)
        before = snaps[i - 1]
        before.tokens = mx.concatenate([before.tokens, snaps[i].tokens], axis=1)
        del snaps[i]

    def _forget(self, why):
        self._snapshots.clear()
        self.refusal = why

    def _kv_bases(self, caches):
        bases = []
        arrays_cache = arrays_cache_class()
        for cache in flat_caches(caches):
            if isinstance(cache, arrays_cache):
                continue
            offset = int_offset(cache)
            bases.append(None if offset is None else offset - self.pos)
        return bases

    def _consistent(self, caches) -> bool:
        if self._after is not None:
            if not all(_unchanged(c, s) for c, s in zip(self.recurrent, self._after)):
                return False
        elif self._snapshots:
            return False
        return self._kv_bases(caches) == self._base

    def _rebase(self, caches):
        """Someone moved the caches behind the journal's back: what was kept no longer
        describes them. Start over from here."""
        self._forget("the caches changed outside the journal")
        self._base = self._kv_bases(caches)

    # -- going back -------------------------------------------------------------------------
    def retained_nbytes(self, cache) -> int:
        """Bytes kept alive for ``cache`` by the journal beyond its current state."""
        try:
            index = next(i for i, c in enumerate(self.recurrent) if c is cache)
        except StopIteration:
            return 0
        live = {id(a) for a in arrays(cache.cache)}
        seen, total = set(), 0
        for snap in self._snapshots:
            for array in arrays(snap.states[index][0]):
                if id(array) not in live and id(array) not in seen:
                    seen.add(id(array))
                    total += array.nbytes
        return total

    def trim(self, caches, n: int) -> int:
        """Go back ``n`` tokens exactly (all layers) and return ``n``; or change nothing and
        return 0 (raise :class:`RollbackRefused` if ``strict``)."""
        if n <= 0:
            return 0
        target = self.position - n
        if self._pending is not None and target >= self.pos and self.covers(caches):
            keep = target - self.pos  # only tokens not re-run yet are dropped
            self._pending = self._pending[:, :keep] if keep else None
            return n
        if self._trims_alone(caches, self.pos - target):
            return self._trim_in_place(caches, self.pos - target)
        why = self._why_not(caches, self.pos - target)
        if why:
            self.refusal = why
            if self.strict:
                raise RollbackRefused(f"cannot go back {n} tokens exactly: {why}")
            return 0
        self._pending = None
        index = max(i for i, s in enumerate(self._snapshots) if s.pos <= target)
        snap = self._snapshots[index]
        replay = self._tokens_since(index)[:, : target - snap.pos]
        back = self.pos - snap.pos
        kept = {id(c) for c in self.recurrent}
        for cache in flat_caches(caches):
            if id(cache) not in kept:
                cache.trim(back)
        for cache, saved in zip(self.recurrent, snap.states):
            _restore(cache, saved)
        del self._snapshots[index:]
        self.pos = snap.pos
        self._after = [_slots(c) for c in self.recurrent]
        if replay.shape[1]:
            self._pending = replay
            # A fused re-run leaves no kept state between the re-run tokens and the pass's own:
            # the next rollback goes back before them and re-runs them again. Bounded here, so
            # rounds that keep rejecting do not make every verify pass longer.
            # A draft's re-run (resync) always goes in front of its next pass, however long: its
            # length is bounded by how far back the anchor is (see _merge_away), not by this.
            if not self.fuse or (replay.shape[1] > self.window and not self.resync):
                self.flush()
        return n

    def _trims_alone(self, caches, n) -> bool:
        """Whether every layer can drop its last ``n`` tokens itself: no recurrent state, and no
        sliding window that has overwritten a key yet (as stock speculation does then)."""
        if not self.covers(caches) or not self._consistent(caches):
            return False
        for cache in flat_caches(caches):
            if isinstance(cache, arrays_cache_class()):
                return False
            offset = int_offset(cache)
            full = getattr(cache, "max_size", None)
            if offset is None or offset < n or (full is not None and offset >= full):
                return False
        return True

    def _trim_in_place(self, caches, n) -> int:
        for cache in flat_caches(caches):
            cache.trim(n)
        self.pos -= n
        self._snapshots = [s for s in self._snapshots if s.pos < self.pos]
        if self._snapshots:
            last = self._snapshots[-1]
            last.tokens = last.tokens[:, : self.pos - last.pos]
        self._after = [_slots(c) for c in self.recurrent]
        return n

    def _tokens_since(self, index):
        import mlx.core as mx

        parts = [s.tokens for s in self._snapshots[index:]]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

    def _why_not(self, caches, n) -> Optional[str]:
        if not self.covers(caches):
            return "the cache list is not the one this journal keeps"
        if not self._consistent(caches):
            return "the caches changed outside the journal (a forward pass it did not see)"
        target = self.pos - n
        if target < 0 or not any(s.pos <= target for s in self._snapshots):
            return (
                f"no recurrent state kept at or before position {target} "
                f"({self.refusal or 'older than the journal window'})"
            )
        snap = max((s for s in self._snapshots if s.pos <= target), key=lambda s: s.pos)
        back = self.pos - snap.pos
        kept = {id(c) for c in self.recurrent}
        for cache in flat_caches(caches):
            if id(cache) in kept:
                continue
            offset = int_offset(cache)
            if offset is None or not cache.is_trimmable() or offset < back:
                return f"{type(cache).__name__} cannot drop its last {back} tokens"
        return None

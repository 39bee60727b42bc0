"""Bring a prompt cache to hold exactly a given token sequence after a generator is done with it.

``generate_step`` feeds every token it yields, so afterwards a supplied prompt cache holds what
it held before, the prompt and every yielded token: callers (``mlx_lm.server``) store it under
that key. mlx-lm's speculative loop does not keep to that (see the ``speculative-cache-sync``
patch), so after it a :class:`CachePart` - one model's share of the prompt cache - is measured
and moved:

* **Measuring.** An attention cache (anything with an ``int`` ``offset``: ``KVCache``,
  ``RotatingKVCache``, ``QuantizedKVCache``, ``ChunkedKVCache``, ...) has advanced by
  ``offset`` minus its offset when :meth:`CachePart.begin` ran. A recurrent cache
  (``ArraysCache``) holds no position: it is read from the journal that ``recurrent-rollback``
  attaches to the cache list for the speculative loop (its ``pos`` counts the tokens the list
  took since the journal started, i.e. since the call). Every layer must agree.
* **Missing tokens** are fed in one forward pass of the model itself (``model(tokens[None],
  cache=...)``): what a cold prefill computes.
* **Extra tokens** are trimmed: attention caches exactly; recurrent caches only through their
  journal while it is still attached (restore a kept state, replay: exact), never by a reset.

Whatever cannot be done exactly raises :class:`CacheOutOfSync` and says why; the cache may then
not be reused as holding those tokens.
"""

import logging
from typing import List, Optional

from mlx_lm_patches.mechanisms.caches import arrays_cache_class, flat_caches, int_offset

log = logging.getLogger("mlx_lm_patches")


class CacheOutOfSync(RuntimeError):
    """A supplied prompt cache cannot be brought to hold exactly the tokens generated with it."""


class CachePart:
    """One model's caches in a prompt cache, and how far they have advanced since
    :meth:`begin`. ``model`` is what feeds them (the model, or a stand-in that forwards calls)."""

    def __init__(self, role: str, model, caches):

        self.role = role
        self.model = model
        self.caches = list(caches)
        arrays_cache = arrays_cache_class()
        leaves = flat_caches(self.caches)
        self.recurrent = [c for c in leaves if isinstance(c, arrays_cache)]
        self.attention = [c for c in leaves if not isinstance(c, arrays_cache) and int_offset(c) is not None]
        self.unknown = [c for c in leaves if not isinstance(c, arrays_cache) and int_offset(c) is None]
        self.journal = None
        self._starts: List[int] = []
        self._recurrent_moved = 0  # tokens fed (+) or trimmed (-) by us after the journal's count

    # -- measuring --------------------------------------------------------------------------
    def begin(self) -> None:
        """Remember where the attention caches are now (before the generator runs)."""
        self._starts = [int_offset(c) for c in self.attention]

    def find_journal(self) -> None:
        """Remember the journal of the recurrent caches, if one is attached now (call while the
        speculative loop is suspended: ``recurrent-rollback`` detaches it when the loop ends)."""
        from mlx_lm_patches.mechanisms.journal import journal_of

        if self.recurrent and self.journal is None:
            self.journal = journal_of(self.caches)

    def unmeasurable(self) -> Optional[str]:
        """Why the position of this part cannot be read, or ``None``."""
        if self.unknown:
            kinds = sorted({type(c).__name__ for c in self.unknown})
            return f"its caches {kinds} have no position to read"
        if self.recurrent and self.journal is None:
            return ("its recurrent caches were not journaled by recurrent-rollback (disabled?), so "
                    "how many tokens they hold is unknown")
        return None

    def advanced(self) -> dict:
        """Tokens taken since :meth:`begin`, per kind of layer (one value each when they agree)."""
        if self.journal is not None:
            self.journal.flush()  # tokens a rollback left to the next pass are re-run now
        seen = {}
        for cache, start in zip(self.attention, self._starts):
            seen.setdefault("attention", set()).add(int_offset(cache) - start)
        if self.recurrent and self.journal is not None:
            seen["recurrent"] = {self.journal.pos + self._recurrent_moved}
        return seen

    def position(self) -> Optional[int]:
        """Tokens every layer has taken since :meth:`begin`, or ``None`` if they disagree."""
        values = set().union(*self.advanced().values())
        return next(iter(values)) if len(values) == 1 else None

    # -- moving -----------------------------------------------------------------------------
    def bring_to(self, tokens, stream=None) -> int:
        """Make this part hold exactly ``tokens`` (the tokens since :meth:`begin`, in order):
        feed what is missing, trim what is extra. Returns the change (fed > 0, trimmed < 0).
        Raises :class:`CacheOutOfSync` (nothing claimed) when that cannot be done exactly."""
        why = self.unmeasurable()
        if why:
            raise CacheOutOfSync(f"the {self.role} model's cache cannot be checked: {why}")
        if not self.attention and not self.recurrent:
            return 0
        now = self.position()
        if now is None or now < 0:
            raise CacheOutOfSync(f"the {self.role} model's cache layers disagree on how many tokens "
                                 f"they took: {self._describe()}")
        target = len(tokens)
        if now < target:
            self._feed(list(tokens[now:]), stream)
        elif now > target:
            self._trim(now - target)
        if self.position() != target:
            raise CacheOutOfSync(f"the {self.role} model's cache holds {self._describe()} new tokens "
                                 f"after catching up, not {target}")
        return target - now

    def _journal_pos(self) -> int:
        return self.journal.position if self.journal is not None else 0

    def _feed(self, tokens, stream):
        import contextlib

        import mlx.core as mx

        before = self._journal_pos()
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            self.model(mx.array(tokens, dtype=mx.uint32)[None], cache=self.caches)
            mx.eval([c.state for c in self.caches])
        # A journaled stand-in counted the pass itself; the bare model did not.
        self._recurrent_moved += len(tokens) - (self._journal_pos() - before)

    def _trim(self, n):
        import sys

        from mlx_lm_patches.mechanisms.journal import RollbackRefused, journal_of

        if self.recurrent and journal_of(self.caches) is None:
            raise CacheOutOfSync(
                f"the {self.role} model's cache holds {n} token(s) too many and its recurrent "
                "states cannot go back (no journal attached any more); a reset would be inexact")
        before = self._journal_pos()
        try:
            trimmed = sys.modules["mlx_lm.models.cache"].trim_prompt_cache(self.caches, n)
        except RollbackRefused as exc:
            raise CacheOutOfSync(f"the {self.role} model's cache cannot drop {n} token(s): {exc}") from exc
        if trimmed != n:
            raise CacheOutOfSync(f"the {self.role} model's cache dropped {trimmed} of {n} extra token(s)")
        self._recurrent_moved -= n - (before - self._journal_pos())

    def _describe(self) -> str:
        return ", ".join(f"{kind} {sorted(values)}" for kind, values in self.advanced().items()) or "nothing"

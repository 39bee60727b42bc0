"""Choosing the number of draft tokens of each speculative round from what this sequence shows.

:class:`Controller` decides ``k`` in ``0..most`` before every round of a sequence from

* the acceptance seen so far: a per-token acceptance estimate from decayed counts of accepted
  and rejected draft tokens (a round of ``k`` drafts that keeps ``n`` shows ``n`` accepted and,
  when ``n < k``, one rejected; what comes after the first rejection is never seen);
* the time of a round of each ``k`` measured in this run (the seconds spent inside the
  speculative loop for the round: draft steps, the verify pass of ``k + 1`` tokens), ``k = 0``
  being a plain decoding step (a longer ``k`` not measured yet is taken to cost what the longest
  measured one below it costs, so it is tried once where its tokens would pay); and the rollback of a rejected round (what the round after
  it takes over its usual time: a hybrid re-runs the kept tokens in front of the next verify
  pass). No constant of any machine.

It picks the ``k`` with the most expected tokens per second,
``E[tokens](k) / (time(k) + (1 - a^k) * rollback)`` with ``E[tokens](k) = (1 - a^(k+1)) / (1 - a)``. At ``k = 0`` it decodes plainly and probes now and
then with one draft token: after ``interval`` plain rounds; a probe that is rejected doubles the
interval (and the interval is at least what keeps the probes' measured extra cost near 1 % of
the plain rounds between them; at most 256 rounds), an accepted one brings it back to the start.
A probe rejected after the longest wait that still cost more than 2 % of that wait (a draft whose
catch-up over the tokens it missed is itself that costly) ends the probing for the sequence.

Tests force a schedule with :func:`forced` (``k`` per round, whatever the controller thinks).
"""

import contextlib
import contextvars
import math

DECAY = 0.9  # weight kept by older acceptance observations per new one (about 10 remembered)
PRIOR = (0.5, 1.0)  # (accepted, seen) pseudo-counts: an estimate of 1/2 before anything is seen
RECENT = 8  # round times kept per k (the estimate is their least)
FIRST_INTERVAL = 4  # plain rounds before the first probe
PROBE_SHARE = 0.01  # the probes' extra cost kept near this share of the plain rounds' time
MOST_INTERVAL = 256  # plain rounds between probes at most: how long a return of acceptance may wait
RETIRE_SHARE = 0.02  # a probe after the longest wait costing more than this share of it: no more probes

_forced = contextvars.ContextVar("mlx_lm_patches_forced_draft_lengths", default=None)


@contextlib.contextmanager
def forced(schedule):
    """Within the block, speculative rounds use ``schedule``'s draft lengths in turn (an iterable
    of ints; each is capped to the call's ``num_draft_tokens`` and to the tokens left; when it
    runs out, the last one stays; the first round drafts at least one). For tests: the output must not depend on the schedule."""
    ks = [int(k) for k in schedule]
    if not ks or min(ks) < 0:
        raise ValueError(f"forced schedule needs draft lengths >= 0, got {ks!r}")
    token = _forced.set(ks)
    try:
        yield
    finally:
        _forced.reset(token)


def forced_schedule():
    return _forced.get()


def expected_tokens(a, k):
    """Tokens a round of ``k`` drafts yields on average at per-token acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class Controller:
    """The draft length of each round of one sequence; ``most``: the caller's ``num_draft_tokens``."""

    def __init__(self, most, schedule=None):
        self.most = int(most)
        self.schedule = list(schedule) if schedule is not None else None
        self.rounds = 0
        self.accepted = 0.0  # decayed counts
        self.rejected = 0.0
        self.seconds = {}  # k -> a round's seconds (the least of the recent ones)
        self.after_rejection = False  # the last round drafted and had a draft token rejected
        self.rollback = None  # seconds a rejected round adds to the next one
        self.recent = {}  # k (or "rollback") -> the last RECENT values
        self.plain_run = 0  # plain rounds since the last round that drafted
        self.interval = FIRST_INTERVAL
        self.probing = False  # the next round is a probe
        self.floored = False  # the first wait for a probe was set from the measured costs
        self.waited = 0  # plain rounds before the current probe
        self.retired = False  # no more probes in this sequence

    # -- what was seen -------------------------------------------------------------------------

    @property
    def acceptance(self):
        return (self.accepted + PRIOR[0]) / (self.accepted + self.rejected + PRIOR[1])

    def observe(self, k, kept, seconds=None, catch_up=0.0):
        """A round of ``k`` drafts kept ``kept`` of them and took ``seconds`` (None: not timed -
        the prompt's prefill was in it) besides ``catch_up`` seconds of the draft catching up on
        tokens decoded without it (a cost of probing, not of rounds of ``k``)."""
        self.rounds += 1
        probe, self.probing = self.probing, False
        for accepted in [1.0] * kept + ([0.0] if kept < k else []):
            self.accepted = DECAY * self.accepted + accepted
            self.rejected = DECAY * self.rejected + (1.0 - accepted)
        self._time(k, kept, seconds)
        if k == 0:
            self.plain_run += 1
            return
        self.plain_run = 0
        if probe:
            if kept:
                self.interval = FIRST_INTERVAL
            else:
                self.interval = 2 * self.interval
                plain = self.seconds.get(0)
                if seconds and plain:
                    # the probe's extra cost, kept near PROBE_SHARE of the plain rounds between probes
                    extra = max(seconds + catch_up - plain, 0.0) + (self.rollback or 0.0)
                    if self.waited >= MOST_INTERVAL and extra > RETIRE_SHARE * plain * self.waited:
                        # keeping the draft in step costs too much by itself (its catch-up grows
                        # with the wait): plain decoding for the rest of the sequence
                        self.retired = True
                    self.interval = max(self.interval, math.ceil(extra / (PROBE_SHARE * plain)))
                self.interval = min(self.interval, MOST_INTERVAL)

    def _time(self, k, kept, seconds):
        """Round times per ``k``, and the rollback. A rejected round of a hybrid leaves the re-run
        of its kept tokens to the next verify pass: what the next round takes over its usual time
        is the rollback's cost (a running estimate); rounds after a rejection are not taken as
        usual times."""
        after_rejection, self.after_rejection = self.after_rejection, k > 0 and kept < k
        if seconds is None or seconds <= 0:
            return
        if not after_rejection:
            self._record(k, seconds)
        elif k in self.seconds:
            self._record("rollback", max(seconds - self.seconds[k], 0.0))
            self.rollback = self.seconds.pop("rollback")

    def _record(self, k, value):
        """The estimate is the least of the last ``RECENT`` values: another process's load only
        ever adds time to a round, so the least is the round's own cost (and it follows a
        lasting change within ``RECENT`` rounds)."""
        recent = self.recent.setdefault(k, [])
        recent.append(value)
        del recent[:-RECENT]
        self.seconds[k] = min(recent)

    # -- what to do next -----------------------------------------------------------------------

    def round_time(self, k):
        """A round's time: measured; a longer draft not measured yet is taken to cost what the
        longest measured one below it costs (optimistic: it is tried once where its tokens
        would pay, then measured - a verify pass of a few more tokens often costs little more);
        a shorter one lies on the line through the plain round and the measured lengths."""
        if k in self.seconds:
            return self.seconds[k]
        plain = self.seconds.get(0)
        below = [j for j in self.seconds if 0 < j < k]
        if below:
            return self.seconds[max(below)]
        slopes = [(t - plain) / j for j, t in self.seconds.items() if j and plain is not None]
        if plain is None or not slopes:
            return None
        return plain + k * max(sum(slopes) / len(slopes), 0.0)

    def best(self):
        """The draft length with the most expected tokens per second (0 when unsure)."""
        a = self.acceptance
        best_k, best_rate = 0, None
        for k in range(self.most + 1):
            t = self.round_time(k)
            if t is None or t <= 0:
                continue
            rate = expected_tokens(a, k) / (t + (1.0 - a ** k) * (self.rollback or 0.0))
            if best_rate is None or rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def choose(self, left=None):
        """The draft length of the next round (``left``: tokens still to generate)."""
        k = self._choose()
        if self.rounds == 0:
            k = max(k, 1)  # the first round drafts: where the draft's prefill leaves it is mlx-lm's
        if left is not None:
            k = min(k, max(left - 1, 0))  # mlx-lm's loop caps at the tokens left; a last round drafts less
        return max(0, min(k, self.most))

    def _choose(self):
        if self.schedule is not None:
            return self.schedule[min(self.rounds, len(self.schedule) - 1)]
        if self.most <= 0:
            return 0
        # start: one round with a draft (the prompt's prefill is in it: not timed), then a plain
        # round and a round of one draft, each timed; from there the model decides.
        if self.rounds == 0:
            return 1
        if 0 not in self.seconds:
            return 0
        if 1 not in self.seconds and len(self.seconds) < 2:
            return 1
        if self.after_rejection and self.rollback is None:
            return 0  # a plain round measures what the rejection left to the next pass
        k = self.best()
        if k:
            return k
        if not self.floored:
            self.floored = True
            # leaving drafting: the first probe waits until its cost is about PROBE_SHARE of the wait
            plain, one = self.seconds[0], self.round_time(1)  # (both measured by now)
            if one is not None and plain > 0:
                wait = math.ceil(max(one + (self.rollback or 0.0) - plain, 0.0) / (PROBE_SHARE * plain))
                self.interval = min(max(FIRST_INTERVAL, wait), MOST_INTERVAL)
        if self.plain_run >= self.interval and not self.retired:
            self.probing, self.waited = True, self.plain_run
            return 1
        return 0

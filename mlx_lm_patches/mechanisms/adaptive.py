"""Choosing the number of draft tokens of each speculative round from what this sequence shows.

:class:`Controller` decides ``k`` in ``0..most`` before every round of a sequence from

* the acceptance seen so far: a per-token estimate from decayed counts of accepted and rejected
  draft tokens (a round of ``k`` drafts that keeps ``n`` shows ``n`` accepted and, when
  ``n < k``, one rejected; what comes after the first rejection is never seen);
* the time of a round of each ``k`` measured in this run (the median of the recent ones; ``k = 0``
  is a plain decoding step), read off the line between measured lengths, and for a length longer
  than every measured one taken as the longest's (so it is tried once where its tokens would
  pay); the rollback of a rejected round; the draft's catch-up per token it missed while plain.
  No constant of any machine.

It picks the ``k`` with the most expected tokens per second,
``E[tokens](k) / (time(k) + (1 - a^k) * rollback)``, ``E[tokens](k) = (1 - a^(k+1)) / (1 - a)``
(a round of fewer drafts taken as never costing more than one of more);
switching between plain decoding and drafting needs a win on the unfavourable side of the
measured spread (catch-up included from plain decoding), and leaving drafting a loss even at
the acceptance one standard deviation above the estimate: a few rejections at a fair rate
are common, and from plain decoding only probes come back (none, where the draft's catch-up
makes them costly). A length of two or more not run for ``STALE`` rounds has its times
forgotten, so a round slowed by the machine does not keep it out. At ``k = 0`` it probes now
and then with one draft token, after a wait that
keeps the probe's extra cost (catch-up over the wait included) near ``PROBE_SHARE`` of the plain
rounds waited; a rejected probe doubles the wait, an accepted one brings it back to the start;
a catch-up that alone costs more than that share ends the probing for the sequence once drafts
are rejected, judged by the hopeful acceptance (or it costs twice the share; otherwise the
probes come at the longest wait).

A sequence starts from what the last sequence with the same model and draft left
(:func:`recall`, :func:`remember`; kept by the caller, keyed ``(id(model), id(draft), an MTP
head?)``): its round times, rollback and catch-up - costs of this
machine, not of one sequence - and its acceptance, as a prior of ``REMEMBERED`` observations
in place of the fresh one. The first sequence measures the costs (plain rounds, rounds of
one draft); later ones skip that and decide from their first round, so a draft that does not
pay (never accepted, or as costly as the main model) is not asked at all. After
``IDLE_SEQUENCES`` such sequences in a row, the next starts afresh: acceptance may be back.

Tests force a schedule with :func:`forced` (``k`` per round, whatever the controller thinks).
"""

import contextlib
import contextvars
import math
import weakref

DECAY = 0.9  # weight kept by older acceptance observations per new one (about 10 remembered)
PRIOR = (0.5, 1.0)  # (accepted, seen) pseudo-counts: an estimate of 1/2 before anything is seen
RECENT = 8  # round times kept per k (the estimate is their median)
START_PLAIN = 3  # plain rounds timed at the start
FIRST_INTERVAL = 4  # plain rounds before the first probe
PROBE_SHARE = 0.01  # the probes' extra cost kept near this share of the plain rounds' time
MOST_INTERVAL = 256  # plain rounds between probes at most: how long a return of acceptance may wait
STALE = 32  # rounds after which the times of a draft length longer than one, not run since, are forgotten
IDLE_SEQUENCES = 3  # sequences in a row that may start from a memory and draft nothing; the next starts afresh
REMEMBERED = 2.0  # observations the last sequence's acceptance (same model and draft) counts for: the next one's prior

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


def _identity(obj):
    """What a stand-in (``ModelWithCaches``, a journaled model) stands for; an MTP draft, made
    anew per call, is its main model's head (``remembered_as``)."""
    for _ in range(8):  # stand-ins wrap each other a few levels deep at most
        try:
            inner = getattr(obj, "remembered_as", None) or getattr(obj, "__dict__", {}).get("_model")
        except Exception:  # an object whose attribute lookup fails otherwise: itself
            inner = None
        if inner is None or inner is obj:
            break
        obj = inner
    return obj


def _key(model, draft):
    follows = bool(getattr(draft, "follows_main_model", False))  # an MTP head, not the model as its own draft
    model, draft = _identity(model), _identity(draft)
    return (id(model), id(draft), follows), model, draft


def recall(store, model, draft):
    """What the last sequence of ``model`` with ``draft`` left in ``store`` (a dict the caller
    keeps: the patch's memo), or None."""
    key, model, draft = _key(model, draft)
    held = store.get(key)
    if held is None or held[0]() is not model or held[1]() is not draft:
        return None
    return held[2]


def remember(store, model, draft, controller):
    """Keep ``controller``'s costs and acceptance in ``store`` for the next sequence of ``model``
    with ``draft`` (held while both are alive; nothing is kept for objects that cannot be
    referenced weakly)."""
    memory = controller.memory()
    if memory is None:
        return
    key, model, draft = _key(model, draft)
    try:
        drop = lambda _ref: store.pop(key, None)  # noqa: E731
        store[key] = (weakref.ref(model, drop), weakref.ref(draft, drop), memory)
    except TypeError:
        pass


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _quantile(values, q):
    """The ``q`` quantile of ``values``, within a factor of two of their median: of a few values
    (the quartile of three is their largest), one round slowed by the machine - a tiny model's
    plain step by a pause ten times its length - would otherwise stand for all of them."""
    ordered = sorted(values)
    middle = _median(ordered)
    return min(max(ordered[round(q * (len(ordered) - 1))], middle / 2), 2 * middle)


def expected_tokens(a, k):
    """Tokens a round of ``k`` drafts yields on average at per-token acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class Controller:
    """The draft length of each round of one sequence; ``most``: the caller's ``num_draft_tokens``."""

    def __init__(self, most, schedule=None, plain_start=False, memory=None):
        self.most = int(most)
        self.plain_start = plain_start  # the sequence may begin with plain rounds (the draft holds nothing yet)
        self.schedule = list(schedule) if schedule is not None else None
        self.rounds = 0
        self.accepted = PRIOR[0]  # decayed counts, the prior's pseudo-counts decaying with them
        self.rejected = PRIOR[1] - PRIOR[0]
        self.seconds = {}  # k -> a round's seconds (the median of the recent ones)
        self.after_rejection = False  # the last round drafted and had a draft token rejected
        self.rollback = None  # seconds a rejected round adds to the next one
        self.recent = {}  # k (or "rollback", "catch-up") -> the last RECENT values
        self.plain_run = 0  # plain rounds since the last round that drafted
        self.interval = FIRST_INTERVAL
        self.probing = False  # the next round is a probe
        self.floored = False  # the first wait for a probe was set from the measured costs
        self.retired = False  # no more probes in this sequence
        self.probed = False  # the last round was a probe
        self.rejected_seen = False  # a draft token was rejected in this sequence
        self.catch_up = 0.0  # seconds per missed token of the draft's catch-up after plain rounds
        self.ran = {}  # k -> the round that last ran k
        self.drafting_timed = False  # a drafting round's usual time was seen (not a first round's, which holds a switch)
        self.bounds = set()  # lengths whose only time is a first round's (an upper bound)
        self.drafted = False  # a round of this sequence drafted
        self.stale = {}  # k -> times forgotten in this sequence (the next one starts from them)
        self.idle = 0  # sequences in a row, before this one, with no round that drafted
        if memory is not None and self.schedule is None and memory["idle"] < IDLE_SEQUENCES:
            self._recall(memory)  # (after sequences that drafted nothing, one starts afresh: acceptance may be back)

    # -- what a sequence leaves for the next ---------------------------------------------------

    def memory(self):
        """Costs measured (round times, rollback, catch-up: the recent values) and the acceptance
        estimate, for the next sequence with the same model and draft; None when nothing was
        measured or the schedule was forced."""
        if self.schedule is not None or not self.recent.get(0):
            return None
        recent = {k: list(v) for k, v in {**self.stale, **self.recent}.items() if k not in self.bounds and v}
        return {"recent": recent, "acceptance": self.acceptance, "idle": 0 if self.drafted else self.idle + 1}

    def _recall(self, memory):
        self.recent = {k: list(v) for k, v in memory["recent"].items()}
        for k, values in self.recent.items():
            self.seconds[k] = _median(values)
        self.rollback = self.seconds.pop("rollback", None)
        self.catch_up = self.seconds.pop("catch-up", 0.0)
        self.drafting_timed = any(k for k in self.seconds if k)
        self.accepted = REMEMBERED * memory["acceptance"]
        self.rejected = REMEMBERED - self.accepted
        self.idle = memory["idle"]

    # -- what was seen -------------------------------------------------------------------------

    @property
    def acceptance(self):
        return self.accepted / (self.accepted + self.rejected)

    @property
    def hopeful_acceptance(self):
        """The estimate one standard deviation up, its decayed counts taken as the sample: what
        the drafts seen do not rule out. Leaving drafting and giving up probing go by it, so a
        few early rejections at a fair rate do not end drafting (at no acceptance it falls
        within a few rounds)."""
        a, seen = self.acceptance, self.accepted + self.rejected
        return min(1.0, a + math.sqrt(a * (1.0 - a) / (seen + 1.0)))

    def observe(self, k, kept, seconds=None, catch_up=0.0, first=False, rows=None):
        """A round of ``k`` drafts kept ``kept`` of them and took ``seconds`` (None: not timed -
        the prompt's prefill was in it) besides ``catch_up`` seconds of the draft catching up on
        tokens decoded without it (a cost of probing, not of rounds of ``k``). ``first``: the
        round began a run of its ``k`` (its time holds the switch: a probe's cost, not a usual
        round's). ``rows``: a batch's round, per row ``(kept, offered)``: the drafts it was offered
        and kept of them (rows offered none do not count; ``kept`` is the most any row kept).
        The rows of a batch's round are that many sequences' rounds side by side: each of their
        observations decays the older ones by ``DECAY`` to the power one over the rows, so the
        estimate remembers as many rounds as one sequence's does, with every row's drafts in it
        (decayed per observation, a round of 8 rows outweighed every round before it, and the
        last rows in the batch made the estimate)."""
        self.rounds += 1
        probe, self.probing = self.probing, False
        self.probed = probe
        self.rejected_seen = self.rejected_seen or kept < k
        counted = [(n, offered) for n, offered in (rows if rows is not None else [(kept, k)]) if offered] if k else []
        decay = DECAY ** (1.0 / max(len(counted), 1))
        for row_kept, offered in counted:
            for accepted in [1.0] * row_kept + ([0.0] if row_kept < offered else []):
                self.accepted = decay * self.accepted + accepted
                self.rejected = decay * self.rejected + (1.0 - accepted)
        if first and k and seconds and k not in self.seconds and kept < k:
            # a rejected first round of an unmeasured length: its time (the switch in it) is an
            # upper bound, enough to tell that a rarely accepted draft does not pay; the first
            # usual time of its length replaces it
            self._record(k, seconds)
            self.bounds.add(k)
        self._time(k, kept, None if first else seconds)
        self.ran[k] = self.rounds
        self.drafted = self.drafted or k > 0
        if k:
            self._forget_stale()
        if k == 0:
            self.plain_run += 1
            return
        usual = self.seconds.get(k)
        if probe and usual is not None and seconds:
            catch_up += max(seconds - usual, 0.0)  # an MTP draft catches up inside its round
        if catch_up > 0 and self.plain_run:
            recent = self.recent.setdefault("catch-up", [])
            recent.append(catch_up / self.plain_run)
            del recent[:-RECENT]
            self.catch_up = _median(recent)
        self.plain_run = 0
        if probe:
            # an accepted probe starts the waits again, a rejected one doubles them; either way
            # the probes' extra cost stays near PROBE_SHARE of the plain rounds between them (a
            # draft accepted but too costly to pay does not make probing frequent)
            self.interval = FIRST_INTERVAL if kept else 2 * self.interval
            wait = self._probe_wait(0.0 if kept else (self.rollback or 0.0))
            if wait is None:
                self.retired = not kept or self._catch_up_share() >= 2 * PROBE_SHARE
                self.interval = MOST_INTERVAL
            else:
                self.interval = max(self.interval, wait)
            self.interval = min(self.interval, MOST_INTERVAL)

    def _forget_stale(self):
        """While drafting, the times of a length of two or more not run for ``STALE`` rounds are
        forgotten: one slow round must not keep a length out for the rest of the sequence (with
        its times forgotten it is estimated as unmeasured lengths are, and tried again where its
        tokens would pay). One draft's times stay: they set the probes' waits."""
        for k in [k for k in self.seconds if k >= 2 and self.rounds - self.ran.get(k, 0) > STALE]:
            del self.seconds[k]
            self.stale[k] = self.recent.pop(k, [])

    def _catch_up_share(self):
        plain = self.seconds.get(0)
        return self.catch_up / plain if plain else 0.0

    def _probe_wait(self, rollback):
        """Plain rounds before a probe so that its extra cost - a round of one draft over a plain
        one, the rollback if rejected, and the draft's catch-up over every token of the wait -
        is PROBE_SHARE of the wait; None when the catch-up alone costs more than that share (no
        wait makes a probe cheap enough: the draft is not probed again in this sequence)."""
        plain, one = self.seconds.get(0), self.round_time(1)
        if not plain or one is None:
            return None
        budget = PROBE_SHARE * plain - self.catch_up
        if budget <= 0:
            return None
        return max(FIRST_INTERVAL, math.ceil(max(one + rollback - plain, 0.0) / budget))

    def _time(self, k, kept, seconds):
        """Round times per ``k``, and the rollback. A rejected round of a hybrid leaves the re-run
        of its kept tokens to the next verify pass: what the next round takes over its usual time
        is the rollback's cost (a running estimate). A round after a rejection is a usual time
        only when no usual time of its ``k`` is known yet, less the rollback where that is known
        (at no acceptance every round follows a rejection: its ``k`` must still get a time)."""
        after_rejection, self.after_rejection = self.after_rejection, k > 0 and kept < k
        if seconds is None or seconds <= 0:
            return
        self.drafting_timed = self.drafting_timed or k > 0
        if k in self.bounds:
            self.bounds.discard(k)
            self.seconds.pop(k, None)
            self.recent.pop(k, None)
        if not after_rejection:
            self._record(k, seconds)
        elif k in self.seconds:
            self._record("rollback", max(seconds - self.seconds[k], 0.0))
            self.rollback = self.seconds.pop("rollback")
        else:
            self._record(k, max(seconds - (self.rollback or 0.0), 0.0) or seconds)

    def rolled_back(self, seconds):
        """A rejected round's rollback done on its own (before plain decoding), in ``seconds``."""
        if self.after_rejection:
            self.after_rejection = False
            self._record("rollback", seconds)
            self.rollback = self.seconds.pop("rollback")

    def _record(self, k, value):
        """The estimate is the median of the last ``RECENT`` values: the same round's time
        varies by 2x even on an idle machine (threads, caches), so the least would be a rare lucky
        round; the median follows a lasting change of load within ``RECENT / 2`` rounds, and load
        moves every ``k``'s time together."""
        recent = self.recent.setdefault(k, [])
        recent.append(value)
        del recent[:-RECENT]
        self.seconds[k] = _median(recent)

    # -- what to do next -----------------------------------------------------------------------

    def round_time(self, k):
        """A round's time: measured; between two measured lengths (the plain round counting as
        0), on the line through them; longer than every measured one, what the longest costs
        (optimistic: the longest draft is tried once where its tokens would pay - a verify pass of
        a few more tokens often costs little more - then measured, and the lengths between are
        read off the line)."""
        if k in self.seconds:
            return self.seconds[k]
        lower = [j for j in self.seconds if j < k]
        upper = [j for j in self.seconds if j > k]
        if not lower:
            return None
        lo = max(lower)
        if not upper:
            return self.seconds[lo]
        hi = min(upper)
        return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (k - lo) / (hi - lo)

    def best(self):
        """The draft length with the most expected tokens per second (0 when unsure). Switching
        needs a win on the unfavourable side of the measured spread, so that noise alone does not
        switch: from a run of plain rounds (and right after a probe) a draft length's rounds'
        upper quartile against the plain rounds' lower quartile, with its measured catch-up per
        missed token spread over ``RECENT`` rounds; while drafting, the plain rounds' upper
        quartile against the drafting ones' lower quartile (a few rejections in a row at high
        acceptance must not send it to plain decoding, from where only a probe brings it back).
        A sequence's first round from a former sequence's costs takes their medians: it switches
        nothing."""
        plain_side = self.plain_run > 0 or self.probed
        times = {}
        for k in range(self.most + 1):
            t = self.round_time(k)
            if k in self.recent and self.rounds:
                t = _quantile(self.recent[k], 0.25 if (k == 0) == plain_side else 0.75)
            if t is None or t <= 0:
                continue
            if plain_side and k:
                t += self.catch_up * self.plain_run / RECENT  # the catch-up over the next rounds
            times[k] = t
        for k in [j for j in times if j]:  # fewer drafts never cost more than more
            times[k] = min(times[j] for j in times if j >= k)

        def rate(k, a):
            return expected_tokens(a, k) / (times[k] + (1.0 - a ** k) * (self.rollback or 0.0))

        # the length by the estimate; whether to draft at all, while drafting, by the hopeful one
        a = self.acceptance
        best_k = 0
        for k in sorted(times):
            if k and (not best_k or rate(k, a) > rate(best_k, a) * (1 + 1e-9)):
                best_k = k
        if best_k and 0 in times:
            hope = a if plain_side else self.hopeful_acceptance
            if rate(best_k, hope) <= rate(0, hope) * (1 + 1e-9):
                best_k = 0
        return best_k

    def choose(self, left=None):
        """The draft length of the next round (``left``: tokens still to generate)."""
        k = self._choose()
        if self.rounds == 0 and not self.plain_start:
            k = max(k, 1)  # the first round drafts: where the draft's prefill leaves it is mlx-lm's
        if left is not None:
            k = min(k, max(left - 1, 0))  # mlx-lm's loop caps at the tokens left; a last round drafts less
        return max(0, min(k, self.most))

    def _choose(self):
        if self.schedule is not None:
            return self.schedule[min(self.rounds, len(self.schedule) - 1)]
        if self.most <= 0:
            return 0
        # start: one round with a draft (the prompt's prefill is in it: not timed; skipped for a
        # plain start, which is a plain round), then plain rounds until START_PLAIN are timed (plain decoding is the yardstick of every choice,
        # and a single time can be twice the usual) and a round of one draft; from there the
        # model decides.
        if self.rounds == 0 and not self.plain_start:
            return 1
        if len(self.recent.get(0, ())) < START_PLAIN:
            return 0
        if not self.drafting_timed or (len(self.seconds) < 2 and len(self.recent.get(1, ())) < 2 and not self.rejected_seen):
            return 1  # rounds of one draft until one is timed with no switch in it (two while every draft is accepted)
        # in a run of plain rounds the choice is looked at again every RECENT rounds (a plain
        # step can be a millisecond: the controller must cost next to nothing there)
        k = self.best() if self.plain_run % RECENT == 0 else 0
        if k:
            return k
        if not self.floored:
            self.floored = True
            # leaving drafting: the first probe waits until its cost is about PROBE_SHARE of the wait
            wait = self._probe_wait(self.rollback or 0.0)
            if wait is not None:
                self.interval = min(wait, MOST_INTERVAL)
            elif self.hopeful_acceptance < PRIOR[0] / PRIOR[1] or self._catch_up_share() >= 2 * PROBE_SHARE:
                self.retired = True  # no probe is cheap: plain decoding to the end of the sequence
            else:
                # left for its costs while accepted, catch-up under twice the share: the rarest probes
                self.interval = MOST_INTERVAL
        if self.plain_run >= self.interval and not self.retired:
            self.probing = True
            return 1
        return 0


class RankZeroChooses:
    """The draft lengths of the ranks of one distributed model (``mlx.launch``): every rank must
    run the same passes, and each measures its own times, so rank 0's controller decides and
    every rank takes its choice (a sum over ``group`` to which the other ranks add 0). Each rank's
    controller still observes its rounds; only rank 0's is asked. Within a run of plain rounds
    rank 0 is asked every ``RECENT`` rounds only: the collective waits for the step mlx-lm has
    queued, so asking every round would undo plain decoding's pipelining (a probe or a return
    to drafting is taken at the next of those rounds)."""

    def __init__(self, controller, group):
        self.controller = controller
        self.group = group
        self.deciding = group.rank() == 0
        self.last = None  # the last agreed draft length
        self.plain = 0  # rounds since the last agreed choice, while plain

    def __getattr__(self, name):
        return getattr(self.controller, name)

    def choose(self, left=None):
        import mlx.core as mx

        if self.last == 0 and self.plain % RECENT:
            self.plain += 1
            return 0
        k = self.controller.choose(left) if self.deciding else 0
        k = int(mx.distributed.all_sum(mx.array(k, mx.int32), group=self.group).item())
        self.plain = 1 if k == 0 else 0
        self.last = k
        return k

"""Speculative decoding inside mlx-lm's ``GenerationBatch``: every row drafts, one batched
forward pass verifies all rows, each row accepts its own number of tokens.

A round, for a batch of ``B`` rows and ``k`` draft tokens (``W = k + 1``):

* **Known tokens.** Each row's *known* sequence is its prompt and every token emitted so far.
  The main model's caches hold a prefix of it (``GenerationBatch.tokens[i]``, as in stock); the
  rest is the row's *pending* tokens (at least one: the last token sampled). The draft model's
  caches hold the known sequence but its last token.
* **Draft.** ``k + 1`` single-token calls of the draft model for the whole batch: the last known
  token, then each token it proposes (the last call only puts ``d_k`` into its caches, so every
  row's draft cache can be cut back to what the row accepts) - :class:`ModelDrafts`. Or the
  main model's MTP head, from the hidden states of the main model's passes
  (``mechanisms/mtp/batched.py``).
* **Verify.** One call of the main model over ``W`` tokens per row: its pending tokens, then as
  many of its drafts as fit (a row with logits processors takes none: its next token is sampled
  from processed logits, as ``GenerationBatch`` does, and any draft slot is filled and refused).
  Each row's sampler picks a token at every position; a row accepts its drafts while they equal
  what the main model picked, and gains one more token (the pick after the last accepted draft).
* **Rows go back on their own.** Attention caches (``BatchKVCache``) drop each row's rejected
  positions: every row by the fewest dropped (a trim), then a row with more to drop keeps them in
  place, masked (``mechanisms/kv_gaps.py``): its ``offset`` counts only what it kept, so rotary
  positions are those of the row alone, and its mask leaves the dropped positions out. Moving the
  row's history right instead (its left padding growing) would read and write each layer's whole
  cache every round; the gaps are compacted that way only when rows leave or join, a row is
  handed out, or a row's gaps pass an eighth of the positions.
  Recurrent caches (``ArraysCache``) take each row's state from the call after which it is the
  right one: the draft's states are kept after each of its single-token calls, so every row's is
  exact. The main model's gated-delta and Mamba-2 layers give their states after each token of
  the verify pass (``mechanisms/step_states.py``), so a row keeps exactly what it accepted.
  Other recurrent layers (Mamba-1 scans, short convolutions alone, ...) only have them before
  and after the pass:
  there a hybrid row keeps the pass when it accepted everything and otherwise goes back to
  before it, its accepted tokens staying pending (they are fed again in front of the next
  round's drafts, which then has fewer slots).
  Every round is ``W`` wide: a row with more pending tokens feeds the first ``W`` of them and
  keeps them (no drafts, no new token), so no row is padded at the end and sent back for it.
  A dense row keeps exactly what it accepted.

Every token a row emits comes from the main model's logits over that row's known prefix, so the
answer is the one greedy decoding gives; nothing is reset. The main model's sliding windows
(``BatchRotatingKVCache``) go back as attention rows do: the verify pass takes its tokens in one
piece, after which the window holds, in temporal order, the ``max_size - 1`` positions before them
and the pass's, so a row moved right keeps what its next token attends to. A draft model's
windows (a ring, fed a token a call) and quantized caches are not handled: :func:`unhostable`
says so before a generator starts speculating.
"""

import contextlib
from typing import List, Optional

from mlx_lm_patches.mechanisms import kv_gaps
from mlx_lm_patches.mechanisms.step_states import StepStates

CACHE = "mlx_lm.models.cache"
GENERATE = "mlx_lm.generate"


def unhostable(caches, verified=False) -> Optional[str]:
    """Why a batch of these caches (one sequence's, as ``make_prompt_cache`` builds them) cannot
    speculate, or None. ``verified``: the main model's, which takes a round's tokens in one pass;
    its sliding windows (``RotatingKVCache``) can then go back per row too (see
    :func:`rewind_rows`); a draft's, fed a token a call, cannot."""
    import sys

    from mlx_lm_patches.mechanisms.caches import flat_caches

    cache = sys.modules[CACHE]
    kinds = (cache.KVCache, cache.RotatingKVCache) if verified else (cache.KVCache,)
    for c in flat_caches(caches):
        if type(c) not in kinds and not isinstance(c, cache.ArraysCache):
            allowed = "KVCache, RotatingKVCache" if verified else "KVCache"
            return f"{type(c).__name__} layers (only {allowed} and ArraysCache rows go back on their own)"
    return None


def _is_window(cache) -> bool:
    import sys

    return isinstance(cache, sys.modules[CACHE].BatchRotatingKVCache)


def in_temporal_order(caches) -> None:
    """Batch windows that mlx-lm's own steps left as a ring put back in temporal order before a
    pass of several tokens. mlx-lm's ``BatchRotatingKVCache.make_mask`` reads the ring's write
    index as the window's length when it computes the trim of such a pass, so a row still holding
    left padding gets a mask one position off (0.31.2-0.32.2, measured: logits 2.4 apart); the
    update itself reorders first, so doing it before the mask is what the update does anyway."""
    from mlx_lm_patches.mechanisms.caches import flat_caches

    for c in flat_caches(caches):
        if _is_window(c) and c.keys is not None and c.rotated:
            c._temporal_order()


def _is_recurrent(cache) -> bool:
    import sys

    return isinstance(cache, sys.modules[CACHE].ArraysCache)


def _states(caches):
    """The recurrent layers' states as they are (by reference: models replace their cache slots),
    per leaf cache (``CacheList`` entries expanded)."""
    from mlx_lm_patches.mechanisms.caches import flat_caches

    return [(list(c.cache), c.left_padding) if _is_recurrent(c) else None for c in flat_caches(caches)]


def _padding(caches):
    """Recurrent layers' ``left_padding``: models that ``advance`` it build a graph per step
    (evaluated with every round, as ``arrays-cache-metadata-graph`` does for plain steps)."""
    from mlx_lm_patches.mechanisms.caches import flat_caches

    return [c.left_padding for c in flat_caches(caches) if _is_recurrent(c) and c.left_padding is not None]


def rewind_rows(caches, width: int, keep: List[int], states=None) -> None:
    """Every row of ``caches`` (batch caches) went forward by ``width`` tokens since ``states``
    were taken; row ``i`` keeps ``keep[i]`` of them. ``states[j]`` holds the recurrent states after
    ``j`` of the ``width`` tokens (from :func:`_states`), for every ``j`` some row keeps."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.caches import flat_caches, widened_token_ids

    drop = [width - n for n in keep]
    if not any(drop):
        return
    for index, c in enumerate(flat_caches(caches)):
        if _is_recurrent(c):
            now = list(c.cache) + [c.left_padding]
            saved = {j: states[j][index][0] + [states[j][index][1]] for j in set(keep) if j != width}
            for slot, current in enumerate(now):
                # each row's state read once from the state it keeps (a state the pass started
                # without stays as the pass left it); rows that keep every token stay as they are
                sources = [current if n == width or saved[n][slot] is None else saved[n][slot] for n in keep]
                if current is not None and any(s is not current for s in sources):
                    # an n-gram context grows in the pass: a row going back may be narrower
                    rows = widened_token_ids([s[i:i + 1] for i, s in enumerate(sources)])
                    now[slot] = mx.concatenate(rows, axis=0)
            c.cache, c.left_padding = now[:-1], now[-1]  # models that ``advance`` moved it
            continue
        if _is_window(c):
            # after a pass of ``width`` tokens a batch window holds, in temporal order, up to
            # ``max_size - 1`` positions before them and the pass's: a row moved right by what it
            # drops keeps the ``max_size - 1`` its next token attends to, and the trim of the next
            # update drops the oldest positions first (a trim here would break that layout)
            if c.rotated or c._idx != c.keys.shape[2]:
                raise RuntimeError("a sliding window goes back only after a pass that took its tokens in one piece")
            _move_right(c, drop)
            continue
        least = min(drop)
        if least:
            c.trim(least)
        # a row dropping more keeps them in place, masked (``kv_gaps``): moving its history right
        # would read and write the layer's whole cache every round
        kv_gaps.drop_newest(c, [d - least for d in drop])
    kv_gaps.compact_sparse(flat_caches(caches))


def _move_right(c, extra: List[int]) -> None:
    """Drop ``extra[i]`` newest positions of row ``i`` of a batch window: the row's keys and
    values move right by as much and its left padding grows by as much."""
    import mlx.core as mx

    shift = mx.array(extra)
    position = mx.arange(c.keys.shape[2])[None, :]
    kv_gaps.gather_positions(c, mx.where(position < c._idx, mx.maximum(position - shift[:, None], 0), position))
    c.left_padding = c.left_padding + shift
    c.offset = c.offset - shift


def kept_rows(caches, keep: List[int]):
    """Batch caches with only rows ``keep`` (filtered in place; none left: no caches)."""
    if not keep:
        return []
    for c in caches:
        c.filter(keep)
    return caches


def _settled(model, caches, held: List[int], wanted: List[int]):
    """``caches`` (one sequence's) hold ``held``; bring them to ``wanted`` where exact. Returns
    ``(caches, the tokens they hold)``."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.caches import flat_caches

    if len(held) > len(wanted):
        leaves = flat_caches(caches)
        if all(not _is_recurrent(c) and c.is_trimmable() for c in leaves):
            for c in leaves:
                c.trim(len(held) - len(wanted))
            held = wanted
    elif len(held) < len(wanted):
        model(mx.array(wanted[len(held):])[None], cache=caches)
        mx.eval([c.state for c in caches])
        held = wanted
    return caches, list(held)


class ModelDrafts:
    """The drafting of a batch by a draft model: its batch caches, which hold every row's known
    tokens but the last (``behind``: the tokens they miss, decoded in rounds without drafts),
    and the draft caches supplied with rows that have not joined yet."""

    def __init__(self, draft, prefill_step_size: int):
        self.draft = draft
        self.prefill_step_size = prefill_step_size
        self.cache = []
        self.supplied = {}  # uid -> (its supplied draft caches, the tokens they hold): see join
        self.behind = []  # per row: tokens its draft caches miss (before the last known one)
        self.states = None  # the recurrent states after each call of the last round's drafting

    def supply(self, uid: int, caches, held: List[int]) -> None:
        """Draft caches supplied with a row (after its main caches), holding ``held``: the row's
        draft starts from them when it joins, fed only the tokens after ``held``."""
        if held and unhostable(caches) is None and all(getattr(c, "offset", len(held)) == len(held) for c in caches):
            self.supplied[uid] = (caches, list(held))

    def forget_supplied(self, present) -> None:
        """Drop the supplied draft caches of rows no longer in the generator (removed before
        they joined): ``present(uids)`` gives those still there."""
        if self.supplied:
            there = set(present(list(self.supplied)))
            self.supplied = {uid: v for uid, v in self.supplied.items() if uid in there}

    def join(self, tokens: List[List[int]], uids) -> None:
        """New rows (their known tokens but the last sampled one): their draft caches are
        prefilled with the same tokens, from the draft caches supplied with the row where they
        hold the start of them."""
        import sys

        import mlx.core as mx

        generate = sys.modules[GENERATE]
        make_prompt_cache = sys.modules[CACHE].make_prompt_cache
        row_caches = []
        for uid, history in zip(uids, tokens):
            cache, held = self.supplied.pop(uid, (None, []))
            if cache is None or history[:len(held)] != held:
                cache, held = make_prompt_cache(self.draft), []
            for start in range(len(held), len(history), self.prefill_step_size):
                self.draft(mx.array(history[start:start + self.prefill_step_size])[None], cache=cache)
                mx.eval([c.state for c in cache])
            row_caches.append(cache)
        self.cache = generate._extend_cache(self.cache, generate._merge_caches(row_caches))
        self.behind.extend([] for _ in tokens)

    def keep_rows(self, keep: List[int]) -> None:
        self.behind = [self.behind[i] for i in keep]
        self.cache = kept_rows(self.cache, keep)

    def _extract(self, idx: int):
        return [c.extract(idx) for c in self.cache]

    def of_finished(self, i: int, known: List[int], wanted: List[int]):
        """The draft caches of row ``i`` (its known tokens ``known``), holding ``wanted``."""
        in_draft = known[:len(known) - 1 - len(self.behind[i])]
        return _settled(self.draft, self._extract(i), in_draft, wanted)[0]

    def stock_fed(self, fed: List[List[int]]) -> None:
        """mlx-lm's own steps fed each row ``fed[i]``: tokens its draft misses."""
        for behind, tokens in zip(self.behind, fed):
            behind.extend(tokens)

    def stock_stepped(self, batch, before_uids) -> None:
        """After one of mlx-lm's own steps (what it fed is read back from ``tokens`` later)."""

    def catch_up(self, batch, pending) -> float:
        """Feed the draft the tokens its rows missed: one pass when every row missed as many,
        else one token a call for every row, each row kept at its own length."""
        import time

        import mlx.core as mx

        lags = [len(b) for b in self.behind]
        most = max(lags, default=0)
        if not most:
            return 0.0
        start = time.perf_counter()
        if min(lags) == most:
            self.draft(mx.array(self.behind), cache=self.cache)
        else:
            states = [_states(self.cache)]
            for j in range(most):
                column = [b[j] if j < len(b) else b[-1] if b else 0 for b in self.behind]
                self.draft(mx.array(column)[:, None], cache=self.cache)
                states.append(_states(self.cache))
            rewind_rows(self.cache, most, lags, states)
        mx.eval([c.state for c in self.cache])
        self.behind = [[] for _ in self.behind]
        return time.perf_counter() - start

    def propose(self, batch, pending, k: int, sample):
        """``k`` proposals per row (``[B, 1]`` each): ``k + 1`` single-token calls of the draft,
        the recurrent states kept after each (the last call only puts the last proposal into
        its caches, so a row can keep every proposal it accepts)."""
        import mlx.core as mx

        self.states, proposals = [_states(self.cache)], []
        x = mx.array([p[-1][0] for p in pending])[:, None]
        for j in range(k + 1):
            logits = self.draft(x, cache=self.cache)[:, -1, :]
            self.states.append(_states(self.cache))
            if j < k:
                x = sample((logits - mx.logsumexp(logits, axis=-1, keepdims=True))[:, None])
                proposals.append(x)
        return proposals

    def to_evaluate(self):
        return _padding(self.cache)

    def settle(self, k: int, rows, hidden=None) -> None:
        """After the verify pass: ``rows[i]`` is ``(start, fed, accepted, new, last_known)``, row
        ``i`` fed from position ``start`` its ``fed`` pending tokens then ``accepted`` drafts,
        and took a new token after them (``new``), ``last_known`` its token before the round."""
        if k:
            rewind_rows(self.cache, k + 1, [1 + accepted if new else 0 for _, _, accepted, new, _ in rows],
                        self.states)
        else:
            for behind, (_, _, _, new, last_known) in zip(self.behind, rows):
                if new:
                    behind.append(last_known)
        self.states = None


class Speculation:
    """The speculative state of one ``GenerationBatch``: its drafting (:class:`ModelDrafts`, or
    ``mechanisms/mtp/batched.HeadDrafts`` for a model's MTP head), each row's pending tokens,
    and the choice of the draft length of each round (``mechanisms/adaptive.py``, one
    controller for the batch: its rounds' times and every row's acceptance), unless
    ``MLX_LM_PATCHES_ADAPTIVE_DRAFTING=0``.

    A row's tokens are emitted when the main model is fed them, as mlx-lm's own step does: the
    token sampled last in a round stays pending, unemitted, to the next round. So a round
    without drafts can be mlx-lm's own pipelined step (:meth:`stock_step`) whenever every row
    has just that one token pending and no row has logits processors; ``marks`` then holds each
    row's token count when mlx-lm took over, and :meth:`take_back` reads its state back."""

    def __init__(self, drafts, num_draft_tokens: int, main_has_recurrent: bool):
        from mlx_lm_patches.engine import env
        from mlx_lm_patches.mechanisms.adaptive import Controller, forced_schedule

        self.drafts = drafts
        self.most = max(1, int(num_draft_tokens))
        self.main_has_recurrent = main_has_recurrent
        self.pending = []  # per row: [(token, logprobs, emitted)]
        schedule = forced_schedule()
        adaptive = schedule is not None or env.setting(env.ADAPTIVE_DRAFTING)
        self.controller = Controller(self.most, schedule, plain_start=True) if adaptive else None
        self.last_k = None
        self.marks = None  # while mlx-lm's own steps decode: each row's token count when they began

    # -- rows joining and leaving -------------------------------------------------------------

    def join(self, tokens: List[List[int]], first_tokens, first_logprobs, uids=()) -> None:
        """New rows (their known tokens in the main model's caches, and the token sampled after
        them, not yet emitted)."""
        firsts = first_tokens.tolist() if first_tokens is not None else []
        if self.marks is not None:
            self.marks.extend(len(history) for history in tokens)
        self.drafts.join(tokens, list(uids) or [None] * len(tokens))
        self.pending.extend([(int(t), lp, False)] for t, lp in zip(firsts, first_logprobs))

    def keep_rows(self, keep: List[int]) -> None:
        self.pending = [self.pending[i] for i in keep]
        if self.marks is not None:
            self.marks = [self.marks[i] for i in keep]
        self.drafts.keep_rows(keep)

    def draft_of_finished(self, batch, idx: int):
        """The draft caches of row ``idx`` as mlx-lm's own step finishes it (or extracts it): while
        its steps decode, brought to hold what the main caches hold (``batch.tokens[idx]``)."""
        tokens = batch.tokens[idx]
        known = tokens + [t for t, _, _ in self.pending[idx]] if self.marks is None else tokens + [0]
        if self.marks is not None:  # what mlx-lm fed since it took over is not in the draft yet
            self.drafts.stock_fed([[] if j != idx else tokens[self.marks[idx]:] for j in range(len(self.pending))])
            self.marks[idx] = len(tokens)
        return self.drafts.of_finished(idx, known, tokens)

    def finished_row(self, batch, i: int, discarded: int):
        """A row that finished with its last ``discarded`` emitted tokens of the round not taken
        (and its pending unemitted ones): its main then draft caches, each brought to hold
        exactly its prompt and taken tokens where that is exact (an attention-only cache drops
        what it holds beyond them; tokens not yet fed are fed through the model's own forward),
        and the tokens the main caches hold."""
        known = batch.tokens[i] + [t for t, _, _ in self.pending[i]]
        unemitted = sum(1 for _, _, done in self.pending[i] if not done)
        wanted = known[:len(known) - discarded - unemitted]
        main, held = _settled(batch.model, [c.extract(i) for c in batch.prompt_cache], batch.tokens[i], wanted)
        return main + self.drafts.of_finished(i, known, wanted), held

    # -- a round ------------------------------------------------------------------------------

    def choose(self) -> int:
        """The draft length of the next round."""
        k = self.controller.choose() if self.controller is not None else self.most
        return max(0, min(k, self.most))

    def stock_can_step(self, batch) -> bool:
        """Whether a round without drafts can be mlx-lm's own step: every row has its last
        sampled token pending (not fed, not emitted) and nothing else, and no row has logits
        processors (mlx-lm keeps their context itself, from its own steps)."""
        if self.marks is not None:
            return True
        if any(batch.logits_processors or ()):
            return False
        return all(len(p) == 1 and not p[0][2] for p in self.pending)

    def stock_step(self, batch, step):
        """A round without drafts by mlx-lm's own ``step()`` (pipelined: it samples the next
        token while this one is emitted); timed for the controller."""
        import time

        import mlx.core as mx

        if self.marks is None:
            batch._next_tokens = mx.array([p[0][0] for p in self.pending])
            batch._next_logprobs = [p[0][1] for p in self.pending]
            self.marks = [len(t) for t in batch.tokens]
        uids = list(batch.uids)
        start = time.perf_counter()
        out = step()
        if self.controller is not None:
            self.controller.observe(0, 0, time.perf_counter() - start, first=self.last_k != 0)
        self.drafts.stock_stepped(batch, uids)
        self.last_k = 0
        return out

    def take_back(self, batch) -> None:
        """After mlx-lm's own steps: each row's pending token is the one they sampled last, and
        the tokens they fed are behind in the draft."""
        if self.marks is None:
            return
        tokens = batch._next_tokens.tolist() if batch.uids else []
        self.pending = [[(t, lp, False)] for t, lp in zip(tokens, batch._next_logprobs)]
        self.drafts.stock_fed([fed[mark:] for mark, fed in zip(self.marks, batch.tokens)])
        self.marks = None

    def round(self, batch, k: int):
        """One round of ``k`` drafts over ``batch`` (a ``GenerationBatch``): per row, the tokens
        it emits ``[(token, logprobs)]``, in order. The batch's caches and ``tokens`` and this
        object's state are moved forward."""
        import time

        catch_up = self.drafts.catch_up(batch, self.pending) if k else 0.0
        start = time.perf_counter()
        emitted, kept = self._round(batch, k)
        seconds = time.perf_counter() - start
        if self.controller is not None:
            self.controller.observe(k, max((n for n, _ in kept), default=0), seconds, catch_up=catch_up,
                                    first=k != self.last_k, rows=kept)
        self.last_k = k
        return emitted

    def _round(self, batch, k):
        import mlx.core as mx

        B = len(batch.uids)
        counts = [len(p) for p in self.pending]
        # a round without drafts after a rejected one: when every row re-runs as many tokens, one
        # pass takes them all (a filler slot would send a hybrid row back to the round's start)
        width = counts[0] if not k and counts and len(set(counts)) == 1 else k + 1
        fed = [min(c, width) for c in counts]  # a row with more pending tokens feeds the first ones
        samplers = [batch.fallback_sampler if s is None else s for s in (batch.samplers or [None] * B)]
        processors = [tuple(p or ()) for p in (batch.logits_processors or [()] * B)]
        shared = all(s is samplers[0] for s in samplers)

        def sample(logprobs):  # (B, n, V) -> (B, n): each row by its own sampler
            rows, n = logprobs.shape[:2]
            if shared:
                return samplers[0](logprobs.reshape(rows * n, -1)).reshape(rows, n)
            return mx.stack([s(logprobs[i]) for i, s in enumerate(samplers)])

        proposals = self.drafts.propose(batch, self.pending, k, sample) if k else []

        # verify: each row's pending tokens (at most ``width``), then as many of its drafts as fit
        # (the rest of a row's slots: a filler that is never accepted)
        slots = [0 if processors[i] or fed[i] < counts[i] else min(k, width - counts[i]) for i in range(B)]
        inputs = mx.array([[t for t, _, _ in p[:width]] + [0] * (width - n) for p, n in zip(self.pending, fed)])
        if k:
            drafts = mx.concatenate(proposals, axis=1)  # (B, k)
            position = mx.arange(width)[None, :] - mx.array(counts)[:, None]
            from_drafts = mx.take_along_axis(drafts, mx.clip(position, 0, k - 1), axis=1)
            inputs = mx.where((position >= 0) & (position < k), from_drafts, inputs)
        in_temporal_order(batch.prompt_cache)
        main_states = _states(batch.prompt_cache) if self.main_has_recurrent else None
        steps = StepStates(batch.model) if self.main_has_recurrent else None
        with steps if steps else contextlib.nullcontext():
            logits = batch.model(inputs, cache=batch.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = sample(logprobs)
        mx.eval(picked, inputs, logprobs, _padding(batch.prompt_cache), self.drafts.to_evaluate())

        picked_rows, input_rows = picked.tolist(), inputs.tolist()
        # a hybrid row keeps what it accepted where every recurrent layer's states after each
        # token of the pass were recorded; elsewhere it goes back to before the pass
        after = steps.after(batch.prompt_cache, main_states, range(1, width)) if steps else None
        stepped = after is not None
        emitted, kept, main_keep, rows = [], [], [], []
        for i in range(B):
            n, start = fed[i], len(batch.tokens[i])
            last_known = self.pending[i][-1][0]
            if n < counts[i]:
                # a hybrid row back from a rejected round with more pending tokens than the round
                # is wide: it feeds the first ones (already emitted) and keeps them; no new token
                emitted.append([])
                batch.tokens[i].extend(t for t, _, _ in self.pending[i][:n])
                main_keep.append(n)
                self.pending[i] = self.pending[i][n:]
                rows.append((start, n, 0, False, last_known))
                continue
            at = n - 1
            row_logprobs = logprobs[i]
            if processors[i]:
                context = mx.array(batch.tokens[i] + [t for t, _, _ in self.pending[i]])
                row_logits = logits[i, at:at + 1]
                for processor in processors[i]:
                    row_logits = processor(context, row_logits)
                processed = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                bonus = int(samplers[i](processed).item())
                accepted, bonus_logprobs = [], processed[0]
            else:
                a = 0
                while a < slots[i] and input_rows[i][n + a] == picked_rows[i][at + a]:
                    a += 1
                accepted = [(input_rows[i][n + m], row_logprobs[at + m]) for m in range(a)]
                bonus, bonus_logprobs = picked_rows[i][at + a], row_logprobs[at + a]
            # emitted as fed: the pending tokens and the accepted drafts; the bonus when fed next
            emitted.append([(t, lp) for t, lp, done in self.pending[i] if not done] + accepted)
            if slots[i]:
                kept.append((len(accepted), slots[i]))
            taken = n + len(accepted)
            rows.append((start, n, len(accepted), True, last_known))
            if not self.main_has_recurrent or taken == width or stepped:
                batch.tokens[i].extend(t for t, _, _ in self.pending[i])
                batch.tokens[i].extend(t for t, _ in accepted)
                main_keep.append(taken)
                self.pending[i] = [(bonus, bonus_logprobs, False)]
            else:
                main_keep.append(0)
                self.pending[i] = ([(t, lp, True) for t, lp, _ in self.pending[i]]
                                   + [(t, lp, True) for t, lp in accepted] + [(bonus, bonus_logprobs, False)])
        rewind_rows(batch.prompt_cache, width, main_keep, {0: main_states, **(after or {})} if main_states else None)
        self.drafts.settle(k, rows)
        return emitted, kept

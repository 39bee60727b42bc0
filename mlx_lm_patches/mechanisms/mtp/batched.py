"""A model's MTP head drafting for every row of a ``GenerationBatch`` (batched speculation).

The head's layer caches are batch caches, one row per sequence, whose slot ``t`` pairs the main
model's hidden state at position ``t`` with the token at ``t + 1``, as in one sequence's
``MTPDraft``. The main model's hidden states come from its own forward passes, read from the
hidden-state capture (``HiddenCapture``): the prompt passes of ``BatchGenerator``'s prompt
batches (the last ``KEEP_POSITIONS`` of each row), the pass over a row's last prompt token
when it joins (the pass that samples its first token), each verify pass (its pending tokens and
accepted drafts: the positions whose hidden states are true), and mlx-lm's own steps in rounds
without drafts. They wait per row until the row drafts again.

A drafting round feeds every row's waiting pairs in one pass, right-padded (each row then keeps
its own, ``rewind_rows``); the first proposal comes from its last pair, further ones from the
head's own output and the previous proposal (recycling, as ``MTPDraft`` does), whose slots are
dropped again before the verify pass. When more than the usual states wait (a row's prompt, a
run of rounds without drafts), those but each row's last are fed first, timed as catch-up for
the controller.

Proposals are only proposals: every token is verified by the main model, so what the head sees
changes speed, never output.
"""

from typing import List, Optional

from mlx_lm_patches.mechanisms.batch_speculation import kept_rows, rewind_rows

KEEP_POSITIONS = 256  # waiting hidden states kept per row (a longer run without drafts skips the oldest:
# what is held, and the catch-up pass, stay bounded; the head then sees a shorter history)


def unhostable(draft) -> Optional[str]:
    """Why ``draft`` (an ``MTPDraft``) cannot draft for a batch, or None."""
    import sys

    from mlx_lm_patches.mechanisms.mtp.decoding import make_mtp_cache

    if draft.depths > 1:
        return f"its MTP head drafts with {draft.depths} layers in turn (batched drafting uses heads of one layer)"
    kv = sys.modules["mlx_lm.models.cache"].KVCache
    for c in make_mtp_cache(draft.main):
        if type(c) is not kv:
            return f"its MTP head keeps {type(c).__name__} layers (batched drafting needs KVCache ones)"
    return None


class _Row:
    """One row's hidden states waiting for the head: positions ``first..first+len-1``."""

    __slots__ = ("first", "hidden")

    def __init__(self, first=0, hidden=None):
        self.first, self.hidden = first, hidden or []  # hidden: [H] arrays, one per position

    @property
    def end(self):
        return self.first + len(self.hidden)

    def add(self, start, states) -> None:
        """The hidden states of positions ``start..`` (``[n, H]``); those already here are kept."""
        if start > self.end:
            self.first, self.hidden = start, []  # a gap: the head's caches skip it
        skip = self.end - start
        self.hidden.extend(states[j] for j in range(max(skip, 0), states.shape[0]))
        if len(self.hidden) > KEEP_POSITIONS:
            drop = len(self.hidden) - KEEP_POSITIONS
            self.first, self.hidden = self.first + drop, self.hidden[drop:]

    def take(self, n):
        """The first ``n`` waiting states; they are the head's now."""
        taken, self.hidden = self.hidden[:n], self.hidden[n:]
        self.first += len(taken)
        return taken


def _rows_of(passes, lengths):
    """Each row's hidden states (``[lengths[i], H]``, or None) from the passes of a prompt batch: passes
    over the whole batch (right-padded, in chunks), or over one row at a time in row order (a
    row in chunks: how ``batch-prefill-per-row`` prefills rows alone)."""
    import mlx.core as mx

    rows = len(lengths)
    if passes and all(p.shape[0] == rows for p in passes):
        joined = mx.concatenate(passes, axis=1) if len(passes) > 1 else passes[0]
        return [joined[i, :n] for i, n in enumerate(lengths)] if joined.shape[1] >= max(lengths) else [None] * rows
    out, queue = [], list(passes)
    for n in lengths:
        parts, width = [], 0
        while width < n and queue and queue[0].shape[0] == 1:
            parts.append(queue.pop(0)[0])
            width += parts[-1].shape[0]
        if width != n:
            return [None] * rows  # not passes of one row at a time: the head starts when rows join
        out.append(mx.concatenate(parts) if len(parts) > 1 else parts[0] if parts else None)
    return out if not queue else [None] * rows


def _add_empty_rows(caches, n: int) -> None:
    """Append ``n`` rows holding nothing to batch KV caches (all padding: their offset is 0).
    Not ``BatchKVCache.extend`` with empty caches, which 0.31.x sizes by the other cache."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.kv_gaps import compact

    for c in caches:
        compact(c)  # rows of positions it dropped in place move right first
        if c.keys is not None:
            _, H, L, _ = c.keys.shape
            c.keys = mx.concatenate([c.keys, mx.zeros((n, H, L, c.keys.shape[3]), dtype=c.keys.dtype)])
            c.values = mx.concatenate([c.values, mx.zeros((n, H, L, c.values.shape[3]), dtype=c.values.dtype)])
        c.left_padding = mx.concatenate([c.left_padding, mx.full((n,), c._idx, dtype=c.left_padding.dtype)])
        c.offset = mx.concatenate([c.offset, mx.zeros((n,), dtype=c.offset.dtype)])


def _known(batch, pending):
    """Each row's known tokens: those in the main model's caches, then its pending ones."""
    return [tokens + [t for t, _, _ in p] for tokens, p in zip(batch.tokens, pending)]


class HeadDrafts:
    """The drafting of a batch by the main model's MTP head (``draft``: its ``MTPDraft``)."""

    def __init__(self, draft):
        self.draft = draft
        self.main = draft.main
        self.capture = draft.capture
        self.kind = draft.hidden
        self.cache = []
        self.rows: List[_Row] = []
        self.prompts = {}  # uid -> _Row: the hidden states of its prompt passes, until it joins
        self.lagging = False  # states wait beyond the usual ones (the head catches up before drafting)

    def supply(self, uid, caches, held) -> None:
        """Supplied draft caches are not used: a row's head caches start with its prompt passes."""

    def forget_supplied(self, present) -> None:
        """Drop the prompt states of rows no longer in the generator (removed before joining)."""
        if self.prompts:
            there = set(present(list(self.prompts)))
            self.prompts = {uid: row for uid, row in self.prompts.items() if uid in there}

    def prompt_pass(self, uids, starts, lengths, passes) -> None:
        """mlx-lm's prompt processing (``PromptProcessingBatch.prompt``) fed row ``i``
        (``uids[i]``) ``lengths[i]`` tokens from position ``starts[i]``; ``passes``: the main
        model's hidden states of each forward it ran (``[B, n, H]``). The last ``KEEP_POSITIONS``
        of each row wait for the head."""
        for uid, start, n, states in zip(uids, starts, lengths, _rows_of(passes, lengths)):
            first = max(n - KEEP_POSITIONS, 0)
            if n and states is not None:
                self.prompts.setdefault(uid, _Row(start + first)).add(start + first, states[first:n])

    def _last_states(self, rows: int):
        """The hidden states of the main model's last forward pass if it had ``rows`` rows."""
        last = self.capture.last
        states = None if last is None else last.get(self.kind)
        return states if states is not None and states.ndim == 3 and states.shape[0] == rows else None

    def join(self, tokens: List[List[int]], uids) -> None:
        """New rows, with the states of their prompt passes; the main model's last pass was the one
        over their last prompt tokens (it sampled their first tokens) when its hidden states have
        one position per new row."""
        import sys

        from mlx_lm_patches.mechanisms.mtp.decoding import make_mtp_cache

        generate = sys.modules["mlx_lm.generate"]
        states = self._last_states(len(tokens))
        for i, (uid, history) in enumerate(zip(uids, tokens)):
            row = self.prompts.pop(uid, None) or _Row(len(history) - 1)
            if states is not None and states.shape[1] == 1:
                row.add(len(history) - 1, states[i])
            self.lagging = self.lagging or len(row.hidden) > 1
            self.rows.append(row)
        if self.cache:
            _add_empty_rows(self.cache, len(tokens))
        else:
            self.cache = generate._merge_caches([make_mtp_cache(self.main) for _ in tokens])

    def keep_rows(self, keep: List[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.cache = kept_rows(self.cache, keep)

    def of_finished(self, i, known, wanted):
        """A finished row's draft cache: the sequence-level ``MTPDraft`` cache, which catches up
        from the main model by itself when it is used again."""
        return self.draft.make_cache()

    def stock_fed(self, fed) -> None:
        """What mlx-lm's own steps fed was recorded as they ran (:meth:`stock_stepped`)."""

    def stock_stepped(self, batch, before_uids) -> None:
        """After one of mlx-lm's own steps: it fed one token per row (the one it appended to
        ``batch.tokens``); that position's hidden state is the row's next waiting one."""
        states = self._last_states(len(before_uids))
        self.lagging = True
        if states is None or states.shape[1] != 1:
            return
        where = {uid: j for j, uid in enumerate(before_uids)}
        for row, uid, tokens in zip(self.rows, batch.uids, batch.tokens):
            if uid in where:
                row.add(len(tokens) - 1, states[where[uid]])

    def catch_up(self, batch, pending) -> float:
        """When more states wait than a round leaves (a prompt, rounds without drafts): every
        row's waiting pairs but its last, in one pass."""
        import time

        import mlx.core as mx

        if not self.lagging:
            return 0.0
        self.lagging = False
        lags = [max(len(r.hidden) - 1, 0) for r in self.rows]
        if not any(lags):
            return 0.0
        start = time.perf_counter()
        self._feed(lags, _known(batch, pending))
        mx.eval(self.to_evaluate())
        return time.perf_counter() - start

    def _feed(self, counts, known):
        """One head pass over the first ``counts[i]`` waiting pairs of each row (right-padded;
        ``known[i]``: the row's known tokens), each row keeping its own slots. Returns the
        logits and output of each row's last fed slot (``[B, 1, ...]``)."""
        import mlx.core as mx

        from mlx_lm_patches.mechanisms.mtp.decoding import _mtp_pass

        width = max(counts)
        like = next(r.hidden[0] for r, n in zip(self.rows, counts) if n)
        filler = mx.zeros(like.shape, dtype=like.dtype)
        hidden, ids = [], []
        for row, n, tokens in zip(self.rows, counts, known):
            first, taken = row.first, row.take(n)
            hidden.append(mx.stack(taken + [filler] * (width - n)))
            ids.append(tokens[first + 1:first + 1 + n] + [0] * (width - n))
        logits, out, _ = _mtp_pass(self.main, mx.stack(hidden), mx.array(ids, dtype=mx.uint32), self.cache,
                                   self.draft.fusion, 0)
        rewind_rows(self.cache, width, list(counts))
        at = mx.array([max(n - 1, 0) for n in counts])[:, None, None]
        return mx.take_along_axis(logits, at, axis=1), mx.take_along_axis(out, at, axis=1)

    def propose(self, batch, pending, k: int, sample):
        """``k`` proposals per row (``[B, 1]`` each): one pass over every row's waiting pairs,
        then ``k - 1`` passes of one slot recycling the head's output; those slots are dropped.
        A row with nothing waiting (its hidden states were not seen) proposes what the filler
        gives: the main model refuses it or takes it as its own pick."""
        import mlx.core as mx

        from mlx_lm_patches.mechanisms.mtp.decoding import _mtp_pass

        counts = [len(r.hidden) for r in self.rows]
        if not any(counts):
            return [mx.zeros((len(self.rows), 1), dtype=mx.uint32)] * k
        self.lagging = False
        logits, out = self._feed(counts, _known(batch, pending))
        proposals = []
        for j in range(k):
            if j:
                logits, out, _ = _mtp_pass(self.main, out, proposals[-1], self.cache, self.draft.fusion, 0)
            proposals.append(sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
        if k > 1:
            rewind_rows(self.cache, k - 1, [0] * len(self.rows))
        return proposals

    def to_evaluate(self):
        return [c.state for c in self.cache if getattr(c, "keys", None) is not None]

    def settle(self, k: int, rows, hidden=None) -> None:
        """After the verify pass: each row's true hidden states (its fed pending tokens and its
        accepted drafts) wait for the head."""
        states = self._last_states(len(rows))
        if k == 0:
            self.lagging = True
        if states is None:
            return
        for row, (start, fed, accepted, _, _), h in zip(self.rows, rows, states):
            row.add(start, h[:fed + accepted])

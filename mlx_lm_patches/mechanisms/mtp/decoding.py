"""Self-speculative decoding with a model's MTP head, through mlx-lm's own speculative loop.

``draft = model.make_draft_model()`` (added by the ``mtp-heads-kept`` patch to models whose head
was kept) returns an object usable as ``draft_model=`` in ``speculative_generate_step``,
``stream_generate``, ``generate`` and the server. Output is always the main model's greedy
output: every drafted token is verified by the main model (and hybrid main models go back
exactly, see ``recurrent-rollback``); the head only decides how many tokens each main forward
pass yields.

How the draft sees the main model. mlx-lm feeds a draft model token ids only. So
``make_draft_model()`` installs a *capture* on the main model (once): its final norm records its
input and output (pre- and post-norm hidden states) and its forward records the position it
started at and the token ids, by swapping the instance's ``__class__`` for a subclass - the
parameter tree, the logits and the class name are unchanged. The patch records that per model
(``Patcher.track``): ``revert()`` puts the original classes back and takes the interface off. When the stock loop asks the draft
for a token, the draft reads how far the main model has committed (the offset of its attention
cache, after mlx-lm's trim, plus any accepted tokens a hybrid's rollback leaves to the next
pass to re-run), takes the main hidden state of the last committed position, and:

* catches its MTP KV cache up over the committed positions it has not seen (one batched pass
  pairing each true hidden state ``h_t`` with token ``x_{t+1}``), dropping the slots it
  computed from its own recycled outputs in the previous round;
* predicts the next token from ``h_{C-1}`` and the token it was given, then, for further draft
  tokens in the round, from its own output hidden state (recycling) and its previous draft.

Contract per family (defaults, configurable with ``make_draft_model(hidden=..., fusion=...)``;
the pieces per family are in ``families/``, one module each):

* Qwen3-Next, Qwen3.5/3.6:
  ``fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])``, then the MTP
  decoder layer(s) with their own KV cache, then ``norm``; logits through the shared ``lm_head``
  (or the tied embedding).
* Nemotron-H: ``eh_proj(concat[enorm(embed(x_{t+1})), hnorm(h_t)])``, then the MTP blocks
  (``NemotronHBlock``: the attention ones with their own KV cache, MoE/MLP ones without), then
  ``final_layernorm`` of the last block; logits through the shared ``lm_head``.

* MiMo: ``input_proj(concat[hidden_layernorm(h_t), token_layernorm(embed(x_{t+1}))])`` (the
  hidden half first), the MTP decoder layer with its own KV cache, ``final_layernorm``; logits
  through the shared ``lm_head`` (or the tied embedding).
* DeepSeek-V3 layout: ``eh_proj(concat[enorm(embed(x_{t+1})), hnorm(h_t)])``, the family's decoder
  layer with its own KV cache, ``shared_head.norm``, the shared ``lm_head``.

In all ``h_t`` is the main model's *post*-final-norm hidden state by default (``hidden="pre"``:
the input of the final norm; Step-3.5's default, ``HIDDEN`` of its family) and the halves come in the family's order (``fusion=`` forces
``"embedding-first"`` or ``"hidden-first"``).

``model.mtp_forward(hidden, next_ids, cache)``, ``model.make_mtp_cache()`` and
``model.hidden_states`` (``{"pre": ..., "post": ...}`` of the last forward, once the capture is
installed) are the lower-level interface engines built on mlx-lm call.
"""

import weakref
from typing import List, Optional

from mlx_lm_patches.mechanisms.mtp.families import SLIDING_WINDOW, family_of

HIDDEN_KINDS = ("post", "pre")
FUSION_ORDERS = ("embedding-first", "hidden-first")  # order of the two halves fed to ``fc``
KEEP_POSITIONS = 8192  # captured hidden states kept at most (positions), per model
CHANGES = 256  # forward passes whose changed positions are remembered
OUTPUTS_KEPT = 64  # positions of an MTP layer's outputs kept for the next layer of a chained head


class MTPUnavailable(RuntimeError):
    """The model has no usable MTP head; the message says why (from ``model.mtp_status``)."""


def _position_leaf(cache):
    """The first attention cache of a prompt cache: its offset is the position."""
    from mlx_lm_patches.mechanisms.caches import flat_caches

    for leaf in flat_caches(cache or []):
        if isinstance(getattr(leaf, "offset", None), int):
            return leaf
    return None


def _offset(cache) -> Optional[int]:
    leaf = _position_leaf(cache)
    return None if leaf is None else leaf.offset


class _Forward:
    __slots__ = ("start", "tokens", "post", "pre")

    def __init__(self, start, tokens, post, pre):
        self.start, self.tokens, self.post, self.pre = start, tokens, post, pre


class HiddenCapture:
    """Records, per forward pass of the main model: start position, token ids, hidden states."""

    def __init__(self):
        self.forwards: List[_Forward] = []
        self.count = 0  # forward passes recorded so far
        self._leaf = None  # weakref to the position leaf of the cache of the recorded passes
        self._leaf_since = 0  # self.count when that cache was first seen
        self._pending = []  # (pre, post) of each final-norm call during the current forward
        self.last = None  # {"pre", "post"} hidden states of the last forward, any batch size
        self.norm = None  # weakref to the final norm whose class was swapped
        self._journal = None  # weakref to the rollback journal of the recorded passes' cache, if any
        self._changes = []  # (pass number, what it wrote over: see _overwritten), the last CHANGES passes
        self.taps = []  # callables given ``last`` after every forward (batched drafting reads prompt passes)

    def forward_started(self):
        self._pending = []  # norm calls outside a forward of the model (e.g. its inner model's) do not count

    def norm_called(self, pre, post):
        self._pending.append((pre, post))

    def forward_done(self, inputs, cache, start):
        import mlx.core as mx

        calls, self._pending = self._pending, []
        pending = None
        if calls:
            # One forward may run the model in pieces (the prefill cut of prompt-cache-prefix-reuse
            # runs a chunk per call of the wrapped ``__call__``): the final norm saw each in turn.
            pre, post = (mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
                         for parts in zip(*calls))
            pending = (pre, post)
            self.last = {"pre": pre, "post": post}
            for tap in self.taps:
                tap(self.last)
        if pending is None or start is None or not isinstance(inputs, mx.array) or inputs.ndim != 2 \
                or inputs.shape[0] != 1 or post.ndim != 3 or post.shape[1] != inputs.shape[1]:
            return
        leaf = _position_leaf(cache)
        journal = _journal_of(cache)
        self._journal = weakref.ref(journal) if journal is not None else None
        current = self._leaf() if self._leaf is not None else None
        if leaf is not current:  # another sequence: what was recorded no longer applies
            self.forwards = []
            self._leaf = weakref.ref(leaf) if leaf is not None else None
            self._leaf_since = self.count
        self.count += 1
        end = start + inputs.shape[1]
        self._changes = (self._changes + [(self.count, self._overwritten(start, inputs))])[-CHANGES:]
        # A new pass from `start` replaces what was recorded at or after it (trim + replay).
        kept = []
        for f in self.forwards:
            if f.start >= start:
                continue
            if f.start + f.tokens.shape[1] > start:
                cut = start - f.start
                f = _Forward(f.start, f.tokens[:, :cut], f.post[:, :cut], f.pre[:, :cut])
            kept.append(f)
        kept.append(_Forward(start, inputs, post, pre))
        while kept and end - kept[0].start > KEEP_POSITIONS and len(kept) > 1:
            kept.pop(0)
        self.forwards = kept

    def _overwritten(self, start, inputs):
        """What a pass from ``start`` writes over: ``[start, recorded tokens there (contiguous from
        start, or None), its own tokens, None]`` - compared only when the draft asks
        (``changed_since``), so that a forward pass never waits on its inputs."""
        pieces, _ = self._pieces(start, 1 << 62)
        return [start, _joined([f.tokens[0, lo - f.start:hi - f.start] for f, lo, hi in pieces], 0), inputs[0], None]

    @staticmethod
    def _first_change(entry):
        """The first position from the pass's start where its tokens differ from those it wrote
        over (a verify pass re-running accepted tokens changes none; one over rejected drafts,
        or a prompt cache trimmed back and extended otherwise, does); past the compared ones if
        none differ."""
        import mlx.core as mx

        start, old, new, found = entry
        if found is None:
            n = 0 if old is None else min(old.shape[0], new.shape[0])
            same = n
            if n:
                differs = (old[:n] != new[:n]).astype(mx.int32)
                if differs.max().item():
                    same = int(mx.argmax(differs).item())
            entry[3] = found = start + same
            entry[1] = entry[2] = None  # (resolved: the tokens are no longer needed)
        return found

    def changed_since(self, count) -> int:
        """The first position whose token a pass after pass number ``count`` changed (0 if those
        passes are no longer all known; a large number if none changed any)."""
        if count < self.count - len(self._changes):
            return 0
        return min((self._first_change(entry) for n, entry in self._changes if n > count), default=1 << 62)

    def committed(self, since=0) -> Optional[int]:
        """How many positions the main model has committed now (after any trim), if its cache
        was first used at or after forward pass number ``since``: the positions its cache holds,
        plus those a rollback journal went back over and leaves to the next pass to re-run (a
        hybrid's rejected draft: the state before the verify pass restored, the accepted tokens
        not run again yet; their hidden states were recorded by the verify pass)."""
        leaf = self._leaf() if self._leaf is not None else None
        if leaf is None or self._leaf_since < since:
            return None
        journal = self._journal() if self._journal is not None else None
        pending = journal.position - journal.pos if journal is not None else 0
        return leaf.offset + pending

    def _pieces(self, first, last):
        """``(record, lo, hi)`` covering positions ``first..`` without a gap, up to ``last`` (less
        if a position is not recorded). The records are in position order; those a pass asks
        about are the last few, so the search starts from the end."""
        i = len(self.forwards)
        while i > 0 and self.forwards[i - 1].start > first:
            i -= 1
        pieces, covered = [], first
        for f in self.forwards[max(i - 1, 0):]:
            lo, hi = max(covered, f.start), min(last, f.start + f.tokens.shape[1])
            if lo != covered or lo >= hi:
                if lo > covered:
                    break
                continue
            pieces.append((f, lo, hi))
            covered = hi
        return pieces, covered

    def span(self, first, last, kind):
        """Hidden states at positions ``first..last-1`` and the token ids at ``first+1..last-1``
        (``(h [1,n,H], x [1,n-1])``), or ``None`` if not all are recorded."""

        pieces, covered = self._pieces(first, last)
        if last <= first or covered != last:
            return None
        hidden = _joined([(f.pre if kind == "pre" else f.post)[:, lo - f.start:hi - f.start] for f, lo, hi in pieces])
        return hidden, _joined([f.tokens[:, lo - f.start:hi - f.start] for f, lo, hi in pieces])[:, 1:]

    def tokens(self, first, last):
        """Token ids at positions ``first..last-1`` (``[1, n]``), or ``None`` if not all are recorded."""

        pieces, covered = self._pieces(first, last)
        if covered != last or not pieces:
            return None
        return _joined([f.tokens[:, lo - f.start:hi - f.start] for f, lo, hi in pieces])


def _joined(parts, axis=1):
    """``parts`` concatenated along ``axis`` (the one part itself; None for none)."""
    import mlx.core as mx

    return mx.concatenate(parts, axis=axis) if len(parts) > 1 else (parts[0] if parts else None)


def _journal_of(cache):
    """The rollback journal keeping ``cache`` (a hybrid's, during speculative decoding), if any."""
    from mlx_lm_patches.mechanisms.journal import journal_of

    try:
        return journal_of(cache)
    except TypeError:  # not a list of caches
        return None


CAPTURE = "_mlx_lm_patches_capture"
SWAPPED = "__mlx_lm_patches_swapped_from__"  # on the subclasses: the class they stand in for
INTERFACE = ("make_draft_model", "mtp_forward", "make_mtp_cache", "hidden_states")


def _swap_class(obj, call):
    """Give ``obj`` a same-named subclass of its class whose ``__call__`` is ``call``."""
    cls = type(obj)
    obj.__class__ = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                               "__qualname__": cls.__qualname__, SWAPPED: cls})
    return cls


def _unswap_class(obj) -> None:
    original = vars(type(obj)).get(SWAPPED)
    if original is not None:
        obj.__class__ = original


def install_capture(model) -> HiddenCapture:
    """Install (once) the hidden-state capture on ``model``; returns it. The capture swaps the
    classes of ``model`` and of its final norm for same-named subclasses; :func:`remove_capture`
    (run by ``revert()`` of ``mtp-heads-kept`` for every model it gave the interface) undoes it."""
    capture = model.__dict__.get(CAPTURE)
    if capture is not None:
        return capture
    capture = HiddenCapture()
    norm = family_of(model).final_norm(model)
    norm_class = type(norm)

    def norm_call(self, x, *args, **kwargs):
        out = norm_class.__call__(self, x, *args, **kwargs)
        self.__dict__[CAPTURE].norm_called(x, out)
        return out

    model_class = type(model)

    def model_call(self, inputs, cache=None, **kwargs):
        start = _offset(cache) if cache is not None else 0  # no cache: a forward from position 0
        self.__dict__[CAPTURE].forward_started()
        out = model_class.__call__(self, inputs, cache=cache, **kwargs)
        self.__dict__[CAPTURE].forward_done(inputs, cache, start)
        return out

    norm.__dict__[CAPTURE] = capture
    _swap_class(norm, norm_call)
    capture.norm = weakref.ref(norm)
    model.__dict__[CAPTURE] = capture
    _swap_class(model, model_call)
    return capture


def remove_capture(model) -> None:
    """Undo :func:`install_capture`: the original classes back, the capture gone."""
    capture = model.__dict__.pop(CAPTURE, None)
    if capture is None:
        return
    norm = capture.norm() if capture.norm is not None else None
    if norm is not None:
        norm.__dict__.pop(CAPTURE, None)
        _unswap_class(norm)
    _unswap_class(model)


def hidden_states(model):
    """``{"pre": ..., "post": ...}`` hidden states of the last forward (capture installed)."""
    return install_capture(model).last


def make_mtp_cache(model, depth=0):
    """The KV caches of the head's layers at ``depth`` (0: the first MTP layer)."""
    family = family_of(model)
    return [family.layer_cache(model) for _ in family.attention_layers(_depth_module(model, depth))]


def depths_of(model) -> int:
    """How many MTP layers of the head draft in turn (one per draft step; 1 for most families)."""
    return 1 + len(getattr(_head(model), "depths", ()))


def _depth_module(model, depth):
    head = _head(model)
    if depth == 0:
        return head
    more = getattr(head, "depths", ())
    if not 0 < depth <= len(more):
        raise ValueError(f"depth={depth}: {model_label(model)}'s MTP head has {len(more) + 1} layer(s) to draft with")
    return more[depth - 1]


def positions_cache(layer_cache):
    """The KV cache that holds a head layer's positions: the layer's cache, or the first of a
    ``CacheList`` (deepseek_v32 keeps its indexer's keys in the second)."""
    return layer_cache[0] if hasattr(layer_cache, "caches") else layer_cache


def model_label(model) -> str:
    """``Model (qwen3_5)``: the class and model type, for messages."""
    return f"{type(model).__name__} ({getattr(model, 'model_type', '?')})"


def _head(model):
    head = model.__dict__.get("mtp")
    if head is None:
        status = model.__dict__.get("mtp_status", "the checkpoint was not loaded with mlx-lm-patches active")
        raise MTPUnavailable(f"{model_label(model)} has no MTP head: {status}")
    return head


def _fusion_order(model, fusion):
    """``fusion``, or the family's own order (``FUSION`` of its family) when None."""
    fusion = fusion or family_of(model).FUSION
    if fusion not in FUSION_ORDERS:
        raise ValueError(f"fusion={fusion!r}: expected one of {FUSION_ORDERS}")
    return fusion


def mtp_forward(model, hidden, next_ids, cache, fusion=None, depth=0):
    """One MTP pass: ``hidden`` [B,T,H] (main hidden at positions t), ``next_ids`` [B,T] (tokens
    at t+1) -> ``(logits [B,T,V], mtp_hidden [B,T,H])``; ``cache`` from ``make_mtp_cache``.
    ``fusion``: the family's order by default, or ``"embedding-first"`` (Qwen3-Next/3.5/3.6,
    Nemotron-H, DeepSeek-V3 layout) or ``"hidden-first"``
    (MiMo-style heads). ``depth``: which MTP layer of a head that has several (Step-3.5-Flash,
    MiMo-V2-Flash; ``cache`` from ``make_mtp_cache(depth)``): layer ``depth`` takes the tokens at
    ``t+1+depth`` (and, where the family chains them, the previous layer's output as ``hidden``)."""
    logits, out, _ = _mtp_pass(model, hidden, next_ids, cache, fusion, depth)
    return logits, out


def _mtp_pass(model, hidden, next_ids, cache, fusion=None, depth=0):
    """``mtp_forward``, also giving the layer's output before its final norm (what the next
    layer of a chained head takes)."""
    import mlx.core as mx

    fusion = _fusion_order(model, fusion)
    head, family = _depth_module(model, depth), family_of(model)
    embedding_norm, hidden_norm, projection = family.fusion(head)
    embedded = embedding_norm(family.embed(model, next_ids, cache))
    normed = hidden_norm(hidden)
    halves = [embedded, normed] if fusion == "embedding-first" else [normed, embedded]
    z = projection(mx.concatenate(halves, axis=-1))
    mask = family.attention_mask(z, cache) if cache else None
    window = head.__dict__.get(SLIDING_WINDOW)
    if window is not None:  # sliding layers over a plain cache: the last ``window`` keys only
        from mlx_lm.models.base import create_causal_mask

        held = positions_cache(cache[0]) if cache else None
        if held is not None and isinstance(held.offset, mx.array):
            # a batch cache (batched drafting): its mask also leaves out each row's padding
            mask = held.make_mask(z.shape[1], window_size=window)
        else:
            mask = create_causal_mask(z.shape[1], held.offset if held is not None else 0, window_size=window)
    z = family.run_layers(head, z, mask, cache)
    out = family.head_norm(head)(z)
    return family.logits(model, out, head=head), out, z


class MTPDraftCache:
    """The draft's per-sequence state: per MTP layer (depth) its KV caches and which positions
    they hold from true inputs. Trimming is a no-op that always succeeds: the draft
    re-synchronises with the main model on every call."""

    def __init__(self, kvs, since):
        self.kvs = kvs  # per depth: the caches of its attention layers
        self.since = since  # main forward passes before this sequence started
        self.seen = since  # main forward passes before the current round started
        self.base = [0] * len(kvs)  # per depth: the position of its caches' first slot
        self.synced = [0] * len(kvs)  # per depth: positions before this one computed from true inputs
        self.outs = [None] * len(kvs)  # per depth: (first position, outputs before its final norm)
        self.recycled = None  # MTP output hidden of the last draft step
        self.round_of = None  # main committed length the current round started at
        self.step = 0  # draft steps taken in the current round
        self.drafts = []  # the tokens drafted in the current round (the loop hands them back)
        self.first_input = None  # x_C: the token the current round started from
        self.skipped = None  # C of calls left to the next round (the draft's part of a prompt)

    @property
    def kv(self):
        return self.kvs[0]

    def _all(self):
        return [c for kv in self.kvs for c in kv]

    def is_trimmable(self):
        return True

    def trim(self, n):
        return n

    @property
    def state(self):
        return [c.state for c in self._all() if positions_cache(c).keys is not None]

    @property
    def nbytes(self):
        held = sum(z.nbytes for _, z in filter(None, self.outs))
        return held + sum(c.nbytes for c in self._all() if positions_cache(c).keys is not None and hasattr(c, "nbytes"))

    def empty(self):
        return all(positions_cache(c).keys is None for c in self._all())

    def cut(self, depth, position):
        """Drop depth ``depth``'s slots from ``position`` on (none if its caches start later)."""
        for kv in self.kvs[depth]:
            end = self.base[depth] + positions_cache(kv).offset
            if end > position:
                kv.trim(end - max(position, self.base[depth]))

    def restart(self, depth, position):
        """Empty depth ``depth``'s caches; its next slot is ``position``."""
        self.cut(depth, self.base[depth])
        self.base[depth] = self.synced[depth] = position
        self.outs[depth] = None

    def keep_outputs(self, depth, first, z):
        """Record depth ``depth``'s outputs ``z`` from position ``first`` on, with those of earlier
        true positions the next depth has not taken yet - at most ``OUTPUTS_KEPT`` of them (a
        next depth further behind, one that has not drafted for a while, starts again when it
        next drafts: what is held stays bounded)."""
        import mlx.core as mx

        old, need = self.outs[depth], self.synced[depth + 1]
        if old is not None and old[0] <= need < first and first - need <= OUTPUTS_KEPT \
                and old[0] + old[1].shape[1] >= first:
            z = mx.concatenate([old[1][:, need - old[0]:first - old[0]], z], axis=1)
            first = need
        self.outs[depth] = (first, z)

    def outputs(self, depth, first, last):
        """Depth ``depth``'s recorded outputs at positions ``first..last-1``, or ``None``."""
        held = self.outs[depth]
        if held is None or first >= last or held[0] > first or held[0] + held[1].shape[1] < last:
            return None
        return held[1][:, first - held[0]:last - held[0]]


class MTPDraft:
    """A draft model for mlx-lm's speculative loop, backed by ``model``'s MTP head. It reads the
    main model's hidden state at the last committed position from what the verify pass
    recorded, so a hybrid main model's rollback leaves the re-run of accepted tokens to the next
    verify pass (journal.py, ``fuse``): a rejected draft costs no model call of its own.

    Heads with several MTP layers (Step-3.5-Flash, MiMo-V2-Flash) draft step ``k`` of a round
    with layer ``k``, as they were trained: layer ``k`` at position ``i`` takes the token at
    ``i+k+1`` and, for a chained family (``CHAINED``: Step-3.5), layer ``k-1``'s output at ``i``
    before its final norm, else (MiMo-V2) the main model's hidden state at ``i``. Each layer's
    cache holds every position it has true inputs for (``i <= C-1-k``, C committed); the draft's
    own tokens fill the rest for the round and are dropped at the next. Steps past the last
    layer recycle the last layer's output."""

    follows_main_model = True  # catches up from the main model's recorded passes (adaptive drafting)

    @property
    def remembered_as(self):
        """Adaptive drafting keeps a sequence's costs for the next one per draft: a draft made
        anew per call is its main model's head."""
        return self.main

    def __init__(self, model, hidden=None, fusion=None):
        hidden = hidden or family_of(model).HIDDEN  # the family's, by default
        if hidden not in HIDDEN_KINDS:
            raise ValueError(f"hidden={hidden!r}: expected one of {HIDDEN_KINDS}")
        self.fusion = _fusion_order(model, fusion)
        _head(model)  # a clear error now rather than in the loop
        self.main = model
        self.hidden = hidden
        self.capture = install_capture(model)
        self.layers = _head(model).layers
        self.depths = depths_of(model)
        self.chained = family_of(model).CHAINED

    def make_cache(self):
        return [MTPDraftCache([make_mtp_cache(self.main, d) for d in range(self.depths)], self.capture.count)]

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        state = cache[0]
        committed = self.capture.committed(state.since)
        vocab = family_of(self.main).vocab_size(self.main)
        placeholder = mx.zeros((inputs.shape[0], inputs.shape[1], vocab))
        if committed is None or committed < 1 or inputs.shape[0] != 1 or state.skipped == committed:
            return placeholder
        if not self._ends_at(inputs, committed):  # a prompt the main model has not run yet: not a
            state.skipped = committed             # round (nor the calls on tokens sampled from this)
            return placeholder
        # the main model moved (a round never has a main pass inside): a new round
        if state.round_of != committed or state.recycled is None or self.capture.count != state.seen:
            logits = self._first_step(state, committed, inputs)
            if logits is None:  # nothing to draft from: proposals the main model rejects
                return placeholder
        else:
            state.step += 1
            state.drafts.append(inputs[:, -1:])
            if state.step < self.depths:
                logits = self._deeper_step(state, committed, state.step)
            else:
                last = self.depths - 1
                logits, out, _ = _mtp_pass(self.main, state.recycled, inputs[:, -1:], state.kvs[last],
                                           self.fusion, last)
                state.recycled = out[:, -1:]
        full = mx.concatenate([placeholder[:, :-1], logits[:, -1:]], axis=1) if inputs.shape[1] > 1 \
            else logits[:, -1:]
        return full

    def _ends_at(self, inputs, committed):
        """Whether ``inputs``' last token is the one at position C, those before it the main
        model's last ones (the loop hands a round's first call one or two tokens). Not so for a
        prompt the draft is handed before the main model runs it (mlx-lm's prefill of the draft,
        or before 0.29 the whole prompt as the first round's input): those tokens go at C and
        after, and the draft leaves them to the round that follows."""
        n = inputs.shape[1]
        if n == 1:
            return True
        if committed - n + 1 < 0:
            return False
        known = self.capture.tokens(committed - n + 1, committed)
        return known is not None and known[0].tolist() == inputs[0, :-1].tolist()

    def _first_step(self, state, committed, inputs):
        """Layer 0 over the committed positions it has not seen, ``h_t`` with ``x_{t+1}``; its last
        slot pairs ``h_{C-1}`` with ``x_C`` - the last token the loop hands the draft, which the
        main model has not processed yet. The logits of that slot, or None."""
        import mlx.core as mx

        self._forget_changed(state, committed)
        state.cut(0, state.synced[0])
        span = self.capture.span(state.synced[0], committed, self.hidden)
        if span is None:  # hidden states not recorded (e.g. prefilled elsewhere)
            state.restart(0, committed - 1)
            span = self.capture.span(committed - 1, committed, self.hidden)
            if span is None:
                state.round_of = None
                return None
        first = state.synced[0]
        state.round_of, state.step, state.drafts, state.skipped = committed, 0, [], None
        state.first_input = inputs[:, -1:]
        h, x_following = span
        x_next = mx.concatenate([x_following, inputs[:, -1:].astype(x_following.dtype)], axis=1)
        logits, out, z = _mtp_pass(self.main, h, x_next.astype(mx.uint32), state.kvs[0], self.fusion, 0)
        state.synced[0] = committed
        if self.depths > 1 and self.chained:
            state.keep_outputs(0, first, z)
        state.recycled = out[:, -1:]
        return logits

    def _forget_changed(self, state, committed):
        """Each layer keeps only the slots still true: those whose tokens come before the first
        position a main pass since the last round changed (a prompt cache trimmed back and
        extended otherwise; a verify pass writes over rejected drafts from the last round's C on,
        where only x_C was taken, from the loop), and before ``C - depth``."""
        changed = self.capture.changed_since(state.seen)
        state.seen = self.capture.count
        last = state.round_of  # the previous round's C: its x_C was the loop's, not yet recorded then
        if last is not None and changed >= last:
            now = self.capture.tokens(last, last + 1)
            same = now is not None and now[0, 0].item() == state.first_input[0, 0].item()
            # the kept slots took tokens up to `last`: unchanged before `changed`, and at `last` x_C
            changed = 1 << 62 if same else last
        # the slot of position i took the token at i+depth+1 (at most C-1: x_C is this round's)
        keeps = [min(state.synced[d], changed - d - 1, committed - d - 1) for d in range(self.depths)]
        if self.chained and any(k < s for k, s in zip(keeps, state.synced)):
            keeps = [min(keeps)] * self.depths  # each layer recomputes what the next one takes again
        for depth, keep in enumerate(keeps):
            if keep < state.base[depth]:
                state.restart(depth, max(keep, 0))
            else:
                state.synced[depth] = keep

    def _deeper_step(self, state, committed, depth):
        """Layer ``depth`` over the positions from its first slot without true inputs to C-1: the
        slots of positions ``i <= C-1-depth`` from the sequence's tokens (kept), the last
        ``depth`` from the round's drafts (dropped at the next round); its last slot's logits."""
        import mlx.core as mx

        first = state.synced[depth]
        state.cut(depth, first)
        inputs = self._inputs(state, committed, depth, first)
        if inputs is None:  # its inputs since `first` are gone (it did not draft for a while)
            held = state.outs[depth - 1] if self.chained else None
            first = held[0] if held is not None else committed - 1
            state.restart(depth, first)
            inputs = self._inputs(state, committed, depth, first)
            if inputs is None:
                return mx.zeros((1, 1, family_of(self.main).vocab_size(self.main)))
        source, ids = inputs
        logits, out, z = _mtp_pass(self.main, source, ids, state.kvs[depth], self.fusion, depth)
        state.synced[depth] = max(first, committed - depth)
        if self.chained and depth + 1 < self.depths:
            state.keep_outputs(depth, first, z)
        state.recycled = out[:, -1:]
        return logits

    def _inputs(self, state, committed, depth, first):
        """What layer ``depth`` takes at positions ``first..C-1``: the hidden states (the previous
        layer's outputs, or the main model's) and the tokens at ``first+depth+1..C+depth`` (the
        sequence's, ``x_C``, then the round's drafts); None if not all are at hand."""
        import mlx.core as mx

        if self.chained:
            source = state.outputs(depth - 1, first, committed)
        else:
            span = self.capture.span(first, committed, self.hidden)
            source = span[0] if span is not None else None
        lo = first + depth + 1
        parts = []
        if lo < committed:
            parts.append(self.capture.tokens(lo, committed))
        if lo <= committed:
            parts.append(state.first_input)
        parts += state.drafts[max(0, lo - committed - 1):]
        if source is None or any(part is None for part in parts):
            return None
        return source, mx.concatenate([part.astype(mx.uint32) for part in parts], axis=1)


def add_interface(model, track=None) -> None:
    """Give a loaded model ``make_draft_model``, ``mtp_forward``, ``make_mtp_cache`` and
    ``hidden_states`` (instance attributes; they raise :class:`MTPUnavailable` without a head).
    ``track`` (the patcher's): records the change so revert takes it off again, together with
    the capture the draft installs later."""
    ref = weakref.ref(model)
    model.__dict__["make_draft_model"] = lambda hidden=None, fusion=None: MTPDraft(ref(), hidden, fusion)
    model.__dict__["mtp_forward"] = lambda hidden, next_ids, cache, fusion=None, depth=0: mtp_forward(
        ref(), hidden, next_ids, cache, fusion, depth)
    model.__dict__["make_mtp_cache"] = lambda depth=0: make_mtp_cache(ref(), depth)
    model.__dict__["hidden_states"] = lambda: hidden_states(ref())
    if track is not None:
        track(model, remove_interface, "MTP interface (and hidden-state capture) on a loaded model")


def remove_interface(model) -> None:
    """Undo :func:`add_interface` and :func:`install_capture` on ``model``."""
    for name in INTERFACE:
        model.__dict__.pop(name, None)
    remove_capture(model)

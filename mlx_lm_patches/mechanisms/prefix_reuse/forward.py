"""Keeping states where they are produced: around the forward pass of a model with recurrent
layers, whoever calls it (``generate_step``, ``BatchGenerator``, speculative decoding, an
engine that prefills by calling the model itself).

A forward of one sequence (a batch of one) into a cache list whose history is known
(:func:`~.trails.known_log`) appends its tokens to the trails of the recurrent caches and, if
it is a multi-token pass, keeps the recurrent states at its end, by reference (mlx arrays are
immutable and models replace their cache slots, so this costs no copy and no evaluation). A
single-token pass (a decode step) only appends its token array to the log's store, unread, in
the wrapper itself: plain decoding pays one call into the package per token, the same at any
length. A pass
that cannot be followed (a batch of several rows, embeddings instead of token ids, a cache
whose slots were changed by something else) records nothing, and the history of that cache
is unknown from then on; the states kept before stay valid, since each is checked token by
token against the request it is used for.

Inside :func:`cutting` (the prefill of ``speculative_generate_step`` and of ``BatchGenerator``
rows, while a prompt-cache store exists), and while a generator given to :func:`arm` runs
(``generate_step``'s own, whose multi-token passes are all prefill), a multi-token pass is also
cut at powers of two
(:func:`~.cuts.cut_points`): more states, at positions a later request is likely to share.
"""

import contextvars
import sys
import weakref
from contextlib import contextmanager
from typing import Optional, Sequence

from mlx_lm_patches.mechanisms.caches import recurrent_caches
from mlx_lm_patches.mechanisms.prefix_reuse.cuts import cut_points, thin
from mlx_lm_patches.mechanisms.prefix_reuse.settings import keeping, max_checkpoints
from mlx_lm_patches.mechanisms.prefix_reuse.trails import (
    ATTR, TokenLog, Trail, checkpoints, known_log, offsets_agree, set_trails, slots_of)

# Per-call scope, in context variables (not thread-locals: one thread of an asyncio server runs
# many requests' tasks, each in its own context; a new thread starts with the defaults).
_INSIDE = contextvars.ContextVar("mlx_lm_patches_prefix_reuse_inside", default=False)  # in a recorded forward
_CUTTING = contextvars.ContextVar("mlx_lm_patches_prefix_reuse_cutting", default=None)  # a _Cutting
_ARMED = contextvars.ContextVar("mlx_lm_patches_prefix_reuse_armed", default=())  # weakrefs to generators


class _Cutting:
    __slots__ = ("seed", "bound")

    def __init__(self, seed):
        self.seed = None if seed is None else tuple(seed)
        self.bound = None  # the cache list the seed was given to


def arm(steps) -> bool:
    """Cut the multi-token passes run while the generator ``steps`` runs in this context, as
    :func:`cutting` does, without a wrapper around its iteration (that would be one more call
    per token). For ``generate_step``, whose multi-token passes are all its prefill. ``False``
    if ``steps`` is not a generator."""
    if not hasattr(steps, "gi_running"):
        return False
    armed = [ref for ref in _ARMED.get() if _alive(ref())]
    armed.append(weakref.ref(steps))
    _ARMED.set(tuple(armed))
    return True


def _alive(generator) -> bool:
    return generator is not None and generator.gi_frame is not None


def _cuts_on() -> bool:
    if _CUTTING.get() is not None:
        return True
    for ref in _ARMED.get():
        generator = ref()
        if generator is not None and generator.gi_running:
            return True
    return False


@contextmanager
def cutting(seed: Optional[Sequence[int]] = None):
    """Within this block (in this context: thread, asyncio task), multi-token passes are also cut at powers of two.
    ``seed``: the tokens the next cache list passed to a forward already holds, for a cache
    list built from one whose history was known (``BatchGenerator`` merges its rows' caches
    into new objects)."""
    token = _CUTTING.set(_Cutting(seed))
    try:
        yield
    finally:
        _CUTTING.reset(token)


def recorded_forward(wrapped, instance, args, kwargs):
    """The wrapper on a model class's ``__call__`` (``inputs, cache=None, ...``).

    The decode step of a followed sequence (one token into a cache list whose every recurrent
    slot is still the one recorded after its last pass) is this one call and nothing else: no
    other function of the package runs (so its checks are written out here), and its work does
    not grow with the sequence: the token array is appended to the log's store, each recurrent
    cache gets a trail with the new slots. Attention offsets are checked when the log is read
    (:func:`~.trails.known_log`): a recorded pass adds as many tokens to them as to the log,
    so a difference made outside stays visible. A pass of several rows is passed on at once."""
    if _INSIDE.get():
        return wrapped(*args, **kwargs)
    # -- fast path: one token into a cache list whose every recurrent slot is the one recorded
    # after the last pass (written out inline: a helper would be one more call per token)
    if len(args) == 1:
        inputs, cache = args[0], (kwargs.get("cache") if len(kwargs) == 1 else None)
    elif len(args) == 2 and not kwargs:
        inputs, cache = args
    else:
        inputs = cache = None
    if type(cache) is list and type(inputs) is _ARRAY:
        shape = inputs.shape
        if len(shape) == 2 and shape[0] != 1:  # several rows (a batch decoding): nothing to follow
            token = _INSIDE.set(True)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _INSIDE.reset(token)
        if len(shape) == 2 and shape[0] == 1 and shape[1] == 1 and inputs.dtype in _INTEGER_DTYPES:
            cache_module = _modules["mlx_lm.models.cache"]
            arrays_cache, cache_list = cache_module.ArraysCache, getattr(cache_module, "CacheList", ())
            followed, log = [], None
            for entry in cache:
                if isinstance(entry, arrays_cache):
                    inner = (entry,)
                elif isinstance(entry, cache_list):
                    inner = entry.caches
                else:
                    continue  # an attention cache
                for leaf in inner:
                    if not isinstance(leaf, arrays_cache):
                        continue
                    rows = leaf.__dict__.get(ATTR)
                    trail = rows[0] if rows is not None and len(rows) == 1 else None
                    after = trail.after if trail is not None else None
                    live = leaf.cache
                    if after is None or (log is not None and trail.log is not log) or len(live) != len(after):
                        log = False
                        break
                    for a, b in zip(live, after):
                        if a is not b:
                            log = False
                            break
                    if log is False:
                        break
                    log = trail.log
                    followed.append((leaf, trail))
                if log is False:
                    break
            if log is not None and log is not False:
                token = _INSIDE.set(True)
                try:
                    out = wrapped(*args, **kwargs)
                finally:
                    _INSIDE.reset(token)
                store, length = log.store, log.length
                if store.length == length:  # the end of its store: append in place
                    store.pending.append(inputs)
                    store.length = length + 1
                    log = _new(TokenLog)
                    log.store, log.length, log._ids = store, length + 1, None
                else:
                    log = log.extended(inputs[0])  # two sequences going on from one prefix
                for leaf, trail in followed:
                    new = _new(Trail)
                    new.log, new.marks, new.after = log, trail.marks, list(leaf.cache)
                    leaf.__dict__[ATTR] = [new]
                return out
    return _slow(wrapped, args, kwargs)


_new = object.__new__
_modules = sys.modules
_ARRAY = None  # mx.array, set by the first slow pass (a fast one follows a slow one)
_INTEGER_DTYPES = ()


def _slow(wrapped, args, kwargs):
    """Every pass but the decode step of a followed sequence."""
    global _ARRAY, _INTEGER_DTYPES
    if _ARRAY is None:
        import mlx.core as mx

        _INTEGER_DTYPES = tuple(getattr(mx, n) for n in ("uint32", "int32", "int64", "uint64", "int16",
                                                         "uint16", "int8", "uint8") if hasattr(mx, n))
        _ARRAY = mx.array
    if not keeping():
        return wrapped(*args, **kwargs)
    inputs = args[0] if args else kwargs.get("inputs")
    cache = args[1] if len(args) > 1 else kwargs.get("cache")
    plain = len(args) <= 2 and all(k in ("inputs", "cache") for k in kwargs)
    follow = _follow(inputs, cache, plain, kwargs)
    token = _INSIDE.set(True)
    try:
        if follow is None:
            return wrapped(*args, **kwargs)
        leaves, log, marks = follow
        if inputs.shape[1] == 1:  # a decode step: its token is appended, nothing is kept
            kept = ([tuple((pos, states[j]) for pos, states in marks) for j in range(len(leaves))]
                    if marks is not None else [leaf.__dict__[ATTR][0].marks for leaf in leaves])
            out = wrapped(*args, **kwargs)
            log = log.extended(inputs[0])
            for leaf, leaf_marks in zip(leaves, kept):
                set_trails(leaf, [Trail(log, leaf_marks, slots_of(leaf))])
            return out
        if marks is None:
            marks = _marks(leaves)
        return _multi(wrapped, args, kwargs, inputs, cache, leaves, log, marks, plain)
    finally:
        _INSIDE.reset(token)


def _follow(inputs, cache, plain, kwargs):
    """``(recurrent caches, log, marks or None)`` if this pass can be recorded, else ``None``."""
    import mlx.core as mx

    if not (isinstance(cache, (list, tuple)) and isinstance(inputs, mx.array) and inputs.ndim == 2
            and inputs.shape[0] == 1 and inputs.shape[1] > 0 and mx.issubdtype(inputs.dtype, mx.integer)):
        return None
    if not plain and any(kwargs.get(k) is not None for k in ("input_embeddings", "inputs_embeds")):
        return None
    leaves = recurrent_caches(cache)
    if not leaves:
        return None
    log = known_log(cache, leaves)
    if log is not None:
        # marks: none for an empty cache (its trails, if any, are stale); else read from the
        # trails (known_log found them valid) when needed
        return leaves, log, (None if len(log) else [])
    seeded = _seeded(cache)
    if seeded is None:
        return None
    seed, marks = seeded
    return leaves, TokenLog(seed), marks


def _marks(leaves) -> list:
    """The kept states of a followed cache list: ``[(position, [slots per recurrent cache])]``
    at the positions every recurrent cache kept."""
    rows = [leaf.__dict__.get(ATTR) for leaf in leaves]
    if any(r is None or r[0] is None for r in rows):
        return []
    per_leaf = [dict(r[0].marks) for r in rows]
    return [(pos, [kept[pos] for kept in per_leaf]) for pos, _ in rows[0][0].marks
            if all(pos in kept for kept in per_leaf)]


def _seeded(cache):
    """The seed of the current :func:`cutting` block, given to the first cache list that
    matches it (its attention caches hold as many tokens): ``(seed, marks)``."""
    state = _CUTTING.get()
    if state is None or state.seed is None or state.bound is not None:
        return None
    seed = state.seed
    if not offsets_agree(cache, len(seed)):
        return None
    state.bound = cache
    marks = [(pos, states) for pos, tokens, states in checkpoints(cache)
             if pos <= len(seed) and tuple(tokens[:pos]) == seed[:pos]]
    return seed, marks


def _multi(wrapped, args, kwargs, inputs, cache, leaves, log, marks, plain):
    import mlx.core as mx

    start, length = len(log), inputs.shape[1]
    cuts = cut_points(start, start + length) if plain and _cuts_on() else []
    if not cuts:
        out = wrapped(*args, **kwargs)
        log = log.extended(inputs[0])
        marks.append((len(log), [slots_of(c) for c in leaves]))
        _publish(leaves, log, thin(marks, max_checkpoints()))
        return out
    outputs, lo = [], 0
    for hi in [p - start for p in cuts] + [length]:
        piece = inputs[:, lo:hi]
        outputs.append(wrapped(piece, cache=cache))
        if hi < length:
            mx.eval([c.state for c in cache])
        log = log.extended(piece[0])
        marks.append((len(log), [slots_of(c) for c in leaves]))
        lo = hi
    _publish(leaves, log, thin(marks, max_checkpoints()))
    pieces = [hi - lo for lo, hi in zip([0] + [p - start for p in cuts], [p - start for p in cuts] + [length])]
    if all(isinstance(o, mx.array) and o.ndim == 3 and o.shape[1] == n for o, n in zip(outputs, pieces)):
        return mx.concatenate(outputs, axis=1)  # logits of every position, as one pass gives
    return outputs[-1]


def _publish(leaves, log, marks) -> None:
    for j, leaf in enumerate(leaves):
        set_trails(leaf, [Trail(log, tuple((pos, states[j]) for pos, states in marks), slots_of(leaf))])

"""Reuse from a prompt-cache store: a stored cache list taken back to a kept position exactly,
or not at all."""

from typing import Optional, Sequence

from mlx_lm_patches.mechanisms.caches import arrays, attention_caches, int_offset, recurrent_caches
from mlx_lm_patches.mechanisms.prefix_reuse.cuts import thin
from mlx_lm_patches.mechanisms.prefix_reuse.settings import max_checkpoints
from mlx_lm_patches.mechanisms.prefix_reuse.trails import TokenLog, Trail, slots_of, checkpoints, set_trails


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
    tokens = TokenLog(tokens)  # one log shared by every recurrent cache of the list
    for j, leaf in enumerate(leaves):
        marks = tuple((pos, states[j]) for pos, states in usable)
        if exact:
            set_trails(leaf, [Trail(tokens, marks, slots_of(leaf))])
        else:
            set_trails(leaf, [Trail(tokens, marks, None)] if marks else None)


def restored_copy(caches, key: Sequence[int], position: int, states, kept) -> Optional[list]:
    """A copy of ``caches`` (which hold exactly ``key``) taken back to ``position``: recurrent
    caches set to the kept ``states``, attention caches cut to the same position. ``None``
    (nothing changed) if any attention cache cannot be cut there exactly."""
    import copy

    kv = attention_caches(caches)
    for cache in kv:
        if int_offset(cache) != len(key) or not cache.is_trimmable():
            return None
    memo = {}
    for leaf in recurrent_caches(caches):  # the live states are replaced below: do not copy them
        for array in arrays(leaf.cache):
            memo[id(array)] = array
    out = copy.deepcopy(caches, memo)
    for cache in attention_caches(out):
        cache.trim(len(key) - position)
        if int_offset(cache) != position:
            return None
        _drop_trimmed_buffer(cache)
    for leaf, slots in zip(recurrent_caches(out), states):
        leaf.cache = type(leaf.cache)(slots)
        if hasattr(leaf, "left_padding"):
            leaf.left_padding = None
        if hasattr(leaf, "lengths"):
            leaf.lengths = None
    tokens = TokenLog(tuple(key[:position]))
    for j, leaf in enumerate(recurrent_caches(out)):
        marks = tuple((pos, st[j]) for pos, st in kept)
        set_trails(leaf, [Trail(tokens, marks, slots_of(leaf))])
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


def holds_quantized_kv(caches) -> bool:
    """Whether a cache list holds quantized attention caches (``QuantizedKVCache``, from
    ``kv_bits``): keys and values rounded once their chunk was done, so the rest of a request
    prefilled on them attends to other values than a cold prefill does."""
    import sys

    quantized = getattr(sys.modules.get("mlx_lm.models.cache"), "QuantizedKVCache", None)
    return quantized is not None and any(isinstance(c, quantized) for c in attention_caches(caches))


def best_restore(entries, tokens: Sequence[int], better_than: int):
    """From ``entries`` (``(key, caches)`` pairs of a prompt-cache store), the cache list taken
    back to the longest kept position ``c`` with ``better_than < c <= len(tokens) - 1`` whose
    tokens ``tokens`` starts with: ``(copy, c)``, or ``None``. Entries holding quantized
    attention caches are not used (not exact: see :func:`holds_quantized_kv`)."""
    candidates = []
    limit_all = len(tokens) - 1
    for key, caches in entries:
        if not recurrent_caches(caches) or holds_quantized_kv(caches):
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

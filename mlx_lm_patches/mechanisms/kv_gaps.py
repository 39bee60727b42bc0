"""Rows of a batch attention cache drop their newest positions where they are: masked, not moved.

In batched speculation every row of a ``BatchKVCache`` drops the positions it rejected, each row
its own number. mlx-lm's masks know only left padding, so a row could only go back by moving its
whole history right by what it drops (its ``left_padding`` growing by as much): every attention
layer's whole cache read and written every round (68 ms a layer at 4096 positions on the CPU).

Here the dropped positions stay where they are, marked in ``gaps`` (rows x positions), and the
cache's class becomes :func:`gapped_class`'s subclass of ``BatchKVCache``, whose ``make_mask``
leaves them out (a sliding window counted over the positions kept). ``offset`` stays each row's
count of kept positions, so rotary positions are unchanged, and new positions are written after
the gaps as after any position. Whatever changes the rows or hands a row out (``filter``,
``extend``, ``extract``, ``finalize``, a new ``state``) first :func:`compact`s: each row's kept
positions move right together, as they used to every round, and the cache is a plain
``BatchKVCache`` again. So does :func:`compact_sparse` once a row's gaps pass a share of the
positions (:data:`MOST_GAPS`), which bounds what the gaps add to every attention pass.

Every attention layer of a model keeps the same rows and drops the same positions, so all of its
caches hold the same gaps: a mask computed from one of them (models share one) fits them all.
"""

import sys
from typing import List

CACHE = "mlx_lm.models.cache"

# a cache is compacted when a row's gaps exceed this share of the positions it spans
MOST_GAPS = 0.125
_SMALLEST = 16  # ... and this many (a short cache is cheap to compact, but not every round)

_CLASS = {}


def gapped_class():
    """The subclass of this mlx-lm's ``BatchKVCache`` whose rows may hold gaps."""
    base = sys.modules[CACHE].BatchKVCache
    if base not in _CLASS:
        _CLASS[base] = _make_class(base)
    return _CLASS[base]


def _make_class(base):
    import mlx.core as mx

    class BatchKVCacheWithGaps(base):
        """A ``BatchKVCache`` whose rows may hold dropped positions (``gaps``, True where
        dropped; positions past its width hold none), left out of every mask."""

        plain_class = base
        gaps = None
        gap_counts = None  # per row, on the host: how many positions it dropped in place

        def make_mask(self, N: int, *args, **kwargs):
            if self.gaps is None:
                return super().make_mask(N, *args, **kwargs)
            window = kwargs.pop("window_size", None)
            mask = super().make_mask(N, *args, **kwargs)  # (B, 1, N, T): causal, left padding
            gaps = _widened(self.gaps, self._idx + N)  # (B, T)
            if window is not None:  # the window counts kept positions only
                kept_before = mx.arange(gaps.shape[1])[None, :] - mx.cumsum(gaps.astype(mx.int32), axis=1)
                queries = kept_before[:, self._idx:]
                mask = mask & (queries[:, None, :, None] < kept_before[:, None, None, :] + window)
            return mask & ~gaps[:, None, None, :]

        def trim(self, n):
            n = min(self._idx, n)
            dropped = [0] * len(self.gap_counts or ())
            if self.gaps is not None and self.gaps.shape[1] > self._idx - n:
                dropped = mx.sum(self.gaps[:, self._idx - n:].astype(mx.int32), axis=1).tolist()
                self.gaps = self.gaps[:, :self._idx - n]
                self.gap_counts = [c - d for c, d in zip(self.gap_counts, dropped)]
            n = super().trim(n)
            if any(dropped):  # gaps trimmed were no longer counted in ``offset``
                self.offset = self.offset + mx.array(dropped, dtype=self.offset.dtype)
            return n

        def filter(self, batch_indices):
            compact(self)
            return self.filter(batch_indices)

        def extend(self, other):
            compact(self)
            compact(other)
            return self.extend(other)

        def extract(self, idx):
            compact(self)
            return self.extract(idx)

        def finalize(self):
            compact(self)
            return self.finalize()

        @property
        def state(self):
            return base.state.fget(self)

        @state.setter
        def state(self, v):
            _plain(self)
            base.state.fset(self, v)

    return BatchKVCacheWithGaps


def _widened(gaps, width: int):
    """``gaps`` (B, G) as (B, width): positions past G hold none."""
    import mlx.core as mx

    if gaps.shape[1] >= width:
        return gaps[:, :width]
    return mx.concatenate([gaps, mx.zeros((gaps.shape[0], width - gaps.shape[1]), dtype=mx.bool_)], axis=1)


def _gapped(c) -> bool:
    return "plain_class" in vars(type(c))


def drop_newest(c, extra: List[int]) -> None:
    """Row ``i`` of the ``BatchKVCache`` ``c`` drops its ``extra[i]`` newest positions, in place."""
    import mlx.core as mx

    if not any(extra):
        return
    if c.keys is None or c._idx < max(extra):
        raise RuntimeError(f"a batch cache of {c._idx} positions cannot drop {max(extra)} of them")
    if not _gapped(c):
        c.__class__ = gapped_class()
        c.gaps, c.gap_counts = None, [0] * len(extra)
    width = c._idx
    dropped = mx.arange(width)[None, :] >= (width - mx.array(extra))[:, None]
    c.gaps = dropped if c.gaps is None else _widened(c.gaps, width) | dropped
    c.gap_counts = [n + e for n, e in zip(c.gap_counts, extra)]
    c.offset = c.offset - mx.array(extra, dtype=c.offset.dtype)


def sparse(c) -> bool:
    """Whether a row of ``c`` has dropped more than :data:`MOST_GAPS` of the positions held."""
    if not _gapped(c) or not c.gap_counts:
        return False
    return max(c.gap_counts) > max(_SMALLEST, MOST_GAPS * c._idx)


def compact_sparse(caches) -> None:
    """Compact every gapped cache of ``caches`` (the attention layers of one model, which hold the
    same gaps) once any of them is :func:`sparse`, so that one mask still fits them all."""
    if any(sparse(c) for c in caches):
        for c in caches:
            compact(c)


def compact(c) -> None:
    """Move each row's kept positions right, together, over its gaps (its left padding grows by
    as many); ``c`` is a plain ``BatchKVCache`` again. Nothing to do for any other cache."""
    import mlx.core as mx

    if not _gapped(c):
        return
    if c.gaps is not None and c.keys is not None and any(c.gap_counts):
        width = c._idx
        position = mx.arange(width)[None, :]
        kept = (position >= c.left_padding[:, None]) & ~_widened(c.gaps, width)
        # sorted: each row's positions not kept first (as -1), then the kept ones in order
        source = mx.maximum(mx.sort(mx.where(kept, position, -1), axis=1), 0)
        buffer = c.keys.shape[2]
        if buffer > width:
            source = mx.concatenate([source, mx.broadcast_to(mx.arange(width, buffer)[None, :],
                                                              (source.shape[0], buffer - width))], axis=1)
        gather_positions(c, source)
        c.left_padding = c.left_padding + mx.array(c.gap_counts, dtype=c.left_padding.dtype)
    _plain(c)


def _plain(c) -> None:
    c.__class__ = type(c).plain_class
    for name in ("gaps", "gap_counts"):
        c.__dict__.pop(name, None)


def gather_positions(c, source) -> None:
    """Position ``p`` of row ``i`` of a batch cache's keys and values becomes its position
    ``source[i, p]`` (``source``: (B, buffer))."""
    import mlx.core as mx

    B, H, S, _ = c.keys.shape
    # whole vectors of D taken by row number: on the CPU a quarter of an element-wise gather's time
    rows = (mx.arange(B * H).reshape(B, H, 1) * S + source[:, None, :]).reshape(-1)
    for name in ("keys", "values"):
        x = getattr(c, name)
        if x.size:  # a cache of vectors of no width (minimax_m3_vl's indexer values) has nothing to move
            setattr(c, name, x.reshape(-1, x.shape[-1])[rows].reshape(x.shape))

"""Rows of a batch attention cache that drop positions in place (``mechanisms/kv_gaps.py``, used by
batched speculation): attention, offsets, extraction and trims as if each row held only the
positions it kept, against each row alone in a ``KVCache``."""

import pytest

H, D = 2, 8
KEPT = [5, 3, 4]  # positions each row keeps before the dropped ones
EXTRA = [2, 1, 0]  # positions each row drops of the 2 written after them
PADDING = [max(KEPT) - n for n in KEPT]


def _random(*shape, seed):
    import mlx.core as mx

    return mx.random.normal(shape, key=mx.random.key(seed))


def _rows():
    """Per row: its history (kept), the 2 positions written after it, the 2 new ones after the drop."""
    return [(_random(1, H, n, D, seed=10 + i), _random(1, H, 2, D, seed=20 + i), _random(1, H, 2, D, seed=30 + i))
            for i, n in enumerate(KEPT)]


def _gapped(rows):
    """A batch cache of the rows (left-padded), then 2 positions each, then each row's drop."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_patches.mechanisms import kv_gaps

    c = BatchKVCache(PADDING)
    history = mx.concatenate([mx.pad(h, [(0, 0), (0, 0), (p, 0), (0, 0)]) for (h, _, _), p in zip(rows, PADDING)])
    c.update_and_fetch(history, history * 2)
    written = mx.concatenate([w for _, w, _ in rows])
    c.update_and_fetch(written, written * 2)
    kv_gaps.drop_newest(c, EXTRA)
    return c


def _alone(row, extra):
    """The row alone: its history and the written positions it kept."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    history, written, _ = row
    kept = mx.concatenate([history, written[:, :, :2 - extra]], axis=2)
    c = KVCache()
    c.update_and_fetch(kept, kept * 2)
    return c


@pytest.mark.parametrize("window", [None, 3, 5])
def test_new_positions_attend_to_what_each_row_kept(window):
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    rows = _rows()
    c = _gapped(rows)
    assert c.offset.tolist() == [n + 2 - e for n, e in zip(KEPT, EXTRA)]
    new = mx.concatenate([n for _, _, n in rows])
    mask = c.make_mask(2, window_size=window) if window else c.make_mask(2)  # before the update, as models do
    keys, values = c.update_and_fetch(new, new * 2)
    got = mx.fast.scaled_dot_product_attention(new, keys, values, scale=1.0, mask=mask)
    for i, row in enumerate(rows):
        alone = _alone(row, EXTRA[i])
        offset = alone.offset
        k, v = alone.update_and_fetch(row[2], row[2] * 2)
        want = mx.fast.scaled_dot_product_attention(row[2], k, v, scale=1.0,
                                                    mask=create_causal_mask(2, offset, window_size=window))
        assert mx.allclose(got[i:i + 1], want, atol=1e-5).item(), (window, i)


def test_a_row_handed_out_holds_only_what_it_kept():
    import mlx.core as mx

    rows = _rows()
    for i, row in enumerate(rows):
        c = _gapped(rows)
        out = c.extract(i)
        alone = _alone(row, EXTRA[i])
        assert out.offset == alone.offset
        assert mx.array_equal(out.keys[..., :out.offset, :], alone.keys[..., :alone.offset, :]).item()
        assert mx.array_equal(out.values[..., :out.offset, :], alone.values[..., :alone.offset, :]).item()
        assert type(c).__name__ == "BatchKVCache"  # compacted: a plain cache again


def test_rows_leaving_and_joining_keep_what_each_kept():
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    rows = _rows()
    c = _gapped(rows)
    c.filter([0, 2])
    other = BatchKVCache([0])
    extra_row = _random(1, H, 3, D, seed=40)
    other.update_and_fetch(extra_row, extra_row * 2)
    c.extend(other)
    for i, want in zip(range(3), [_alone(rows[0], EXTRA[0]), _alone(rows[2], EXTRA[2]), None]):
        out = c.extract(i)
        keys = out.keys[..., :out.offset, :]
        assert mx.array_equal(keys, extra_row if want is None else want.keys[..., :want.offset, :]).item(), i


def test_a_trim_over_gaps_counts_only_the_positions_kept():
    import mlx.core as mx

    rows = _rows()
    c = _gapped(rows)
    c.trim(2)  # the 2 written positions: kept ones and dropped ones
    assert c.offset.tolist() == KEPT
    for i, row in enumerate(rows):
        out = c.extract(i)
        assert mx.array_equal(out.keys[..., :out.offset, :], row[0]).item(), i


def test_a_cache_of_values_of_no_width_compacts():
    """minimax_m3_vl's indexer caches keys with values of width 0: compacting moves its keys."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_patches.mechanisms import kv_gaps

    c = BatchKVCache([0, 0])
    keys = _random(2, H, 4, D, seed=50)
    c.update_and_fetch(keys, mx.zeros((2, H, 4, 0)))
    kv_gaps.drop_newest(c, [1, 0])
    out = c.extract(0)
    assert out.offset == 3 and out.values.shape[-1] == 0
    assert mx.array_equal(out.keys[..., :3, :], keys[0:1, :, :3]).item()

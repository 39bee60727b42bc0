"""Rotary embeddings whose frequencies depend on the sequence length, with per-row offsets.

The patches ``internlm2-batch-rope``, ``internlm3-batch-rope``, ``su-scaled-rope-batch`` and
``dynamic-ntk-rope-batch`` make these classes accept a batch cache's per-row offsets. Here, on
the installed mlx-lm: each patched class called with per-row offsets on both sides of its
threshold (and negative ones, as left padding gives) equals the stock method called on each row
alone with that row's int offset; the grouping helper keeps row order; and the models that use
these classes are the ones ``batch-prefill-per-row`` prefills row by row. Batched generation with
such models is tested by the patches' scenarios (``tests/test_matrix_cells.py``: exact with the
patches, strict xfail on stock where affected) and by ``tests/test_offset_consumers.py``.
"""

import sys

import pytest

import mlx_lm_patches
from mlx_lm_patches.mechanisms import rope_rows
from mlx_lm_patches.selftest import tiny_models
from mlx_lm_patches.selftest import tiny_rope_models

ROWS = {row.id: row for row in mlx_lm_patches.apply()}


def _rope(pid):
    """An instance of the rotary class ``pid`` patches, with a threshold of 8."""
    if ROWS[pid].state != "applied":
        pytest.skip(f"{pid} is {ROWS[pid].state} here")
    if pid in ("internlm2-batch-rope", "internlm3-batch-rope"):
        module = sys.modules[f"mlx_lm.models.{pid.split('-')[0]}"]
        return module.DynamicNTKScalingRoPE(16, max_position_embeddings=8, base=10000.0, scale=2.0)
    rope_utils = sys.modules["mlx_lm.models.rope_utils"]
    if pid == "su-scaled-rope-batch":
        return rope_utils.SuScaledRoPE(16, max_position_embeddings=64, original_max_position_embeddings=8,
                                       short_factor=[1.0, 1.5, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0],
                                       long_factor=[2.0, 1.5, 3.0, 1.0, 4.0, 2.5, 1.2, 5.0])
    return rope_utils.DynamicNTKScalingRoPE(16, max_position_embeddings=8, traditional=False,
                                            base=10000.0, factor=2.0)


@pytest.mark.parametrize("pid", list(tiny_rope_models.KINDS))
@pytest.mark.parametrize("length", [1, 3])
def test_per_row_offsets_equal_each_row_alone(pid, length):
    import mlx.core as mx

    rope = _rope(pid)
    offsets = [-2, 0, 3, 6, 7, 9, 20]  # below, at and past the threshold (8) for L = 1 and 3
    x = mx.random.normal((len(offsets), 4, length, 16), key=mx.random.key(3))
    batched = rope(x, offset=mx.array(offsets))
    for row, offset in enumerate(offsets):
        alone = rope(x[row:row + 1], offset=offset)
        assert mx.array_equal(batched[row:row + 1], alone).item(), f"row {row} (offset {offset})"
    single = rope(x[2:3], offset=mx.array([offsets[2]]))  # a batch of one row
    assert mx.array_equal(single, rope(x[2:3], offset=offsets[2])).item()


def test_input_is_not_modified():
    import mlx.core as mx

    rope = _rope("su-scaled-rope-batch")  # the stock class scales its input in place
    x = mx.ones((2, 2, 1, 16))
    rope(x, offset=mx.array([1, 9]))
    assert mx.array_equal(x, mx.ones((2, 2, 1, 16))).item()


def test_rotate_rows_groups_and_keeps_order():
    import mlx.core as mx

    x = mx.arange(5)[:, None].astype(mx.float32)
    calls = []

    def rotate(rows, offsets, key):
        calls.append((key, offsets.tolist()))
        return rows * 10 + key

    got = rope_rows.rotate_rows(x, mx.array([5, 1, 7, 2, 9]), lambda o: int(o > 4), rotate)
    assert got[:, 0].tolist() == [1, 10, 21, 30, 41]
    assert sorted(calls) == [(0, [1, 2]), (1, [5, 7, 9])]
    calls.clear()
    rope_rows.rotate_rows(x, mx.array([1, 2, 3, 4, 0]), lambda o: 0, rotate)
    assert calls == [(0, [1, 2, 3, 4, 0])], "one group: one call with every row"


@pytest.mark.parametrize("pid", list(tiny_rope_models.KINDS))
def test_models_with_these_ropes_are_prefilled_row_by_row(pid):
    built, skipped = tiny_rope_models.buildable(pid, "decode")
    for model_type, model in built:
        has = rope_rows.has_length_dependent_rope(model)
        # on releases outside the patch's range the family uses another rotary class
        assert has == (ROWS[pid].state == "applied"), (model_type, ROWS[pid].state)
    if not built:
        pytest.skip(f"no model builds here: {skipped}")


def test_plain_models_are_not_length_dependent():
    assert not rope_rows.has_length_dependent_rope(tiny_models.build_tiny_model("llama", seed=1))
    assert not rope_rows.has_length_dependent_rope(object())

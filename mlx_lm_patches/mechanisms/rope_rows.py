"""Rotary embeddings whose frequencies depend on the sequence length, applied per batch row.

Some of mlx-lm's rotary classes choose their frequencies from the sequence length they are
called at, ``offset + L``: dynamic-NTK scaling grows the base once the sequence passes
``max_position_embeddings`` (``rope_utils.DynamicNTKScalingRoPE`` from 0.32.0, internlm2/3's own
class up to 0.31.3), and ``rope_utils.SuScaledRoPE`` in 0.29.x-0.30.0 switches from short to
long factors past ``original_max_position_embeddings``. They make that choice in Python from an
int offset. In batched generation the offset is a per-row ``mx.array``, so the choice crashes;
and each row would have made its own choice alone.

:func:`rotate_rows` gives each row the choice it would get alone: rows are grouped by their
choice (read on the host from the offsets, as the stock code reads its int) and each group is
rotated with ``mx.fast.rope`` and its own per-row offsets; ``mx.fast.rope`` with an array of
offsets gives each row exactly what it gives the row alone with an int offset.

A row's choice also depends on how its prompt is cut into forward passes (its keys keep the
frequencies they were rotated with), so such models cannot be prefilled with padding either:
a right-padded row would see the padded length. :func:`has_length_dependent_rope` lets
``batch-prefill-per-row`` prefill their rows alone.
"""

from typing import Callable, Hashable, List

# (module, class) of the rotary classes that choose frequencies from offset + L. SuScaledRoPE
# only does so in the releases where it keeps short and long frequencies (``_long_freqs``).
_LENGTH_DEPENDENT = {
    ("mlx_lm.models.rope_utils", "DynamicNTKScalingRoPE"),
    ("mlx_lm.models.internlm2", "DynamicNTKScalingRoPE"),
    ("mlx_lm.models.internlm3", "DynamicNTKScalingRoPE"),
}
_SU_SCALED = ("mlx_lm.models.rope_utils", "SuScaledRoPE")


def is_row_offsets(offset) -> bool:
    """``offset`` is a batch cache's per-row offsets (an ``mx.array`` with a batch axis)."""
    import mlx.core as mx

    return isinstance(offset, mx.array) and offset.ndim > 0


def rotate_rows(x, offset, choice: Callable[[int], Hashable], rotate):
    """``rotate(x_rows, offset_rows, key)`` applied to the rows of ``x`` (batch axis 0) grouped by
    ``key = choice(row_offset)``, reassembled in row order. ``offset``: per-row offsets (B,)."""
    import mlx.core as mx

    offsets: List[int] = offset.tolist()
    keys = [choice(int(o)) for o in offsets]
    groups = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    if len(groups) == 1:
        return rotate(x, offset, keys[0])
    if x.shape[0] != len(offsets):
        raise ValueError(f"{len(offsets)} row offsets for a batch of {x.shape[0]} rows")
    parts, order = [], []
    for key, rows in groups.items():
        index = mx.array(rows)
        parts.append(rotate(x[index], offset[index], key))
        order.extend(rows)
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return mx.concatenate(parts, axis=0)[mx.array(inverse)]


def is_length_dependent(module) -> bool:
    """``module`` is a rotary embedding whose frequencies depend on ``offset + L``."""
    kind = (type(module).__module__, type(module).__name__)
    if kind in _LENGTH_DEPENDENT:
        return True
    return kind == _SU_SCALED and hasattr(module, "_long_freqs")


def has_length_dependent_rope(model) -> bool:
    """``model`` holds a rotary embedding whose frequencies depend on the sequence length."""
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return False
    try:
        return any(is_length_dependent(m) for m in modules())
    except Exception:  # a stand-in model, or a module tree we cannot walk: not ours to judge
        return False

"""Longrope (``SuScaledRoPE``) models decode in batches: short or long factors chosen per row.

Bug
    In mlx-lm 0.29.0 - 0.30.0 ``rope_utils.SuScaledRoPE.__call__`` chooses between its short and
    long frequencies in Python: ``if offset + L > original_max_position_embeddings``. In batched
    generation ``offset`` is the ``BatchKVCache``'s per-row ``mx.array``, so batched decoding of
    every model built with this class (phi3 with ``rope_scaling`` type ``longrope``/``su``,
    phimoe, minicpm3, ``initialize_rope`` with type ``longrope``) crashes with ``ValueError:
    [convert] Only length-1 arrays can be converted to Python scalars``. (Upstream PR 707 fixed
    the crash in 0.30.1 by always using the long factors.)

Fix
    With per-row offsets, each row gets the factors and input scale the stock method picks for
    that row's int offset (rows grouped by choice, ``mx.fast.rope`` with the group's per-row
    offsets; see ``mlx_lm_patches/mechanisms/rope_rows.py``); the input is scaled into a new array instead of
    in place. An int offset runs the stock method. The choice also depends on how a prompt is cut
    into forward passes, so rows of different lengths are prefilled alone
    (``batch-prefill-per-row`` recognises the two-factor class); decoding stays batched.

Retire
    When 0.30.0 drops out of the supported range.

Metal
    Same ``mx.fast.rope`` kernel as the stock method, called once per group of rows.
"""

import sys

from mlx_lm_patches.mechanisms import rope_rows

MODULE = "mlx_lm.models.rope_utils"
PID = "su-scaled-rope-batch"


def _per_row(wrapped, instance, args, kwargs):
    import mlx.core as mx

    x = args[0] if args else kwargs["x"]
    offset = args[1] if len(args) > 1 else kwargs.get("offset", 0)
    if not rope_rows.is_row_offsets(offset):
        return wrapped(*args, **kwargs)
    length, limit, dim = x.shape[-2], instance.original_max_position_embeddings, instance.dim

    def use_long(row_offset):
        return row_offset + length > limit

    def rotate(rows, offsets, long):
        freqs = instance._long_freqs if long else instance._short_freqs
        scale = instance._long_scale if long else instance._short_scale
        rows = rows.at[..., :dim].multiply(scale)
        return mx.fast.rope(rows, dim, traditional=False, base=None, scale=1.0, offset=offsets,
                            freqs=freqs)

    return rope_rows.rotate_rows(x, offset, use_long, rotate)


def probe():
    import mlx.core as mx

    cls = sys.modules[MODULE].SuScaledRoPE
    rope = cls(16, max_position_embeddings=64, original_max_position_embeddings=4)
    if not hasattr(rope, "_long_freqs"):
        return None  # one set of factors for every length: nothing to choose per row
    try:
        mx.eval(rope(mx.zeros((2, 2, 1, 16)), offset=mx.array([1, 5])))
    except (ValueError, TypeError) as exc:
        return f"SuScaledRoPE with per-row offsets raises {type(exc).__name__}: {exc}"
    return None


def apply(p):
    p.wrap(f"{MODULE}:SuScaledRoPE.__call__", _per_row)


def scenario():
    """phi3 with longrope, three prompts batched with rows on both sides of the switch."""
    from mlx_lm_patches.selftest.tiny_rope_models import scenario_outcome

    return scenario_outcome(PID, "phi3 longrope (SuScaledRoPE)")

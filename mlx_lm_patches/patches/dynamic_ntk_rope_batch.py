"""Models with dynamic-NTK rotary scaling decode in batches: the base is chosen per row.

Bug
    ``rope_utils.DynamicNTKScalingRoPE.__call__`` (new in 0.32.0, used by ``initialize_rope`` for
    ``rope_scaling`` type ``dynamic``) computes its base from
    ``max(L + offset, max_position_embeddings)`` in Python. In batched generation ``offset`` is
    the ``BatchKVCache``'s per-row ``mx.array``, so every batched decode of a model configured
    with dynamic scaling crashes with ``ValueError: [convert] Only length-1 arrays can be
    converted to Python scalars``: llama and the hybrids qwen3_next and falcon_h1 were measured;
    every family that passes ``rope_scaling`` to ``initialize_rope`` is exposed.

Fix
    With per-row offsets, each row gets the base the stock method computes for that row's int
    offset (rows grouped by base, ``mx.fast.rope`` with the group's per-row offsets; see
    ``mlx_lm_patches/mechanisms/rope_rows.py``); an int offset runs the stock method. The base also depends
    on how a prompt is cut into forward passes, so rows of different lengths are prefilled alone
    (``batch-prefill-per-row`` recognises this class); decoding stays batched.

Retire
    When ``DynamicNTKScalingRoPE`` handles per-row offsets upstream (the probe then says the bug
    is absent).

Metal
    Same ``mx.fast.rope`` kernel as the stock method, called once per group of rows.
"""

import sys

from mlx_lm_patches.mechanisms import rope_rows

MODULE = "mlx_lm.models.rope_utils"
PID = "dynamic-ntk-rope-batch"


def _per_row(wrapped, instance, args, kwargs):
    import mlx.core as mx

    x = args[0] if args else kwargs["x"]
    offset = args[1] if len(args) > 1 else kwargs.get("offset", 0)
    if not rope_rows.is_row_offsets(offset):
        return wrapped(*args, **kwargs)
    length, limit = x.shape[-2], instance.max_position_embeddings
    factor, dims = instance.factor, instance.dims

    def base(row_offset):
        seq_len = max(length + row_offset, limit)
        return instance.base * ((factor * seq_len / limit) - (factor - 1)) ** (dims / (dims - 2))

    def rotate(rows, offsets, row_base):
        return mx.fast.rope(rows, dims, traditional=instance.traditional, base=row_base,
                            scale=1.0, offset=offsets)

    return rope_rows.rotate_rows(x, offset, base, rotate)


def probe():
    import mlx.core as mx

    cls = getattr(sys.modules[MODULE], "DynamicNTKScalingRoPE", None)
    if cls is None:
        return None
    rope = cls(16, max_position_embeddings=4, traditional=False, base=10000.0, factor=2.0)
    try:
        mx.eval(rope(mx.zeros((2, 2, 1, 16)), offset=mx.array([1, 5])))
    except (ValueError, TypeError) as exc:
        return f"rope_utils.DynamicNTKScalingRoPE with per-row offsets raises {type(exc).__name__}: {exc}"
    return None


def apply(p):
    p.wrap(f"{MODULE}:DynamicNTKScalingRoPE.__call__", _per_row)


def scenario():
    """llama, qwen3_next and falcon_h1 with ``rope_scaling`` type ``dynamic``, three prompts
    batched with rows on both sides of the NTK threshold."""
    from mlx_lm_patches.selftest.tiny_rope_models import scenario_outcome

    return scenario_outcome(PID, "dynamic-NTK RoPE (rope_scaling type dynamic)")

"""internlm2/internlm3's own ``DynamicNTKScalingRoPE`` (the same class in both, up to mlx-lm
0.31.3) with per-row offsets: each row gets the base it gets alone (see :mod:`.rope_rows`)."""

from mlx_lm_patches.mechanisms import rope_rows


def per_row_dynamic_ntk(wrapped, instance, args, kwargs):
    """Wrapper of internlm2/internlm3 ``DynamicNTKScalingRoPE.__call__``."""
    import mlx.core as mx

    x = args[0] if args else kwargs["x"]
    offset = args[1] if len(args) > 1 else kwargs.get("offset", 0)
    if not rope_rows.is_row_offsets(offset):
        return wrapped(*args, **kwargs)
    heads = x.shape[1]
    limit = instance.max_position_embeddings
    scale, dims = instance.scale, instance.dims

    def base(row_offset):
        seq_len = heads + row_offset
        if seq_len > limit:
            return instance.original_base * ((scale * seq_len / limit) - (scale - 1)) ** (dims / (dims - 2))
        return instance.original_base

    def rotate(rows, offsets, row_base):
        return mx.fast.rope(rows, dims, traditional=instance.traditional, base=row_base,
                            scale=scale, offset=offsets)

    return rope_rows.rotate_rows(x, offset, base, rotate)


def per_row_failure(cls):
    """Evidence that ``cls(...)(x, offset=per-row offsets)`` fails, or None."""
    import mlx.core as mx

    rope = cls(16, max_position_embeddings=4, base=10000.0, scale=2.0)
    try:
        mx.eval(rope(mx.zeros((2, 4, 1, 16)), offset=mx.array([1, 5])))
    except (ValueError, TypeError) as exc:
        return f"{cls.__module__}.{cls.__qualname__} with per-row offsets raises {type(exc).__name__}: {exc}"
    return None

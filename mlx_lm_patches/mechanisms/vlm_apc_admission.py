"""Which requests mlx-vlm's prefix cache (``apc_mode == "exact"``, hybrid models) looks up when
``BatchGenerator`` admits them: ``mlx-vlm-apc-hybrid-batches-cold`` sends requests admitted
together down mlx-vlm's cold path, ``mlx-vlm-apc-hybrid-hits-refused`` every request."""


def cold_admissions(at_least: int):
    """Wrapper of ``BatchGenerator._build_mixed_prompt_batch(sequences)``: in the "exact" (hybrid)
    mode, ``at_least`` or more sequences admitted together are not looked up (``None``: mlx-vlm's
    cold path)."""

    def wrapper(wrapped, instance, args, kwargs):
        from mlx_lm_patches.mechanisms.calls import bind_arguments

        sequences = bind_arguments(wrapped, args, kwargs).arguments.get("sequences")
        if getattr(instance, "apc_mode", None) == "exact" and sequences is not None and len(sequences) >= at_least:
            return None
        return wrapped(*args, **kwargs)

    return wrapper

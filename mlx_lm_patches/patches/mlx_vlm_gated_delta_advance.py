"""mlx-vlm's Qwen3.5 gated-delta layers advance their cache: left-padded rows keep decoding.

Bug
    mlx-lm's ``ArraysCache`` masks left padding with ``make_mask`` from its ``left_padding``,
    which the layer using the cache moves past the tokens it consumed with ``cache.advance(N)``
    (mlx-lm's own recurrent layers do; mlx-lm's ``BatchGenerator`` also clears it in
    ``finalize``). mlx-vlm (<= 0.4.x) ``Qwen3_5GatedDeltaNet.__call__`` never calls ``advance``
    and mlx-vlm's ``BatchGenerator`` never calls ``finalize``, so after a batched prefill the
    padding stays where it was: each decode step's mask hides the new token of every
    left-padded row (its convolution input is zeroed, its recurrent state frozen). Batched
    Qwen3.5 / Qwen3.5-MoE text generation with prompts of different lengths is silently wrong
    on every padded row, also once ``mlx-vlm-qwen3-5-batch-positions`` gives each row its
    positions.

Fix
    After the stock ``Qwen3_5GatedDeltaNet.__call__``, call ``cache.advance(S)`` (``S`` tokens
    consumed) when the cache has it: mlx-lm's contract for its recurrent layers. For a
    single-sequence cache (no padding, no lengths) ``advance`` changes nothing.

Retire
    When mlx-vlm < 0.5.0 is no longer supported.

Metal
    Cache bookkeeping only; the layer's kernels are the stock ones.
"""

import sys

MODULE = "mlx_vlm.models.qwen3_5.language"


def _advance_after(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    inputs = args[0] if args else kwargs["inputs"]
    cache = args[2] if len(args) > 2 else kwargs.get("cache")
    if cache is not None and hasattr(cache, "advance"):
        cache.advance(inputs.shape[1])
    return out


def apply(p):
    p.wrap(f"{MODULE}:Qwen3_5GatedDeltaNet.__call__", _advance_after)


def probe():
    from mlx_lm_patches.mechanisms.probing.vlm_problems import gated_delta_advance_problem

    return gated_delta_advance_problem(sys.modules[MODULE])


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5 (gated-delta and attention layers): prompts of 5, 9
    and 13 tokens batched equal each prompt alone."""
    from mlx_lm_patches.selftest.vlm.batching import scenario_outcome

    return scenario_outcome("qwen3_5", only=("mlx-vlm", "mlx-lm"), before_rows=True)

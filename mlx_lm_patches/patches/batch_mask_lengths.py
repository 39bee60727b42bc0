"""Batched prefill of hybrid models with prompts of different lengths is exact on mlx-lm 0.31.3.

Bug
    In mlx-lm 0.31.3, ``ArraysCache.merge`` of empty caches (what ``BatchGenerator`` does before
    a batched prefill) sets ``left_padding``, and ``prepare`` then sets ``lengths``. But
    ``ArraysCache.make_mask`` returns the left-padding mask and ignores ``lengths`` when both are
    set, so recurrent layers (gated delta, Mamba2 SSM) fold padded positions into their state:
    prompts of different lengths decode to silently wrong log-probabilities and tokens
    (qwen3_next, qwen3_5, qwen3_5_moe, kimi_linear, plamo2, mamba2, ...).

Fix
    A cache that ``prepare`` or ``extend`` leaves with both set gets a ``make_mask`` of its own
    that combines them: a position counts when it is at or after the row's left padding *and*
    before the row's length - the rule mlx-lm 0.32.0 adopted; ``finalize`` takes it away. The
    class's ``make_mask`` is untouched, so single-sequence decoding never calls into the package.

Retire
    When 0.31.3 drops out of the supported range.

Metal
    The mask is built with mlx ops in Python; the models' own (Metal) kernels consume it as on
    0.32.
"""

import sys
import types

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"


def _combined_mask(cache, n):
    """``make_mask`` of a cache with both ``left_padding`` and ``lengths`` set."""
    import mlx.core as mx

    left_padding, lengths = cache.left_padding, cache.lengths
    if left_padding is None or lengths is None:
        return type(cache).make_mask(cache, n)
    pos = mx.arange(n)
    return (pos >= left_padding[:, None]) & (pos < lengths[:, None])


def _drop_mask(cache):
    vars(cache).pop("make_mask", None)


def apply(p):
    def combining(wrapped, instance, args, kwargs):  # prepare / extend
        out = wrapped(*args, **kwargs)
        if instance.left_padding is not None and instance.lengths is not None and "make_mask" not in vars(instance):
            instance.make_mask = types.MethodType(_combined_mask, instance)
            p.track(instance, _drop_mask, "make_mask combining left_padding and lengths")
        return out

    def finalizing(wrapped, instance, args, kwargs):
        _drop_mask(instance)
        return wrapped(*args, **kwargs)

    p.wrap(f"{CACHE}:ArraysCache.prepare", combining)
    p.wrap(f"{CACHE}:ArraysCache.extend", combining)
    p.wrap(f"{CACHE}:ArraysCache.finalize", finalizing)


def probe():
    import mlx.core as mx

    arrays_cache = sys.modules[CACHE].ArraysCache
    if not hasattr(arrays_cache, "prepare"):
        return None
    cache = arrays_cache(1, left_padding=[1, 0])
    cache.prepare(lengths=[2, 2])
    mask = cache.make_mask(4)
    expected = mx.array([[False, True, False, False], [True, True, False, False]])
    if mask is None or not mx.array_equal(mask, expected):
        got = None if mask is None else mask.tolist()
        return f"ArraysCache.make_mask ignores lengths when left_padding is set (got {got})"
    return None


def scenario():
    """BatchGenerator with prompts of different lengths equals single-sequence decoding."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    from mlx_lm.models.cache import ArraysCache

    if not hasattr(ArraysCache, "merge"):
        return Outcome.not_applicable("this mlx-lm cannot batch recurrent caches at all (no ArraysCache.merge)")
    details = []
    for model_type in [t for t in ("qwen3_next", "mamba2", "kimi_linear") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13)]
        try:
            got = batched_greedy(model, prompts)
        except Exception as exc:
            return Outcome.failure(f"{model_type}: BatchGenerator", exc)
        for i, (prompt, decoded) in enumerate(zip(prompts, got)):
            problem = greedy(model, prompt).compare(decoded)
            if problem:
                return Outcome.failure(f"{model_type}: batched prompt {i} ({len(prompt)} tokens): {problem}")
        details.append(f"{model_type}: 3 prompts of 5/9/13 tokens batched exactly")
    return Outcome(True, "batched prefill with different prompt lengths is exact", details)

"""arrays-cache-optional-size on the real mlx-lm: ArraysCache() without a size behaves like a
sized cache everywhere mlx-lm touches it; decoding with such caches is exact for every hybrid
family; calls with a size are unchanged."""

import pytest

from mlx_lm_patches.patches.arrays_cache_optional_size import AutoSizedSlots
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy, prefill, round_trip_prompt_cache
from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model


import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import ArraysCache, make_prompt_cache  # noqa: E402


@pytest.mark.parametrize("build", [
    lambda: ArraysCache(), lambda: ArraysCache(None), lambda: ArraysCache(size=None),
    lambda: ArraysCache(0), lambda: ArraysCache(left_padding=[1, 0]),
], ids=["()", "(None)", "(size=None)", "(0)", "(left_padding=)"])
def test_unsized_cache_reads_none_and_grows_on_write(build):
    cache = build()
    assert isinstance(cache.cache, AutoSizedSlots)
    assert cache[0] is None and cache[5] is None
    assert len(cache.cache) == 0
    cache[1] = mx.ones((1, 2))
    assert len(cache.cache) == 2 and cache[0] is None and cache[1].shape == (1, 2)


def test_sized_calls_are_untouched():
    cache = ArraysCache(2)
    assert type(cache.cache) is list and cache.cache == [None, None]
    cache = ArraysCache(size=1, left_padding=[2])
    assert type(cache.cache) is list and cache.left_padding.tolist() == [2]


def test_iteration_matches_the_sequence_protocol_for_sized_caches():
    cache = ArraysCache(2)
    cache[0] = mx.zeros((1,))
    first, second = cache
    assert second is None and first.shape == (1,)
    unsized = ArraysCache()
    unsized[1] = mx.ones((1,))
    assert [c is None for c in unsized] == [True, False]


def test_subclass_pattern_without_size():
    class BatchMambaCache(ArraysCache):  # downstream code after MambaCache's removal
        def __init__(self, left_padding=None):
            super().__init__(left_padding=left_padding)

    cache = BatchMambaCache(left_padding=[0, 1])
    assert cache[0] is None and cache.left_padding.tolist() == [0, 1]


def _flat_recurrent_families():
    families = []
    for model_type in available_model_types():
        caches = make_prompt_cache(build_tiny_model(model_type))
        if any(isinstance(c, ArraysCache) for c in caches):
            families.append(model_type)
    return families


def _unsized_like(cache):
    """An unsized cache of the same class (mamba <= 0.30.5 stores state only in a MambaCache)."""
    if type(cache) is ArraysCache:
        return ArraysCache()
    twin = type(cache).__new__(type(cache))
    ArraysCache.__init__(twin)
    return twin


def _swap(model):
    return [_unsized_like(c) if isinstance(c, ArraysCache) else c for c in make_prompt_cache(model)]


UNPACKS_FRESH_CACHE = ("kimi_linear", "kimi_k3")  # `conv_state, ssm_state = cache` before any write


@pytest.mark.family_sweep(_flat_recurrent_families())
@pytest.mark.parametrize("model_type", _flat_recurrent_families())
def test_decoding_and_round_trip_exact_with_unsized_caches(model_type):
    model = build_tiny_model(model_type, seed=7)
    prompt = prompt_tokens(10, seed=7)
    if model_type in UNPACKS_FRESH_CACHE:
        with pytest.raises(TypeError, match="built without a size .* cannot be unpacked"):
            greedy(model, prompt, prompt_cache=_swap(model))
        return
    assert greedy(model, prompt).compare(greedy(model, prompt, prompt_cache=_swap(model))) is None
    assert round_trip_prompt_cache(model, prompt, make_cache=_swap) is None


def test_merge_and_extract_of_unsized_caches_match_sized_ones():
    if not hasattr(ArraysCache, "merge"):
        pytest.skip("this mlx-lm has no ArraysCache.merge")
    model_type = next(t for t in ("qwen3_next", "nemotron_h") if t in available_model_types())
    model = build_tiny_model(model_type, seed=8)
    sized = [make_prompt_cache(model) for _ in range(2)]
    unsized = [_swap(model) for _ in range(2)]
    for i, caches in enumerate((sized, unsized)):
        for j, cache in enumerate(caches):
            prefill(model, prompt_tokens(6, seed=j), cache)
    layer = next(i for i, c in enumerate(sized[0]) if isinstance(c, ArraysCache))
    merged_sized = type(sized[0][layer]).merge([c[layer] for c in sized])
    merged_unsized = ArraysCache.merge([c[layer] for c in unsized])
    for a, b in zip(merged_sized.cache, merged_unsized.cache):
        assert mx.array_equal(a, b)
    back = merged_unsized.extract(1)
    for a, b in zip(back.cache, unsized[1][layer].cache):
        assert mx.array_equal(a, b)

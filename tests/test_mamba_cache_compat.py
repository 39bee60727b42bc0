"""mamba-cache-compat on the real mlx-lm: every calling convention, exact decoding with
MambaCache layers for every hybrid family that uses two-slot recurrent caches, prompt-cache
files naming MambaCache, and the stock failure where the matrix says affected."""

import pytest

from conftest import run_python, xfail_if_affected
from mlx_lm_patches.patches import mamba_cache_compat as patch
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy
from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model


from mlx_lm.models import cache as cache_module  # noqa: E402
from mlx_lm.models.cache import ArraysCache, MambaCache  # noqa: E402


@pytest.mark.parametrize("description,build,size,left_padding", patch._conventions(MambaCache),
                         ids=[c[0] for c in patch._conventions(MambaCache)])
def test_convention(description, build, size, left_padding):
    cache = build()
    assert isinstance(cache, ArraysCache)
    assert cache.cache == [None] * size
    padding = cache.left_padding
    assert (None if padding is None else padding.tolist()) == left_padding


@pytest.mark.parametrize("args,kwargs,message", [
    ((), {"sizes": 2}, "unexpected keyword argument"),
    ((2,), {"size": 2}, "size both positionally"),
    (([1], ), {"left_padding": [1]}, "left_padding both"),
    ((2, [1], 3), {}, "at most a size and a left_padding"),
    ((), {"size": 0}, "positive int"),
])
def test_bad_arguments_are_clear_errors(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        MambaCache(*args, **kwargs)


def test_isinstance_and_identity_for_models():
    assert issubclass(MambaCache, ArraysCache)
    assert cache_module.MambaCache is MambaCache
    assert patch.probe() is None


def _two_slot_families():
    found = []
    for model_type in available_model_types():
        model = build_tiny_model(model_type, seed=0)
        caches = model.make_cache() if hasattr(model, "make_cache") else []
        if any(type(c) in (ArraysCache, MambaCache) for c in caches):
            found.append(model_type)
    return found


@pytest.mark.parametrize("model_type", _two_slot_families())
def test_decoding_with_mamba_caches_is_exact(model_type):
    """Downstream code (vllm-mlx's BatchMambaCache) swaps recurrent caches for MambaCache."""
    from mlx_lm.models.cache import make_prompt_cache

    model = build_tiny_model(model_type, seed=3)
    prompt = prompt_tokens(14, seed=3)
    reference = greedy(model, prompt, max_tokens=6)
    cache = make_prompt_cache(model)
    for i, c in enumerate(cache):
        if type(c) in (ArraysCache, MambaCache):
            cache[i] = MambaCache(len(c.cache))
    assert reference.compare(greedy(model, prompt, max_tokens=6, prompt_cache=cache)) is None


def test_prompt_cache_file_naming_mamba_cache_round_trips(tmp_path):
    """save_prompt_cache records the class name; load_prompt_cache resolves it in the cache
    module, where the class now lives again on >= 0.30.6."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model_type = next(t for t in ("nemotron_h", "qwen3_next") if t in available_model_types())
    model = build_tiny_model(model_type, seed=5)
    prompt = prompt_tokens(16, seed=5)
    reference = greedy(model, prompt, max_tokens=5)

    cache = make_prompt_cache(model)
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            cache[i] = MambaCache()
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in cache]
    got = greedy(model, prompt[-1:], max_tokens=5, prompt_cache=loaded)
    assert reference.compare(got) is None


@pytest.mark.subprocess
@xfail_if_affected("mamba-cache-compat")
def test_stock_every_convention_works():
    ran = run_python("""
        from mlx_lm_patches.patches import mamba_cache_compat as patch
        import mlx_lm.models.cache
        problem = patch.probe()
        assert problem is None, problem
        from mlx_lm.models.cache import MambaCache
        MambaCache(size=2); MambaCache(2)
    """, env={"MLX_LM_PATCHES": "0"})
    assert ran.returncode == 0, ran.stderr[-1500:]

"""Prefix reuse wherever a hybrid prompt is prefilled (patch ``prompt-cache-prefix-reuse``),
not only through ``generate_step``: the states are kept by the model's own forward, whoever
calls it.

* An engine that prefills by calling the model itself, chunk by chunk, stores the cache in an
  ``LRUPromptCache`` and fetches it for a request that diverges inside it: at least half of the
  shared prefix is reused, and the engine's own greedy continuation equals the reference path
  (``generate_step``, cold prefill): same tokens, log-probabilities within 1e-4. For every
  hybrid family of the release (gated-delta, Mamba/Mamba2 SSM, short conv, RG-LRU, RWKV, ...).
* ``speculative_generate_step`` with a supplied prompt cache (main and draft caches, as
  ``mlx_lm.server --draft-model`` builds it), hybrid or dense draft: the stored cache is reused
  for both models and the speculative answer equals greedy decoding.
* Kept states are freed with the entries that hold them: 200 requests with distinct prefixes
  through a bounded store keep memory flat.
Patches off: the diverging request reuses nothing (strict xfail where the matrix says affected).
"""

import pytest

from conftest import reverted, xfail_if_affected
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import engine_greedy, engine_prefill, engine_prefix_reuse, greedy, lru_prompt_cache_class, speculative_greedy
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model


HYBRIDS = available_model_types()
CHUNK = 64
SHARED = 3 * CHUNK + 21  # at least twice the largest prefill chunk
PATCH = "prompt-cache-prefix-reuse"


def _requests(shared=SHARED, seed=4):
    a = prompt_tokens(shared + 40, seed=seed)
    b = a[:shared] + [(t + 5) % 250 + 1 for t in a[shared:shared + 7]]
    return a, b


def _engine_reuse(model):
    return engine_prefix_reuse(model, shared=SHARED, chunk=CHUNK)


@pytest.mark.family_sweep(HYBRIDS)
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_an_engine_calling_the_model_itself_reuses_exactly(model_type):
    reused, problem = _engine_reuse(build_tiny_model(model_type, seed=1))
    assert problem is None, problem
    assert SHARED // 2 <= reused <= SHARED, f"reused {reused} of {SHARED} shared tokens"


@pytest.fixture
def stock():
    """The prefix-reuse patch reverted for one test (what mlx-lm does without it)."""
    with reverted(PATCH):
        yield


@xfail_if_affected(PATCH, "stock mlx-lm: a hybrid prompt diverging inside a stored one is a full miss")
def test_stock_engine_reuse_misses(stock):
    reused, problem = _engine_reuse(build_tiny_model("qwen3_next", seed=1))
    assert problem is None, problem
    assert reused >= SHARED // 2, f"reused {reused} of {SHARED} shared tokens"


def _speculative_reuse(model, draft, num_draft=3):
    from mlx_lm.models.cache import make_prompt_cache

    store = lru_prompt_cache_class()()
    a, b = _requests(seed=6)

    def both():
        return make_prompt_cache(model) + make_prompt_cache(draft)

    cache = both()
    first = speculative_greedy(model, draft, a, max_tokens=5, num_draft_tokens=num_draft, prompt_cache=cache,
                               prefill_step_size=CHUNK)
    store.insert_cache("m", a + first.tokens, cache)
    fetched, rest = store.fetch_nearest_cache("m", b)
    reused = len(b) - len(rest)
    warm = speculative_greedy(model, draft, list(rest), max_tokens=6, num_draft_tokens=num_draft,
                              prompt_cache=fetched if fetched is not None else both(), prefill_step_size=CHUNK)
    return reused, greedy(model, b, max_tokens=6).compare(warm)


SPECULATIVE = [("qwen3_next", "same-family draft"), ("qwen3_next", "dense draft"),
               ("nemotron_h", "same-family draft"), ("falcon_h1", "dense draft")]


@pytest.mark.parametrize("model_type,draft_kind", [s for s in SPECULATIVE if s[0] in HYBRIDS],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_speculative_decoding_into_a_supplied_cache_reuses_exactly(model_type, draft_kind):
    model = build_tiny_model(model_type, seed=1)
    draft = build_tiny_model(model_type if draft_kind == "same-family draft" else DENSE_MODEL_TYPE, seed=2)
    reused, problem = _speculative_reuse(model, draft)
    assert problem is None, problem
    assert SHARED // 2 <= reused <= SHARED, f"reused {reused} of {SHARED} shared tokens"


@xfail_if_affected(PATCH, "stock mlx-lm: a hybrid prompt diverging inside a stored one is a full miss")
def test_stock_speculative_reuse_misses(stock):
    model, draft = build_tiny_model("qwen3_next", seed=1), build_tiny_model(DENSE_MODEL_TYPE, seed=2)
    reused, problem = _speculative_reuse(model, draft)
    assert problem is None, problem
    assert reused >= SHARED // 2, f"reused {reused} of {SHARED} shared tokens"


def _nbytes(cache):
    """A cache's bytes with its kept states (``nbytes`` where the release has it)."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import arrays

    if hasattr(cache, "nbytes"):
        return cache.nbytes
    live = sum(a.nbytes for a in arrays(list(cache.state)))
    return live + (pc.retained_nbytes(cache) if hasattr(cache, "cache") else 0)


def test_kept_states_are_freed_with_their_entries():
    """200 requests with distinct prefixes through a store bounded to a few entries: the memory
    in use after request 200 is what it was after request 50 (within 2 entries' worth)."""
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    active = getattr(mx, "get_active_memory", None)
    if active is None:
        pytest.skip("this mlx reports no active memory")
    store_class = lru_prompt_cache_class()
    try:
        store = store_class(max_size=4)
    except TypeError:
        store = store_class(4)
    model = build_tiny_model("lfm2" if "lfm2" in HYBRIDS else "qwen3_next", seed=1)
    samples, entry_bytes = {}, 0
    for i in range(200):
        prompt = prompt_tokens(64, seed=1000 + i)
        cache = make_prompt_cache(model)
        engine_prefill(model, prompt, cache, chunk=16)
        assert pc.checkpoints(cache), "states were kept"
        entry_bytes = max(entry_bytes, sum(_nbytes(c) for c in cache))
        store.insert_cache("m", prompt, cache)
        del cache
        if i + 1 in (50, 200):
            gc.collect()
            mx.clear_cache()
            samples[i + 1] = active()
    assert samples[200] - samples[50] <= 2 * entry_bytes, (samples, entry_bytes)


def test_a_state_changed_unseen_is_never_used_past_the_change():
    """Exact or refuse: after something the package did not see replaces a recurrent state, the
    passes that follow keep nothing, and a request is restored only from a state kept before
    the change (and then equals a cold prefill)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import recurrent_caches

    model = build_tiny_model("qwen3_next", seed=1)
    a, b = _requests()
    cache = make_prompt_cache(model)
    engine_prefill(model, a[:2 * CHUNK], cache, CHUNK)
    leaf = recurrent_caches(cache)[-1]
    leaf[len(leaf.cache) - 1] = leaf.cache[-1] * 1.5  # not by a forward: unseen
    mx.eval(leaf.cache[-1])
    engine_prefill(model, a[2 * CHUNK:], cache, CHUNK)
    assert [p for p, _, _ in pc.checkpoints(cache)] == [CHUNK, 2 * CHUNK]
    store = lru_prompt_cache_class()()
    store.insert_cache("m", a, cache)
    fetched, rest = store.fetch_nearest_cache("m", b)
    reused = len(b) - len(rest)
    assert reused == 2 * CHUNK, reused
    problem = greedy(model, b, max_tokens=4).compare(engine_greedy(model, list(rest), fetched, chunk=CHUNK))
    assert problem is None, problem

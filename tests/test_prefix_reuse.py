"""Diverging prefix reuse for hybrid models in mlx-lm's ``LRUPromptCache`` (patch
``prompt-cache-prefix-reuse``), patches on, on the installed release.

A request that diverges from a longer stored prompt reuses an exact recurrent state at or before
the divergence (at least half of the shared prefix with prefill chunks of at most 256 tokens)
and continues exactly as a cold prefill would: same greedy tokens, log-probabilities within
1e-4. Through both paths ``mlx_lm.server`` uses: ``generate_step`` (single sequence) and
``BatchGenerator`` (batched), for every hybrid family of the release. Plus: nothing ever claims
a trim it cannot do, resetting the state instead (mlx-lm PR #1254) is wrong, shorter stored
prompts are not evicted, kept states are bounded and counted in ``nbytes``.
"""

import pytest

from mlx_lm_patches.mechanisms import prefix_reuse as pc
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import _batched_one, _single_one, greedy, lru_prompt_cache_class, prefix_reuse
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model


HYBRIDS = available_model_types()
SHARED, STEP = 300, 128


@pytest.fixture(scope="module")
def store_class():
    return lru_prompt_cache_class()


@pytest.mark.family_sweep(HYBRIDS)
@pytest.mark.parametrize("path", ["generate_step", "BatchGenerator"])
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_diverging_request_reuses_an_exact_earlier_state(model_type, path, store_class):
    model = build_tiny_model(model_type, seed=1)
    reused, problem = prefix_reuse(model, shared=SHARED, prefill_step_size=STEP, max_tokens=4,
                                   batched=path == "BatchGenerator")
    assert problem is None, problem
    assert SHARED // 2 <= reused <= SHARED, f"reused {reused} of {SHARED} shared tokens"


def _store_one(store, model, prompt, batched=False, start=None, max_tokens=4, step=STEP):
    decode = _batched_one if batched else _single_one
    decoded, cache = decode(model, prompt, start, max_tokens, step)
    store.insert_cache("m", list(prompt) + decoded.tokens, cache)
    return decoded, cache


def _warm(store, model, prompt, batched=False, max_tokens=4):
    """Fetch ``prompt`` from the store and decode it from what the store gives."""
    from mlx_lm.models.cache import make_prompt_cache

    fetched, rest = store.fetch_nearest_cache("m", list(prompt))
    reused = len(prompt) - len(rest)
    if fetched is None:
        fetched = make_prompt_cache(model)
    decode = _batched_one if batched else _single_one
    decoded, cache = decode(model, list(rest), (fetched, prompt[:reused]), max_tokens, STEP)
    return reused, decoded, cache


@pytest.mark.parametrize("batched", [False, True], ids=["generate_step", "BatchGenerator"])
def test_a_continuation_keeps_states_for_the_next_request(store_class, batched):
    """A -> B diverges after 300 tokens -> C diverges from B 200 tokens further: C reuses a state
    B kept (B's own prefill started from A's state), and every continuation is exact."""
    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    shared = prompt_tokens(SHARED, seed=5)
    a = shared + prompt_tokens(40, seed=6)
    b = shared + prompt_tokens(300, seed=7)
    c = b[:SHARED + 200] + prompt_tokens(20, seed=9)
    _store_one(store, model, a, batched)
    reused_b, decoded_b, cache_b = _warm(store, model, b, batched)
    assert reused_b >= SHARED // 2
    assert greedy(model, b, max_tokens=4).compare(decoded_b) is None
    store.insert_cache("m", b + decoded_b.tokens, cache_b)
    reused_c, decoded_c, _ = _warm(store, model, c, batched)
    assert reused_c >= (SHARED + 200) // 2 and reused_c > reused_b, (reused_b, reused_c)
    assert greedy(model, c, max_tokens=4).compare(decoded_c) is None


def test_multi_turn_hits_the_whole_previous_turn(store_class):
    """The next turn extends the stored prompt + reply: mlx-lm's own (shorter-prefix) hit, which
    the patch leaves as it is, exact."""
    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    turn1 = prompt_tokens(200, seed=3)
    decoded, _ = _store_one(store, model, turn1)
    turn2 = turn1 + decoded.tokens + prompt_tokens(30, seed=4)
    reused, got, _ = _warm(store, model, turn2)
    assert reused == len(turn1) + len(decoded.tokens)
    assert greedy(model, turn2, max_tokens=4).compare(got) is None


def test_concurrent_requests_reuse_exactly(store_class):
    """Two requests diverging from one stored prompt at different places, decoded together in
    one BatchGenerator, each from its fetched cache: both exact."""
    import inspect

    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    base = prompt_tokens(400, seed=11)
    _store_one(store, model, base, batched=True)
    requests = [base[:330] + prompt_tokens(9, seed=12), base[:280] + prompt_tokens(17, seed=13)]
    fetched = [store.fetch_nearest_cache("m", list(r)) for r in requests]
    reused = [len(r) - len(rest) for r, (_, rest) in zip(requests, fetched)]
    assert all(n >= 140 for n in reused), reused
    gen = BatchGenerator(model, max_tokens=4, prefill_step_size=STEP)
    kwargs = dict(caches=[c for c, _ in fetched])
    if "all_tokens" in inspect.signature(gen.insert).parameters:
        kwargs["all_tokens"] = [list(r[:n]) for r, n in zip(requests, reused)]
    uids = gen.insert([list(rest) for _, rest in fetched], [4, 4], **kwargs)
    got = {uid: ([], []) for uid in uids}
    step = getattr(gen, "next_generated", None) or gen.next
    while responses := step():
        for r in responses:
            got[r.uid][0].append(int(r.token))
            got[r.uid][1].append(r.logprobs)
    for uid, request in zip(uids, requests):
        reference = greedy(model, request, max_tokens=4)
        assert got[uid][0] == reference.tokens
        worst = max(mx.abs(a - b).max().item() for a, b in zip(got[uid][1], reference.logprobs))
        assert worst <= 1e-4


def test_no_cache_claims_a_trim_it_cannot_do(store_class):
    """Stored hybrid caches stay untrimmable for mlx-lm (so it never trims them, never evicts
    shorter entries for them); their kept states are used only through the fetch."""
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    prompt = prompt_tokens(SHARED, seed=5)
    _, cache = _store_one(store, model, prompt)
    assert pc.checkpoints(cache), "states were kept"
    assert not can_trim_prompt_cache(cache)
    before = [mx.array(s) for s in cache[0].cache if s is not None]
    assert trim_prompt_cache(cache, 5) == 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, [s for s in cache[0].cache if s is not None]))


def test_resetting_the_state_instead_is_wrong(store_class):
    """The trap (mlx-lm PR #1254): take the stored prompt back by cutting the attention caches and
    zeroing the recurrent state. The continuation differs from a cold prefill; the kept state
    gives the cold result."""
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    shared = prompt_tokens(256, seed=5)
    a, b = shared + prompt_tokens(30, seed=6), shared + prompt_tokens(8, seed=8)
    decoded, cache = _store_one(store, model, a)
    reset = copy.deepcopy(cache)
    for layer in reset:
        if isinstance(layer, ArraysCache):
            layer.cache = [None if s is None else mx.zeros_like(s) for s in layer.cache]
        else:
            layer.trim(layer.offset - 256)
    cold = greedy(model, b, max_tokens=6)
    assert cold.compare(greedy(model, b[256:], max_tokens=6, prompt_cache=reset)) is not None
    reused, warm, _ = _warm(store, model, b, max_tokens=6)
    assert reused == 256 and cold.compare(warm) is None


def test_shorter_stored_prompts_are_not_evicted(store_class):
    """The server stores a system prompt on its own, then longer prompts extending it; the
    system entry stays (a trimmable cache would have it deleted as redundant)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.selftest.scenarios import prefill

    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    system = prompt_tokens(120, seed=2)
    cache = make_prompt_cache(model)
    prefill(model, system, cache)
    store.insert_cache("m", system, cache)
    _store_one(store, model, system + prompt_tokens(50, seed=3))
    assert len(store._lru) == 2  # entries (the store has no len() before 0.31.1)
    _, rest = store.fetch_nearest_cache("m", system + prompt_tokens(9, seed=4))
    assert len(rest) == 9


def test_kept_states_are_bounded_and_counted(store_class, monkeypatch):
    """At most MLX_LM_PATCHES_PREFIX_CHECKPOINTS states per stored prompt, their bytes in the
    entry's nbytes (where mlx-lm counts bytes); 0 keeps none and reuse falls back to mlx-lm's."""
    from mlx_lm.models.cache import ArraysCache

    model = build_tiny_model("qwen3_next", seed=1)
    prompt = prompt_tokens(1100, seed=5)
    monkeypatch.setenv("MLX_LM_PATCHES_PREFIX_CHECKPOINTS", "3")
    _, cache = _store_one(store_class(), model, prompt, step=256)
    kept = [pos for pos, _, _ in pc.checkpoints(cache)]
    assert len(kept) == 3 and kept[-1] == len(prompt) - 1, kept
    assert all(b <= 2 * a for a, b in zip(kept, kept[1:]) if a >= pc.CHAIN_FLOOR), "a chain within factors of two"
    recurrent = [c for c in cache if isinstance(c, ArraysCache)]
    per_state = sum(a.nbytes for a in recurrent[0].cache if a is not None)
    assert pc.retained_nbytes(recurrent[0]) == 3 * per_state
    if isinstance(vars(ArraysCache).get("nbytes"), property):
        stock = sum(a.nbytes for a in recurrent[0].cache if a is not None)
        assert recurrent[0].nbytes == stock + 3 * per_state
    monkeypatch.setenv("MLX_LM_PATCHES_PREFIX_CHECKPOINTS", "0")
    model = build_tiny_model("qwen3_next", seed=1)
    store = store_class()
    _, cache = _store_one(store, model, prompt)
    assert pc.checkpoints(cache) == []
    assert _warm(store, model, prompt[:900] + [7, 8])[0] == 0


def test_dense_models_are_left_to_mlx_lm(store_class):
    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1)
    store = store_class()
    prompt = prompt_tokens(SHARED, seed=5)
    _store_one(store, model, prompt)
    reused, got, _ = _warm(store, model, prompt[:200] + prompt_tokens(5, seed=9))
    assert reused == 200, "mlx-lm trims dense caches to the common prefix itself"
    assert greedy(model, prompt[:200] + prompt_tokens(5, seed=9), max_tokens=4).compare(got) is None


def _chain_length(positions):
    """States needed so that every position from the floor up has a kept one within a factor
    of two below it."""
    count, top = 1, positions[-1]
    while top >= pc.CHAIN_FLOOR:
        lower = [p for p in positions if p < top]
        if not lower:
            break
        top = next((p for p in lower if 2 * p >= top), lower[-1])
        count += 1
    return count


@pytest.mark.parametrize("positions", [list(range(32, 4097, 32)), [32, 64, 128, 256, 300, 512, 600, 1024, 1500, 2047],
                                       [5, 7, 9, 200, 201, 202, 5000], [32, 64, 128] + list(range(256, 2113, 256)) + [2111]])
@pytest.mark.parametrize("limit", [1, 3, 8, 12])
def test_thinning_keeps_a_state_within_a_factor_of_two(positions, limit):
    positions = sorted(set(positions))
    kept = [p for p, _ in pc.thin([(p, None) for p in positions], limit)]
    assert len(kept) == min(limit, len(positions)) and kept[-1] == positions[-1]
    if limit >= _chain_length(positions):
        for d in range(pc.CHAIN_FLOOR, positions[-1] + 1):
            if any(d / 2 <= p <= d for p in positions):
                assert any(d / 2 <= p <= d for p in kept), (d, kept)


def test_spare_states_go_to_the_newest_positions():
    """A 2112-token prompt prefilled in chunks of 256: besides the chain, the budget keeps the
    latest chunk ends (a request sharing 2048 tokens reuses 2048), not the first few tokens."""
    positions = [32, 64, 128] + list(range(256, 2049, 256)) + [2111]
    kept = [p for p, _ in pc.thin([(p, None) for p in positions], 8)]
    assert kept == [256, 512, 768, 1280, 1536, 1792, 2048, 2111], kept


def test_what_keeps_states_and_where():
    """A prefill into a prompt cache the caller holds keeps states at the ends of mlx-lm's own
    passes (no extra cuts: the computation is stock). Only once an LRUPromptCache exists (or the
    variable is set) are passes also cut at powers of two and BatchGenerator rows prefilled one
    at a time for it; MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0 keeps nothing anywhere."""
    from conftest import run_python

    code = """
        import json, mlx_lm_patches
        mlx_lm_patches.apply()
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm_patches.mechanisms import prefix_reuse as pc
        from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
        from mlx_lm_patches.selftest.scenarios import _batched_one, greedy, lru_prompt_cache_class
        from mlx_lm_patches.selftest.tiny_models import build_tiny_model
        model = build_tiny_model("qwen3_next", seed=1)
        def kept():
            cache = make_prompt_cache(model)
            greedy(model, prompt_tokens(300), max_tokens=2, prompt_cache=cache, prefill_step_size=128)
            _, batched = _batched_one(model, prompt_tokens(300), None, 2, 128)
            return [[p for p, _, _ in pc.checkpoints(c)] for c in (cache, batched)]
        out = {"before": kept()}
        # A cache prefilled before any store existed, stored afterwards: still reusable.
        shared = prompt_tokens(600, seed=5)
        a, b = shared + prompt_tokens(9, seed=6), shared + prompt_tokens(7, seed=8)
        early = make_prompt_cache(model)
        first = greedy(model, a, max_tokens=3, prompt_cache=early, prefill_step_size=256)
        store = lru_prompt_cache_class()()
        store.insert_cache("m", a + first.tokens, early)
        fetched, rest = store.fetch_nearest_cache("m", b)
        warm = greedy(model, list(rest), max_tokens=3, prompt_cache=fetched or make_prompt_cache(model))
        out["late store"] = [len(b) - len(rest), greedy(model, b, max_tokens=3).compare(warm)]
        out["after"] = kept()
        print(json.dumps(out))
    """
    ran = run_python(code)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.json() == {"before": [[128, 256, 299], []], "late store": [512, None],
                          "after": [[32, 64, 128, 256, 299], [32, 64, 128, 256, 299]]}, ran.stdout
    ran = run_python(code, env={"MLX_LM_PATCHES_PREFIX_CHECKPOINTS": "0"})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.json() == {"before": [[], []], "late store": [0, None], "after": [[], []]}, ran.stdout

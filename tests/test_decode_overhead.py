"""Plain decoding pays at most one call into the package per token, the same at any length
(a quiet guest): ``generate_step`` without a draft, on a hybrid model (whose forward the
``prompt-cache-prefix-reuse`` patch wraps to record the sequence) and on a dense one (nothing
of ours runs). A call into the package is a Python function (or generator resumption) whose code
lives in ``mlx_lm_patches`` (tests/support/package_calls.py).

* calls per decoded token at 100 decode steps and at 400 (qwen3_5 / qwen3_next, attention and
  gated-delta layers): at most one, and the same at both lengths; one also while prefills are
  cut for a prompt-cache store; none for a dense model;
* at position 10,000 (after a 10,000-token prompt) as at the start, hybrid and dense: the same
  calls per decoded token (one, none);
* at 100 and 10,000 decode steps (mamba, one layer: the cheapest recurrent model; still about
  10 s of CPU, so this one runs once per Python version - what it adds to the above is our
  code's cost over a long sequence, which does not depend on the mlx-lm release);
* the recording stays exact over those steps: the cache's known history is the prompt followed
  by the generated tokens, appended to one store (no copy per step).
"""

import pytest

import mlx_lm_patches
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model, tiny_config
from support.counting import CountingModel
from support.package_calls import count_calls


PATCH = "prompt-cache-prefix-reuse"


def _hybrid():
    """A two-layer qwen3_5 (one gated-delta layer, one attention layer), else qwen3_next."""
    from mlx_lm_patches.selftest.tiny_models import available_model_types

    model_type = "qwen3_5" if "qwen3_5" in available_model_types() else "qwen3_next"
    config = tiny_config(model_type)
    if "text_config" in config:
        return build_tiny_model(model_type, seed=1, overrides={"text_config": dict(
            config["text_config"], num_hidden_layers=2, full_attention_interval=2)})
    return build_tiny_model(model_type, seed=1, overrides={"num_hidden_layers": 2, "full_attention_interval": 2})


def _decode(model, steps, prompt=None):
    """Plain ``generate_step`` of ``steps`` decode steps after the first token; the calls into the
    package and the forward passes while they run (the first token, and the prefill, excluded),
    and the cache with the prompt and every token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    prompt = prompt or prompt_tokens(40, seed=3)
    counted = CountingModel(model)
    cache = make_prompt_cache(model)
    generator = generate_step(mx.array(prompt), counted, max_tokens=steps + 1, prompt_cache=cache)
    tokens = [next(generator)[0]]
    before = counted.calls
    rest, calls = count_calls(lambda: [token for token, _ in generator])
    tokens += rest
    return calls, counted.calls - before, cache, prompt + tokens


def _per_token(calls, forwards):
    assert forwards > 0
    return sum(calls.values()) / forwards


def _history_is(cache, tokens):
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    # generate_step feeds each token before it yields it: the cache holds the prompt and them all
    return pc.exact_history(cache) == tuple(tokens)


def test_hybrid_decoding_pays_one_call_per_token_at_any_length():
    model = _hybrid()
    short, short_forwards, cache, tokens = _decode(model, 100)
    assert _history_is(cache, tokens)
    long, long_forwards, cache, tokens = _decode(model, 400)
    assert _history_is(cache, tokens)
    assert _per_token(short, short_forwards) <= 1, dict(short)
    assert _per_token(short, short_forwards) == _per_token(long, long_forwards), (dict(short), dict(long))
    assert sum(short.values()) > 0, "the hybrid forward is recorded: one call per token is counted"


def test_one_call_per_token_while_prefills_are_cut(monkeypatch):
    """Prefills cut at powers of two, as while an ``LRUPromptCache`` exists: the generator is
    mlx-lm's own, not one of ours around it (that would be one more call per token)."""
    monkeypatch.setenv("MLX_LM_PATCHES_PREFIX_CHECKPOINTS", "8")
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    assert pc.capturing({})  # no prompt-cache store noted: the variable alone turns cuts on
    calls, forwards, cache, tokens = _decode(_hybrid(), 100, prompt=prompt_tokens(70, seed=3))
    assert _per_token(calls, forwards) == 1, dict(calls)
    assert _history_is(cache, tokens)
    assert [pos for pos, _, _ in pc.checkpoints(cache)] == [32, 64, 69], "the prefill was cut at 32 and 64"


@pytest.mark.python_only
def test_recurrent_decoding_pays_one_call_per_token_over_ten_thousand_tokens():
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    model = build_tiny_model("mamba", seed=1, overrides={"num_hidden_layers": 1})
    short, short_forwards, cache, tokens = _decode(model, 100)
    assert _history_is(cache, tokens)
    long, long_forwards, cache, tokens = _decode(model, 10_000)
    assert _per_token(short, short_forwards) <= 1, dict(short)
    assert _per_token(short, short_forwards) == _per_token(long, long_forwards), (dict(short), dict(long))
    log = pc.known_log(cache)
    assert log is not None and len(log) == len(tokens)
    assert len(log.store.pending) >= 10_000, "decode steps append to one store, never copy it"
    assert _history_is(cache, tokens)


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_decoding_at_ten_thousand_tokens_pays_what_it_pays_at_the_start(kind):
    """Decode steps at position 10,000 (after a 10,000-token prompt, prefilled in mlx-lm's
    chunks) cost the same calls into the package as at position 40: one for the hybrid, none
    for the dense model. (Ten thousand decode steps of a hybrid or dense model would take half a
    minute of CPU; the mamba test above decodes them, for the recording's own cost.)"""
    if kind == "hybrid":
        model = _hybrid()
    else:
        model = build_tiny_model(DENSE_MODEL_TYPE, seed=1, overrides={"num_hidden_layers": 1})
    start, start_forwards, _, _ = _decode(model, 100)
    late, late_forwards, cache, tokens = _decode(model, 100, prompt=prompt_tokens(10_000, seed=3))
    assert max(getattr(c, "offset", 0) for c in cache) == len(tokens), "the steps ran past position 10,000"
    assert _per_token(start, start_forwards) == _per_token(late, late_forwards), (dict(start), dict(late))
    if kind == "hybrid":
        assert _per_token(late, late_forwards) == 1, dict(late)
        assert _history_is(cache, tokens)
    else:
        assert sum(late.values()) == 0, dict(late)


def test_dense_decoding_pays_nothing():
    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1, overrides={"num_hidden_layers": 1})
    short, short_forwards, _, _ = _decode(model, 100)
    long, long_forwards, _, _ = _decode(model, 400)
    assert sum(short.values()) == 0 and sum(long.values()) == 0, (dict(short), dict(long))


def test_stock_pays_nothing_per_token():
    """The counter against stock mlx-lm (the patch reverted): no call into the package, so the
    one per token above is the recording's."""
    mlx_lm_patches.revert([PATCH])
    try:
        calls, forwards, _, _ = _decode(_hybrid(), 100)
    finally:
        mlx_lm_patches.apply([PATCH])
    assert forwards == 100 and sum(calls.values()) == 0, dict(calls)

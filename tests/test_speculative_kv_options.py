"""Speculative decoding with the cache options of plain decoding (patch ``speculative-kv-options``).

* ``max_kv_size`` windows (``RotatingKVCache(W, keep=4)`` as mlx-lm builds them; a hybrid's
  attention layers with ``hybrid-max-kv-size``): ``speculative_generate_step`` with prompt
  caches built that way gives the tokens and log-probabilities of ``generate_step`` through the
  same kind of caches, with the same ``prefill_step_size`` - prompts shorter and longer than
  the window, a draft that agrees and one that rejects, prefill chunks that cross the window;
  ``stream_generate`` with a draft as without. Hybrids of every recurrent kind and a dense
  control (qwen3, no ``make_cache``). Stock mlx-lm differs past the window (strict xfail).
* ``kv_bits``: refused with a ``ValueError`` naming ``kv_bits`` at the generator's first
  ``next()``, before any token (``stream_generate`` too); nothing is yielded.
"""

import pytest

import mlx_lm_patches
from conftest import xfail_if_affected
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
from mlx_lm_patches.selftest.tiny_models import build_tiny_model
from support.kv_window import hybrids_with_plain_attention, specified_caches


import mlx.core as mx  # noqa: E402

PATCH = "speculative-kv-options"
WINDOW = 24
DENSE = "qwen3"  # no make_cache: make_prompt_cache gives it RotatingKVCache(W, keep=4) in mlx-lm


FAMILIES = hybrids_with_plain_attention()


def _speculate_and_compare(model, draft, prompt, max_tokens=14, num_draft=3, **kwargs):
    reference = greedy(model, prompt, max_tokens=max_tokens, prompt_cache=specified_caches(model, WINDOW), **kwargs)
    got = speculative_greedy(model, draft, prompt, max_tokens=max_tokens, num_draft_tokens=num_draft,
                             prompt_cache=specified_caches(model, WINDOW) + specified_caches(draft, WINDOW),
                             **kwargs)
    return reference.compare(got)


@pytest.mark.family_sweep(FAMILIES)
@pytest.mark.parametrize("model_type", FAMILIES + [DENSE])
def test_speculation_through_windows_equals_generate_step(model_type):
    """A 30-token prompt (the window of 24 is passed inside the prompt) with a rejecting dense
    draft; the dense control also with a 12-token prompt (passed while decoding) and an
    agreeing draft (whole rounds accepted)."""
    model = build_tiny_model(model_type, seed=1)
    cases = [(30, "rejecting dense draft", build_tiny_model(DENSE, seed=7))]
    if model_type == DENSE:
        cases += [(12, "rejecting dense draft", cases[0][2]), (30, "agreeing draft", build_tiny_model(DENSE, seed=1))]
    for prompt_length, label, draft in cases:
        problem = _speculate_and_compare(model, draft, prompt_tokens(prompt_length, seed=3))
        assert problem is None, f"{prompt_length}-token prompt, {label}: {problem}"


@pytest.mark.parametrize("model_type", [t for t in ("nemotron_h",) if t in FAMILIES] + [DENSE])
def test_prefill_chunks_crossing_the_window(model_type):
    """``prefill_step_size=10`` on a 45-token prompt: the prompt is chunked as generate_step
    chunks it, whatever the speculative loop's own prefill does."""
    model = build_tiny_model(model_type, seed=1)
    problem = _speculate_and_compare(model, build_tiny_model(DENSE, seed=7), prompt_tokens(45, seed=4),
                                     prefill_step_size=10)
    assert problem is None, problem


@xfail_if_affected(PATCH, "stock mlx-lm: verify passes mask windows by distance, single steps keep the first positions")
def test_stock_speculation_through_a_window_differs():
    # adaptive drafting off too: its plain rounds are generate_step's own
    mlx_lm_patches.revert([PATCH, "adaptive-drafting"])
    try:
        model = build_tiny_model(DENSE, seed=1)
        problem = _speculate_and_compare(model, build_tiny_model(DENSE, seed=7), prompt_tokens(30, seed=3))
    finally:
        mlx_lm_patches.apply([PATCH, "adaptive-drafting"])
    assert problem is None, problem


def _stream(model, tokenizer, prompt, **kwargs):
    from mlx_lm.generate import stream_generate

    out = []
    for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=10, **kwargs):
        out.append((int(r.token), float(r.logprobs[r.token].item())))
    return out


def test_stream_generate_with_a_draft_equals_it_without(tmp_path):
    from mlx_lm import load
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    main_type = "nemotron_h" if "nemotron_h" in FAMILIES else DENSE
    model, tokenizer = load(str(write_model_folder(tmp_path / "m", build_tiny_model(main_type, seed=1),
                                                   tiny_config(main_type))))
    draft = build_tiny_model(DENSE, seed=7)
    prompt = prompt_tokens(30, seed=3)
    plain = _stream(model, tokenizer, prompt, prompt_cache=specified_caches(model, WINDOW))
    got = _stream(model, tokenizer, prompt, draft_model=draft, num_draft_tokens=3,
                  prompt_cache=specified_caches(model, WINDOW) + specified_caches(draft, WINDOW))
    assert [t for t, _ in got] == [t for t, _ in plain]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, plain)) < 1e-4


def test_stream_generate_keeps_max_kv_size_with_a_draft(tmp_path):
    """``stream_generate(..., max_kv_size=W, draft_model=D)`` (what ``mlx_lm.generate
    --max-kv-size W --draft-model D`` runs) equals ``stream_generate(..., max_kv_size=W)``,
    which past the window differs from unbounded decoding (stock drops W with a draft)."""
    from mlx_lm import load
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    main_type = "qwen3_next" if "qwen3_next" in FAMILIES else DENSE
    model, tokenizer = load(str(write_model_folder(tmp_path / "m", build_tiny_model(main_type, seed=1),
                                                   tiny_config(main_type))))
    prompt = prompt_tokens(20, seed=3)
    windowed = _stream(model, tokenizer, prompt, max_kv_size=WINDOW)
    assert [t for t, _ in windowed] != [t for t, _ in _stream(model, tokenizer, prompt)], "the test cannot fail"
    got = _stream(model, tokenizer, prompt, max_kv_size=WINDOW, draft_model=build_tiny_model(DENSE, seed=7),
                  num_draft_tokens=3)
    assert [t for t, _ in got] == [t for t, _ in windowed]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, windowed)) < 1e-4


@pytest.mark.parametrize("model_type", [t for t in ("qwen3_next",) if t in FAMILIES] + [DENSE])
@pytest.mark.parametrize("quantized_kv_start", [0, 16])
def test_kv_bits_is_refused_before_the_first_token(model_type, quantized_kv_start):
    from mlx_lm.generate import speculative_generate_step

    model, draft = build_tiny_model(model_type, seed=1), build_tiny_model(DENSE, seed=7)
    steps = speculative_generate_step(mx.array(prompt_tokens(20, seed=3)), model, draft, max_tokens=30,
                                      num_draft_tokens=3, kv_bits=4, kv_group_size=16,
                                      quantized_kv_start=quantized_kv_start)
    with pytest.raises(ValueError, match="kv_bits"):
        next(steps)


@pytest.mark.parametrize("model_type", [t for t in ("qwen3_next",) if t in FAMILIES] + [DENSE])
def test_kv_bits_below_the_conversion_step_runs_as_stock(model_type):
    """``kv_bits`` with ``quantized_kv_start`` beyond prompt + max_tokens + a verify pass: no
    cache converts, the loop is exact (as stock) and is not refused."""
    model, draft = build_tiny_model(model_type, seed=1), build_tiny_model(DENSE, seed=7)
    prompt = prompt_tokens(20, seed=3)
    settings = dict(kv_bits=4, kv_group_size=16, quantized_kv_start=20 + 14 + 3 + 1)
    reference = greedy(model, prompt, max_tokens=14, **settings)
    got = speculative_greedy(model, draft, prompt, max_tokens=14, num_draft_tokens=3, **settings)
    assert reference.compare(got) is None, reference.compare(got)

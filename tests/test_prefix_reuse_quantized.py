"""Hybrid prefix reuse and quantized KV caches: ``mlx_lm.server --kv-bits 8 --quantized-kv-start 0``
(releases whose server has ``--kv-bits``) with a qwen3_next model folder, and the same two
requests in process through an ``LRUPromptCache`` and ``generate_step`` with ``kv_bits``.

A stored prompt then holds quantized attention caches: keys and values rounded once their
prefill chunk was done. A request diverging inside it, prefilled on a restored state, attends
to those rounded values where a cold prefill of the same request attends to exact ones (it
quantizes after its own chunk): the answer's log-probabilities differ by about 1e-3. So the
package declines such restores (exact or refuse): the request is prefilled cold, as stock mlx-lm
does for hybrids, and its answer equals a cold prefill with the same ``kv_bits`` - same tokens,
log-probabilities within 1e-4 - computed in this process. In process, a restore forced through
(the decline switched off) shows the difference the decline avoids.
"""

import re

import pytest

from conftest import clean_env
from support.chat_reference import chat_prompt
from mlx_lm_patches.selftest.model_folder import write_model_folder
from support.server import serve, server_flags
from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config


MODEL = "qwen3_next"
SIZES = {"head_dim": 32}  # quantized in groups of 32 along the head dimension
KV = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
STEP = 256
MAX_TOKENS = 8
DOCUMENT = " ".join(f"Fact {i} is about item{i % 13}." for i in range(40))
FIRST = [{"role": "user", "content": DOCUMENT + " Final question: alpha?"}]
SECOND = [{"role": "user", "content": DOCUMENT + " Final question: omega?"}]
REUSED = re.compile(r"prompt cache: (\d+) of (\d+) tokens reused")
DECLINED = "no kept state reused (KV caches quantized"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = dict(tiny_config(MODEL), **SIZES)
    return write_model_folder(tmp_path_factory.mktemp("quantized-prefix") / MODEL,
                              build_tiny_model(MODEL, seed=1, overrides=SIZES), config)


def _cold(folder, messages):
    """Greedy answer, cold prefill, the server's prefill step and KV quantization: token ids
    and their log-probabilities (stopping at the end-of-sequence token as the server does)."""
    import mlx.core as mx
    import mlx_lm_patches
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    mlx_lm_patches.apply()
    model, tokenizer = load(str(folder))
    tokens, logprobs = [], []
    prompt = mx.array(chat_prompt(tokenizer, messages))
    for response in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, prefill_step_size=STEP, **KV):
        if response.finish_reason == "stop":
            break
        tokens.append(int(response.token))
        logprobs.append(float(response.logprobs[response.token].item()))
    return tokens, logprobs


def _ask(server, messages):
    body = server.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True})
    content = (body["choices"][0].get("logprobs") or {}).get("content") or []
    return [int(c["id"]) for c in content], [float(c["logprob"]) for c in content]


def _in_process(store_tokens=64, tail=16):
    """Request A decoded with quantized KV caches and stored; request B diverging after
    ``store_tokens`` fetched and decoded from what it gets: ``(reused, B's tokens and
    log-probabilities, cold B's)``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import lru_prompt_cache_class

    model = build_tiny_model(MODEL, seed=1, overrides=SIZES)

    def run(prompt, cache):
        out = []
        for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=6, prompt_cache=cache,
                                             prefill_step_size=STEP, **KV):
            out.append((int(token), logprobs[int(token)].item()))
        return out

    shared = prompt_tokens(store_tokens, seed=5)
    a, b = shared + prompt_tokens(tail, seed=6), shared + prompt_tokens(tail, seed=8)
    store, cache = lru_prompt_cache_class()(), make_prompt_cache(model)
    first = run(a, cache)
    try:
        store.insert_cache("model", a + [t for t, _ in first], cache)
    except NameError as exc:  # 0.31.1: QuantizedKVCache.nbytes calls tree_reduce, never imported
        pytest.skip(f"this mlx-lm's LRUPromptCache cannot store quantized caches ({exc})")
    fetched, rest = store.fetch_nearest_cache("model", b)
    warm = run(list(rest), fetched if fetched is not None else make_prompt_cache(model))
    return len(b) - len(rest), warm, run(b, make_prompt_cache(model))


def _memo():
    """What prompt-cache-prefix-reuse has noted in this process (its patcher's memo)."""
    from mlx_lm_patches.engine import core

    core.get()
    return core.memo("prompt-cache-prefix-reuse") or {}


def _differ(warm, cold):
    return [t for t, _ in warm] != [t for t, _ in cold] or max(abs(w - c) for (_, w), (_, c) in zip(warm, cold)) > 1e-4


def test_in_process_a_quantized_prompt_is_not_reused():
    from mlx_lm_patches.mechanisms.prefix_reuse.settings import QUANTIZED_FROM

    reused, warm, cold = _in_process()
    assert reused == 0
    assert not _differ(warm, cold)
    assert _memo()[QUANTIZED_FROM] == 0


def test_in_process_a_restore_on_quantized_caches_would_not_be_exact(monkeypatch):
    """Why the restore is declined: forced through, it reuses the stored prefix and B's answer
    differs from a cold prefill by more than 1e-4."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.prefix_reuse import restore

    monkeypatch.setattr(pc, "quantized_prefill", lambda memo, length: False)
    monkeypatch.setattr(restore, "holds_quantized_kv", lambda caches: False)
    reused, warm, cold = _in_process()
    assert reused == 64
    assert _differ(warm, cold)


@pytest.mark.subprocess
@pytest.mark.release_only
@pytest.mark.skipif("--kv-bits" not in server_flags(), reason="this mlx_lm.server has no --kv-bits")
def test_a_quantized_prompt_is_not_reused_and_the_answer_equals_a_cold_prefill(folder):
    args = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0", "--prefill-step-size", str(STEP)]
    with serve(folder, *args, env=clean_env(MLX_LM_PATCHES_DEBUG="1")) as server:
        _ask(server, FIRST)
        tokens, logprobs = _ask(server, SECOND)
        log = server.log()
    assert DECLINED in log, "the package saw a stored hybrid prompt and declined it"
    assert not REUSED.findall(log)
    cold_tokens, cold_logprobs = _cold(folder, SECOND)
    assert tokens == cold_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, cold_logprobs)) <= 1e-4, (logprobs, cold_logprobs)

"""``mlx_lm.server --draft-model`` over HTTP: a conversation whose second turn carries the first
turn's answer. The server stores a generation's prompt cache under ``prompt + generated tokens``
and continues the next request from it; with a draft model that cache must hold exactly those
tokens (``speculative-cache-sync``), or turn 2 is decoded without part of its history. Both
turns must equal greedy decoding of their prompts with a cold prefill, computed in this process.
Dense main and draft models (the bug is not specific to hybrids); stock mlx-lm is a strict xfail
where the matrix says affected.

Chat completions from mlx-lm 0.30.0; before, with transformers 5, the stock server cannot
tokenize chat requests at all (its ``apply_chat_template`` returns a ``BatchEncoding``), so
there the two turns are text completions: turn 2's prompt is turn 1's prompt, its answer and
more text.
"""

import pytest

from conftest import clean_env, xfail_if_affected
from support.chat_reference import chat_prompt, chat_reference, token_reference
from mlx_lm_patches.selftest.model_folder import write_model_folder
from support.server import serve
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model, tiny_config

pytestmark = [pytest.mark.subprocess, pytest.mark.release_only]

PATCH = "speculative-cache-sync"
MAX_TOKENS = 8
FOLLOW_UP = " Why is that so?"
CANDIDATES = [
    "the quick brown fox", "Hello! How can I help you today?", "Once upon a time",
    "What is the capital of France?", "Tell me a story.", "Why do birds sing?", "Good evening, everyone.",
    "Please write a short poem about the sea.", "The meeting is on Monday at 10 am.", "hi",
]


def _chat_requests():
    from packaging.version import Version

    from mlx_lm_patches.engine import versions

    return versions.mlx_lm().parsed >= Version("0.30.0")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative-server")
    return {name: write_model_folder(root / name, build_tiny_model(DENSE_MODEL_TYPE, seed=seed),
                                     tiny_config(DENSE_MODEL_TYPE))
            for name, seed in (("main", 1), ("draft", 5))}


@pytest.fixture(scope="module")
def conversation(folders):
    """Two requests (JSON bodies) and their cold references. Turn 1's answer must re-tokenize to
    the tokens generated (random weights often produce token sequences that do not), so that
    turn 2's prompt starts with everything the server stored: searched among candidates."""
    from mlx_lm import load

    model, tokenizer = load(str(folders["main"]))
    for question in CANDIDATES:
        if _chat_requests():
            first = [{"role": "user", "content": question}]
            ref1 = chat_reference(model, tokenizer, first, MAX_TOKENS)
            second = first + [{"role": "assistant", "content": ref1.text},
                              {"role": "user", "content": FOLLOW_UP.strip()}]
            prompt2 = chat_prompt(tokenizer, second)
            bodies = [{"messages": first}, {"messages": second}]
        else:
            ref1 = token_reference(model, tokenizer, tokenizer.encode(question), MAX_TOKENS)
            text2 = question + ref1.text + FOLLOW_UP
            prompt2 = tokenizer.encode(text2)
            bodies = [{"prompt": question}, {"prompt": text2}]
        if prompt2[:len(ref1.fed)] == ref1.fed and len(prompt2) > len(ref1.fed):
            ref2 = token_reference(model, tokenizer, prompt2, MAX_TOKENS)
            return list(zip(bodies, (ref1, ref2)))
    raise AssertionError("no candidate's answer re-tokenizes to the generated tokens: add candidates")


def _answer(server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    reply = server.post(path, dict(body, model="default_model", max_tokens=MAX_TOKENS, temperature=0.0))
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "messages" in body else choice["text"]
    cached = ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return text, choice["finish_reason"], cached


@pytest.mark.parametrize("patches", ["on", pytest.param("off", marks=xfail_if_affected(PATCH))])
def test_second_turn_from_the_stored_cache_equals_the_cold_reference(folders, conversation, patches):
    env = clean_env(MLX_LM_PATCHES_STRICT="1") if patches == "on" else clean_env(MLX_LM_PATCHES="0")
    with serve(folders["main"], "--draft-model", folders["draft"], "--num-draft-tokens", "3",
               env=env) as server:
        answers = [_answer(server, body) for body, _ in conversation]
    (ref1, ref2) = (ref for _, ref in conversation)
    text1, finish1, _ = answers[0]
    assert (text1, finish1) == (ref1.text, ref1.finish_reason), "turn 1"
    text2, finish2, cached = answers[1]
    if cached is not None:  # reported from 0.31.1: turn 2 continued turn 1's stored cache
        assert cached >= len(ref1.fed), f"turn 2 reused {cached} tokens, turn 1 stored {len(ref1.fed)}"
    assert (text2, finish2) == (ref2.text, ref2.finish_reason), "turn 2 (continues turn 1's cache)"

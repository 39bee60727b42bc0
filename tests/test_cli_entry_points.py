"""The command-line entry points as users run them, with the package installed and no code
change: ``mlx_lm.generate`` and ``mlx_lm.chat`` on a hybrid model folder (nemotron_h, local
tokenizer, ChatML chat template) give the reference answers; bad input - a config that claims
an MTP head without its tensors, a draft with another vocabulary, an unknown patch id in
``MLX_LM_PATCHES_DISABLE`` - gives a clear message in bounded time, from ``mlx_lm.generate`` and
from ``mlx_lm.server``.

References are computed in this process: greedy decoding of the chat-templated prompt, single
sequence, cold prefill (``chat_reference``). ``mlx_lm.chat`` keeps one prompt cache for the
whole conversation and templates only the new message each turn, so turn k's reference is cold
greedy decoding of every token fed so far plus the new message's template.
"""

import os
import subprocess
import sys
import time

import pytest

from conftest import clean_env, xfail_if_affected
from support.chat_reference import chat_prompt, chat_reference, token_reference
from mlx_lm_patches.selftest.model_folder import write_model_folder
from support.server import ServerExited, serve
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model, tiny_config

pytestmark = [pytest.mark.subprocess, pytest.mark.release_only]

MAIN = "nemotron_h"
MAX_TOKENS = 12
TIMEOUT = 300  # every subprocess and request is bounded


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {
        "main": write_model_folder(root / "main", build_tiny_model(MAIN, seed=1), tiny_config(MAIN)),
        "hybrid-draft": write_model_folder(root / "hybrid-draft", build_tiny_model("qwen3_next", seed=7),
                                           tiny_config("qwen3_next")),
        # Same model vocabulary (256 rows), but a tokenizer of 128 tokens: another vocabulary.
        "other-vocab-draft": write_model_folder(root / "other-vocab", build_tiny_model(DENSE_MODEL_TYPE, seed=2),
                                                tiny_config(DENSE_MODEL_TYPE), vocab_size=128),
        # config.json declares one MTP layer; the checkpoint has no mtp.* tensors.
        "mtp-claimed": write_model_folder(root / "mtp-claimed", build_tiny_model("qwen3_next", seed=1),
                                          dict(tiny_config("qwen3_next"), num_nextn_predict_layers=1)),
    }


@pytest.fixture(scope="module")
def loaded(folders):
    import mlx_lm_patches
    from mlx_lm import load

    mlx_lm_patches.apply()  # the reference path is untouched; this only makes 0.28.4 tokenize
    return load(str(folders["main"]))


def _script(name):
    return os.path.join(os.path.dirname(sys.executable), name)


def _run(name, *args, stdin=None, env=None):
    proc = subprocess.run([_script(name), *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT, env=clean_env(**(env or {})), cwd="/")
    return proc


# -- mlx_lm.generate ------------------------------------------------------------------------------
def test_generate_equals_the_reference(folders, loaded):
    """``mlx_lm.generate --model M --prompt P`` (chat template applied, greedy) prints the
    reference answer."""
    prompt = "What is the capital of France?"
    proc = _run("mlx_lm.generate", "--model", folders["main"], "--prompt", prompt,
                "--max-tokens", MAX_TOKENS, "--verbose", "False")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = chat_reference(*loaded, [{"role": "user", "content": prompt}], MAX_TOKENS)
    assert ref.text.strip()
    assert proc.stdout == ref.text + "\n"


def test_generate_max_kv_size_bounds_the_hybrid(folders, loaded):
    """``mlx_lm.generate --max-kv-size W`` on the hybrid, without and with a draft model: the
    answer of mlx-lm's rotating window (attention layers ``RotatingKVCache(W, keep=4)``, recurrent
    layers as the model makes them), which past the window differs from the unbounded answer
    (patches ``hybrid-max-kv-size``, ``speculative-kv-options``)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from support.kv_window import specified_caches

    model, tokenizer = loaded
    prompt = "What is the capital of France?"
    ids = chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    window = len(ids) + 3

    def answer(**kwargs):
        return "".join(r.text for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=MAX_TOKENS,
                                                       **kwargs))

    expected = answer(prompt_cache=specified_caches(model, window))
    assert expected != answer(), "the window changes nothing: the test cannot fail"
    for draft in ((), ("--draft-model", folders["hybrid-draft"], "--num-draft-tokens", 3)):
        # with a draft: the window kept and speculation through it exact (speculative-kv-options)
        proc = _run("mlx_lm.generate", "--model", folders["main"], "--prompt", prompt, "--max-kv-size", window,
                    "--max-tokens", MAX_TOKENS, "--verbose", "False", *draft)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == expected + "\n", f"draft {draft}"


# -- mlx_lm.cache_prompt, then mlx_lm.generate --prompt-cache-file with a draft ------------------
SYSTEM = "You are a terse assistant. Answer in one word. " * 3


@pytest.fixture(scope="module")
def cached_prompt(folders, tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt-cache") / "system.safetensors"
    proc = _run("mlx_lm.cache_prompt", "--model", folders["main"], "--prompt", SYSTEM, "--prompt-cache-file", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def _generate_on_file(folders, path, *draft, env=None):
    return _run("mlx_lm.generate", "--model", folders["main"], "--prompt-cache-file", path, "--prompt",
                "What is the capital of France?", "--max-tokens", MAX_TOKENS, "--verbose", "False", *draft, env=env)


@pytest.fixture(scope="module")
def plain_on_file(folders, cached_prompt):
    """The answer on the file without a draft (no draft: the patch changes nothing there)."""
    plain = _generate_on_file(folders, cached_prompt)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.strip()
    return plain.stdout


def test_prompt_cache_file_with_a_draft_equals_it_without(folders, cached_prompt, plain_on_file):
    """``mlx_lm.generate --prompt-cache-file F --draft-model D`` prints what it prints without
    the draft (the draft's cache rebuilt from the tokens F records: patch
    ``prompt-cache-file-draft``)."""
    drafted = _generate_on_file(folders, cached_prompt, "--draft-model", folders["hybrid-draft"],
                                "--num-draft-tokens", 3)
    assert drafted.returncode == 0, drafted.stderr[-3000:]
    assert drafted.stdout == plain_on_file


@xfail_if_affected("prompt-cache-file-draft", "stock mlx-lm: a prompt-cache file holds no draft caches")
def test_stock_prompt_cache_file_with_a_draft(folders, cached_prompt, plain_on_file):
    drafted = _generate_on_file(folders, cached_prompt, "--draft-model", folders["hybrid-draft"],
                                env={"MLX_LM_PATCHES_DISABLE": "prompt-cache-file-draft"})
    assert drafted.returncode == 0, drafted.stderr[-3000:]
    assert drafted.stdout == plain_on_file


# -- mlx_lm.chat ----------------------------------------------------------------------------------
def test_chat_conversation_equals_the_reference(folders, loaded):
    """``mlx_lm.chat`` driven through stdin (it reads lines with ``input()``; 0.32 draws a
    prompt line around it): two turns, then ``q``. Each answer is streamed as one line of
    stdout, equal to the reference of everything the conversation fed so far."""
    model, tokenizer = loaded
    questions = ["the quick brown fox", "What is the capital of France?"]
    proc = _run("mlx_lm.chat", "--model", folders["main"], "--max-tokens", MAX_TOKENS,
                stdin="".join(q + "\n" for q in questions) + "q\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fed, position = [], 0
    for question in questions:
        prompt = fed + chat_prompt(tokenizer, [{"role": "user", "content": question}])
        ref = token_reference(model, tokenizer, prompt, MAX_TOKENS)
        assert ref.text.strip()
        found = proc.stdout.find(ref.text + "\n", position)
        assert found >= 0, f"turn {question!r}: {ref.text!r} not in the output after position {position}:\n{proc.stdout}"
        position = found + len(ref.text)
        fed = ref.fed


# -- bad input: an MTP head the config claims but the checkpoint lacks ---------------------------
MTP_MISSING = "config declares 1 MTP layer(s) but the checkpoint has no mtp.* tensors"


def test_generate_draft_model_mtp_without_head_is_a_clear_error(folders):
    started = time.monotonic()
    proc = _run("mlx_lm.generate", "--model", folders["mtp-claimed"], "--draft-model", "mtp",
                "--prompt", "hi", "--max-tokens", 4, "--verbose", "False")
    assert proc.returncode != 0
    assert MTP_MISSING in proc.stderr
    assert proc.stdout == ""
    assert time.monotonic() - started < 120


def _server_error(folder, *args, env=None):
    """Start ``mlx_lm.server`` and send one chat request; return what a user sees: the
    error body, or the server's log if it exited before answering. Bounded in time."""
    try:
        with serve(folder, *args, env=clean_env(**(env or {})), ready_timeout=120) as server:
            status, body = server.request("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            }, timeout=60)
            assert status != 200, body
            return body.decode(errors="replace"), server.log()
    except ServerExited as exited:  # loaded before serving (<= 0.31.2), or /health 503 (0.32+)
        return "", exited.log


def test_server_draft_model_mtp_without_head_is_a_clear_error(folders):
    """Before 0.31.3 the server loads the model first and exits with the error. 0.31.3 loads
    it in the generation thread: stock then never answers (``server-thread-death``); with the
    package the request gets the error. 0.32.x answers "generation thread died" and logs it."""
    body, log = _server_error(folders["mtp-claimed"], "--draft-model", "mtp")
    assert MTP_MISSING in body or MTP_MISSING in log, (body, log[-3000:])


# -- bad input: a draft model with another vocabulary ---------------------------------------------
def test_generate_draft_with_another_vocabulary_is_a_clear_error(folders):
    proc = _run("mlx_lm.generate", "--model", folders["main"], "--draft-model", folders["other-vocab-draft"],
                "--prompt", "hi", "--max-tokens", 4, "--verbose", "False")
    assert proc.returncode != 0
    assert "Draft model tokenizer does not match model tokenizer" in proc.stderr


def test_server_draft_with_another_vocabulary_warns_and_stays_exact(folders, loaded):
    """``mlx_lm.server`` only warns about a draft with another vocabulary (every release): the
    main model verifies every drafted token, so answers stay the main model's greedy answers
    (an unknown id in ``MLX_LM_PATCHES_DISABLE`` is named too, and ignored)."""
    env = {"MLX_LM_PATCHES_DISABLE": "recurrent_rollback"}
    with serve(folders["main"], "--draft-model", folders["other-vocab-draft"], env=clean_env(**env)) as server:
        messages = [{"role": "user", "content": "hello there"}]
        body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0},
                           timeout=120)
        log = server.log()
    assert "Draft model tokenizer does not match model tokenizer" in log
    assert "'recurrent_rollback' (did you mean 'recurrent-rollback'?)" in log
    assert body["choices"][0]["message"]["content"] == chat_reference(*loaded, messages, 8).text


# -- bad input: an unknown patch id ----------------------------------------------------------------
def test_unknown_patch_id_is_named_and_ignored(folders, loaded):
    """A typo in ``MLX_LM_PATCHES_DISABLE`` names the id, suggests the real one, and disables
    nothing: speculative decoding with a hybrid draft still equals the reference."""
    proc = _run("mlx_lm.generate", "--model", folders["main"], "--draft-model", folders["hybrid-draft"],
                "--prompt", "the quick brown fox", "--max-tokens", MAX_TOKENS, "--verbose", "False",
                env={"MLX_LM_PATCHES_DISABLE": "recurrent_rollback"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("MLX_LM_PATCHES_DISABLE names unknown patch id(s) 'recurrent_rollback' "
            "(did you mean 'recurrent-rollback'?)") in proc.stderr
    assert "ignored" in proc.stderr
    ref = chat_reference(*loaded, [{"role": "user", "content": "the quick brown fox"}], MAX_TOKENS)
    assert proc.stdout == ref.text + "\n"

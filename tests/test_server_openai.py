"""``mlx_lm.server`` where users run it: the installed package, no code change, a hybrid model
folder on disk (local tokenizer, ChatML chat template), the real ``openai`` client on loopback.

Every answer is compared with the reference path computed in this process: greedy decoding of
the same chat-templated prompt, single sequence, cold prefill, no draft (``chat_reference``).
The model is nemotron_h: stock mlx-lm's batched decoding of it is silently wrong for prompts
of different lengths (``batch-prefill-per-row``) and its speculative decoding is wrong or
refused (``recurrent-rollback``, ``speculative-cache-split``). One server per module
configuration serves all its tests; ``max_tokens`` stays small.

Release differences handled here (each checked in the installed sources):

* token ids and log-probabilities of a non-streamed answer: ``logprobs.tokens`` /
  ``logprobs.token_logprobs`` by default before 0.30.6; ``logprobs.content[i].id`` /
  ``.logprob`` with ``logprobs: true`` from 0.30.6 (before, ``logprobs`` is an int and any
  value > 0 makes the request unbatchable);
* ``usage.prompt_tokens_details.cached_tokens`` from 0.31.1;
* 0.28.4 sends requests with the default ``repetition_penalty`` (1.0) down the one-at-a-time
  path; ``repetition_penalty: 0`` makes them batchable (the concurrent tests send it).
"""

import concurrent.futures
import json
import threading

import pytest

from conftest import clean_env
from support.chat_reference import chat_reference
from mlx_lm_patches.selftest.model_folder import write_model_folder
from support.server import serve
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model, tiny_config

pytestmark = [pytest.mark.subprocess, pytest.mark.release_only]

MAIN = "nemotron_h"
HYBRID_DRAFT = "qwen3_next"
MAX_TOKENS = 10
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and kindly. " * 3}
QUESTIONS = [
    "the quick brown fox",
    "Hello! How can I help you today?",
    "What is the capital of France? The capital",
    "a",
    "Every morning the cat walked down to the river to watch the fish.",
    "two plus two",
]


def _version():
    from mlx_lm_patches.engine import versions

    return versions.mlx_lm().parsed


def _at_least(text):
    from packaging.version import Version

    return _version() >= Version(text)


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    return {
        "main": write_model_folder(root / "main", build_tiny_model(MAIN, seed=1), tiny_config(MAIN)),
        "hybrid-draft": write_model_folder(root / "hybrid-draft", build_tiny_model(HYBRID_DRAFT, seed=7),
                                           tiny_config(HYBRID_DRAFT)),
        "dense-draft": write_model_folder(root / "dense-draft", build_tiny_model(DENSE_MODEL_TYPE, seed=2),
                                          tiny_config(DENSE_MODEL_TYPE)),
    }


@pytest.fixture(scope="module")
def reference(folders):
    """``reference(messages, max_tokens)`` -> :class:`Reference` (memoized)."""
    import mlx_lm_patches
    from mlx_lm import load

    mlx_lm_patches.apply()  # the reference path is untouched; this only makes 0.28.4 tokenize
    model, tokenizer = load(str(folders["main"]))
    memo = {}
    lock = threading.Lock()

    def compute(messages, max_tokens=MAX_TOKENS):
        key = (json.dumps(messages), max_tokens)
        with lock:
            if key not in memo:
                memo[key] = chat_reference(model, tokenizer, messages, max_tokens)
            return memo[key]

    compute.tokenizer = tokenizer
    return compute


@pytest.fixture(scope="module")
def server(folders):
    with serve(folders["main"], env=clean_env()) as running:
        yield running


@pytest.fixture(scope="module")
def draft_server(folders):
    with serve(folders["main"], "--draft-model", folders["hybrid-draft"], "--num-draft-tokens", "3",
               env=clean_env(MLX_LM_PATCHES_DEBUG="1")) as running:
        yield running


# -- helpers --------------------------------------------------------------------------------------
def _messages(question, system=True, history=()):
    return ([SYSTEM] if system else []) + list(history) + [{"role": "user", "content": question}]


def _extra(batchable=False):
    """Request fields beyond the OpenAI ones: token ids in the answer, and batchability on 0.28.4."""
    extra = {}
    if _at_least("0.30.6"):
        extra["logprobs"] = True  # id + logprob per token; does not affect batching
    if batchable:
        extra["repetition_penalty"] = 0
    return extra


def _tokens_and_logprobs(body):
    """Generated token ids and their log-probabilities from a raw non-streamed answer."""
    logprobs = body["choices"][0].get("logprobs") or {}
    if "content" in logprobs:
        items = logprobs["content"]
        return [i["id"] for i in items], [i["logprob"] for i in items]
    return list(logprobs.get("tokens", [])), list(logprobs.get("token_logprobs", []))


def _chat(client, messages, max_tokens=MAX_TOKENS, **extra):
    """A non-streamed chat completion: (parsed openai object, raw JSON body)."""
    raw = client.chat.completions.with_raw_response.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra)
    return raw.parse(), json.loads(raw.http_response.text)


def _stream(client, messages, max_tokens=MAX_TOKENS, **extra):
    """A streamed chat completion: (text, finish_reason, usage or None)."""
    chunks = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    text, finish, usage = "", None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def _assert_answer(reply, body, ref, what):
    assert reply.choices[0].message.content == ref.text, f"{what}: text differs from the reference"
    assert reply.choices[0].finish_reason == ref.finish_reason, what
    assert reply.usage.prompt_tokens == len(ref.prompt), what
    tokens, logprobs = _tokens_and_logprobs(body)
    if ref.eos is not None and tokens and tokens[-1] == ref.eos:
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    assert tokens == ref.tokens, f"{what}: tokens {tokens} != reference {ref.tokens}"
    worst = max((abs(a - b) for a, b in zip(logprobs, ref.logprobs)), default=0.0)
    assert worst <= 1e-4, f"{what}: log-probabilities differ by {worst:.3g}"


def _cached_tokens(usage):
    details = getattr(usage, "prompt_tokens_details", None)
    return None if details is None else details.cached_tokens


# -- one request at a time ------------------------------------------------------------------------
def test_chat_completion_equals_the_reference(server, reference):
    client = server.client()
    for question in QUESTIONS[:3]:
        messages = _messages(question)
        reply, body = _chat(client, messages, **_extra())
        _assert_answer(reply, body, reference(messages), question)
        assert body["object"] == "chat.completion"


def test_streamed_chat_completion_equals_the_reference(server, reference):
    client = server.client()
    for question in QUESTIONS[3:5]:
        messages = _messages(question, system=False)
        text, finish, usage = _stream(client, messages)
        ref = reference(messages)
        assert (text, finish) == (ref.text, ref.finish_reason), question
        assert usage is not None and usage.prompt_tokens == len(ref.prompt)
        assert usage.completion_tokens in (len(ref.tokens), len(ref.fed) - len(ref.prompt))


# -- concurrent requests: the batched path --------------------------------------------------------
def _concurrent(server, jobs, workers=8):
    """Run ``jobs`` (``(kind, messages)``) from ``workers`` threads at once; results in order."""
    barrier = threading.Barrier(min(workers, len(jobs)))

    def run(job):
        kind, messages = job
        client = server.client()
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        if kind == "stream":
            return _stream(client, messages, **_extra(batchable=True))
        return _chat(client, messages, **_extra(batchable=True))

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, jobs))


def test_concurrent_requests_equal_sequential_references(server, reference):
    """Eight requests at once (shared system prompt or none, different lengths, streamed or not):
    the server decodes them in one batch; every answer equals its own cold reference."""
    jobs = [("stream" if i % 3 == 2 else "chat", _messages(q, system=i % 2 == 0))
            for i, q in enumerate(QUESTIONS + QUESTIONS[:2])]
    results = _concurrent(server, jobs)
    for (kind, messages), got in zip(jobs, results):
        ref = reference(messages)
        what = f"{kind} {messages[-1]['content']!r}"
        if kind == "stream":
            assert got[:2] == (ref.text, ref.finish_reason), what
        else:
            _assert_answer(*got, ref, what)


# -- conversations: prompt-cache reuse ------------------------------------------------------------
CANDIDATES = QUESTIONS + [
    "What time is it?", "Tell me a story.", "Hello", "Good evening, everyone.", "Why do birds sing?", "hi",
    "Please write a short poem about the sea.", "The meeting is on Monday at 10 am.", "Keep going.",
]


def _continuable(reference, follow_up):
    """A first question (no system prompt) whose answer re-tokenizes to the generated tokens,
    so that the second turn's prompt starts with everything the first turn fed: the only way a
    hybrid's stored cache (not trimmable) is reused whole. Random weights often produce token
    sequences that re-tokenize differently, and which ones do depends on the mlx release, so
    the question is searched for (in references computed here)."""
    for question in CANDIDATES:
        first = _messages(question, system=False)
        ref1 = reference(first)
        second = _messages(follow_up, system=False, history=[first[-1], {"role": "assistant", "content": ref1.text}])
        if reference(second).prompt[:len(ref1.fed)] == ref1.fed:
            return first, second
    raise AssertionError("no candidate question re-tokenizes its answer exactly: add candidates")


def _conversation(client, reference, follow_up, **extra):
    """Turn 1, then turn 2 carrying turn 1's answer (a conversation whose turn 2 extends all of
    turn 1); both checked against cold references. Returns (ref 1, ref 2, turn 2 usage)."""
    first, second = _continuable(reference, follow_up)
    reply, body = _chat(client, first, **extra)
    ref1 = reference(first)
    _assert_answer(reply, body, ref1, "turn 1")
    reply, body = _chat(client, second, **extra)
    ref2 = reference(second)
    _assert_answer(reply, body, ref2, "turn 2")
    return ref1, ref2, reply.usage


def test_multi_turn_conversation_reuses_the_prompt_cache(server, reference):
    """Turn 2 extends turn 1's prompt and answer: the server continues turn 1's stored cache (a
    hybrid cache cannot be trimmed, so only an exact stored prefix can be reused) and the answer
    still equals the cold reference. From 0.31.1 the reuse is reported (``cached_tokens``): all
    of turn 1. A repeated request reuses all but its last prompt token."""
    client = server.client()
    ref1, ref2, usage = _conversation(client, reference, "And what about tomorrow?", **_extra())
    cached = _cached_tokens(usage)
    if not _at_least("0.31.1"):
        assert cached is None  # not reported before 0.31.1
        return
    assert len(ref1.fed) <= cached < len(ref2.prompt)
    messages = _messages(QUESTIONS[2])
    for _ in range(2):
        reply, body = _chat(client, messages, **_extra())
    _assert_answer(reply, body, reference(messages), "repeated request")
    assert _cached_tokens(reply.usage) == len(reference(messages).prompt) - 1


# -- speculative decoding with a draft model ------------------------------------------------------
def test_draft_model_server_equals_the_reference(draft_server, reference):
    """``--draft-model`` with a hybrid draft (qwen3_next) for a hybrid main model (nemotron_h):
    non-streamed and streamed answers equal the main model's cold greedy answers."""
    client = draft_server.client()
    for question in QUESTIONS[:2]:
        messages = _messages(question)
        _assert_answer(*_chat(client, messages, **_extra()), reference(messages), question)
    messages = _messages(QUESTIONS[4], system=False)
    ref = reference(messages)
    assert _stream(client, messages)[:2] == (ref.text, ref.finish_reason)


def test_draft_model_conversation_continues_exactly(draft_server, reference):
    """A second turn that extends the first turn's prompt and answer reuses the stored cache
    (main and draft caches) and must equal its cold reference (stock leaves the last generated
    token(s) out of that cache: ``speculative-cache-sync``)."""
    _conversation(draft_server.client(), reference, "Why?", **_extra())


def test_dense_draft_selected_per_request(draft_server, folders, reference):
    """A request's ``draft_model`` field replaces the server's draft (the server reloads): a
    dense draft (llama) gives the same answers."""
    client = draft_server.client()
    for question in QUESTIONS[2:4]:
        messages = _messages(question)
        _assert_answer(*_chat(client, messages, draft_model=str(folders["dense-draft"]), **_extra()),
                       reference(messages), question)


def test_concurrent_requests_with_a_draft_model(draft_server, reference):
    """Speculative requests sent at once all finish, exact: from 0.31.3 decoded together
    (``batch-speculative-decoding``: the server's generator speculates with its draft model),
    before one at a time."""
    jobs = [("chat", _messages(q, system=i % 2 == 0)) for i, q in enumerate(QUESTIONS[:4])]
    results = _concurrent(draft_server, jobs, workers=4)
    for (_, messages), got in zip(jobs, results):
        _assert_answer(*got, reference(messages), messages[-1]["content"])
    batched = "BatchGenerator speculates with a draft model" in draft_server.log()
    assert batched == _at_least("0.31.3"), draft_server.log_tail()


def test_speculative_requests_arriving_while_others_decode(draft_server, reference):
    """Requests of different lengths and ``max_tokens`` arriving one after another while the
    earlier ones decode (streamed and not): every answer equals its cold reference."""
    import time

    jobs = [(i, _messages(q, system=i % 2 == 1)) for i, q in enumerate(QUESTIONS)]

    def run(job):
        i, messages = job
        time.sleep(0.15 * i)
        client = draft_server.client()
        if i % 3 == 2:
            return _stream(client, messages, max_tokens=6 + i, **_extra(batchable=True))
        return _chat(client, messages, max_tokens=6 + i, **_extra(batchable=True))

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (i, messages), got in zip(jobs, results):
        ref = reference(messages, max_tokens=6 + i)
        if i % 3 == 2:
            assert got[:2] == (ref.text, ref.finish_reason), messages[-1]["content"]
        else:
            _assert_answer(*got, ref, messages[-1]["content"])



# -- a bounded load: shared and diverging prefixes ------------------------------------------------
LOAD_REQUESTS = 32


def test_load_with_shared_and_diverging_prefixes(server, reference):
    """32 requests at concurrency 8 (the full 200 are ``benchmarks/server_load.py``): shared
    system prompts, a shared document diverging in the last message, second turns, repeats;
    a third streamed. No errors, nothing lost, every answer equal to its cold reference."""
    from support.server_load import run_load, workload

    jobs = workload(LOAD_REQUESTS, lambda messages: reference(messages, 8).text, seed=1)
    result = run_load(server, jobs, concurrency=8, max_tokens=8, extra=_extra(batchable=True), timeout=120)
    assert not result.errors, [a.error for a in result.errors[:3]]
    assert result.lost == 0 and len(result.answers) == LOAD_REQUESTS
    wrong = [(a.index, a.text, reference(jobs[a.index], 8).text) for a in result.answers
             if (a.text, a.finish_reason) != (reference(jobs[a.index], 8).text, reference(jobs[a.index], 8).finish_reason)]
    assert not wrong, f"{len(wrong)} answers differ from their references, e.g. {wrong[:3]}"

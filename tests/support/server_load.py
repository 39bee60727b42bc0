"""A bounded load on ``mlx_lm.server``: many chat requests with shared and diverging prefixes,
sent from a few threads at once, each answer checked against its cold reference.

:func:`workload` builds the requests (message lists): conversations under a long shared system
prompt, a short one or none; user messages that share a long document and diverge only at the
end (a divergence inside the last message); second turns that carry a first turn's answer; and
repeats. :func:`run_load` sends them at a given concurrency through the ``openai`` client and
times each; :class:`LoadResult` summarises errors, lost requests, throughput and latency
percentiles. Used by ``tests/test_server_openai.py`` (small) and
``benchmarks/server_load.py`` (200 requests, patched vs stock).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

__all__ = ["Answer", "LoadResult", "run_load", "workload"]

SYSTEMS = (
    "You are a helpful assistant. Answer briefly, kindly and honestly. " * 4,
    "You are a terse assistant.",
    None,
)
DOCUMENT = (
    "Once upon a time there was a little house on the side of a hill. In the house lived an old "
    "man, his daughter, and a very curious cat. Every morning the cat walked down to the river "
    "to watch the fish. The water was cold and clear, and the sun was warm on the stones. "
)
ENDINGS = ("Who lived in the house?", "Where did the cat go?", "Was the water warm?",
           "What did the cat watch?", "Final question: alpha", "Final question: omega")
QUESTIONS = ("Hello! How can I help you today?", "What is the capital of France?",
             "Please write a short poem about the sea.", "What time does the train leave?",
             "Why do birds sing in the morning?", "two plus two")
FOLLOW_UPS = ("And why?", "Tell me more.", "Thank you. What else?")


def _messages(system, user, history=()):
    out = [{"role": "system", "content": system}] if system else []
    return out + list(history) + [{"role": "user", "content": user}]


def workload(n: int, answer: Callable[[list], str], seed: int = 0) -> List[list]:
    """``n`` message lists, in a shuffled but reproducible order: every distinct request once
    (48 of them), then repeats. ``answer(messages)`` gives a first turn's answer text (the
    reference), which second turns carry as the assistant message; it is called only for the
    second turns chosen."""
    rng = random.Random(seed)
    first_turns = []
    for system in SYSTEMS:
        for question in QUESTIONS:
            first_turns.append(_messages(system, question))
        for ending in ENDINGS:
            first_turns.append(_messages(system, DOCUMENT + ending))

    def second_turn(i):
        first = first_turns[3 * i]
        history = [m for m in first if m["role"] != "system"]
        history.append({"role": "assistant", "content": answer(first)})
        system = first[0]["content"] if first[0]["role"] == "system" else None
        return _messages(system, FOLLOW_UPS[i % len(FOLLOW_UPS)], history)

    pool = [("first", i) for i in range(len(first_turns))]
    pool += [("second", i) for i in range(len(first_turns[::3]))]
    rng.shuffle(pool)
    chosen = [pool[i % len(pool)] for i in range(n)]
    rng.shuffle(chosen)
    built = {}
    for kind, i in chosen:
        if (kind, i) not in built:
            built[kind, i] = first_turns[i] if kind == "first" else second_turn(i)
    return [built[key] for key in chosen]


@dataclass
class Answer:
    index: int
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    cached_tokens: Optional[int] = None
    seconds: float = 0.0
    error: Optional[str] = None


@dataclass
class LoadResult:
    answers: List[Answer]
    seconds: float  # wall time of the whole load
    requests: int
    concurrency: int
    errors: List[Answer] = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Requests without an answer or error (never expected)."""
        return self.requests - len(self.answers)

    @property
    def completion_tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def latency(self, quantile: float) -> float:
        times = sorted(a.seconds for a in self.answers if a.error is None)
        if not times:
            return float("nan")
        if len(times) == 1:
            return times[0]
        return statistics.quantiles(times, n=100, method="inclusive")[int(quantile * 100) - 1]

    def summary(self) -> dict:
        return {"requests": self.requests, "concurrency": self.concurrency, "errors": len(self.errors),
                "lost": self.lost, "seconds": round(self.seconds, 3),
                "completion_tokens": self.completion_tokens,
                "tokens_per_second": round(self.tokens_per_second, 2),
                "p50_s": round(self.latency(0.50), 4), "p95_s": round(self.latency(0.95), 4)}


def run_load(server, jobs: Sequence[list], concurrency: int = 8, max_tokens: int = 16,
             stream_every: int = 3, extra: Optional[dict] = None, timeout: float = 300.0,
             max_errors: Optional[int] = None) -> LoadResult:
    """Send ``jobs`` (message lists) to ``server`` (``support.server.Server``) from
    ``concurrency`` threads, greedy (temperature 0); every ``stream_every``-th request streams.
    ``extra`` goes into each request body (e.g. ``repetition_penalty``); ``timeout`` bounds
    each request. After ``max_errors`` errors the requests not sent yet are not sent (each
    counts as an error "not sent"): a server that hangs costs one timeout, not one per request."""
    local = threading.local()
    failures = []

    def one(index):
        if max_errors is not None and len(failures) >= max_errors:
            failures.append(index)
            return Answer(index, error="not sent: too many errors before it")
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = server.client(timeout=timeout)
        messages = jobs[index]
        answer = Answer(index)
        started = time.perf_counter()
        try:
            if stream_every and index % stream_every == stream_every - 1:
                text, finish, usage = "", None, None
                for chunk in client.chat.completions.create(
                        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0,
                        stream=True, stream_options={"include_usage": True}, extra_body=extra or {}):
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        finish = choice.finish_reason or finish
            else:
                reply = client.chat.completions.create(
                    model="default_model", messages=messages, max_tokens=max_tokens, temperature=0,
                    extra_body=extra or {})
                text, finish, usage = reply.choices[0].message.content or "", reply.choices[0].finish_reason, reply.usage
            answer.text, answer.finish_reason = text, finish
            if usage is not None:
                answer.completion_tokens = usage.completion_tokens
                details = getattr(usage, "prompt_tokens_details", None)
                answer.cached_tokens = getattr(details, "cached_tokens", None)
        except Exception as exc:  # counted, never raised: the load goes on
            answer.error = f"{type(exc).__name__}: {exc}"
            failures.append(index)
        answer.seconds = time.perf_counter() - started
        return answer

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, range(len(jobs))))
    seconds = time.perf_counter() - started
    return LoadResult(answers, seconds, len(jobs), concurrency, [a for a in answers if a.error])


def load_rounds(modes, start, jobs, reference, rounds: int, concurrency: int, max_tokens: int,
                timeout: float, extra=None, log=print):
    """What the load benchmarks share: for each round and each mode, ``start(mode)`` (a context
    manager giving a running server), a warm-up of ``concurrency`` requests, then ``jobs``; each
    answer checked against ``reference(messages)`` (text and finish reason). Returns
    ``(best row per mode by throughput, {mode: why it does not work})``."""
    from support.server import ServerExited

    best, broken = {}, {}
    width = max(len(m) for m in modes)
    for round_ in range(rounds):
        for mode in modes:
            if mode in broken:
                continue
            try:
                with start(mode) as server:
                    warm = run_load(server, jobs[:concurrency], concurrency, max_tokens, extra=extra, timeout=timeout)
                    if warm.errors:
                        broken[mode] = f"warm-up failed: {warm.errors[0].error}"
                        continue
                    result = run_load(server, jobs, concurrency, max_tokens, extra=extra, timeout=timeout,
                                      max_errors=concurrency)
            except ServerExited as exc:
                broken[mode] = f"server did not start: {str(exc).splitlines()[0]}"
                continue
            wrong = sum(1 for a in result.answers if a.error is None and
                        (a.text, a.finish_reason) != (reference(jobs[a.index]).text,
                                                      reference(jobs[a.index]).finish_reason))
            row = dict(result.summary(), wrong=wrong, round=round_,
                       first_error=result.errors[0].error[:200] if result.errors else None)
            log(f"  round {round_} {mode:>{width}}: {row}", flush=True)
            if mode not in best or row["tokens_per_second"] > best[mode]["tokens_per_second"]:
                best[mode] = row
    log()
    log(f"{'mode':>{width}} {'errors':>6} {'lost':>4} {'wrong':>5} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7}")
    for mode in modes:
        if mode in broken:
            log(f"{mode:>{width}}  does not work: {broken[mode]}")
            continue
        row = best[mode]
        log(f"{mode:>{width}} {row['errors']:>6} {row['lost']:>4} {row['wrong']:>5} {row['tokens_per_second']:>8.1f} "
            f"{row['p50_s']:>7.3f} {row['p95_s']:>7.3f}")
    return best, broken


def tiny_workload(folder_root, model_type: str, requests: int, max_tokens: int, mtp: bool = False):
    """A tiny random-weight ``model_type`` written under ``folder_root`` (``mtp``: a float32
    checkpoint with an MTP head) and a workload of ``requests`` chats for it with their cold
    references: ``(folder, reference, jobs, distinct)``, ``reference(messages)`` memoised (greedy,
    one sequence, cold prefill, in this process)."""
    import json
    import os

    from mlx_lm import load

    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config
    from support.chat_reference import chat_reference

    if mtp:
        from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

        folder = write_mtp_checkpoint(folder_root, model_type, dtype="float32", name="model").folder
    else:
        folder = write_model_folder(os.path.join(folder_root, "model"), build_tiny_model(model_type, seed=1),
                                    tiny_config(model_type))
    model, tokenizer = load(str(folder))
    memo = {}

    def reference(messages):
        key = json.dumps(messages)
        if key not in memo:
            memo[key] = chat_reference(model, tokenizer, messages, max_tokens)
        return memo[key]

    jobs = workload(requests, lambda m: reference(m).text, seed=0)
    for messages in jobs:
        reference(messages)
    return folder, reference, jobs, len(memo)

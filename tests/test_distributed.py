"""Distributed serving as users run it: ``mlx.launch -n 2 --backend ring -- python -m
mlx_lm.server ...`` (two local ranks on loopback; rank 0 serves HTTP, rank 1 follows it through
MLX collectives), on tiny random-weight hybrid model folders, queried with the ``openai`` client.

Layouts, where the installed release has them for the family (``sharded_load``: ``Model.shard``
for tensor parallelism, ``model.model.pipeline`` and the server's ``--pipeline`` for pipeline
parallelism): tensor-parallel qwen3_5, pipeline-parallel qwen3_next. For each, one two-rank
server answers

* concurrent chat requests of different lengths (batched by the server): every answer must equal
  the single-process reference (greedy, one sequence, cold prefill, computed in this process);
* a request diverging inside a stored prompt: its answer must equal the cold reference, it must
  reuse at least half of the shared prefix (``usage.prompt_tokens_details.cached_tokens``), and
  both ranks must have made the same reuse decision (each rank logs it with
  ``MLX_LM_PATCHES_DEBUG=1``; a decision on one rank only would desynchronize the collectives).

``--draft-model mtp`` (stock refuses every draft model in distributed mode): a second two-rank
server per layout, on a checkpoint with an MTP head, drafts with the model's own head on every
rank (each rank logs it) and answers the same requests - concurrent ones, then a diverging one
that reuses a stored prompt, draft caches included - exactly as the single-process greedy
reference (without ``mtp-draft-selection``, a strict xfail: stock refuses). On a checkpoint
without a head, every rank refuses the load with the same error.

Under tensor parallelism the MTP head is split by the family's own ``Model.shard``: one launch
of a script (``sharded_load`` on two ranks, every kept family with ``shard`` in the release)
shows each rank holds part of the head and computes the single-process head's logits.

A failure on one rank must reach the client within a bounded time, not hang it. Each server ends
with failures (the servers run a test-only entry, ``HOOK``, that fails on rank 1 for a marked
request and serves every other one unchanged): on the pipeline server rank 1 dies (the client
gets an error, ``mlx.launch`` ends rank 0, every process exits); on the tensor server rank 1
alone raises while tokenizing (with ``distributed-request-agreement`` every rank refuses it, the
next request is answered exactly), then inside the model forward (with
``distributed-generation-death`` rank 1 ends its process and ``mlx.launch`` the others: the
client gets an error, every process exits). Without each patch (a launch each) the request
hangs: strict xfails bounded by the client's timeout.

CI time: the module runs on the own row of every mlx-lm release that can shard a hybrid family
(``Model.shard`` for qwen3_5: 0.31.1+; ``model.model.pipeline`` for qwen3_next: 0.32.0+), not on
the newest-mlx twins (``release_only``). Nine launches on the newest releases, each bounded
(readiness, client and stop timeouts), their whole process groups killed when the fixture ends.
"""

import concurrent.futures
import pathlib
import re
import textwrap
import time

import pytest

from conftest import affected, clean_env, xfail_if_affected
from mlx_lm_patches.selftest.model_folder import write_model_folder
from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
from mlx_lm_patches.selftest.tiny_models import _module_exists, build_tiny_model, tiny_config
from support.chat_reference import chat_prompt, chat_reference
from support.server import launcher, serve, server_flags

RANKS = 2
MAX_TOKENS = 8
READY_TIMEOUT = 120.0
REQUEST_TIMEOUT = 60.0
HANG_TIMEOUT = 10.0  # a request still unanswered after this long, on a tiny model, hangs
EXIT_TIMEOUT = 30.0  # for every process to end once a rank died

DOCUMENT = " ".join(f"Fact {i} is about item{i % 13}." for i in range(40))
CONCURRENT = [
    [{"role": "user", "content": "Hi."}],
    [{"role": "user", "content": "Tell me a story about item3 and item7, briefly please."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": " ".join(f"Word{i} word{i * 7 % 11}." for i in range(30))}],
]
FIRST = [{"role": "user", "content": DOCUMENT + " Final question: alpha?"}]
DIVERGING = [{"role": "user", "content": DOCUMENT + " Final question: omega?"}]
# The package's own debug line (its handler prints the bare message at the start of a line; the
# server's root handler, to which the record propagates, prints it again after its own prefix).
REUSED = re.compile(r"^mlx-lm-patches: prompt cache: (\d+) of (\d+) tokens reused", re.M)
DRAFTING = re.compile(r"^mlx-lm-patches: --draft-model mtp: rank (\d+) of (\d+) drafts with the model's MTP head",
                      re.M)

LAYOUTS = {"tensor-qwen3_5": ("qwen3_5", ()), "pipeline-qwen3_next": ("qwen3_next", ("--pipeline",))}


def _release_skip():
    if not pathlib.Path(launcher()).exists():
        return "no mlx.launch beside this interpreter"
    return None


RELEASE_SKIP = _release_skip()
pytestmark = [pytest.mark.subprocess, pytest.mark.release_only,
              pytest.mark.skipif(RELEASE_SKIP is not None, reason=str(RELEASE_SKIP))]


def _layout_skip(model_type, args):
    """Why the installed release cannot serve ``model_type`` this way, or None."""
    import mlx_lm.utils

    if not hasattr(mlx_lm.utils, "sharded_load"):
        return "mlx_lm.utils has no sharded_load"
    if not _module_exists(model_type):
        return f"no {model_type} in this mlx-lm"
    model = build_tiny_model(model_type, seed=1)
    if "--pipeline" in args:
        if "--pipeline" not in server_flags():
            return "mlx_lm.server has no --pipeline"
        if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
            return f"{model_type} cannot be pipelined by this release (no model.model.pipeline)"
    elif not hasattr(model, "shard"):
        return f"{model_type} cannot be tensor-sharded by this release (no Model.shard)"
    return None


def _layout(name):
    """``(model_type, server args)`` of layout ``name``; skips the test where this release cannot
    serve it that way."""
    model_type, args = LAYOUTS[name]
    reason = _layout_skip(model_type, args)
    if reason:
        pytest.skip(reason)
    return model_type, args


def _folder(tmp_path_factory, model_type):
    return write_model_folder(tmp_path_factory.mktemp(f"dist-{model_type}") / model_type,
                              build_tiny_model(model_type, seed=1), tiny_config(model_type))


def _mtp_folder(tmp_path_factory, model_type):
    """A checkpoint with an MTP head (float32: the single-process reference is exact)."""
    return write_mtp_checkpoint(tmp_path_factory.mktemp(f"dist-mtp-{model_type}"), model_type,
                                dtype="float32", name="model").folder


def _logged(server, pattern, count, timeout=EXIT_TIMEOUT):
    """``pattern``'s matches in the server's log once there are ``count`` of them (or after
    ``timeout`` seconds, or once every process has ended): ``mlx.launch`` forwards each rank's
    output a little after the rank wrote it, so a line can come after the answer it belongs to."""
    deadline = time.monotonic() + timeout
    while (len(found := pattern.findall(server.log())) < count and server.group_alive()
           and time.monotonic() < deadline):
        time.sleep(0.1)
    return found


def _ask_concurrently(client):
    """The ``CONCURRENT`` requests at once (the server batches them): their answers, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        return [f.result() for f in [pool.submit(_ask, client, m) for m in CONCURRENT]]


def _prefill_args():
    return ["--prefill-step-size", "256"] if "--prefill-step-size" in server_flags() else []


def _ask(client, messages):
    reply = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0.0)
    details = getattr(reply.usage, "prompt_tokens_details", None)
    return reply.choices[0].message.content, getattr(details, "cached_tokens", None)


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist-hook") / "failing_rank_server.py"
    path.write_text(HOOK)
    return path


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def served(request, tmp_path_factory, hook):
    """A two-rank server of one layout, after the concurrent requests, the diverging one and,
    last, the layout's failure request (it ends the server: one launch per layout, CI time)."""
    model_type, args = _layout(request.param)
    folder = _folder(tmp_path_factory, model_type)
    with serve(folder, *args, *_prefill_args(), ranks=RANKS, ready_timeout=READY_TIMEOUT,
               entry=(str(hook),), env=clean_env(MLX_LM_PATCHES_DEBUG="1")) as server:
        client = server.client(timeout=REQUEST_TIMEOUT)
        concurrent_answers = _ask_concurrently(client)
        _ask(client, FIRST)
        logged = len(REUSED.findall(server.log()))
        diverging = _ask(client, DIVERGING)
        decisions = _logged(server, REUSED, logged + RANKS)[logged:]
        failures = {mode: _fail(server, mode) for mode in FAILURES[request.param]}
        yield dict(folder=folder, concurrent=concurrent_answers, diverging=diverging,
                   decisions=decisions, failures=failures)


@pytest.fixture(scope="module")
def reference():
    """Single-process references, per model folder."""
    import mlx_lm_patches
    from mlx_lm import load

    mlx_lm_patches.apply()
    loaded = {}

    def model_and_tokenizer(folder):
        if folder not in loaded:
            loaded[folder] = load(str(folder))
        return loaded[folder]

    def compute(folder, messages):
        return chat_reference(*model_and_tokenizer(folder), messages, MAX_TOKENS)

    def prompt(folder, messages):
        return chat_prompt(model_and_tokenizer(folder)[1], messages)

    compute.prompt = prompt
    return compute


def test_concurrent_requests_equal_single_process_reference(served, reference):
    answers = [text for text, _ in served["concurrent"]]
    assert answers == [reference(served["folder"], m).text for m in CONCURRENT]


def test_diverging_request_equals_cold_prefill(served, reference):
    text, _ = served["diverging"]
    assert text == reference(served["folder"], DIVERGING).text


def test_diverging_request_reuses_half_the_shared_prefix(served, reference):
    _, cached = served["diverging"]
    stored = reference(served["folder"], FIRST).fed
    asked = reference.prompt(served["folder"], DIVERGING)
    shared = next(i for i, (a, b) in enumerate(zip(stored + [None], asked + [-1])) if a != b)
    assert cached is not None, "this release reports no cached tokens"
    assert shared // 2 <= cached <= shared, f"reused {cached} of {shared} shared tokens"


# -- --draft-model mtp -------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def mtp_served(request, tmp_path_factory, hook):
    """A two-rank ``--draft-model mtp`` server of one layout on a checkpoint with an MTP head
    (float32: the reference is exact), after concurrent requests and a diverging one; last, a
    request whose model forward fails on rank 1 (served alone, as every drafted request is)."""
    model_type, args = _layout(request.param)
    folder = _mtp_folder(tmp_path_factory, model_type)
    with serve(folder, "--draft-model", "mtp", *args, *_prefill_args(), ranks=RANKS, entry=(str(hook),),
               ready_timeout=READY_TIMEOUT, env=clean_env(MLX_LM_PATCHES_DEBUG="1")) as server:
        client = server.client(timeout=REQUEST_TIMEOUT)
        concurrent_answers = _ask_concurrently(client)
        _ask(client, FIRST)
        diverging = _ask(client, DIVERGING)
        _logged(server, DRAFTING, RANKS)
        log = server.log()
        failure = _fail(server, "forward")
        yield dict(folder=folder, concurrent=concurrent_answers, diverging=diverging, log=log, failure=failure)


def test_draft_model_mtp_a_rank_failing_in_the_forward_ends_every_process(mtp_served):
    """A drafted request is served alone (``_serve_single``), which answers an error on the rank
    that raised and goes on, while the other rank waits in the model's collective (stock: a
    hang). ``distributed-generation-death`` ends that rank instead (exit code 70): the client
    gets an error, every process exits."""
    import openai

    failure = mtp_served["failure"]
    outcome = failure["outcome"]
    assert isinstance(outcome, (openai.APIConnectionError, openai.APIStatusError)), outcome
    assert not isinstance(outcome, openai.APITimeoutError), f"no answer after {failure['seconds']:.0f}s"
    assert failure["exited"], f"ranks still running {EXIT_TIMEOUT:.0f}s after rank 1 failed"
    assert "rank 1 exited with code 70" in failure["log"], failure["log"][-3000:]


def test_draft_model_mtp_drafts_on_every_rank(mtp_served):
    ranks = sorted(int(rank) for rank, _ in DRAFTING.findall(mtp_served["log"]))
    assert ranks == list(range(RANKS)), f"ranks that logged drafting with the MTP head: {ranks}"


def test_draft_model_mtp_answers_equal_single_process_reference(mtp_served, reference):
    answers = [text for text, _ in mtp_served["concurrent"]] + [mtp_served["diverging"][0]]
    assert answers == [reference(mtp_served["folder"], m).text for m in CONCURRENT + [DIVERGING]]


def test_draft_model_mtp_without_a_head_is_refused_on_every_rank(tmp_path_factory):
    """A checkpoint without an MTP head: every rank refuses the load with one error, from one
    collective, naming the ranks without a head (a draft on one rank only would desynchronize
    the collectives). The client gets an error, not an answer and not a hang: mlx-lm's
    "generation thread died" (or, where ``server-thread-death`` applies, the refusal itself), or
    a closed connection when rank 1, whose generation thread died too, has already ended, and
    ``mlx.launch`` with it."""
    import openai

    model_type, args = _layout("tensor-qwen3_5")
    from support.server import ServerExited

    refusal = f"ValueError: --draft-model mtp: no MTP head on rank(s) 0, 1 of {RANKS}"
    try:
        with serve(_folder(tmp_path_factory, model_type), "--draft-model", "mtp", *args, ranks=RANKS,
                   ready_timeout=READY_TIMEOUT, env=clean_env()) as server:
            try:
                outcome = _ask(server.client(timeout=HANG_TIMEOUT), CONCURRENT[0])
            except (openai.APIStatusError, openai.APIConnectionError) as error:
                outcome = error
            # the client can hear of the failure before a rank has written its traceback
            waited = time.monotonic() + EXIT_TIMEOUT
            while refusal not in server.log() and server.group_alive() and time.monotonic() < waited:
                time.sleep(0.2)
            log = server.log()
    except ServerExited as exited:  # the ranks had ended before /health answered
        outcome, log = exited, exited.log
    assert isinstance(outcome, Exception), f"answered {outcome!r}"
    assert not isinstance(outcome, openai.APITimeoutError), f"no answer after {HANG_TIMEOUT:.0f}s"
    if isinstance(outcome, openai.APIStatusError):  # mlx-lm's own answer, or server-thread-death's
        text = outcome.response.text
        assert "generation thread died" in text or "no MTP head on rank(s) 0, 1" in text, text
    # Rank 0's error names rank 1 too: it learned it in the collective every rank takes part in,
    # so every rank raised the same (rank 1's own log may be cut short when mlx.launch ends it).
    assert refusal in log, log[-3000:]


@pytest.mark.parametrize("pid", [pytest.param("mtp-draft-selection", marks=xfail_if_affected("mtp-draft-selection"))])
def test_stock_draft_model_mtp_on_two_ranks_answers(pid, tmp_path_factory, reference):
    """Without ``mtp-draft-selection`` (every other patch on) mlx-lm refuses the draft in
    distributed mode: the client gets "generation thread died" instead of the answer. A strict
    xfail where compat_matrix.yaml says the release is affected."""
    model_type, args = _layout("tensor-qwen3_5")
    folder = _mtp_folder(tmp_path_factory, model_type)
    with serve(folder, "--draft-model", "mtp", *args, ranks=RANKS, ready_timeout=READY_TIMEOUT,
               env=clean_env(MLX_LM_PATCHES_DISABLE=pid)) as server:
        try:
            answer = _ask(server.client(timeout=HANG_TIMEOUT), CONCURRENT[0])[0]
        except Exception as error:  # openai.APIStatusError: "generation thread died"
            answer = error
    assert answer == reference(folder, CONCURRENT[0]).text, answer


# -- the MTP head under tensor parallelism -----------------------------------------------------

# Families whose head is kept and whose Model.shard the head's layers go through (where the
# installed release has the family and its shard).
SHARDED_HEADS = ("qwen3_5", "qwen3_5_moe", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
                 "exaone_moe", "step3p5", "longcat_flash", "longcat_flash_ngram")

HEAD_SCRIPT = textwrap.dedent('''\
    """Each rank: sharded_load each folder (tensor parallel), then one MTP pass of its head on a
    fixed input; writes what it saw to OUT/rank<r>-<i>.json."""
    import json
    import sys

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import sharded_load

    from mlx_lm_patches.mechanisms.mtp.decoding import make_mtp_cache, mtp_forward

    out = sys.argv[1]
    rank = mx.distributed.init().rank()
    for i, folder in enumerate(sys.argv[2:]):
        model = sharded_load(folder)[0]
        head = model.mtp
        with open(f"{folder}/config.json") as f:
            config = json.load(f)
        hidden = mx.random.normal((1, 5, config.get("text_config", config)["hidden_size"]), key=mx.random.key(7))
        logits, _ = mtp_forward(model, hidden, mx.array([[3, 1, 4, 1, 5]]), make_mtp_cache(model))
        with open(f"{out}/rank{rank}-{i}.json", "w") as f:
            json.dump(dict(status=model.mtp_status, logits=logits.astype(mx.float32).tolist(),
                           head_size=sum(v.size for _, v in tree_flatten(head.parameters()))), f)
''')


def _tensor_sharded_families():
    import importlib.util

    return [f for f in SHARDED_HEADS if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None
            and hasattr(build_tiny_model(f, seed=1), "shard")]


def test_mtp_head_is_sharded_with_the_model_and_computes_the_same(tmp_path):
    """``sharded_load`` on two ranks (tensor parallel): each family's MTP head is split by the
    family's own ``Model.shard`` like the backbone's layers (each rank holds less than the whole
    head, ``mtp_status`` says so), and one pass of it gives the single-process head's logits on
    every rank (within 1e-4)."""
    import json

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    import mlx_lm_patches
    from mlx.utils import tree_flatten
    from mlx_lm_patches.mechanisms.mtp.decoding import make_mtp_cache, mtp_forward
    from support.server import run_ranks

    families = _tensor_sharded_families()
    if not families:
        pytest.skip("no family whose MTP head is kept has Model.shard in this release")
    mlx_lm_patches.apply()
    folders = [str(write_mtp_checkpoint(tmp_path, f, dtype="float32", name=f).folder) for f in families]
    script = tmp_path / "head_ranks.py"
    script.write_text(HEAD_SCRIPT)
    done = run_ranks(script, tmp_path, *folders, ranks=RANKS, env=clean_env(), timeout=READY_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    written = sorted(p.name for p in tmp_path.glob("rank*.json"))
    assert len(written) == RANKS * len(families), (written, done.stdout[-3000:])
    for i, (family, folder) in enumerate(zip(families, folders)):
        model = load(folder)[0]
        whole = sum(v.size for _, v in tree_flatten(model.mtp.parameters()))
        config = tiny_config(family)
        x = mx.random.normal((1, 5, config.get("text_config", config)["hidden_size"]), key=mx.random.key(7))
        expected = np.array(mtp_forward(model, x, mx.array([[3, 1, 4, 1, 5]]), make_mtp_cache(model))[0])
        for rank in range(RANKS):
            seen = json.loads((tmp_path / f"rank{rank}-{i}.json").read_text())
            assert f"sharded over {RANKS} ranks" in seen["status"], (family, seen["status"])
            assert seen["head_size"] < whole, (family, seen["head_size"], whole)
            np.testing.assert_allclose(np.array(seen["logits"]), expected, atol=1e-4, rtol=0,
                                       err_msg=f"{family} rank {rank}")


ADAPTIVE_SCRIPT = textwrap.dedent('''\
    """Each rank: greedy decoding of one prompt, then mlx-lm's speculative_generate_step with a
    draft that always proposes the right token (from the greedy run) - free on rank 0, 20 ms a
    call on rank 1, so each rank's own timings would choose differently; writes its tokens and
    its draft calls to OUT/rank<r>.json."""
    import json
    import sys
    import time

    import mlx.core as mx

    import mlx_lm_patches

    mlx_lm_patches.apply()
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.models.cache import KVCache

    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    out, model_type = sys.argv[1], sys.argv[2]
    rank = mx.distributed.init().rank()
    model = build_tiny_model(model_type, seed=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=48)]
    sequence = prompt + greedy
    vocab = model(mx.array([prompt])).shape[-1]
    calls = [0]

    class Oracle:
        layers = [None]

        def make_cache(self):
            return [KVCache()]

        def __call__(self, inputs, cache=None):
            calls[0] += 1
            if rank:
                time.sleep(0.02)
            n = inputs.shape[1]
            cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
            target = sequence[min(cache[0].offset, len(sequence) - 1)]
            return mx.broadcast_to(mx.zeros((vocab,)).at[target].add(10.0), (1, n, vocab))

    spec = [int(t) for t, _, _ in speculative_generate_step(mx.array(prompt), model, Oracle(), max_tokens=48,
                                                            num_draft_tokens=3)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(dict(greedy=greedy, speculative=spec, draft_calls=calls[0]), f)
''')


def test_adaptive_drafting_ranks_take_rank_zeros_draft_lengths(tmp_path):
    """Adaptive drafting on two ranks (``mlx.launch``): the ranks of a distributed model must run
    the same passes, but each times its own rounds. With a draft that is free on rank 0 and slow
    on rank 1, both ranks draft as rank 0 chooses (as many draft calls) and decode greedy's
    tokens. (Choosing from each rank's own timings, rank 1 would stop drafting.)"""
    import json

    from support.server import run_ranks

    script = tmp_path / "adaptive_ranks.py"
    script.write_text(ADAPTIVE_SCRIPT)
    runs = []
    # rank 0 drafting its free draft at all is a matter of this machine's timings (a CI machine
    # running other jobs beside the two ranks once made it stop after the start); the ranks'
    # agreement and exactness are checked on every run, the drafting on one of two
    for attempt in range(2):
        done = run_ranks(script, tmp_path, "qwen3_5" if _module_exists("qwen3_5") else "qwen3_next", ranks=RANKS,
                         env=clean_env(), timeout=READY_TIMEOUT)
        assert done.returncode == 0, done.stdout[-3000:]
        seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
        for rank, ran in enumerate(seen):
            assert ran["speculative"] == ran["greedy"], f"rank {rank}"
        calls = [ran["draft_calls"] for ran in seen]
        assert calls[0] == calls[1], f"draft calls per rank: {calls}"
        runs.append(calls[0])
        if calls[0] > 20:
            break
    assert max(runs) > 20, f"rank 0 stopped drafting a free draft always accepted: {runs} draft calls"


def test_every_rank_makes_the_same_reuse_decision(served):
    decisions = served["decisions"]
    assert len(decisions) == RANKS and len(set(decisions)) == 1, (
        f"reuse decisions logged for the diverging request: {decisions}")


# -- a failure on one rank --------------------------------------------------------------------

# The failures each layout's server is sent last, in order (requests whose last message is the
# marker): one the ranks agree on and go on from, then one that ends the server.
FAILURES = {"tensor-qwen3_5": ("raise", "forward"), "pipeline-qwen3_next": ("exit",)}
ENDING = ("exit", "forward")  # every process must have exited after these
MARKER = "<<fail on rank 1: {}>>"

HOOK = textwrap.dedent('''\
    """Test-only entry: mlx_lm.server, where rank 1 fails on a request whose last message is
    "<<fail on rank 1: exit>>" (its process dies while tokenizing it), "<<fail on rank 1:
    raise>>" (its chat template raises: as a template that differs between hosts would) or
    "<<fail on rank 1: forward>>" (its model forward raises). Every other request is served
    unchanged."""
    import importlib
    import os

    import mlx_lm.server as server
    import mlx_lm.tokenizer_utils as tokenizer_utils

    if os.environ.get("MLX_RANK") == "1":
        tokenize = server.ResponseGenerator._tokenize

        def _tokenize(self, tokenizer, request, args):
            last = (getattr(request, "messages", None) or [{}])[-1].get("content")
            if last == "<<fail on rank 1: exit>>":
                os._exit(3)
            return tokenize(self, tokenizer, request, args)

        server.ResponseGenerator._tokenize = _tokenize
        failing = {}

        def _tokenize(self, tokenizer, request, args, tokenize=_tokenize):
            last = (getattr(request, "messages", None) or [{}])[-1].get("content")
            failing["forward"] = last == "<<fail on rank 1: forward>>"
            return tokenize(self, tokenizer, request, args)

        server.ResponseGenerator._tokenize = _tokenize
        for family in ("qwen3_5", "qwen3_next"):
            model_class = importlib.import_module(f"mlx_lm.models.{family}").Model
            forward = model_class.__call__

            def __call__(self, *args, forward=forward, **kwargs):
                if failing.get("forward"):
                    raise RuntimeError("failure injected on rank 1 (the model forward)")
                return forward(self, *args, **kwargs)

            model_class.__call__ = __call__
        template = tokenizer_utils.TokenizerWrapper.apply_chat_template

        def apply_chat_template(self, messages, *args, **kwargs):
            if messages and messages[-1].get("content") == "<<fail on rank 1: raise>>":
                raise RuntimeError("failure injected on rank 1 (its chat template)")
            return template(self, messages, *args, **kwargs)

        tokenizer_utils.TokenizerWrapper.apply_chat_template = apply_chat_template
    server.main()
''')


def _fail(server, mode, then_ask=True):
    """Send the failure request; what came back (an exception counts), after how many seconds,
    and (``exit``, ``forward``) whether every process had exited ``EXIT_TIMEOUT`` seconds after that;
    (``raise`` and ``then_ask``) the answer to a next request."""
    started = time.monotonic()
    try:
        outcome = _ask(server.client(timeout=HANG_TIMEOUT),
                       [{"role": "user", "content": MARKER.format(mode)}])
    except Exception as error:  # openai.APIConnectionError, APITimeoutError, APIStatusError
        outcome = error
    seconds = time.monotonic() - started
    hung = type(outcome).__name__ == "APITimeoutError"  # then there is nothing to wait for
    while mode in ENDING and not hung and server.group_alive() and time.monotonic() - started < seconds + EXIT_TIMEOUT:
        time.sleep(0.2)
    after = None
    if mode == "raise" and then_ask:  # the ranks must still be in step: the next request is answered
        try:
            after = _ask(server.client(timeout=HANG_TIMEOUT), CONCURRENT[0])[0]
        except Exception as error:
            after = error
    return dict(mode=mode, outcome=outcome, seconds=seconds, exited=not server.group_alive(),
                log=server.log(), after=after)


def _failure(served, mode):
    return served["failures"][mode]


def _ending_with(mode):
    """Run the test on the server of the layout that is sent failure ``mode``."""
    return pytest.mark.parametrize("served", [k for k, v in FAILURES.items() if mode in v],
                                   indirect=True)


@_ending_with("exit")
def test_a_rank_dying_mid_request_fails_the_request_and_every_process_exits(served):
    import openai

    failure = _failure(served, "exit")
    outcome = failure["outcome"]
    assert isinstance(outcome, (openai.APIConnectionError, openai.APIStatusError)), outcome
    assert not isinstance(outcome, openai.APITimeoutError), f"no answer after {failure['seconds']:.0f}s"
    assert failure["exited"], f"ranks still running {EXIT_TIMEOUT:.0f}s after rank 1 died"
    assert "rank 1 exited with code 3" in failure["log"]


@_ending_with("forward")
def test_a_rank_failing_in_the_forward_fails_the_request_and_every_process_exits(served):
    """``distributed-generation-death``: the model forward raises on rank 1 only, inside the
    batch loop (rank 0 is then waiting in the model's collective): rank 1 ends its process,
    ``mlx.launch`` ends rank 0, the client gets an error within a bounded time."""
    import openai

    failure = _failure(served, "forward")
    outcome = failure["outcome"]
    assert isinstance(outcome, (openai.APIConnectionError, openai.APIStatusError)), outcome
    assert not isinstance(outcome, openai.APITimeoutError), f"no answer after {failure['seconds']:.0f}s"
    assert failure["exited"], f"ranks still running {EXIT_TIMEOUT:.0f}s after rank 1 failed"
    # exit code 70 is the patch's (its log line can be lost: mlx.launch before mlx 0.32.4 stops
    # reading a rank's output once the rank has exited)
    assert "rank 1 exited with code 70" in failure["log"], failure["log"][-3000:]


@pytest.fixture(scope="module")
def stock_forward(tmp_path_factory, hook):
    """The tensor layout without ``distributed-generation-death`` (every other patch on), sent
    only the request whose forward raises on rank 1."""
    model_type, args = _layout("tensor-qwen3_5")
    folder = _folder(tmp_path_factory, model_type)
    with serve(folder, *args, *_prefill_args(), ranks=RANKS, ready_timeout=READY_TIMEOUT, entry=(str(hook),),
               env=clean_env(MLX_LM_PATCHES_DISABLE="distributed-generation-death")) as server:
        yield _fail(server, "forward")


@pytest.mark.parametrize("pid", [pytest.param("distributed-generation-death",
                                              marks=xfail_if_affected("distributed-generation-death"))])
def test_stock_a_rank_failing_in_the_forward_fails_the_request_in_bounded_time(pid, stock_forward):
    """Stock mlx-lm: rank 1's generation thread dies, its process lives on, rank 0 waits in the
    model's collective: no answer (bounded here by the client's timeout), no process exits. A
    strict xfail where compat_matrix.yaml says the release is affected."""
    import openai

    outcome = stock_forward["outcome"]
    assert not isinstance(outcome, openai.APITimeoutError), f"no answer after {stock_forward['seconds']:.0f}s"
    assert stock_forward["exited"], f"ranks still running {EXIT_TIMEOUT:.0f}s after rank 1 failed"


@_ending_with("raise")
def test_a_rank_raising_alone_fails_the_request_on_every_rank(served, reference):
    """``distributed-request-agreement``: rank 1's tokenization fails, so every rank refuses the
    request; the client gets the error at once, and the next request is answered exactly."""
    import openai

    failure = _failure(served, "raise")
    outcome = failure["outcome"]
    assert isinstance(outcome, openai.APIStatusError), f"answered {outcome!r}"
    assert "failed on rank(s) 1 of 2" in outcome.response.text, outcome.response.text
    assert failure["after"] == reference(served["folder"], CONCURRENT[0]).text, failure["after"]


@pytest.fixture(scope="module")
def stock_raising(tmp_path_factory, hook):
    """The tensor layout without ``distributed-request-agreement`` (every other patch on), sent
    only the request that raises on rank 1."""
    model_type, args = _layout("tensor-qwen3_5")
    folder = _folder(tmp_path_factory, model_type)
    with serve(folder, *args, *_prefill_args(), ranks=RANKS, ready_timeout=READY_TIMEOUT, entry=(str(hook),),
               env=clean_env(MLX_LM_PATCHES_DISABLE="distributed-request-agreement")) as server:
        yield _fail(server, "raise", then_ask=False)  # stock hangs: a next request would wait too


@pytest.mark.parametrize("pid", [pytest.param("distributed-request-agreement",
                                              marks=xfail_if_affected("distributed-request-agreement"))])
def test_stock_a_rank_raising_alone_fails_the_request_in_bounded_time(pid, stock_raising):
    """Stock mlx-lm: the rank that raised answers and moves on to the next request's share,
    while rank 0 waits in the model's collective for it: no answer, ever (bounded here by the
    client's timeout). A strict xfail where compat_matrix.yaml says the release is affected."""
    import openai

    outcome = stock_raising["outcome"]
    assert isinstance(outcome, Exception), f"answered {outcome!r}"
    assert not isinstance(outcome, openai.APITimeoutError), f"no answer after {stock_raising['seconds']:.0f}s"


def test_draft_model_mtp_says_why_it_serves_one_request_at_a_time(mtp_served):
    """Where the server keeps batching with a draft model (``batch-speculative-decoding``, mlx-lm
    0.31.3 and later), a distributed server drafting with the MTP head does not batch (its ranks
    would have to agree on every round): every rank's log says so."""
    from mlx_lm.server import ModelProvider

    from mlx_lm_patches.patches.batch_speculative_decoding import MTP_DISTRIBUTED

    if not affected("batch-speculative-decoding") or not hasattr(ModelProvider, "_load"):
        pytest.skip("this release's server keeps no batching with a draft model")
    said = re.findall(rf"^mlx-lm-patches: mlx_lm.server --draft-model mtp serves concurrent requests one at a "
                      rf"time: {re.escape(MTP_DISTRIBUTED)}$", mtp_served["log"], re.M)  # the package's own lines
    assert len(said) == RANKS, mtp_served["log"][-3000:]

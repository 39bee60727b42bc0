"""Speculative decoding never refuses what stock mlx-lm answers for the rollback budget
(``MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS``, issue 37 items 1-2), through the public entry points:

* a **draft** model's rollback never raises: a dense main model with a hybrid draft drafting more
  tokens than the kept states allow gives the main model's greedy tokens (stock mlx-lm's answer),
  and the draft is re-synchronised exactly (the same proposals as with states to spare);
* a hybrid **main** model drafting more than the budget runs with ``num_draft_tokens`` capped to
  ``snapshots - 2`` before the first token, exact, with one warning on stderr and nothing on
  stdout.

Adaptive drafting (on by default) starts with rounds of one draft token and lengthens them only
where they pay, so it rarely asks for a rollback near the budget: the tests that need rounds of
the full ``num_draft_tokens`` run with it off (``_fixed_rounds``); one runs as users do (default).

``mlx_lm.generate --draft-model`` over the budget: test_speculative_entry_points.py.
"""

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model


HYBRID = "qwen3_next"  # in every supported release
SNAPSHOTS = "MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS"
CAPPED = "num_draft_tokens={} capped to {}"


def _fixed_rounds(monkeypatch):
    """Every round drafts ``num_draft_tokens`` (adaptive drafting off), as the budget needs."""
    from mlx_lm_patches.engine import env

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "0")


class _Proposals:
    """``model``, recording the token it proposes (argmax of the last position) at each call."""

    def __init__(self, model):
        self.model, self.proposed = model, []

    def __call__(self, *args, **kwargs):
        import mlx.core as mx

        out = self.model(*args, **kwargs)
        self.proposed.append(int(mx.argmax(out[0, -1]).item()))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_dense_main_hybrid_draft_beyond_the_default_budget(monkeypatch):
    """The issue's command: 40 draft tokens, default budget (32 states), max_tokens 40. Every
    round here rejects early, so the draft goes back ~39 tokens each time; the first tokens
    (three rounds) are enough to show it (the generator is closed after them). The draft proposes
    exactly what it proposes with 64 states (a draft left ahead, as stock leaves it, does not).
    Rounds of 40 drafts: adaptive drafting off (with it, these rounds draft one token)."""
    import itertools

    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    _fixed_rounds(monkeypatch)
    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1)
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=3)
    proposals = {}
    for snapshots in ("", "64"):
        monkeypatch.setenv(SNAPSHOTS, snapshots)
        draft = _Proposals(build_tiny_model(HYBRID, seed=7))
        steps = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=40, max_tokens=40)
        first = list(itertools.islice(steps, 3))
        proposals[snapshots] = list(draft.proposed)  # not the re-run that ending the loop may run
        steps.close()
        problem = reference.compare(Decoded([int(t) for t, _, _ in first], [lp for _, lp, _ in first]))
        assert problem is None, f"{SNAPSHOTS}={snapshots!r}: {problem}"
    assert len(proposals[""]) > 3 * 32, "the draft never went back over the budget: the test cannot fail"
    assert proposals[""] == proposals["64"]


def test_dense_main_hybrid_draft_beyond_the_budget_with_adaptive_drafting(monkeypatch):
    """The issue's command as users run it (adaptive drafting on, its default), 16 tokens:
    the main model's greedy tokens, no refusal."""
    from mlx_lm_patches.engine import env

    monkeypatch.delenv(env.ADAPTIVE_DRAFTING, raising=False)
    monkeypatch.delenv(SNAPSHOTS, raising=False)
    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1)
    prompt = prompt_tokens(13, seed=3)
    got = speculative_greedy(model, build_tiny_model(HYBRID, seed=7), prompt, max_tokens=16, num_draft_tokens=40)
    problem = greedy(model, prompt, max_tokens=16).compare(got)
    assert problem is None, problem


@pytest.mark.parametrize("main_type", [DENSE_MODEL_TYPE, HYBRID])
def test_hybrid_draft_over_budget_is_resynchronised_exactly(monkeypatch, main_type):
    """Few states kept: with 2, a dense main model keeps drafting 4 tokens (the draft's rollback
    of 3 goes back to an older state and re-runs more); with 3, a hybrid main model drafts 1
    (its cap). Output: the main model's greedy tokens; the draft proposes exactly what it
    proposes with states to spare (a draft left ahead of the accepted tokens, as stock leaves
    it, proposes other tokens). Adaptive drafting off: every round drafts ``nd``."""
    _fixed_rounds(monkeypatch)
    model = build_tiny_model(main_type, seed=1)
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=16)
    few = "2" if main_type == DENSE_MODEL_TYPE else "3"
    proposals = {}
    for snapshots in ("64", few):
        monkeypatch.setenv(SNAPSHOTS, snapshots)
        draft = _Proposals(build_tiny_model(HYBRID, seed=7))
        nd = 4 if main_type == DENSE_MODEL_TYPE else 1  # what the hybrid main is capped to at 3
        got = speculative_greedy(model, draft, prompt, max_tokens=16, num_draft_tokens=nd)
        problem = reference.compare(got)
        assert problem is None, f"{SNAPSHOTS}={snapshots}: {problem}"
        proposals[snapshots] = draft.proposed
    assert proposals[few] == proposals["64"]


def test_hybrid_main_over_budget_is_capped_before_the_first_token(monkeypatch, caplog):
    """A hybrid main model (and a hybrid draft) asked for 7 draft tokens with 4 states: 2 per
    round, said once per process and setting (a second generation says nothing), exact.
    Adaptive drafting off, so that uncapped rounds would draft 7 (with it they may draft fewer)."""
    import logging

    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    _fixed_rounds(monkeypatch)
    model = build_tiny_model(HYBRID, seed=1)
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=12)
    monkeypatch.setenv(SNAPSHOTS, "4")
    calls = []

    class Recorded:  # a model, recording which of the two ran each pass
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __call__(self, inputs, **kwargs):
            calls.append(self.name)
            return self.inner(inputs, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with caplog.at_level(logging.WARNING, logger="mlx_lm_patches"):
        steps = speculative_generate_step(mx.array(prompt), model, build_tiny_model(HYBRID, seed=7),
                                          num_draft_tokens=7, max_tokens=12)
        warned_before_first_token = [r.getMessage() for r in caplog.records]
        steps.close()
        got = speculative_greedy(Recorded("main", model), Recorded("draft", build_tiny_model(HYBRID, seed=7)),
                                 prompt, max_tokens=12, num_draft_tokens=7)
    problem = reference.compare(got)
    assert problem is None, problem
    said = [r.getMessage() for r in caplog.records if CAPPED.format(7, 2) in r.getMessage()]
    assert len(said) == 1, caplog.records
    assert any(CAPPED.format(7, 2) in m for m in warned_before_first_token)
    assert f"{SNAPSHOTS}=4" in said[0]
    # More draft tokens than the budget but fewer tokens to generate: nothing to cap.
    short = speculative_greedy(model, build_tiny_model(HYBRID, seed=7), prompt, max_tokens=2, num_draft_tokens=7)
    assert greedy(model, prompt, max_tokens=2).compare(short) is None
    assert len([r for r in caplog.records if "capped" in r.getMessage()]) == 1
    # Draft passes between two main passes: 2 per round (uncapped: 7). Passes of the prompt
    # (before the first main pass) and the draft's re-runs are fused into its next pass.
    rounds = [len(run) for run in "".join("d" if c == "draft" else "|" for c in calls).split("|")]
    assert max(rounds) == 2, calls


@pytest.mark.parametrize("limit", [2, 3])
def test_a_drafts_journal_over_its_bound_keeps_its_re_runs_short(limit):
    """A draft's journal (``resync``) with fewer states than its window keeps an anchor no
    further back than twice the window, however long the sequence; and a trim of a whole window
    from there is exact (the next token's logits equal those after a cold prefill)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_lm_patches.mechanisms.journal import Journal

    model, window = build_tiny_model(HYBRID, seed=7), 5
    tokens = prompt_tokens(40, seed=5)
    cache = make_prompt_cache(model)
    journal = Journal(model, cache, window=window, limit=limit, resync=True)
    try:
        journal.forward(mx.array(tokens[:4])[None], cache)
        farthest = 0
        for i, token in enumerate(tokens[4:], start=5):
            journal.forward(mx.array([[token]]), cache)
            assert len(journal._snapshots) <= limit
            if i > 2 * window:
                farthest = max(farthest, journal.pos - journal._snapshots[0].pos)
        assert window <= farthest <= 2 * window
        assert trim_prompt_cache(cache, window) == window
        journal.flush()
    finally:
        journal.detach()
    cold = make_prompt_cache(model)
    model(mx.array(tokens[:-window])[None], cache=cold)
    step = mx.array([[tokens[-window]]])  # the next token after both: the same logits
    assert mx.abs(model(step, cache=cache) - model(step, cache=cold)).max().item() <= 1e-4


PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    root = tmp_path_factory.mktemp("budget")
    return {name: write_model_folder(root / name, build_tiny_model(model_type, seed=seed), tiny_config(model_type))
            for name, (model_type, seed) in {"dense": (DENSE_MODEL_TYPE, 1), "hybrid": (HYBRID, 1),
                                             "hybrid-draft": (HYBRID, 7)}.items()}


def test_stream_generate_dense_main_hybrid_draft(folders, monkeypatch):
    """``stream_generate(draft_model=...)`` on loaded model folders, three states and three
    draft tokens (rounds of three: adaptive drafting off): the tokens and log-probabilities of
    ``stream_generate`` without a draft."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    _fixed_rounds(monkeypatch)
    monkeypatch.setenv(SNAPSHOTS, "3")
    model, tokenizer = load(str(folders["dense"]))
    draft, _ = load(str(folders["hybrid-draft"]))

    def run(**kwargs):
        return [(r.token, r.logprobs) for r in stream_generate(model, tokenizer, PROMPT, max_tokens=14, **kwargs)]

    reference, got = run(), run(draft_model=draft, num_draft_tokens=3)
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(reference, got)) <= 1e-4


def test_mtp_draft_of_a_hybrid_over_budget_is_capped(tmp_path, monkeypatch, caplog):
    """The MTP draft path (``model.make_draft_model()``, ``--draft-model mtp``) of a hybrid:
    three states, five draft tokens asked: one per round, said once, exact."""
    import logging

    from mlx_lm import load

    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

    model, _ = load(str(write_mtp_checkpoint(tmp_path, HYBRID, dtype="float32").folder))
    prompt = prompt_tokens(17, seed=4)
    reference = greedy(model, prompt, max_tokens=10)
    monkeypatch.setenv(SNAPSHOTS, "3")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_patches"):
        got = speculative_greedy(model, model.make_draft_model(), prompt, max_tokens=10, num_draft_tokens=5)
    problem = reference.compare(got)
    assert problem is None, problem
    assert [r.getMessage() for r in caplog.records if "capped" in r.getMessage()] == [
        next(r.getMessage() for r in caplog.records if CAPPED.format(5, 1) in r.getMessage())]


@pytest.mark.subprocess
@pytest.mark.release_only
def test_server_draft_model_over_budget(folders):
    """``mlx_lm.server --draft-model`` with a hybrid main model and a hybrid draft, three states,
    three draft tokens: two completions answer the greedy text; the cap is logged once."""
    from mlx_lm import load

    from conftest import clean_env
    from support.chat_reference import token_reference
    from support.server import serve

    model, tokenizer = load(str(folders["hybrid"]))
    reference = token_reference(model, tokenizer, tokenizer.encode(PROMPT), 8)
    with serve(folders["hybrid"], "--draft-model", folders["hybrid-draft"], "--num-draft-tokens", "3",
               env=clean_env(MLX_LM_PATCHES_STRICT="1", **{SNAPSHOTS: "3"})) as server:
        for _ in range(2):
            reply = server.post("/v1/completions", {"prompt": PROMPT, "model": "default_model",
                                                    "max_tokens": 8, "temperature": 0.0})
            assert reply["choices"][0]["text"] == reference.text
        log = server.log()
    assert log.count(CAPPED.format(3, 1)) == 1, log[-3000:]

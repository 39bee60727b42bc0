"""Concurrent sequences decoding speculatively together (patch ``batch-speculative-decoding``).

``BatchGenerator(model, draft_model=..., num_draft_tokens=k)``: every row drafts, one batched
pass verifies all rows, each row accepts its own number of tokens and goes back on its own. The
draft is ``nearby_model`` (the main model's weights moved by noise): it agrees on most tokens,
not all, so rows accept different numbers of drafts in one round. Every row must equal greedy
decoding of that prompt alone (tokens, log-probabilities within 1e-4), its rows in fewer steps
than tokens. Hybrids of every recurrent kind and a dense control; rows of different lengths, rows
joining while others decode, their own ``max_tokens``, stop tokens, a row with logits processors
or its own sampler, the extracted cache (main then draft caches) inserted again, caches that
that cannot go back per row (a draft's sliding windows) decoding plainly; the main model's
sliding windows going back per row. The server: ``ModelProvider`` keeps
batching with a draft model and its generators take the draft (the HTTP answers are checked in
test_server_openai.py).
"""

import sys

import pytest

from mlx_lm_patches.selftest.scenarios import Decoded, greedy, prompt_tokens
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model, nearby_model
from mlx_lm_patches.mechanisms.adaptive import forced
from mlx_lm_patches.patches.batch_speculative_decoding import ATTR, batched_speculative
from support.counting import CountingModel

import mlx.core as mx  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(sys.modules["mlx_lm.generate"], "GenerationBatch"),
                                reason="this mlx-lm's BatchGenerator (before 0.31.2) does not host speculation")

HYBRIDS = available_model_types()
HYBRID = "qwen3_5" if "qwen3_5" in HYBRIDS else "qwen3_next"
# a hybrid whose recurrent layers have no states after each token of a pass (a Mamba-1 scan, short
# convolutions alone): its rows that reject go back to the round's start
GOES_BACK = next(t for t in ("jamba", "lfm2", "mamba", "kimi_linear") if t in HYBRIDS)
PROMPTS = [prompt_tokens(n, seed=n) for n in (5, 9, 13, 30)]
# draft lengths per round: up and down, runs without drafts (the draft then catches up, in one
# pass or, after rows joined, row by row) and back
SCHEDULE = [3, 1, 0, 0, 2, 3, 0, 3, 3, 1, 0, 2]


def _models(model_type, scale=0.01):
    return build_tiny_model(model_type, seed=1), nearby_model(model_type, seed=1, scale=scale)


def _assert_rows_equal_greedy(model, prompts, got, max_tokens):
    for i, (prompt, decoded) in enumerate(zip(prompts, got)):
        wanted = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        problem = greedy(model, prompt, max_tokens=wanted).compare(decoded)
        assert problem is None, f"row {i} ({len(prompt)} tokens): {problem}"


def _run(gen, uids, late=None, late_after=2):
    """Drive ``gen`` until every row finished; ``late``: (prompts, max_tokens) inserted after
    ``late_after`` steps. Returns ({uid: Decoded}, {uid: final prompt cache}, steps)."""
    decoded = {uid: Decoded([], []) for uid in uids}
    caches, steps = {}, 0
    while len(caches) < len(decoded):
        for r in gen.next_generated():
            decoded[r.uid].tokens.append(int(r.token))
            decoded[r.uid].logprobs.append(r.logprobs)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
        steps += 1
        if late and steps == late_after:
            new = gen.insert(*late)
            decoded.update({uid: Decoded([], []) for uid in new})
    mx.eval([d.logprobs for d in decoded.values()])
    return decoded, caches, steps


@pytest.mark.family_sweep(HYBRIDS)
@pytest.mark.parametrize("model_type", HYBRIDS + [DENSE_MODEL_TYPE])
def test_rows_of_different_lengths_each_equal_greedy_alone(model_type):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.batch_speculation import unhostable

    model, draft = _models(model_type)
    with forced(SCHEDULE):
        got, steps = batched_speculative(model, draft, PROMPTS, max_tokens=14, num_draft_tokens=3)
    _assert_rows_equal_greedy(model, PROMPTS, got, 14)
    plain = 14 * len(PROMPTS)  # each row's steps, summed, without drafts
    if unhostable(make_prompt_cache(model)):  # rotating windows: decoded plainly, batched
        assert steps == plain
    else:
        assert steps < plain, f"its rows took {steps} steps for 14 tokens each: the draft was not used"


@pytest.mark.family_sweep(HYBRIDS)
@pytest.mark.parametrize("model_type", HYBRIDS + [DENSE_MODEL_TYPE])
def test_rows_of_one_token_each_equal_greedy_alone(model_type):
    """Every row's prompt is one token (longcat_flash_ngram's n-gram context then grows in the
    first verify pass, so a row going back is narrower than one that kept every token)."""
    model, draft = _models(model_type, scale=0.05)  # some rows reject in the first round, some not
    prompts = [prompt_tokens(1, seed=s) for s in (11, 12, 13, 14)]
    with forced([3]):  # the first round's rows go back to different widths
        got, _ = batched_speculative(model, draft, prompts, max_tokens=8, num_draft_tokens=3)
    _assert_rows_equal_greedy(model, prompts, got, 8)


@pytest.mark.parametrize("model_type", [HYBRID, DENSE_MODEL_TYPE])
@pytest.mark.parametrize("scale", [0.0, 0.05])
def test_drafts_always_or_rarely_accepted(model_type, scale):
    """The draft is the main model itself (every draft accepted) or far from it (most rejected),
    two tokens drafted every round."""
    model, draft = _models(model_type, scale)
    with forced([2]):
        got, steps = batched_speculative(model, draft, PROMPTS, max_tokens=12, num_draft_tokens=2)
    _assert_rows_equal_greedy(model, PROMPTS, got, 12)
    if scale == 0.0:  # three tokens a round (the last sampled, two drafts), the first round two
        assert steps <= len(PROMPTS) * (12 // 3 + 1)


@pytest.mark.parametrize("model_type", [HYBRID, DENSE_MODEL_TYPE])
def test_rows_joining_leaving_and_stopping_on_their_own(model_type):
    """Rows with their own ``max_tokens``, one stopping on a stop token mid-round, two more
    joining while the first decode; afterwards the draft's caches hold no row."""
    from mlx_lm.generate import BatchGenerator

    model, draft = _models(model_type)
    reference = [greedy(model, p, max_tokens=16) for p in PROMPTS]
    stop = reference[1].tokens[6]  # row 1 ends on it (the token at step 7 or earlier)
    with forced(SCHEDULE):
        gen = BatchGenerator(model, max_tokens=16, stop_tokens=[[stop]], draft_model=draft, num_draft_tokens=3)
    first = gen.insert([list(p) for p in PROMPTS[:2]], [16, 9])
    late = ([list(p) for p in PROMPTS[2:]], [5, 16])
    decoded, _, _ = _run(gen, first, late=late)
    uids = sorted(decoded)
    for uid, prompt, wanted in zip(uids, PROMPTS, [16, 9, 5, 16]):
        ref = greedy(model, prompt, max_tokens=wanted)
        if stop in ref.tokens:
            end = ref.tokens.index(stop) + 1
            ref = Decoded(ref.tokens[:end], ref.logprobs[:end])
        assert ref.compare(decoded[uid]) is None, (uid, ref.compare(decoded[uid]))
    spec = vars(gen._generation_batch)[ATTR]
    assert spec.pending == [] and spec.drafts.cache == []
    gen.close()


def test_a_row_with_logits_processors_and_one_with_its_own_sampler():
    """A repetition penalty on one row (its next token from processed logits), an argmax sampler
    of its own on another: every row as the same batch decoded without a draft, and the rows
    without processors as greedy decoding alone. (0.31.x's batched decoding applies the penalty
    over another context than ``generate_step`` does: the batch without a draft is the reference
    for that row.)"""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    model, draft = _models(HYBRID)
    penalty = make_logits_processors(repetition_penalty=1.5)
    options = dict(logits_processors=[[], penalty, []], samplers=[None, None, lambda x: mx.argmax(x, axis=-1)])
    results = []
    for speculative in (False, True):
        with forced(SCHEDULE):
            gen = BatchGenerator(model, max_tokens=12, **(dict(draft_model=draft, num_draft_tokens=3)
                                                          if speculative else {}))
        uids = gen.insert([list(p) for p in PROMPTS[:3]], [12] * 3, **options)
        decoded, _, _ = _run(gen, uids)
        gen.close()
        results.append([decoded[uid] for uid in uids])
    plain, speculated = results
    for i, (a, b) in enumerate(zip(plain, speculated)):
        assert a.compare(b) is None, (i, a.compare(b))
    for i in (0, 2):
        assert greedy(model, PROMPTS[i], max_tokens=12).compare(speculated[i]) is None


@pytest.mark.parametrize("model_type", [HYBRID, DENSE_MODEL_TYPE])
def test_the_extracted_cache_is_main_then_draft_and_continues_exactly(model_type):
    """A finished row's cache is its main caches then its draft's (what the server's
    one-at-a-time path stores) and holds exactly the row's ``all_tokens``; inserted again for a
    follow-up it gives greedy decoding of the whole conversation, and the draft starts from its
    part: it is fed the follow-up's tokens only."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    model, draft = _models(model_type)
    draft = CountingModel(draft)
    n_main, n_draft = len(make_prompt_cache(model)), len(make_prompt_cache(draft))
    with forced(SCHEDULE):
        gen = BatchGenerator(model, max_tokens=10, draft_model=draft, num_draft_tokens=3)
    (uid,) = gen.insert([list(PROMPTS[1])], [10])
    history, cache = [], None
    while cache is None:
        for r in gen.next_generated():
            history.append(int(r.token))
            if r.finish_reason:
                cache, held = r.prompt_cache, list(r.all_tokens)
    assert len(cache) == n_main + n_draft
    assert held == PROMPTS[1] + history  # as stock: the prompt and every emitted token
    follow_up = prompt_tokens(6, seed=40)
    conversation = PROMPTS[1] + history + follow_up
    draft.shapes.clear()
    new = conversation[len(held):]
    (uid,) = gen.insert([new], [8], caches=[cache], all_tokens=[held])
    decoded, _, _ = _run(gen, [uid])
    gen.close()
    assert greedy(model, conversation, max_tokens=8).compare(decoded[uid]) is None
    assert draft.lengths[0] == len(new), draft.lengths[:3]


def test_supplied_draft_caches_wait_for_their_row_and_go_with_it():
    """Draft caches supplied with a request are kept until its row joins the generation batch;
    a request removed before that takes them with it (the next insert forgets them)."""
    from mlx_lm.generate import BatchGenerator

    model, draft = _models(HYBRID)
    gen = BatchGenerator(model, max_tokens=6, draft_model=draft, num_draft_tokens=2)
    (uid,) = gen.insert([list(PROMPTS[0])], [6])
    cache = held = None
    while cache is None:
        for r in gen.next_generated():
            if r.finish_reason:
                cache, held = r.prompt_cache, list(r.all_tokens)
    spec = vars(gen._generation_batch)[ATTR]
    (removed,) = gen.insert([prompt_tokens(4, seed=41)], [6], caches=[cache], all_tokens=[held])
    assert removed in spec.drafts.supplied
    gen.remove([removed])
    (kept,) = gen.insert([list(PROMPTS[1])], [6])
    assert spec.drafts.supplied == {}
    decoded, _, _ = _run(gen, [kept])
    gen.close()
    assert greedy(model, PROMPTS[1], max_tokens=6).compare(decoded[kept]) is None


# sliding windows of 6 positions: prompts of 5 to 30 tokens and 20 more wrap them, rows join with
# left padding beyond the window, every rejection lands after a wrap
NARROW_WINDOWS = {"recurrent_gemma": {"attention_window_size": 6}, "baichuan_m1": {"sliding_window": 6},
                  "exaone_moe": {"sliding_window": 6}, "gear": {"sliding_window": 6}}


def _hinted_rows(model, draft, prompts, max_tokens, share, **options):
    """``BatchGenerator`` with ``draft`` whose proposals are the true token at a pseudo-random
    ``share`` of the positions (support/batch_hints.py): each row's Decoded, the steps its rows
    took."""
    import random

    from mlx_lm.generate import BatchGenerator

    from support.batch_hints import hint_proposals

    gen = BatchGenerator(model, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=3, **options)
    uids = gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
    reference = {uid: list(p) + greedy(model, p, max_tokens=max_tokens, **options).tokens for uid, p in zip(uids, prompts)}
    hint_proposals(gen, reference, lambda uid, target: random.Random(uid * 7919 + target).random() < share)
    decoded, _, steps = _run(gen, uids)
    gen.close()
    return [decoded[u] for u in uids], steps


@pytest.mark.parametrize("model_type", sorted(NARROW_WINDOWS))
@pytest.mark.parametrize("share", [0.5, 0.9])
def test_sliding_windows_go_back_per_row(model_type, share):
    """Rows of sliding-window models draft, verify and go back on their own past the window (a row
    moves right inside the window, which keeps the ``max_size - 1`` positions its next token
    needs), each equal to greedy decoding alone, in fewer steps than tokens."""
    from mlx_lm_patches.selftest.tiny_models import _module_exists

    if not _module_exists(model_type):
        pytest.skip(f"no {model_type} in this mlx-lm")
    model = build_tiny_model(model_type, seed=1, overrides=NARROW_WINDOWS[model_type])
    with forced(SCHEDULE):
        got, steps = _hinted_rows(model, build_tiny_model(DENSE_MODEL_TYPE, seed=3), PROMPTS, 20, share)
    _assert_rows_equal_greedy(model, PROMPTS, got, 20)
    assert steps < len(PROMPTS) * 20


def test_a_draft_with_sliding_windows_decodes_plainly_with_one_warning(caplog):
    """A draft model's windows are fed a token a call, a ring that cannot go back per row: the
    generator decodes without drafting (one warning), every row still equal to greedy."""
    import logging

    from mlx_lm.generate import BatchGenerator

    model = build_tiny_model("qwen3", seed=1)
    draft = build_tiny_model("exaone_moe", seed=2, overrides={"sliding_window": 6})
    with caplog.at_level(logging.WARNING, logger="mlx_lm_patches"):
        gen = BatchGenerator(model, max_tokens=8, draft_model=draft, num_draft_tokens=3)
    assert [r.getMessage() for r in caplog.records if "without drafting" in r.getMessage()]
    assert ATTR not in vars(gen._generation_batch)
    decoded, _, steps = _run(gen, gen.insert([list(p) for p in PROMPTS[:2]], [8, 8]))
    gen.close()
    _assert_rows_equal_greedy(model, PROMPTS[:2], [decoded[u] for u in sorted(decoded)], 8)
    assert steps >= 8


def _provider(tmp_path, draft_path, main=None):
    import argparse

    from mlx_lm.server import ModelProvider

    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    main = main or write_model_folder(tmp_path / "main", build_tiny_model(HYBRID, seed=1), tiny_config(HYBRID))
    args = argparse.Namespace(model=str(main), adapter_path=None, draft_model=None, num_draft_tokens=2,
                              trust_remote_code=False, chat_template=None, use_default_chat_template=False,
                              pipeline=False)
    provider = ModelProvider(args)
    provider.load(str(main), None, draft_path)
    return provider


def test_the_server_keeps_batching_with_a_draft_model(tmp_path):
    """``mlx_lm.server --draft-model PATH`` (0.31.3 and later): the model provider stays
    batchable and the server's ``BatchGenerator(model, ...)`` drafts with that model and
    ``--num-draft-tokens``; 0.31.2 serves speculative requests one at a time."""
    from mlx_lm.generate import BatchGenerator

    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    draft = write_model_folder(tmp_path / "draft", build_tiny_model(DENSE_MODEL_TYPE, seed=2),
                               tiny_config(DENSE_MODEL_TYPE))
    provider = _provider(tmp_path, str(draft))
    if not hasattr(type(provider), "_load"):
        pytest.skip("0.31.2 decides batching in ModelProvider.load: its server is left as stock")
    assert provider.is_batchable
    gen = BatchGenerator(provider.model, max_tokens=4)
    spec = vars(gen._generation_batch)[ATTR]
    assert spec.drafts.draft is provider.draft_model and spec.most == 2
    gen.close()


def test_the_server_keeps_batching_with_the_mtp_head(tmp_path):
    """``mlx_lm.server --draft-model mtp`` (0.31.3 and later): the model provider stays
    batchable and the server's ``BatchGenerator(model, ...)`` drafts with the model's head
    (the HTTP answers are checked in test_mtp_server.py)."""
    from mlx_lm.generate import BatchGenerator

    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

    if HYBRID != "qwen3_5":
        pytest.skip("no qwen3_5 in this mlx-lm: its MTP head is the one written here")
    written = write_mtp_checkpoint(tmp_path, HYBRID, dtype="float32")
    provider = _provider(tmp_path, "mtp", main=written.folder)
    if not hasattr(type(provider), "_load"):
        pytest.skip("0.31.2 decides batching in ModelProvider.load: its server is left as stock")
    assert provider.draft_model is not None and provider.is_batchable
    gen = BatchGenerator(provider.model, max_tokens=4)
    spec = vars(gen._generation_batch)[ATTR]
    assert type(spec.drafts).__name__ == "HeadDrafts" and spec.drafts.draft is provider.draft_model
    assert spec.most == 2
    gen.close()


@pytest.mark.parametrize("model_type", [HYBRID, DENSE_MODEL_TYPE])
def test_adaptive_drafting_stops_drafting_a_draft_never_accepted(model_type):
    """Unforced (the default), a draft that is never accepted is soon left: the draft model is
    called in few of the rounds, the answers equal greedy decoding."""
    model, draft = build_tiny_model(model_type, seed=1), CountingModel(build_tiny_model(model_type, seed=9))
    got, steps = batched_speculative(model, draft, PROMPTS, max_tokens=40, num_draft_tokens=3)
    _assert_rows_equal_greedy(model, PROMPTS, got, 40)
    prefill = len(PROMPTS)  # one prefill pass a row (prompts shorter than a prefill step)
    assert draft.calls - prefill < 40, f"{draft.calls - prefill} draft calls in {steps} rounds"



def _round_widths(model, draft, schedule, max_tokens):
    """``PROMPTS`` decoded together with ``draft`` in the forced draft lengths ``schedule`` (each
    row checked against greedy alone): the tokens of each of the main model's passes from the
    first round on (the prompts' passes come before it)."""
    from mlx_lm.generate import BatchGenerator

    main = CountingModel(model)
    with forced(schedule):
        gen = BatchGenerator(main, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=max(schedule))
    uids = gen.insert([list(p) for p in PROMPTS], [max_tokens] * len(PROMPTS))
    decoded, _, _ = _run(gen, uids)
    gen.close()
    _assert_rows_equal_greedy(model, PROMPTS, [decoded[uid] for uid in uids], max_tokens)
    return main.lengths[main.shapes.index((len(PROMPTS), schedule[0] + 1)):]


@pytest.mark.parametrize("model_type", [GOES_BACK])
def test_rounds_after_a_rejection_are_as_wide_as_their_drafts(model_type):
    """A hybrid row whose round was rejected goes back and keeps its accepted tokens pending;
    the next rounds stay ``k + 1`` tokens wide (the row feeds its first pending tokens, keeps them,
    and catches up), so rounds without drafts cost a plain step; only where every row has as many
    pending, the first round without drafts takes them all at once (no row padded). Before, they
    were as wide as the longest pending row, and every shorter row was padded at the end and sent
    back again."""
    rounds = _round_widths(*_models(model_type, scale=0.05), [3] * 2 + [0] * 30, max_tokens=12)
    # the first round without drafts: 1 wide, or as wide as every row's pending tokens
    assert rounds[:2] == [4, 4] and rounds[2] <= 4 and set(rounds[3:]) == {1}, rounds


def test_a_round_without_drafts_after_every_row_rejected_takes_one_pass():
    """Every hybrid row rejected its draft: each has its kept token and the new one pending, so
    the round without drafts after it feeds both in one pass (before, a pass over the kept
    tokens that emitted nothing, then another), and the rounds after it are plain steps."""
    model, draft = build_tiny_model(GOES_BACK, seed=1), build_tiny_model(GOES_BACK, seed=9)
    rounds = _round_widths(model, draft, [1] + [0] * 30, max_tokens=8)  # the first: every row rejected
    assert rounds[:2] == [2, 2] and set(rounds[2:]) == {1}, rounds


@pytest.mark.parametrize("model_type", [t for t in ("qwen3_next", "qwen3_5", "nemotron_h") if t in HYBRIDS])
def test_a_gated_delta_or_mamba2_row_keeps_what_it_accepted(model_type):
    """A gated-delta or Mamba-2 row that rejected keeps the tokens it accepted (the states after each token
    of the verify pass were recorded, ``mechanisms/step_states.py``): nothing is fed again, every
    round without drafts after a rejected one is a plain step, and rounds of drafts each feed only
    their last sampled token and their drafts."""
    model, draft = build_tiny_model(model_type, seed=1), build_tiny_model(model_type, seed=9)
    rounds = _round_widths(model, draft, [1] + [0] * 30, max_tokens=8)  # the first: every row rejected
    assert rounds[0] == 2 and set(rounds[1:]) == {1}, rounds
    rounds = _round_widths(*_models(model_type, scale=0.05), [3] * 4 + [0] * 30, max_tokens=12)
    assert rounds[:4] == [4] * 4 and set(rounds[4:]) == {1}, rounds

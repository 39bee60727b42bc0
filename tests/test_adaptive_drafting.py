"""Adaptive drafting (patch ``adaptive-drafting``): speculative decoding chooses the draft length
of each round, and the output never moves.

* Forced schedules (``mechanisms.adaptive.forced``) that switch ``k`` up and down, with runs of
  ``k = 0`` and back, give greedy decoding's tokens and log-probabilities (1e-4): a hybrid
  (qwen3_5: recurrent journal), sliding windows (``max_kv_size`` rotating caches, through the
  same caches for the reference), a dense control; through ``speculative_generate_step``,
  ``stream_generate(draft_model=...)``, with a separate draft model and with an MTP head.
* The draft catches up exactly on what it missed at ``k = 0``: the main model as its own draft
  has every draft token accepted whatever the schedule (a draft that missed or repeated a token
  would propose other tokens).
* A supplied prompt cache ends holding exactly the prompt and the generated tokens (the next
  turn from it equals a cold prefill), also when the schedule ended at ``k = 0``.
* Unforced, a draft never accepted stops being asked (few draft calls); with
  ``MLX_LM_PATCHES_ADAPTIVE_DRAFTING=0`` every round drafts ``num_draft_tokens`` as in stock.
"""

import pytest

from conftest import reverted
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import continue_after_speculation, greedy
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model
from mlx_lm_patches.mechanisms.adaptive import Controller, forced

import mlx.core as mx  # noqa: E402

PATCH = "adaptive-drafting"
HYBRID = "qwen3_5" if "qwen3_5" in available_model_types() else "qwen3_next"
# up and down, runs of k = 0 (and one at the very end), single-round segments, a plain start
SCHEDULES = {"up-down": [3, 1, 0, 0, 2, 0, 3, 3, 1, 0, 0, 0, 2, 1, 0],
             "zero-runs": [1, 0, 0, 0, 0, 3, 0, 0, 2, 2, 0],
             # the prompt through plain decoding, the draft prefilled by its first catch-up
             "plain-start": [0, 0, 2, 0, 3, 1, 0, 0, 1]}
TOKENS = 16


def _speculate(model, draft, prompt, schedule, num_draft=3, max_tokens=TOKENS, **kwargs):
    """``schedule``: forced draft lengths, or None (the controller chooses)."""
    import contextlib

    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    tokens, logprobs, flags = [], [], []
    with forced(schedule) if schedule is not None else contextlib.nullcontext():
        for token, lp, from_draft in speculative_generate_step(
                mx.array(prompt), model, draft, num_draft_tokens=num_draft, max_tokens=max_tokens, **kwargs):
            tokens.append(int(token))
            logprobs.append(lp)
            flags.append(bool(from_draft))
    mx.eval(logprobs)
    return Decoded(tokens, logprobs), flags


def _expected_accepted(schedule, most, max_tokens, first_rejected=False, plain_start=True):
    """Draft tokens yielded when every proposal is accepted (but the first round's, if
    ``first_rejected``), under the controller's own caps. A run of plain rounds (mlx-lm's
    ``generate_step``, a token ahead) ends with one more plain token after the round whose
    next choice drafts."""
    controller, produced, accepted = Controller(most, schedule, plain_start=plain_start), 0, 0
    k = controller.choose(max_tokens - produced)
    while produced < max_tokens:
        kept = 0 if first_rejected and not produced else k
        got = min(kept + 1, max_tokens - produced)
        accepted += min(kept, got)
        produced += got
        controller.observe(k, kept)
        if produced >= max_tokens:
            break
        chosen = controller.choose(max_tokens - produced)
        if k == 0 and chosen:
            produced += 1  # the token generate_step had sampled ahead
        k = chosen
    return accepted


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("main_type", [HYBRID, DENSE_MODEL_TYPE])
def test_forced_schedules_equal_greedy(main_type, schedule):
    """A rejecting dense draft and the main model as its own draft (all accepted)."""
    model = build_tiny_model(main_type, seed=1)
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=TOKENS)
    for label, draft in (("rejecting draft", build_tiny_model(DENSE_MODEL_TYPE, seed=2)),
                         ("self-draft", build_tiny_model(main_type, seed=1))):
        got, flags = _speculate(model, draft, prompt, SCHEDULES[schedule])
        assert reference.compare(got) is None, f"{label}: {reference.compare(got)}"
        if label == "self-draft":  # the draft caught up exactly on the tokens decoded at k = 0
            assert sum(flags) == _expected_accepted(SCHEDULES[schedule], 3, TOKENS), flags


def test_sliding_windows_equal_generate_step():
    """``max_kv_size`` windows (RotatingKVCache(8, keep=4)) on both models, the prompt and the
    generation past the window, a hybrid main model; the reference decodes through the same
    kind of caches."""
    from mlx_lm.models.cache import make_prompt_cache

    model = build_tiny_model(HYBRID, seed=1)
    draft = build_tiny_model(HYBRID, seed=1)
    prompt = prompt_tokens(12, seed=5)
    reference = greedy(model, prompt, max_tokens=TOKENS, prompt_cache=make_prompt_cache(model, max_kv_size=8))
    for schedule in SCHEDULES.values():
        cache = make_prompt_cache(model, max_kv_size=8) + make_prompt_cache(draft, max_kv_size=8)
        got, _ = _speculate(model, draft, prompt, schedule, prompt_cache=cache)
        assert reference.compare(got) is None, f"{schedule}: {reference.compare(got)}"


@pytest.mark.parametrize("stop_after", [None, 9])
def test_supplied_cache_holds_prompt_and_generated_tokens(stop_after):
    """The schedule ends in a run of k = 0 (the draft far behind): both parts of the cache still
    continue like a cold prefill."""
    model, draft = build_tiny_model(HYBRID, seed=1), build_tiny_model(DENSE_MODEL_TYPE, seed=5)
    with forced([2, 0, 1, 0, 0, 0, 0, 0]):
        problem = continue_after_speculation(model, draft, max_tokens=12, stop_after=stop_after)
    assert problem is None, problem


def test_stream_generate_with_a_forced_schedule(tmp_path):
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    model, tokenizer = load(str(write_model_folder(tmp_path / "m", build_tiny_model(HYBRID, seed=1),
                                                   tiny_config(HYBRID))))
    draft = build_tiny_model(HYBRID, seed=1)  # the same weights: accepted rounds too

    def run(**kwargs):
        return [(int(r.token), r.logprobs) for r in stream_generate(model, tokenizer, "a b c d e",
                                                                    max_tokens=TOKENS, **kwargs)]

    plain = run()
    with forced(SCHEDULES["up-down"]):
        got = run(draft_model=draft, num_draft_tokens=3)
    assert [t for t, _ in got] == [t for t, _ in plain]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(plain, got)) <= 1e-4


def test_mtp_head_with_a_forced_schedule(tmp_path):
    """An MTP draft (a hybrid's head, hinted so that rounds accept) follows the main model's k = 0
    steps on its own."""
    from mlx_lm import load

    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
    from support.mtp_drafts import hinted_draft

    family = next(f for f in ("qwen3_5", "qwen3_next", "deepseek_v3") if f in available_model_types())
    model, _ = load(str(write_mtp_checkpoint(tmp_path, family, dtype="float32").folder))
    prompt = prompt_tokens(13, seed=4)
    reference = greedy(model, prompt, max_tokens=TOKENS)
    sequence = prompt + reference.tokens
    for schedule in SCHEDULES.values():
        got, flags = _speculate(model, hinted_draft(model, sequence, hint=lambda t: True), prompt, schedule)
        assert reference.compare(got) is None, f"{schedule}: {reference.compare(got)}"
        # releases without a draft prefill hand the whole prompt to the first round's draft call:
        # the head cannot draft before the model ran it, that round's proposals are rejected
        # (an MTP head follows the main model's passes: its sequence starts with the schedule's first
        # round drafting, no plain start)
        assert sum(flags) == _expected_accepted(schedule, 3, TOKENS, first_rejected=not flags[0],
                                                plain_start=False), flags


def _draft_calls(monkeypatch, setting):
    from mlx_lm_patches.engine import env
    from mlx_lm_patches.patches.adaptive_drafting import _draft_calls as count
    from mlx_lm.generate import speculative_generate_step

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, setting)
    return count(speculative_generate_step, limit=100)


def test_a_draft_never_accepted_stops_being_asked(monkeypatch):
    assert _draft_calls(monkeypatch, "1") <= 12


def test_off_switch_drafts_every_round(monkeypatch):
    assert _draft_calls(monkeypatch, "0") >= 46  # 2 per round (the last round: 1), 24 rounds


def test_controller_backs_off_and_returns():
    """Costs as measured: a plain round 1.0, each draft token 0.5 more. At 0 % acceptance the
    probes thin out (fewer than one round in 30 drafts); when acceptance returns the controller
    drafts two or more tokens again within 300 rounds (the longest probe interval and a few
    accepted probes)."""
    controller = Controller(4)
    drafted = 0
    for r in range(200):
        k = controller.choose()
        drafted += k > 0
        controller.observe(k, 0, 1.0 + 0.5 * k)
    assert drafted < 200 / 30, drafted
    for back in range(600):
        k = controller.choose()
        if k >= 2:
            break
        controller.observe(k, k, 1.0 + 0.5 * k)
    assert back < 300, "acceptance returned, the controller did not draft again"


def test_status_says_whether_it_is_on(monkeypatch):
    from mlx_lm_patches.__main__ import adaptive_drafting_line
    from mlx_lm_patches.engine import env

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "0")
    assert "off" in adaptive_drafting_line()
    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "1")
    assert adaptive_drafting_line().startswith("adaptive drafting: on")


def test_controller_retires_a_draft_whose_catch_up_alone_costs_too_much():
    """0 % acceptance, and the draft's catch-up costs 5 % of a plain step per token missed: after
    a probe at the longest wait the probes stop (at most 2 % of plain decoding spent on them)."""
    controller = Controller(4)
    waited, probes = 0, []
    for r in range(1500):
        k = controller.choose()
        if k:
            probes.append(r)
        controller.observe(k, 0, 1.0 + 0.5 * k, catch_up=0.05 * waited if k else 0.0)
        waited = 0 if k else waited + 1
    assert controller.retired and probes[-1] < 1000, probes


def _simulated_speed(draft, verify, acceptance, fixed=None, seed=0, tokens=192, most=3):
    """Tokens per plain-step time of one sequence on synthetic costs (a plain step = 1, times
    20 % log-normal noise): a round of k drafts costs ``draft * k + 1 + verify * k``, a switch
    out of plain decoding 1 and into it 2, the draft's catch-up ``draft`` per missed token, a
    rejected round's rollback 0.5. ``fixed``: stock's fixed k."""
    import random

    rng = random.Random(seed)
    spent, _ = _simulated_sequence(rng, Controller(most, plain_start=True), draft, verify, acceptance, tokens,
                                   fixed=fixed)
    return tokens / spent


def _simulated_sequence(rng, controller, draft, verify, acceptance, tokens, fixed=None, catch_up=None):
    """(time, the draft lengths run) of one sequence on the costs of :func:`_simulated_speed`,
    drawn from ``rng``; ``catch_up``: the draft's catch-up per missed token (default ``draft``)."""
    noise = lambda: rng.lognormvariate(0.0, 0.2)  # noqa: E731
    per_token = draft if catch_up is None else catch_up
    k = fixed if fixed is not None else controller.choose(tokens)
    spent, produced, previous, lag, rejected, chosen = 0.0, 0, None, 0, False, []
    while produced < tokens:
        chosen.append(k)
        caught, kept = 0.0, 0
        if k == 0:
            seconds = noise() + (2.0 if previous else 0.0)
            lag += 1
        else:
            caught, lag = per_token * lag * noise(), 0
            seconds = (draft * k + 1 + verify * k) * noise() + (1.0 if previous == 0 else 0.0)
            seconds += 0.5 * noise() if rejected else 0.0
            while kept < k and rng.random() < acceptance:
                kept += 1
            rejected = kept < k
        spent += seconds + caught
        produced += min(kept + 1, tokens - produced)
        if fixed is None:
            timed = previous is not None and not (k == 0 and previous)
            controller.observe(k, kept, seconds if timed else None, caught, first=k > 0 and previous != k)
            previous = k
            k = controller.choose(tokens - produced)
            if previous and not k:
                rollback = 0.5 * noise() if rejected else 0.0
                spent, rejected = spent + rollback, False
                controller.rolled_back(rollback)
        else:
            previous, k = k, min(fixed, max(tokens - produced - 1, 0))
    return spent, chosen


@pytest.mark.parametrize("case, draft, verify, acceptance", [
    ("never accepted", 0.3, 0.3, 0.0),
    ("as costly as the main model, all accepted", 0.7, 0.3, 1.0),
    ("cheap, all accepted", 0.1, 0.2, 1.0),
    ("cheap, 90 %", 0.1, 0.3, 0.9),
    ("a fifth of a step, 90 %, a cheap verify", 0.3, 0.15, 0.9),
])
def test_controller_on_synthetic_noisy_costs(case, draft, verify, acceptance):
    """Decisions, not speed: on synthetic costs with 20 % noise per round (median of 11
    sequences of 192 tokens), adaptive drafting stays at >= 0.93x plain decoding and >= 0.9x
    the best fixed k (the plain start and its exploration cost a few rounds of 192)."""
    import statistics

    adaptive = statistics.median(_simulated_speed(draft, verify, acceptance, seed=s) for s in range(11))
    best = max(statistics.median(_simulated_speed(draft, verify, acceptance, fixed=k, seed=s)
                                 for s in range(11)) for k in (1, 2, 3))
    assert adaptive >= 0.93, f"{case}: {adaptive:.2f}x plain decoding"
    assert adaptive >= 0.9 * best, f"{case}: {adaptive:.2f}x plain, the best fixed k {best:.2f}x"


@pytest.mark.parametrize("draft, verify, acceptance", [
    (0.1, 0.1, 0.6), (0.15, 0.1, 0.7), (0.15, 0.1, 0.5), (0.3, 0.3, 0.6),
])
def test_controller_at_fair_acceptance(draft, verify, acceptance):
    """Near the rate where one draft starts to pay (a 10-20 % gain, or a loss), whether a
    sequence keeps drafting turns on its first few rejections and the speeds of sequences split
    in two; over 41 sequences of 192 tokens (costs and noise as above) the mean stays >= 0.91x
    the better of plain decoding and the best fixed k (0.88x at 70 % when a few early
    rejections could end drafting for the sequence)."""
    import statistics

    def mean(fixed=None):
        return statistics.mean(_simulated_speed(draft, verify, acceptance, fixed=fixed, seed=s) for s in range(41))

    adaptive, best = mean(), max([1.0] + [mean(k) for k in (1, 2, 3)])
    assert adaptive >= 0.91 * best, f"{adaptive:.2f}x plain, the better of plain and fixed k {best:.2f}x"


def test_a_first_rounds_time_gives_way_to_the_first_usual_one():
    """A rejected first round of one draft took 5.0 (the switch out of plain decoding in it):
    an upper bound, kept only until a usual round of one draft is timed (1.2 here, after a
    rejection with no rollback time known yet), which replaces it; otherwise one draft would
    look four times as costly for the rest of the sequence and the round after it would be
    taken as a 3.8 rollback."""
    controller = Controller(3, plain_start=True)
    while controller.choose() == 0:
        controller.observe(0, 0, 1.0)
    controller.observe(1, 0, 5.0, first=True)
    assert controller.round_time(1) == 5.0
    assert controller.choose() == 1
    controller.observe(1, 0, 1.2)
    assert controller.round_time(1) == pytest.approx(1.2)
    assert not controller.rollback


def test_early_rejections_do_not_end_a_fair_draft():
    """The first two drafts rejected (one sequence in eleven at this rate), then seven in ten
    accepted; a round of one draft costs 1.35 plain steps (one draft pays from about 40 %) and
    the draft's catch-up 5 % of a plain step per missed token, so no probe from plain decoding
    is cheap and leaving drafting would be for good. Two rejections are not evidence enough:
    the controller keeps drafting, in most rounds."""
    controller = Controller(3, plain_start=True)
    outcomes = iter([0, 0] + [1, 1, 0, 1, 1, 0, 1, 1, 1, 0] * 100)
    chosen, waited = [], 0
    for _ in range(200):
        k = controller.choose()
        kept = 0
        while kept < k and next(outcomes):
            kept += 1
        controller.observe(k, kept, 1.0 + 0.35 * k, catch_up=0.05 * waited if k else 0.0,
                           first=bool(chosen) and k > 0 and chosen[-1] != k)
        waited = 0 if k else waited + 1
        chosen.append(k)
    assert not controller.retired, "".join(map(str, chosen))
    assert sum(k > 0 for k in chosen) > 150, "".join(map(str, chosen))


def test_one_slowed_plain_round_does_not_keep_a_rejected_draft_on():
    """Plain rounds of 0.3 (a tiny model's step) with one slowed to 10.0 by the machine, and a
    draft never accepted whose rounds take 2.5: the plain rounds' upper quartile (of three:
    their largest) is held within twice their median, so the controller still leaves drafting
    after two rounds of one draft. Unclipped it drafted to the end (21 draft calls for 24
    tokens, the `adaptive-drafting` scenario's failure under load)."""
    controller = Controller(2, plain_start=True)
    plain, chosen = iter([0.3, 0.3, 10.0] + [0.3] * 30), []
    for left in range(24, 0, -1):
        k = controller.choose(left)
        first = k > 0 and (not chosen or chosen[-1] != k)
        controller.observe(k, 0, next(plain) if k == 0 else (5.0 if first else 2.5), first=first)
        chosen.append(k)
    assert sum(chosen) <= 3, "".join(map(str, chosen))


def test_a_length_slowed_once_is_tried_again():
    """Every draft accepted; the rounds of three drafts cost 2.0 (a plain round 1.0, one draft
    1.6), but two of them were slowed to 10.0 by the machine: the controller drafts one token
    for a while, then forgets the stale times and drafts three again."""
    controller = Controller(3)
    slowed, chosen = 2, []
    for _ in range(120):
        k = controller.choose()
        chosen.append(k)
        seconds = {0: 1.0, 1: 1.6, 2: 1.8, 3: 2.0}[k]
        if k == 3 and slowed:
            seconds, slowed = 10.0, slowed - 1
        controller.observe(k, k, seconds, first=len(chosen) > 1 and chosen[-2] != k)
    schedule = "".join(map(str, chosen))
    assert "31" in schedule, f"the slowed rounds did not send it back to one draft: {schedule}"
    assert chosen[-20:].count(3) >= 15, schedule


def test_a_plain_starts_prompt_is_not_a_catch_up(monkeypatch):
    """After a plain start the draft's first call prefills the prompt, then catches up on the
    tokens decoded plainly: only the latter is a cost of plain rounds. A draft whose passes take
    2 ms a token and a prompt of 200 tokens: the catch-up the controller is told of is the few
    plain tokens' (under 0.1 s), not the prompt's 0.4 s (which, divided by the plain rounds, made
    any later probe look too costly to make)."""
    from mlx_lm_patches.mechanisms import adaptive
    from support.counting import CountingModel

    catch_ups = []
    observe = adaptive.Controller.observe

    def recorded(self, k, kept, seconds=None, catch_up=0.0, *args, **kwargs):
        catch_ups.append(catch_up)
        return observe(self, k, kept, seconds, catch_up, *args, **kwargs)

    monkeypatch.setattr(adaptive.Controller, "observe", recorded)
    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1)
    prompt = prompt_tokens(200, seed=3)
    reference = greedy(model, prompt, max_tokens=TOKENS)
    got, flags = _speculate(model, CountingModel(build_tiny_model(DENSE_MODEL_TYPE, seed=1), seconds_per_token=0.002),
                            prompt, None)
    assert reference.compare(got) is None
    assert any(flags), "the sequence never drafted"
    first = next(c for c in catch_ups if c)
    assert first < 0.1, f"the draft's first catch-up was reported as {first:.3f} s"


def test_a_batch_round_weighs_as_one_round_of_every_row():
    """Rows of a batch accepting 80 % of their drafts at costs where three drafts pay (a batch's
    plain round 0.23 s, rounds of 1-3 drafts 0.38, 0.48, 0.54 s, as measured with 8 rows of a
    qwen3_5 of width 1024): the estimate stays near 80 % and the batch keeps drafting. Decayed
    per observation, one round of 8 rows outweighed every round before it: an unlucky round sent
    the estimate to 50 % and the batch to plain decoding for good."""
    import random

    rng = random.Random(5)
    seconds = {0: 0.23, 1: 0.38, 2: 0.48, 3: 0.54}
    controller = Controller(3, plain_start=True)
    estimates, plain_after_start = [], 0
    for r in range(60):
        k = controller.choose()
        rows = []
        for _ in range(8):
            kept = 0
            while kept < k and rng.random() < 0.8:
                kept += 1
            rows.append((kept, k))
        controller.observe(k, max(n for n, _ in rows) if k else 0, seconds[k] * rng.uniform(0.95, 1.1),
                           first=r == 0, rows=rows if k else None)
        if r >= 12:
            estimates.append(controller.acceptance)
            plain_after_start += k == 0
    assert min(estimates) > 0.65 and max(estimates) < 0.92, (min(estimates), max(estimates))
    assert plain_after_start <= 2, plain_after_start


def _simulated_sequences(draft, verify, acceptances, seed=0, tokens=128, catch_up=None):
    """Sequences one after another on the synthetic costs of :func:`_simulated_speed`, each
    starting from what the one before left (as sequences with the same model and draft do);
    per sequence, (tokens per plain-step time, the draft lengths it ran). ``catch_up``: the
    draft's catch-up per missed token (default ``draft``)."""
    import random

    rng = random.Random(seed)
    memory, results = None, []
    for acceptance in acceptances:
        controller = Controller(3, plain_start=True, memory=memory)
        spent, chosen = _simulated_sequence(rng, controller, draft, verify, acceptance, tokens, catch_up=catch_up)
        memory = controller.memory()
        results.append((tokens / spent, chosen))
    return results


def test_a_later_sequence_starts_from_the_measured_costs():
    """Every draft accepted, cheap: the first sequence times plain rounds and rounds of one
    draft before it drafts three; the ones after it draft from their first round."""
    import statistics

    seeds = [_simulated_sequences(0.1, 0.2, [1.0] * 3, seed=s) for s in range(9)]
    for runs in seeds:
        assert runs[0][1][:3] == [0, 0, 0], runs[0][1][:8]
        for _, chosen in runs[1:]:
            assert chosen[0] >= 2 and chosen[:4].count(0) == 0, chosen[:8]
    first, later = (statistics.median(runs[i][0] for runs in seeds) for i in (0, 2))
    assert later > first, (later, first)


@pytest.mark.parametrize("case, draft, verify, acceptance, catch_up", [
    ("never accepted, a costly catch-up", 0.3, 0.3, 0.0, 0.05),
    ("as costly as the main model, all accepted", 1.0, 0.3, 1.0, 0.3),
])
def test_a_draft_given_up_is_not_tried_again_at_every_start(case, draft, verify, acceptance, catch_up):
    """The first sequence finds drafting does not pay and decodes plainly; the next three start
    plainly and draft no round at all; the fourth after the last one that drafted starts
    afresh (acceptance may have come back) and gives up again; the one after it drafts
    nothing."""
    runs = _simulated_sequences(draft, verify, [acceptance] * 6, catch_up=catch_up)
    drafted = [sum(1 for k in chosen if k) for _, chosen in runs]
    assert drafted[0] > 0 and drafted[1:4] == [0, 0, 0] and drafted[4] > 0 and drafted[5] == 0, (case, drafted)


def test_acceptance_that_comes_back_is_found_in_a_later_sequence():
    """Two sequences whose drafts are never accepted (a costly catch-up: no probe within a
    sequence), then sequences whose drafts all are: within four sequences one drafts most of
    its rounds again."""
    runs = _simulated_sequences(0.1, 0.2, [0.0, 0.0] + [1.0] * 5, catch_up=0.05)
    back = [sum(1 for k in chosen if k) / len(chosen) for _, chosen in runs[2:]]
    assert max(back[:4]) > 0.8, back


def test_a_sequence_starts_from_the_last_one_with_the_same_model_and_draft():
    """Through ``speculative_generate_step``: a draft never accepted whose passes cost 2 ms a
    token (its catch-up is costly). The first call measures and gives it up; the next calls
    with the same model and draft never call it; the fourth after the first starts afresh (it
    calls the draft again), as does a different draft object, and the first call after
    ``revert()``. Every call gives greedy decoding's tokens."""
    from support.counting import CountingModel

    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1)
    prompt = prompt_tokens(9, seed=3)
    reference = greedy(model, prompt, max_tokens=40)
    draft = CountingModel(build_tiny_model(DENSE_MODEL_TYPE, seed=2), seconds_per_token=0.002)
    calls = []
    for _ in range(5):
        before = draft.calls
        got, _ = _speculate(model, draft, prompt, None, max_tokens=40)
        assert reference.compare(got) is None
        calls.append(draft.calls - before)
    assert calls[0] > 0 and calls[1:4] == [0, 0, 0] and calls[4] > 0, calls
    before = draft.calls
    _speculate(model, draft, prompt, None, max_tokens=40)
    assert draft.calls == before, "the sequence after a fresh start did not start from it"
    with reverted(PATCH):  # revert() forgets what the sequences measured (the patch's memo)
        pass
    before = draft.calls
    got, _ = _speculate(model, draft, prompt, None, max_tokens=40)
    assert reference.compare(got) is None and draft.calls > before, "the memory outlived revert()"
    other = CountingModel(draft.model, seconds_per_token=0.002)
    got, _ = _speculate(model, other, prompt, None, max_tokens=40)
    assert reference.compare(got) is None and other.calls > 0, other.calls


@pytest.mark.parametrize("draft, verify, acceptance", [
    (0.1, 0.15, 0.0), (0.1, 0.15, 0.6), (0.1, 0.15, 0.7), (0.1, 0.15, 1.0),
    (0.3, 0.3, 0.5), (0.3, 0.3, 0.9), (0.1, 0.3, 0.7), (0.1, 0.3, 0.9),
])
def test_later_sequences_on_synthetic_costs(draft, verify, acceptance):
    """Sequences that start from the one before (costs as in :func:`_simulated_speed`, 192
    tokens, 15 seeds of four sequences): the later ones stay >= 0.95x the better of plain
    decoding and the best fixed k, and no worse than the first (which measures the costs)."""
    import statistics

    seeds = [_simulated_sequences(draft, verify, [acceptance] * 4, seed=s, tokens=192) for s in range(15)]
    first = statistics.median(runs[0][0] for runs in seeds)
    later = statistics.median(speed for runs in seeds for speed, _ in runs[1:])
    best = max([1.0] + [statistics.median(_simulated_speed(draft, verify, acceptance, fixed=k, seed=s)
                                          for s in range(15)) for k in (1, 2, 3)])
    assert later >= 0.95 * best, f"later sequences {later:.2f}x plain, the better of plain and fixed k {best:.2f}x"
    assert later >= first - 0.01, f"later sequences {later:.2f}x plain, the first {first:.2f}x"

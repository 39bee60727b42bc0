"""MTP self-speculative decoding: ``model.make_draft_model()`` (or ``--draft-model mtp``) as the
draft of mlx-lm's own speculative loop equals greedy decoding of the model, for dense and MoE,
hybrid MTP models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Nemotron-H) and attention-only ones of the
DeepSeek-V3 layout (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash) and MiMo; the draft's proposals are the
MTP head's predictions at the right positions;
missing heads give clear errors. Checkpoints are tiny, float32, written to disk and loaded with
``mlx_lm.load``, patches on."""

import importlib.util
import os

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import Decoded, LOGPROB_TOLERANCE, prompt_tokens
from mlx_lm_patches.selftest.scenarios import speculative_greedy
from mlx_lm_patches.selftest.mtp_checkpoints import MTP_MODEL_TYPES, write_mtp_checkpoint
from mlx_lm_patches.mechanisms.mtp.families import family_of
from support.counting import CountingModel
from support.references import greedy_of



@pytest.fixture(autouse=True)
def _fixed_draft_length(monkeypatch):
    """These tests follow the draft round by round at a fixed ``num_draft_tokens`` (which MTP
    layers draft, what each proposal is): adaptive drafting off (its schedules are tested in
    test_adaptive_drafting.py, MTP included)."""
    from mlx_lm_patches.engine import env

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "0")

FAMILIES = [f for f in MTP_MODEL_TYPES
            if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from mlx_lm import load

    root = tmp_path_factory.mktemp("mtp")
    folders = {f: write_mtp_checkpoint(root, f, dtype="float32").folder for f in FAMILIES}
    return {f: load(str(folder)) + (folder,) for f, folder in folders.items()}


@pytest.mark.parametrize("hidden,fusion", [("post", "embedding-first"), ("pre", "embedding-first"),
                                           ("post", "hidden-first")])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_mtp_speculation_equals_greedy(loaded, family, hidden, fusion):
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded[family][0]
    draft = model.make_draft_model(hidden=hidden, fusion=fusion)
    prompt = prompt_tokens(17, seed=4)
    reference = greedy_of(model, prompt, max_tokens=12)
    for num_draft in (1, 2, 3):
        got = speculative_greedy(model, draft, prompt, max_tokens=12, num_draft_tokens=num_draft)
        assert reference.compare(got) is None, f"num_draft_tokens={num_draft}: {reference.compare(got)}"
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    got = speculative_greedy(model, draft, prompt, max_tokens=12, num_draft_tokens=2, prompt_cache=cache)
    assert reference.compare(got) is None


@pytest.mark.parametrize("hidden", ["post", "pre"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_mtp_speculation_with_accepted_proposals_equals_greedy(loaded, family, hidden):
    """A random head's proposals are all rejected; with the true token hinted for two targets
    in three (the head still runs, see ``tests/support/mtp_drafts.py``) rounds accept some, all or
    none of their drafts, and the output is still the greedy output."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from support.mtp_drafts import hinted_draft

    model = loaded[family][0]
    prompt = prompt_tokens(17, seed=4)
    reference = greedy_of(model, prompt, max_tokens=16)
    for num_draft in (1, 2, 3):
        draft = hinted_draft(model, prompt + reference.tokens, hidden=hidden)
        steps = list(speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=num_draft,
                                               max_tokens=16))
        accepted = sum(bool(from_draft) for _, _, from_draft in steps)
        assert 0 < accepted < len(steps) - 1, accepted
        got = Decoded([int(t) for t, _, _ in steps], [lp for _, lp, _ in steps])
        assert reference.compare(got) is None, f"num_draft_tokens={num_draft}: {reference.compare(got)}"


@pytest.mark.parametrize("hinted", [False, True], ids=["own-proposals", "with-accepted-rounds"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_draft_proposals_are_the_heads_predictions_at_the_committed_position(loaded, family, hinted):
    """Each round's first draft logits are the MTP head's over the true sequence at slot C-1
    (main hidden h_{C-1}, token x_C, the head's cache holding every earlier slot), C being what
    the main model has committed - also after rounds that accepted drafts, where the head
    catches its cache up over several positions. Compared with one cold pass of the head over
    the whole sequence, within the log-probability tolerance."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.mtp.decoding import mtp_forward
    from support.mtp_drafts import hinted_draft, recording_draft

    model = loaded[family][0]
    proposals = []
    prompt = prompt_tokens(15, seed=9)
    draft = recording_draft(model, proposals)
    if hinted:
        draft = hinted_draft(model, prompt + greedy_of(model, prompt, max_tokens=10).tokens, draft=draft)
    steps = list(speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=2, max_tokens=10))
    sequence = prompt + [int(t) for t, _, _ in steps]
    assert len(proposals) >= 3
    assert any(from_draft for _, _, from_draft in steps) == hinted
    model(mx.array(sequence)[None])  # cold forward: the capture records every position
    kind = family_of(model).HIDDEN  # the hidden state the draft reads by default
    hidden = model.hidden_states()[kind]
    logits, _ = mtp_forward(model, hidden[:, :-1], mx.array(sequence[1:])[None], model.make_mtp_cache())
    checked = [(c, row) for c, row in proposals if c < len(sequence)]  # x_C must be in the sequence
    assert len(checked) >= 3
    for committed, row in checked:
        assert int(mx.argmax(row).item()) == int(mx.argmax(logits[0, committed - 1]).item()), committed
        worst = mx.abs(row - logits[0, committed - 1]).max().item()
        assert worst < LOGPROB_TOLERANCE, (committed, worst)


LAYERED = [f for f in ("mimo_v2_flash", "step3p5") if f in FAMILIES]  # heads with an MTP layer per draft step


def _layer_reference(model, sequence, committed, drafts, main=None):
    """Logits of MTP layer ``len(drafts)`` at position C-1 (C = ``committed``), computed cold over
    the whole prefix: layer k at position i takes the token at i+k+1 (the sequence's up to C,
    then ``drafts``) and the main hidden state at i, or for a chained family layer k-1's output
    at i before its final norm. ``main``: the main model's hidden states over ``sequence`` (a
    cold pass over it by default)."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.mtp.decoding import _mtp_pass, make_mtp_cache

    family = family_of(model)
    if main is None:
        model(mx.array(sequence)[None])
        main = model.hidden_states()[family.HIDDEN]
    main = main[:, :committed]
    tokens = sequence[:committed + 1] + drafts
    hidden = main
    for depth in range(len(drafts) + 1):
        ids = mx.array(tokens[depth + 1:committed + depth + 1])[None]
        logits, _, z = _mtp_pass(model, hidden, ids, make_mtp_cache(model, depth), depth=depth)
        hidden = z if family.CHAINED else main
    return logits[0, -1]


def _recording(model, calls):
    """The model's MTP draft, appending ``(C, drafts, logits)`` to ``calls`` for every proposal:
    the round's committed length, the tokens drafted before in the round, the proposal's row."""
    from mlx_lm_patches.mechanisms.mtp.decoding import MTPDraft

    class Recording(MTPDraft):
        def __call__(self, inputs, cache=None, **kwargs):
            state = cache[0]
            committed = self.capture.committed(state.since)
            logits = super().__call__(inputs, cache=cache, **kwargs)
            if committed and state.round_of == committed:  # (not a placeholder, e.g. while prefilling)
                calls.append((committed, [int(d.item()) for d in state.drafts], logits[0, -1]))
            return logits

    return Recording(model)


def _check_layer_proposals(model, sequence, calls, depths):
    """Every recorded proposal of a layer (not a recycled step past the last) equals the layer's
    cold pass over the prefix; returns the draft steps seen."""
    import mlx.core as mx

    checked = [(c, d, row) for c, d, row in calls if len(d) < depths and c + len(d) < len(sequence)]
    model(mx.array(sequence)[None])  # one cold pass: the main hidden states at every position
    main = model.hidden_states()[family_of(model).HIDDEN]
    for committed, drafts, row in checked:
        expected = _layer_reference(model, sequence, committed, drafts, main)
        worst = mx.abs(row - expected).max().item()
        assert worst < LOGPROB_TOLERANCE, (committed, drafts, worst)
    return {len(d) for _, d, _ in checked}


@pytest.mark.parametrize("hinted", [False, True], ids=["own-proposals", "with-accepted-rounds"])
@pytest.mark.parametrize("family", LAYERED)
def test_each_draft_step_uses_its_own_mtp_layer(loaded, family, hinted):
    """MiMo-V2-Flash and Step-3.5 ship an MTP layer per draft step: step k of a round is layer k's
    prediction at C-1 over the sequence extended by the round's drafts (Step-3.5's layers chained,
    each taking the previous one's output; MiMo-V2's each taking the main hidden state), equal to
    a cold pass of each layer over the whole prefix - also after rounds that accepted drafts,
    where each layer catches its cache up over several positions - within the log-probability
    tolerance. (Steps past the last layer recycle the last one's output: not compared.) Output:
    greedy."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.mtp.decoding import depths_of
    from support.mtp_drafts import hinted_draft

    model = loaded[family][0]
    depths = depths_of(model)
    assert depths > 1
    calls = []
    prompt = prompt_tokens(15, seed=9)
    reference = greedy_of(model, prompt, max_tokens=12)
    draft = _recording(model, calls)
    if hinted:
        draft = hinted_draft(model, prompt + reference.tokens, draft=draft)
    steps = list(speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=depths + 1,
                                           max_tokens=12))
    assert [int(t) for t, _, _ in steps] == reference.tokens
    assert any(from_draft for _, _, from_draft in steps) == hinted
    steps_seen = _check_layer_proposals(model, prompt + reference.tokens, calls, depths)
    assert steps_seen == set(range(depths)), [len(d) for _, d, _ in calls]


def _continued(model, family, first_max, second, trim=None, depths=None):
    """Generate from ``first`` (15 prompt tokens, ``first_max`` new ones) with the MTP draft on a
    prompt cache, optionally trim the cache back to ``trim`` tokens, then continue it with
    ``second(round_of)`` (tokens; ``round_of``: the draft's last round's C) for 12 more. The
    second run's output must be greedy's over its sequence, and each of its layer proposals the
    layer's cold pass (``_check_layer_proposals``); returns the draft steps checked."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    from mlx_lm_patches.mechanisms.mtp.decoding import depths_of

    if trim is not None and not can_trim_prompt_cache(make_prompt_cache(model)):
        pytest.skip(f"{family}'s cache cannot be trimmed back (a hybrid: the server reuses its snapshots)")
    depths, calls = depths_of(model), []
    first = prompt_tokens(15, seed=9)
    draft = _recording(model, calls)
    cache = make_prompt_cache(model) + draft.make_cache()
    generated = [int(t) for t, _, _ in speculative_generate_step(
        mx.array(first), model, draft, prompt_cache=cache, num_draft_tokens=depths + 1, max_tokens=first_max)]
    held = first + generated
    if trim is not None:
        assert trim_prompt_cache(cache[:-1], len(held) - trim) == len(held) - trim
        held = held[:trim]
    tokens = second(cache[-1].round_of)
    calls.clear()
    steps = list(speculative_generate_step(mx.array(tokens), model, draft, prompt_cache=cache,
                                           num_draft_tokens=depths + 1, max_tokens=12))
    # (the reference runs the model on caches of its own, which the draft would follow: after)
    reference = greedy_of(model, held + tokens, max_tokens=12)
    assert [int(t) for t, _, _ in steps] == reference.tokens
    return _check_layer_proposals(model, held + tokens + reference.tokens, calls, depths)


SUFFIXES = ("1", "2", "6", "to-the-last-round")


# every suffix for heads with several layers; for the others, the two with a catch of their own
@pytest.mark.parametrize("family,suffix", [(f, s) for f in FAMILIES
                                           for s in (SUFFIXES if f in LAYERED else ("2", "to-the-last-round"))])
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_the_draft_follows_a_prompt_cache_trimmed_back(loaded, family, suffix):
    """A prompt cache (the main model's and the draft's) trimmed back into the prompt and
    extended with other tokens - one, two (no main pass before the draft's first round), six,
    or as many as bring the main model back to the previous generation's last round: every MTP
    layer keeps only the slots whose tokens are still the sequence's, so each proposal of the
    next request equals the layer's cold pass over its own sequence; output greedy's."""
    from mlx_lm_patches.mechanisms.mtp.decoding import depths_of

    model = loaded[family][0]
    other = prompt_tokens(40, seed=31)

    def second(round_of):  # the tokens after the first 8
        return other[:round_of - 8 + 1] if suffix == "to-the-last-round" else other[:int(suffix)]

    steps_seen = _continued(model, family, 12, second, trim=8)
    assert steps_seen == set(range(depths_of(model))), steps_seen


@pytest.mark.parametrize("family", LAYERED)
def test_a_layered_draft_keeps_its_layers_through_a_continued_conversation(loaded, family):
    """A generation cut by max_tokens (its last rounds draft fewer tokens than the head has layers)
    continued on the same prompt cache: no layer starts again - each proposal of the
    continuation equals the layer's cold pass over the whole conversation; output greedy's."""
    from mlx_lm_patches.mechanisms.mtp.decoding import depths_of

    model = loaded[family][0]
    for first_max in (10, 11, 13):
        steps_seen = _continued(model, family, first_max, lambda _: prompt_tokens(3, seed=41))
        assert steps_seen == set(range(depths_of(model))), (first_max, steps_seen)


@pytest.mark.parametrize("family", LAYERED)
def test_a_layered_draft_drafting_fewer_tokens_than_layers_holds_little(loaded, family):
    """Fewer draft tokens per round than MTP layers (mlx-lm's default of 2 for Step-3.5's three):
    the layers that never draft hold nothing, and the outputs kept for the next layer stay
    bounded (``OUTPUTS_KEPT`` and a round), however long the generation; output greedy."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.mtp.decoding import OUTPUTS_KEPT, depths_of
    from support.mtp_drafts import hinted_draft

    model = loaded[family][0]
    depths = depths_of(model)
    prompt = prompt_tokens(15, seed=9)
    reference = greedy_of(model, prompt, max_tokens=120)
    draft = hinted_draft(model, prompt + reference.tokens)
    cache = make_prompt_cache(model) + draft.make_cache()
    steps = list(speculative_generate_step(mx.array(prompt), model, draft, prompt_cache=cache,
                                           num_draft_tokens=depths - 1, max_tokens=120))
    assert [int(t) for t, _, _ in steps] == reference.tokens
    state = cache[-1]
    held = [0 if kept is None else kept[1].shape[1] for kept in state.outs]
    assert max(held) <= OUTPUTS_KEPT + depths, held
    assert all(c.offset == 0 for c in state.kvs[-1]), "the last layer never drafted"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_a_rejected_mtp_draft_costs_a_hybrid_no_model_call_of_its_own(loaded, family):
    """A hybrid main model goes back over a rejected draft by restoring the recurrent state kept
    before the verify pass; the accepted tokens since are re-run in front of the next verify
    pass, not in a pass of their own, although the MTP draft reads the main model in between:
    it takes the hidden state of the last accepted token from the verify pass. Same proposals
    (committed positions and logits) and the greedy output as when the re-run is done at once;
    fewer main forward passes. (Gated-delta layers keep their states after each token of the
    pass, ``mechanisms/step_states.py``: nothing is re-run, either way.)"""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.caches import arrays_cache_class, flat_caches
    from mlx_lm_patches.mechanisms.step_states import StepStates
    from support.mtp_drafts import recording_draft

    model = loaded[family][0]
    if not any(isinstance(c, arrays_cache_class()) for c in flat_caches(make_prompt_cache(model))):
        pytest.skip(f"{family} keeps no recurrent state: its caches trim here without any re-run")
    prompt = prompt_tokens(15, seed=9)
    reference = greedy_of(model, prompt, max_tokens=10)
    calls, seen = {}, {}
    for at_once in (False, True):
        main, proposals = CountingModel(model), []
        draft = recording_draft(model, proposals)
        if at_once:
            draft.reads_main_model = True  # what made the loop re-run accepted tokens at once
        got = speculative_greedy(main, draft, prompt, max_tokens=10, num_draft_tokens=2)
        assert reference.compare(got) is None, (at_once, reference.compare(got))
        calls[at_once], seen[at_once] = main.calls, proposals
    if StepStates(model):  # gated-delta layers: their states after each token are kept, nothing is re-run
        assert calls[False] == calls[True], calls
    else:
        assert calls[False] < calls[True], calls
    assert [c for c, _ in seen[False]] == [c for c, _ in seen[True]]
    for (_, fused), (_, rerun) in zip(seen[False], seen[True]):
        assert mx.abs(fused - rerun).max().item() < LOGPROB_TOLERANCE


def test_missing_head_is_a_clear_error(tmp_path):
    from mlx_lm import load

    from mlx_lm_patches.mechanisms.mtp.decoding import MTPUnavailable

    written = write_mtp_checkpoint(tmp_path, "qwen3_next", drop=["mtp.norm.weight"])
    model, _ = load(str(written.folder))
    with pytest.raises(MTPUnavailable, match=r"missing 1 tensors \(mtp.norm.weight\)"):
        model.make_draft_model()


def test_draft_model_mtp_selects_the_head(loaded):
    """What ``mlx_lm.generate --model PATH --draft-model mtp`` does: load(PATH), then load("mtp")."""
    import sys

    from mlx_lm_patches.mechanisms.mtp.decoding import MTPDraft

    load = sys.modules["mlx_lm.generate"].load
    model, tokenizer = load(str(loaded[FAMILIES[0]][2]))
    draft, draft_tokenizer = load("mtp")
    assert isinstance(draft, MTPDraft) and draft.main is model and draft_tokenizer is tokenizer


# Every way in the README names: the console script, python -m, the package's runner (with
# automatic activation off, so it alone applies), and the launcher (automatic activation itself:
# MLX_LM_PATCHES=0 turns it off too).
CLI_FORMS = {
    "console-script": lambda bin_dir, python: [os.path.join(bin_dir, "mlx_lm.generate")],
    "python -m": lambda bin_dir, python: [python, "-m", "mlx_lm.generate"],
    "run -m": lambda bin_dir, python: [python, "-m", "mlx_lm_patches", "run", "-m", "mlx_lm.generate"],
    "mlx-lm-patches-run": lambda bin_dir, python: [os.path.join(bin_dir, "mlx-lm-patches-run"),
                                                   os.path.join(bin_dir, "mlx_lm.generate")],
}


def _generate_cli(folder, *extra, form="console-script"):
    import subprocess
    import sys

    from conftest import clean_env

    command = CLI_FORMS[form](os.path.dirname(sys.executable), sys.executable)
    env = clean_env(MLX_LM_PATCHES="0") if form == "run -m" else clean_env()
    proc = subprocess.run([*command, "--model", folder, "--prompt", "the quick brown fox", "--max-tokens", "12",
                           "--verbose", "False", *extra], capture_output=True, text=True, timeout=300,
                          env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def generate_cli_reference(loaded):
    reference = _generate_cli(str(loaded[FAMILIES[0]][2]))
    assert reference.strip()
    return reference


@pytest.mark.subprocess
@pytest.mark.parametrize("form", sorted(CLI_FORMS))
def test_generate_cli_draft_model_mtp(loaded, generate_cli_reference, form):
    """``mlx_lm.generate --model PATH --draft-model mtp``, every way in: the same text as
    without a draft."""
    folder = str(loaded[FAMILIES[0]][2])
    assert _generate_cli(folder, "--draft-model", "mtp", "--num-draft-tokens", "2", form=form) == generate_cli_reference


@pytest.mark.subprocess
def test_generate_cli_draft_model_mtp_without_a_head_is_one_line(tmp_path):
    """``--draft-model mtp`` on a checkpoint without a head: one line on stderr that says why
    and how to get one, exit status 1, no traceback."""
    import os
    import subprocess
    import sys

    from conftest import clean_env

    full = write_mtp_checkpoint(tmp_path, "qwen3_next", name="full")
    written = write_mtp_checkpoint(tmp_path, "qwen3_next", name="no-head", drop=[f"mtp.{k}" for k in full.head])
    script = os.path.join(os.path.dirname(sys.executable), "mlx_lm.generate")
    proc = subprocess.run([script, "--model", str(written.folder), "--prompt", "hi", "--max-tokens", "4",
                           "--draft-model", "mtp"], capture_output=True, text=True, timeout=300,
                          env=clean_env(), cwd="/")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("mlx_lm.generate: --draft-model mtp: ")
    assert "the checkpoint has no mtp.* tensors" in proc.stderr and "load a checkpoint that ships one" in proc.stderr

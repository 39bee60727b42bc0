"""The recurrent states after every token of one forward pass (``mechanisms/step_states.py``):
for gated-delta layers of the Qwen3-Next layout and Mamba-2 layers, the states :class:`StepStates` gives after ``j``
of a pass's ``W`` tokens equal those of a pass over only those ``j`` tokens (within 1e-5), the
recorded pass's logits equal the pass without it (within 1e-5: a Mamba-2 scan of one token is
computed as a decode step computes it), and the model and mlx-lm are as before once it closes. Other
recurrent layouts answer None (their rows go back to before the pass).
"""

import sys

import pytest

from mlx_lm_patches.mechanisms.batch_speculation import _states
from mlx_lm_patches.mechanisms.caches import flat_caches
from mlx_lm_patches.mechanisms.step_states import StepStates
from mlx_lm_patches.selftest.scenarios import prompt_tokens
from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

import mlx.core as mx  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(sys.modules["mlx_lm.generate"], "GenerationBatch"),
                                reason="used by batched speculation, which this mlx-lm (before 0.31.2) does not host")

# gated-delta (Qwen3-Next layout) and Mamba-2 layers: recorded
RECORDED = [t for t in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "falcon_h1", "granitemoehybrid",
                        "mamba2", "plamo2") if t in available_model_types()]
# Mamba-1 scans, short convolutions alone, separate convolutions per projection: not recorded
OTHER = [t for t in ("jamba", "mamba", "lfm2", "kimi_linear") if t in available_model_types()]
WIDTH = 4


def _batch_caches(model, prompts):
    """Batch caches of ``prompts`` (each prefilled alone, then merged, as ``BatchGenerator``
    joins rows)."""
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache

    rows = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    return _merge_caches(rows)


def _recurrent_slots(caches):
    return [list(c.cache) for c in flat_caches(caches) if type(c).__name__ == "ArraysCache"]


@pytest.mark.parametrize("model_type", RECORDED)
def test_the_states_after_each_token_equal_a_pass_over_those_tokens(model_type):
    model = build_tiny_model(model_type, seed=1)
    prompts = [prompt_tokens(7, seed=1), prompt_tokens(7, seed=2)]
    inputs = mx.array([prompt_tokens(WIDTH, seed=3), prompt_tokens(WIDTH, seed=4)])

    plain = _batch_caches(model, prompts)
    wanted_logits = model(inputs, cache=plain)

    caches = _batch_caches(model, prompts)
    before = _states(caches)
    with StepStates(model) as steps:
        logits = model(inputs, cache=caches)
    assert mx.allclose(logits, wanted_logits, atol=1e-5).item()
    after = steps.after(caches, before, range(1, WIDTH))
    assert after is not None
    for j in range(1, WIDTH):
        alone = _batch_caches(model, prompts)
        model(inputs[:, :j], cache=alone)
        got = [slots for slots in (leaf[0] for leaf in after[j] if leaf is not None)]
        wanted = _recurrent_slots(alone)
        assert len(got) == len(wanted) > 0
        for layer, (g, w) in enumerate(zip(got, wanted)):
            for slot in range(2):
                assert g[slot].shape == w[slot].shape
                assert mx.allclose(g[slot], w[slot], atol=1e-5).item(), (j, layer, slot)


@pytest.mark.parametrize("model_type", RECORDED[:1])
def test_the_model_and_mlx_lm_are_as_before_once_it_closes(model_type):
    model = build_tiny_model(model_type, seed=1)
    module = sys.modules[f"mlx_lm.models.{model_type}"]
    update = module.gated_delta_update
    convs = [m["conv1d"] for m in model.modules() if "conv1d" in m]
    caches = _batch_caches(model, [prompt_tokens(5, seed=1)])
    with pytest.raises(RuntimeError):
        with StepStates(model):
            assert module.gated_delta_update is not update
            raise RuntimeError("a pass that failed")
    assert module.gated_delta_update is update
    assert [m["conv1d"] for m in model.modules() if "conv1d" in m] == convs
    assert all(type(c).__name__ == "Conv1d" for c in convs)
    assert model(mx.array([[1, 2]]), cache=caches).shape[:2] == (1, 2)


@pytest.mark.parametrize("model_type", OTHER)
def test_other_recurrent_layouts_have_no_step_states(model_type):
    model = build_tiny_model(model_type, seed=1)
    caches = _batch_caches(model, [prompt_tokens(5, seed=1)])
    before = _states(caches)
    with StepStates(model) as steps:
        model(mx.array([prompt_tokens(WIDTH, seed=2)]), cache=caches)
    assert steps.after(caches, before, [1]) is None


@pytest.mark.parametrize("model_type", RECORDED[:1])
def test_the_journal_keeps_a_verify_passs_states_not_a_prompts(model_type):
    """Through the speculative loop's journal (``mechanisms/journal.py``, window 4): a pass of
    4 tokens leaves a kept state before each of its tokens, so a trim into it re-runs nothing;
    a prompt's pass (12 tokens) is not recorded (a trim never goes that far back)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.journal import Journal

    model = build_tiny_model(model_type, seed=1)
    caches = make_prompt_cache(model)
    journal = Journal(model, caches, window=4, fuse=True)
    journal.forward(mx.array([prompt_tokens(12, seed=1)]), caches)
    assert [s.pos for s in journal._snapshots] == [0]
    journal.forward(mx.array([prompt_tokens(4, seed=2)]), caches)
    assert [s.pos for s in journal._snapshots][-4:] == [12, 13, 14, 15]
    assert journal.trim(caches, 2) == 2 and journal.position == 14 and journal._pending is None
    alone = make_prompt_cache(model)
    model(mx.array([prompt_tokens(12, seed=1) + prompt_tokens(4, seed=2)[:2]]), cache=alone)
    for got, wanted in zip(_recurrent_slots(caches), _recurrent_slots(alone)):
        for slot in range(2):
            assert mx.allclose(got[slot], wanted[slot], atol=1e-5).item()
    journal.detach()

"""Batched generation of every hybrid family equals single-sequence greedy decoding (tokens, and
log-probabilities within 1e-4), in the three situations of issue 3: prompts of different
lengths, a prompt inserted into a generator already decoding, prompts continuing from pre-filled
per-prompt caches. Through mlx-lm's own BatchGenerator and batch_generate, patches on."""

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy, split_prefilled
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model
from support.references import tiny_greedy
from support.upstream_bugs import RECURRENT_GEMMA_JOIN


# (model_type, situation) -> True where the cell is known wrong and its fix is pending
PENDING = {}

SITUATIONS = ("different-lengths", "inserted-while-decoding", "prefilled-caches")


def _cell(model_type, situation):
    marks = []
    if PENDING.get((model_type, situation)):
        marks.append(pytest.mark.xfail(strict=True, reason="known inexact, fix pending (issue 3)"))
    return pytest.param(model_type, situation, marks=marks, id=f"{model_type}-{situation}")


CELLS = [_cell(t, s) for t in [DENSE_MODEL_TYPE] + available_model_types() for s in SITUATIONS]


@pytest.mark.family_sweep(available_model_types())
@pytest.mark.parametrize("model_type,situation", CELLS)
def test_batched_equals_single_sequence(model_type, situation):
    model = build_tiny_model(model_type, seed=1)
    prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13)]
    reference = [tiny_greedy(model_type, p) for p in prompts]
    if situation == "different-lengths":
        got = batched_greedy(model, prompts)
    elif situation == "inserted-while-decoding":
        got = batched_greedy(model, prompts[:2], late_prompts=prompts[2:], late_after=3)
    else:
        caches, rest = split_prefilled(model, prompts, (3, 6, 4))
        got = batched_greedy(model, rest, caches=caches)
    problems = [ref.compare(g) for ref, g in zip(reference, got)]
    assert not any(problems), problems


@pytest.mark.parametrize("model_type", [t for t in ("nemotron_h", "jamba", "qwen3_next") if t in available_model_types()])
def test_batch_generate_token_ids_equal_generate(model_type):
    """The public batch_generate entry point, with a real tokenizer, equals mlx_lm.generate."""
    import inspect
    import tempfile

    from mlx_lm import load
    from mlx_lm.generate import batch_generate
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    if "return_token_ids" not in inspect.signature(batch_generate).parameters:
        pytest.skip("batch_generate of this release returns texts only")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_folder(tmp, build_tiny_model(model_type, seed=2), tiny_config(model_type))
        model, tokenizer = load(str(folder))
    texts = ["the quick brown fox", "a b", "jumps over the lazy dog and then some"]
    prompts = [tokenizer.encode(t) for t in texts]
    batched = batch_generate(model, tokenizer, prompts, max_tokens=6, return_token_ids=True)
    for prompt, ids in zip(prompts, batched.token_ids):
        single = greedy(model, prompt, max_tokens=6).tokens
        eos = set(tokenizer.eos_token_ids)
        cut = next((i + 1 for i, t in enumerate(single) if t in eos), len(single))
        assert list(ids)[:cut] == single[:cut]


@pytest.mark.skipif("recurrent_gemma" not in available_model_types(), reason="no recurrent_gemma in this mlx-lm")
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=RECURRENT_GEMMA_JOIN)
def test_recurrent_gemma_rows_joining_a_step_apart_equal_each_alone():
    """Rows of 61, 25 and 121 prompt tokens inserted a step apart: each equals decoding it alone
    (support/upstream_bugs.py: the third emits its 7th token twice)."""
    import sys

    generate = sys.modules["mlx_lm.generate"]
    if not hasattr(generate, "GenerationBatch"):
        pytest.skip("this mlx-lm's BatchGenerator (before 0.31.2) is not measured for this")
    model = build_tiny_model("recurrent_gemma", seed=1)
    prompts = [prompt_tokens(n, seed=n) for n in (61, 25, 121)]
    gen = generate.BatchGenerator(model, max_tokens=10)
    out, row, step = {}, {}, 0
    while len(out) < 3 or any(len(tokens) < 10 for tokens in out.values()):
        if step < 3:
            (uid,) = gen.insert([prompts[step]], [10])
            row[uid], out[uid] = step, []
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
        step += 1
    gen.close()
    for uid, tokens in out.items():
        assert tokens == greedy(model, prompts[row[uid]], max_tokens=10).tokens, row[uid]

"""Batched generation of every hybrid family equals single-sequence greedy decoding (tokens, and
log-probabilities within 1e-4), in the three situations of issue 3: prompts of different
lengths, a prompt inserted into a generator already decoding, prompts continuing from pre-filled
per-prompt caches. Through mlx-lm's own BatchGenerator and batch_generate, patches on."""

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import (
    batched_greedy,
    fresh_rows_beside_history,
    greedy,
    short_prompts_beside_longer,
    split_prefilled,
)
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model
from support.references import tiny_greedy


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


@pytest.mark.parametrize("model_type", [DENSE_MODEL_TYPE] + available_model_types())
def test_a_new_row_beside_rows_with_history_equals_it_alone(model_type, mlx_lm_version):
    """A prompt inserted while another is still prefilled (it joins that row's prompt batch from
    0.31.2), and a new prompt batched with one continuing a pre-filled cache: each row equals
    decoding it alone (``batch-fresh-row-state``: recurrent_gemma's rows started from zeros)."""
    from packaging.version import Version

    if model_type == DENSE_MODEL_TYPE and mlx_lm_version is not None and mlx_lm_version < Version("0.30.4"):
        pytest.skip("before 0.30.4 BatchKVCache.merge cannot take an empty cache beside a filled one: "
                    "a dense-model crash outside this package (hybrid prompts are prefilled alone there)")
    assert fresh_rows_beside_history(build_tiny_model(model_type, seed=1), model_type) is None


@pytest.mark.parametrize("model_type", [DENSE_MODEL_TYPE] + available_model_types())
def test_prompts_of_one_and_two_tokens_beside_longer_ones_equal_each_alone(model_type, mlx_lm_version):
    """Prompts shorter than a recurrent layer's window (longcat_flash_ngram keeps the last
    ``n - 1`` token ids: ``ngram-context-rows``) beside longer ones: together, inserted while
    decoding, inserted mid-prefill, beside continued prompt caches of 5 and 1 tokens; each row
    equals decoding it alone."""
    from packaging.version import Version

    if model_type == DENSE_MODEL_TYPE and mlx_lm_version is not None and mlx_lm_version < Version("0.30.4"):
        pytest.skip("before 0.30.4 BatchKVCache.merge cannot take an empty cache beside a filled one: "
                    "a dense-model crash outside this package (hybrid prompts are prefilled alone there)")
    assert short_prompts_beside_longer(build_tiny_model(model_type, seed=1), model_type) is None


@pytest.mark.parametrize("cache_class", ["KVCache", "RotatingKVCache"])
def test_new_rows_joining_a_prompt_in_its_prefill_get_a_row_of_keys_each(cache_class):
    """Prompts joining one still in its prefill (``PromptProcessingBatch.extend``, 0.31.2 and
    later): an attention cache that holds nothing yet gets one row of keys and values per new
    sequence, and the row already there keeps its own (0.31.2 gave the new side the other side's
    row count: ``prompt-batch-join-state``), for one new row beside two and two beside one."""
    import sys

    import mlx.core as mx
    import mlx_lm.models.cache as cache

    generate = sys.modules["mlx_lm.generate"]
    if not hasattr(generate, "PromptProcessingBatch"):
        pytest.skip("this mlx-lm prefills each new prompt in a batch of its own")
    make = (lambda: cache.KVCache()) if cache_class == "KVCache" else (lambda: cache.RotatingKVCache(8))

    def held(value):
        c = make()
        c.update_and_fetch(mx.full((1, 1, 2, 4), value), mx.full((1, 1, 2, 4), value))
        return [c]

    for present, joining in ((1, 2), (2, 1)):
        batch = generate.PromptProcessingBatch(None, list(range(present)), [held(i + 1) for i in range(present)])
        batch.extend(generate.PromptProcessingBatch(None, list(range(present, present + joining)),
                                                    [[make()] for _ in range(joining)]))
        c = batch.prompt_cache[0]
        mx.eval(c.keys, c.values)
        assert c.keys.shape[0] == c.values.shape[0] == present + joining, (present, joining, c.keys.shape)
        for i in range(present):  # the rows with history keep their keys, right-aligned
            assert c.keys[i, 0, -2:].tolist() == [[float(i + 1)] * 4] * 2
        assert not mx.any(c.keys[present:]).item() and not mx.any(c.values[present:]).item()


@pytest.mark.parametrize("cache_class", ["BatchKVCache", "BatchRotatingKVCache"])
def test_an_engine_extending_batch_caches_gets_a_row_of_keys_per_sequence(cache_class, mlx_lm_version):
    """An engine joining rows by calling a batch attention cache's own ``extend``, with one side
    that holds nothing yet (on either side): the result has one row of keys per sequence, the
    rows with history keep theirs, and the new rows hold nothing but zeros (0.31.2 gave the empty
    side the other side's row count: ``prompt-batch-join-state``). Before 0.31.2 mlx-lm itself
    never extends with an empty side, and its ``extend`` refuses one (an AttributeError)."""
    import mlx.core as mx
    import mlx_lm.models.cache as cache
    from packaging.version import Version

    if mlx_lm_version is not None and mlx_lm_version < Version("0.31.2"):
        pytest.skip("before 0.31.2 a batch cache's extend refuses a side without keys")
    cls = getattr(cache, cache_class)
    make = (lambda rows: cls([0] * rows)) if cache_class == "BatchKVCache" else (lambda rows: cls(8, [0] * rows))
    for present, joining in ((1, 2), (2, 1)):
        for held_first in (True, False):
            held, empty = make(present), make(joining)
            values = mx.arange(1, present + 1, dtype=mx.float32)[:, None, None, None] * mx.ones((present, 1, 2, 4))
            held.update_and_fetch(values, values)
            target = held if held_first else empty
            target.extend(empty if held_first else held)
            keys, values, offset = target.keys, target.values, target.offset
            mx.eval(keys, values)
            rows = list(range(present)) if held_first else list(range(joining, joining + present))
            assert keys.shape[0] == values.shape[0] == offset.shape[0] == present + joining, (
                present, joining, held_first, keys.shape)
            for n, i in enumerate(rows):  # its two positions, wherever the buffer holds them
                written = [p for p in keys[i, 0, :, 0].tolist() if p != 0]
                assert written == [float(n + 1)] * 2, (present, joining, held_first, i, written)
            new = [i for i in range(present + joining) if i not in rows]
            assert not mx.any(keys[mx.array(new)]).item() and not mx.any(values[mx.array(new)]).item()


@pytest.mark.parametrize("model_type", [DENSE_MODEL_TYPE] + available_model_types())
def test_a_finished_rows_cache_continues_as_the_whole_sequence(model_type):
    """The cache ``BatchGenerator`` hands back for a finished row (the server's next turn,
    ``batch_generate``'s caches), continued by a single sequence, equals greedy decoding of the
    whole sequence; prompts of 1 and 5 tokens, alone in their batch (``batch-window-extract``:
    before 0.30.4 a window without left padding came back with its unused buffer)."""
    from mlx_lm_patches.selftest.scenarios import _batched_one

    model = build_tiny_model(model_type, seed=1)
    more = prompt_tokens(3, seed=77)
    for n in (1, 5):
        prompt = prompt_tokens(n, seed=n + 30)
        first, cache = _batched_one(model, prompt, None, 3, 2048)
        got = greedy(model, more, max_tokens=3, prompt_cache=cache)
        problem = greedy(model, prompt + first.tokens + more, max_tokens=3).compare(got)
        assert problem is None, f"{n}-token prompt: {problem}"


@pytest.mark.parametrize("model_type", available_model_types())
def test_a_zero_state_computes_what_no_state_does_except_where_the_patch_knows(model_type):
    """mlx-lm fills a new row's empty recurrent slots with zeros when it batches it beside rows
    with state. That is exact for a family only if a zero state computes what no state does;
    ``batch-fresh-row-state`` knows the families where it does not (recurrent_gemma's RG-LRU)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.caches import arrays_cache_class, flat_caches
    from mlx_lm_patches.patches.batch_fresh_row_state import _starts_from_none

    model = build_tiny_model(model_type, seed=1)
    tokens = mx.array([prompt_tokens(12, seed=3)])
    empty = make_prompt_cache(model)
    from_none = model(tokens, cache=empty)
    zeros = make_prompt_cache(model)
    recurrent = [(z, e) for z, e in zip(flat_caches(zeros), flat_caches(empty)) if isinstance(z, arrays_cache_class())]
    for z, e in recurrent:
        z.cache = [None if s is None else _zeros_like(s) for s in e.cache]
    from_zeros = model(tokens, cache=zeros)
    differs = not mx.array_equal(from_none, from_zeros).item()
    assert differs == _starts_from_none(model), f"{model_type}: a zero state {'differs' if differs else 'does not differ'}"


def _zeros_like(slot):
    import mlx.core as mx

    if isinstance(slot, (tuple, list)):
        return type(slot)(_zeros_like(s) for s in slot)
    return mx.zeros(slot.shape, slot.dtype)


@pytest.mark.skipif("recurrent_gemma" not in available_model_types(), reason="no recurrent_gemma in this mlx-lm")
def test_recurrent_gemma_rows_joining_a_step_apart_equal_each_alone():
    """Rows of 61, 25 and 121 prompt tokens inserted a step apart, as vllm-mlx's concurrent chats
    arrive: each equals decoding it alone (without ``batch-fresh-row-state`` the third, which
    joins the second's prompt batch, emits its 7th token twice)."""
    import sys

    generate = sys.modules["mlx_lm.generate"]
    if not hasattr(generate.BatchGenerator, "next_generated"):
        pytest.skip("this mlx-lm's BatchGenerator (before 0.31.2) prefills a new prompt in a batch of its own")
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

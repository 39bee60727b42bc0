"""mlx-vlm's Qwen3.5 / Qwen3-VL language models in batched text generation (needs mlx-vlm; the
CI matrix has rows with mlx-vlm 0.4.0, 0.5.0, 0.6.4, 0.6.14, 0.6.17 and 0.7.10, elsewhere this
file is skipped).

Tiny random-weight mlx-vlm models built from config dicts
(``mlx_lm_patches/mechanisms/probing/tiny_vlm.py``), prompts of 5, 9 and 13 tokens. Reference: each
prompt alone through mlx-vlm's ``generate_step``. Batched: mlx-vlm's own ``BatchGenerator`` (fed
as ``batch_generate`` feeds it, rows keeping their lengths) and mlx-lm's ``BatchGenerator``
driving the language model. With the patches: same greedy tokens, log-probabilities within 1e-4.
Stock (every patch reverted, or only the gated-delta advance): a strict xfail where the matrix
says the installed mlx-vlm is affected. From mlx-vlm 0.5, ``mlx_vlm.batch_generate`` itself (a
processor from a locally built tokenizer, three chat prompts) must answer each prompt as
``mlx_vlm.generate`` answers it alone.
"""

import pytest

pytest.importorskip("mlx_vlm")

import mlx_lm_patches  # noqa: E402
import conftest  # noqa: E402
from conftest import affected, run_python, xfail_if_affected  # noqa: E402
from mlx_lm_patches.mechanisms.probing import tiny_vlm, vlm_problems  # noqa: E402
from mlx_lm_patches.selftest.vlm import api as vlm_api  # noqa: E402
from mlx_lm_patches.selftest.vlm import batch_generate as vlm_batch_generate  # noqa: E402
from mlx_lm_patches.selftest.vlm import batching as vlm_batching  # noqa: E402
from support import image_batches  # noqa: E402

ROWS = {row.id: row for row in mlx_lm_patches.apply()}
PATHS = vlm_batching.paths()
POSITIONS = {"qwen3_5": "mlx-vlm-qwen3-5-batch-positions", "qwen3_vl": "mlx-vlm-qwen3-vl-batch-positions",
             "qwen3_vl_moe": "mlx-vlm-qwen3-vl-moe-batch-positions"}
# the fix of batch_generate's hand-over of its padded rows, by how this mlx-vlm hands them over
DELTAS = {"stripped": "mlx-vlm-unpadded-rope-deltas", "told": "mlx-vlm-left-padding-rope-deltas",
          "inserted": "mlx-vlm-padded-rows-stripped"}
HANDED = (vlm_api.batch_generate_padding() or "inserted") if vlm_api.takes_rows() else None
# from mlx-vlm 0.5: each language module's fix of its batched prefill positions
# (qwen3_5_moe's language model inherits Qwen3.5's positions, attention and gated-delta layers)
PREFILL = {"qwen3_5": "mlx-vlm-qwen3-5-prefill-positions", "qwen3_5_moe": "mlx-vlm-qwen3-5-prefill-positions",
           "qwen3_vl": "mlx-vlm-qwen3-vl-prefill-positions", "qwen3_vl_moe": "mlx-vlm-qwen3-vl-moe-prefill-positions"}
LANGUAGE_MODULE = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe"}
# Releases whose own BatchGenerator, stock, decodes text rows of different lengths inserted one by
# one wrong (measured by hand on 0.5.0, 0.6.0, 0.6.3, 0.6.4, 0.6.5): the rows reach the two bugs the
# prefill-positions patches fix (from 0.6.5 the generator hands each row's positions and the
# model keeps their deltas). Qwen3.5's own mask from the cache's padding makes it exact on 0.6.0 - 0.6.3.
STOCK_ROWS_WRONG = {"qwen3_5": {"0.5.0", "0.6.4"}, "qwen3_5_moe": {"0.5.0", "0.6.4"},
                    "qwen3_vl": {"0.5.0", "0.6.0", "0.6.1", "0.6.2", "0.6.3", "0.6.4"},
                    "qwen3_vl_moe": {"0.5.0", "0.6.0", "0.6.1", "0.6.2", "0.6.3", "0.6.4"}}


def _installed_mlx_vlm():
    from importlib import metadata

    return metadata.version("mlx-vlm")


def _skip_unless_driven(model_type):
    """Skip where the installed mlx-vlm lacks ``model_type`` or its batching API is not one these
    drivers use."""
    if not tiny_vlm.available(model_type):
        pytest.skip(f"this mlx-vlm has no {model_type}")
    why = vlm_api.unsupported_api(model_type)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module", params=vlm_batching.MODEL_TYPES)
def model(request):
    _skip_unless_driven(request.param)
    return request.param, tiny_vlm.build(request.param)


@pytest.mark.parametrize("path", list(PATHS))
def test_batched_text_generation_equals_each_prompt_alone(model, path):
    model_type, built = model
    assert vlm_batching.batched_problem(built, model_type, PATHS[path]) is None


@pytest.mark.parametrize("model_type", vlm_batching.MODEL_TYPES)
def test_batch_generate_answers_each_prompt_as_alone(model_type):
    """The user's call: ``mlx_vlm.batch_generate`` of three text prompts of different lengths,
    with a processor from a locally built tokenizer, answers each prompt as ``mlx_vlm.generate``
    answers it alone (greedy)."""
    _skip_unless_driven(model_type)
    if not vlm_api.takes_rows():
        pytest.skip("mlx-vlm < 0.5: batch_generate feeds one padded batch (the mlx-vlm path covers it)")
    assert vlm_batch_generate.batch_generate_texts_problem(tiny_vlm.build(model_type), model_type) is None


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=xfail_if_affected(DELTAS[HANDED]) if HANDED else ())
                                        for m in vlm_batching.MODEL_TYPES])
def test_stock_batch_generate_is_wrong_where_affected(model_type):
    """Every patch reverted: ``batch_generate`` is wrong where the matrix says this mlx-vlm's
    hand-over of its padded rows is affected (a strict xfail), right elsewhere."""
    _skip_unless_driven(model_type)
    if not vlm_api.takes_rows():
        pytest.skip("mlx-vlm < 0.5: batch_generate feeds one padded batch (the mlx-vlm path covers it)")
    mlx_lm_patches.revert()
    try:
        problem = vlm_batch_generate.batch_generate_texts_problem(tiny_vlm.build(model_type), model_type)
    finally:
        mlx_lm_patches.apply()
    assert problem is None


@pytest.fixture
def reverted(request):
    """The given patch ids (all if ``None``) reverted for the test, then applied again."""
    with conftest.reverted(*(request.param or ())):
        yield request.param


def _stock_cases():
    for model_type, pid in POSITIONS.items():
        for path in PATHS:
            if path == "mlx-vlm" and vlm_api.takes_rows():
                continue  # (>= 0.5: test_stock_rows_inserted_one_by_one_are_wrong_where_measured)
            # batch_generate's rows also go through its hand-over of the padding; from 0.5 mlx-lm's
            # BatchGenerator reaches Qwen3.5's gated-delta layers with padding only prefilled per row
            pids = [pid] + ([DELTAS[HANDED]] if path == "batch_generate" and HANDED else []) \
                + (["batch-prefill-per-row"] if path == "mlx-lm" and model_type == "qwen3_5" and vlm_api.takes_rows() else [])
            broken = [p for p in pids if affected(p)]
            yield pytest.param(model_type, path, None, id=f"{model_type}-{path}-stock",
                               marks=xfail_if_affected(broken[0] if broken else pid))
    yield pytest.param("qwen3_5", "mlx-vlm", ["mlx-vlm-gated-delta-advance"], id="qwen3_5-mlx-vlm-no-advance",
                       marks=xfail_if_affected("mlx-vlm-gated-delta-advance"))
    for handed, pid in DELTAS.items():
        if handed == HANDED:
            for model_type in vlm_batching.MODEL_TYPES:
                yield pytest.param(model_type, "batch_generate", [pid], id=f"{model_type}-batch_generate-own-deltas",
                                   marks=xfail_if_affected(pid))


@pytest.mark.parametrize("model_type,path,reverted", list(_stock_cases()), indirect=["reverted"])
def test_unpatched_batching_fails_where_affected(model_type, path, reverted):
    _skip_unless_driven(model_type)
    if path not in PATHS:
        pytest.skip(f"this mlx-vlm has no {path} path")
    built = tiny_vlm.build(model_type)
    assert vlm_batching.batched_problem(built, model_type, PATHS[path]) is None


def _prefill_patched_module(model_type):
    """mlx-vlm (>= 0.5)'s language module of ``model_type`` (skips elsewhere)."""
    import importlib

    _skip_unless_driven(model_type)
    if not vlm_api.takes_rows():
        pytest.skip("mlx-vlm < 0.5: the batch-positions patches cover its language models")
    return importlib.import_module(f"mlx_vlm.models.{model_type}.language")


@pytest.mark.parametrize("model_type", vlm_batching.MODEL_TYPES)
def test_language_model_prefills_each_row_at_its_own_positions(model_type):
    """A two-layer language model: two rows (one left-padded) prefilled together on mlx-vlm's
    empty batch caches without positions, and a row prefilled with handed ``position_ids`` and
    ``rope_deltas``, decode their next token as the row alone (logits within 1e-4)."""
    assert vlm_problems.prefill_positions_problem(_prefill_patched_module(model_type), model_type) is None


@pytest.mark.parametrize("model_type,reverted", [
    pytest.param(m, [PREFILL[m]], id=m, marks=xfail_if_affected(PREFILL[m])) for m in vlm_batching.MODEL_TYPES],
    indirect=["reverted"])
def test_stock_language_model_prefills_rows_elsewhere_where_affected(model_type, reverted):
    assert vlm_problems.prefill_positions_problem(_prefill_patched_module(model_type), model_type) is None


@pytest.mark.parametrize("model_type,reverted", [(m, [PREFILL[m]]) for m in vlm_batching.MODEL_TYPES], indirect=["reverted"])
def test_stock_rows_inserted_one_by_one_are_wrong_where_measured(model_type, reverted, request):
    """The prefill-positions patch reverted: rows inserted one by one into mlx-vlm's
    ``BatchGenerator`` are wrong on the releases measured wrong (strict xfail), exact elsewhere
    (from 0.6.5 the generator hands each row's positions and the model keeps their deltas)."""
    _prefill_patched_module(model_type)
    if _installed_mlx_vlm() in STOCK_ROWS_WRONG[model_type]:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"{PREFILL[model_type]} reverted"))
    assert vlm_batching.batched_problem(tiny_vlm.build(model_type), model_type, vlm_batching.vlm_rows_batched) is None


@pytest.mark.parametrize("model_type", vlm_batching.MODEL_TYPES)
def test_rows_prefilled_in_chunks_equal_each_prompt_alone(model_type):
    """``prefill_step_size=3``: the 5- and 9-token rows are still in their padding after the first
    chunks (Qwen3.5 clamps those negative offsets at 0 when it builds positions: the patch keeps
    them; on mlx-vlm 0.6.0 - 0.6.4 its row-by-row prefill would crash on those chunks:
    ``mlx-vlm-qwen3-5-padding-only-rows-skipped``)."""
    _prefill_patched_module(model_type)
    run = lambda model, rows: vlm_batching.vlm_rows_batched(model, rows, prefill_step_size=3)  # noqa: E731
    assert vlm_batching.batched_problem(tiny_vlm.build(model_type), model_type, run) is None


WIDENED = "mlx-vlm-qwen3-5-padding-only-rows-skipped"


@pytest.mark.parametrize("model_type,reverted", [pytest.param(m, [WIDENED], id=m, marks=xfail_if_affected(WIDENED))
                                                 for m in ("qwen3_5", "qwen3_5_moe")], indirect=["reverted"])
def test_stock_padding_only_chunks_crash_where_affected(model_type, reverted):
    """The skip reverted: mlx-vlm 0.6.0 - 0.6.4's Qwen3.5 raises on a chunk that is only
    padding for a row (strict xfail there)."""
    _prefill_patched_module(model_type)
    run = lambda model, rows: vlm_batching.vlm_rows_batched(model, rows, prefill_step_size=3)  # noqa: E731
    assert vlm_batching.batched_problem(tiny_vlm.build(model_type), model_type, run) is None


@pytest.mark.parametrize("prefill_step_size", [None, 16], ids=["unchunked", "chunks-of-16"])
def test_prefix_cache_snapshots_inside_padding_do_not_crash_a_batch(prefill_step_size):
    """mlx-vlm's prefix cache (an ``APCManager``) ends a prefill chunk at each prefix snapshot it
    takes: a 5-token and a 40-token prompt together put the long one's snapshots inside the short
    one's padding (0.6.0 - 0.6.4 stock: ValueError, chunked or not). Both, then a request
    extending the long one and a new short one, equal each prompt alone."""
    import importlib.util
    import types

    import mlx.core as mx
    from mlx_vlm.utils import StoppingCriteria

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    _skip_unless_driven("qwen3_5")
    if importlib.util.find_spec("mlx_vlm.apc") is None or not vlm_api.takes_rows():
        pytest.skip("this mlx-vlm has no prefix cache for its BatchGenerator")
    from mlx_vlm import apc

    model = tiny_vlm.build("qwen3_5")
    language_model = model.language_model
    generator = tiny_vlm.generation_module().BatchGenerator(
        language_model, types.SimpleNamespace(stopping_criteria=StoppingCriteria([], None)), max_tokens=4,
        prefill_batch_size=2, completion_batch_size=2, apc_manager=apc.APCManager(), prefill_step_size=prefill_step_size)

    def answer(rows):
        kwargs = []
        for row in rows:
            language_model._position_ids = language_model._rope_deltas = None
            kwargs.append(tiny_vlm.embeddings(model, mx.array([row])))
        uids = generator.insert(rows, 4, prompt_kwargs=kwargs)
        out = {uid: [] for uid in uids}
        while generator.has_work:
            for response in generator.next()[1]:
                out[response.uid].append(int(response.token))
        return [out[uid] for uid in uids]

    first = [prompt_tokens(5, seed=5), prompt_tokens(40, seed=40)]
    second = [first[1] + prompt_tokens(3, seed=1), prompt_tokens(7, seed=7)]
    try:
        got = answer(first) + answer(second)
    finally:
        if hasattr(generator, "close"):
            generator.close()
    for row, tokens in zip(first + second, got):
        language_model._position_ids = language_model._rope_deltas = None
        assert tokens == tiny_vlm.single(model, row, 4).tokens, len(row)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_an_engine_prefilling_padded_chunks_itself_equals_each_row_alone(model_type):
    """An engine calling the language model itself: a 2-token and a 9-token prompt left-padded
    into one batch on mlx-vlm's batch caches, prefilled in chunks of 3 (the first two only
    padding for the short row), then one decode step: each row's logits equal the row alone
    (0.6.0 - 0.6.4 stock: ValueError in the first chunk)."""
    import importlib

    import mlx.core as mx

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    _skip_unless_driven(model_type)
    _prefill_patched_module(model_type)
    caches = importlib.import_module("mlx_vlm.models.cache")
    lm = tiny_vlm.build(model_type).language_model
    rows, last = [prompt_tokens(2, seed=2), prompt_tokens(9, seed=9)], [7, 4]
    want = []
    for row, token in zip(rows, last):
        lm._position_ids = lm._rope_deltas = None
        alone = lm.make_cache()
        lm(mx.array([row]), cache=alone)
        want.append(lm(mx.array([[token]]), cache=alone).logits)
    padding = [7, 0]
    batch = [caches.ArraysCache(len(c.cache), left_padding=padding) if isinstance(c, caches.ArraysCache)
             else caches.BatchKVCache(padding) for c in lm.make_cache()]
    lm._position_ids = lm._rope_deltas = None
    ids = mx.array([[0] * 7 + rows[0], rows[1]])
    for start in range(0, 9, 3):
        lm(ids[:, start:start + 3], cache=batch)
    for c in batch:
        if isinstance(c, caches.ArraysCache) and hasattr(c, "finalize"):
            c.finalize()
    got = lm(mx.array([[t] for t in last]), cache=batch).logits
    assert mx.abs(got - mx.concatenate(want)).max().item() < 1e-4


@pytest.mark.parametrize("lengths", [(2, 13), (1, 13), (13, 5, 1)], ids=["two-tokens", "one-token", "three-rows"])
def test_rows_of_one_or_two_tokens_beside_a_long_one_in_chunks(lengths):
    """Rows whose real tokens start in the last columns (a one-token prompt: only the column the
    generator holds back for its final pass) beside a long one, in chunks of 3: each equals the
    prompt alone (0.6.0 - 0.6.4: padding-only rows skipped chunk after chunk)."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    _skip_unless_driven("qwen3_5")
    _prefill_patched_module("qwen3_5")
    model = tiny_vlm.build("qwen3_5")
    rows = [prompt_tokens(n, seed=n) for n in lengths]
    got = vlm_batching.vlm_rows_batched(model, rows, prefill_step_size=3)
    for row, decoded in zip(rows, got):
        reference = tiny_vlm.single(model, row)
        reference = type(reference)(reference.tokens, [lp.reshape(-1)[t] for lp, t in zip(reference.logprobs, reference.tokens)])
        assert reference.compare(decoded) is None, (len(row), reference.compare(decoded))


def _hands_positions(model):
    """Whether the installed mlx-vlm's ``get_input_embeddings`` hands an image prompt its
    positions (``position_ids``): what lets a batched prefill place image tokens (0.6.4 on)."""
    import mlx.core as mx

    model.language_model._position_ids = model.language_model._rope_deltas = None
    ids, pixels, grid = image_batches.image_rows(model)[0]
    embedded = model.get_input_embeddings(mx.array([ids]), pixels, image_grid_thw=grid).to_dict()
    model.language_model._position_ids = model.language_model._rope_deltas = None
    return embedded.get("position_ids") is not None


@pytest.mark.parametrize("model_type", vlm_batching.MODEL_TYPES)
def test_image_rows_inserted_one_by_one_are_exact_or_refused(model_type):
    """Two image prompts of different lengths and a text prompt, each inserted with its own
    embeddings into mlx-vlm's ``BatchGenerator`` (as its server inserts requests): each answer
    equals the prompt alone with its image - or, where mlx-vlm hands the rows no positions
    (0.5.0 - 0.6.3: the prefill cannot place image tokens), the batch is refused with an error.
    Refusing where the rows carry their positions fails the test."""
    from mlx_lm_patches.mechanisms.vlm_positions import BatchedVisionPositions

    _prefill_patched_module(model_type)
    model = tiny_vlm.build(model_type, images=True)
    handed = _hands_positions(model)
    try:
        problem = image_batches.image_rows_problem(model, model_type)
    except BatchedVisionPositions as refused:
        assert not handed, f"refused although mlx-vlm hands each row its positions: {refused}"
        return
    assert problem is None


@pytest.mark.parametrize("model_type,reverted", [(m, [PREFILL[m]]) for m in vlm_batching.MODEL_TYPES], indirect=["reverted"])
def test_stock_image_rows_are_wrong_where_measured(model_type, reverted, request):
    """The prefill-positions patch reverted: the image rows are answered wrong on mlx-vlm 0.5.0 -
    0.6.4 (measured on 0.5.0, 0.6.0 and 0.6.4: strict xfail), exact from 0.6.5."""
    from packaging.version import Version

    _prefill_patched_module(model_type)
    if Version(_installed_mlx_vlm()) < Version("0.6.5"):
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"{PREFILL[model_type]} reverted"))
    assert image_batches.image_rows_problem(tiny_vlm.build(model_type, images=True), model_type) is None


IMAGES_PATCH = "mlx-vlm-right-padded-rows-left-aligned"


@pytest.mark.parametrize("padding_side", [None, "left"], ids=["tokenizer-pads-right", "tokenizer-pads-left"])
@pytest.mark.parametrize("model_type", vlm_batching.MODEL_TYPES)
def test_batch_generate_with_images_answers_each_prompt_as_alone_or_refuses(model_type, padding_side):
    """The user's call: ``mlx_vlm.batch_generate`` with mlx-vlm's own processor (over a locally
    built tokenizer padding on either side), three prompts with an image (two of one image shape
    and different lengths, batched together) and a text prompt: each answer equals
    ``mlx_vlm.generate`` of the prompt alone with its image - or, where mlx-vlm hands the rows
    no positions (0.5.0 - 0.6.3), the batch is refused with an error naming the limitation."""
    from mlx_lm_patches.mechanisms.vlm_positions import BatchedVisionPositions

    _skip_unless_driven(model_type)
    if not vlm_api.takes_rows():
        pytest.skip("mlx-vlm < 0.5: batch_generate feeds one padded batch (the mlx-vlm path covers it)")
    model = tiny_vlm.build(model_type, images=True)
    handed = _hands_positions(model)
    try:
        problem = vlm_batch_generate.batch_generate_images_problem(model, model_type, padding_side)
    except BatchedVisionPositions as refused:
        assert not handed, f"refused although mlx-vlm hands each row its positions: {refused}"
        assert "one at a time" in str(refused)
        return
    assert problem is None


@pytest.mark.parametrize("model_type,reverted", [
    pytest.param(m, [IMAGES_PATCH], marks=xfail_if_affected(IMAGES_PATCH)) for m in vlm_batching.MODEL_TYPES],
    indirect=["reverted"])
def test_stock_batch_generate_with_right_padded_images_is_wrong_where_affected(model_type, reverted):
    """The fix reverted, a processor padding on the right: wrong where the matrix says this
    mlx-vlm takes the rows' padding to be on the left (strict xfail), exact where it strips the
    padding by the mask (0.7) or the other fixes do (0.6.4 - 0.6.14)."""
    _skip_unless_driven(model_type)
    if not vlm_api.takes_rows():
        pytest.skip("mlx-vlm < 0.5: batch_generate feeds one padded batch")
    model = tiny_vlm.build(model_type, images=True)
    if not _hands_positions(model):
        pytest.skip("this mlx-vlm hands image rows no positions: batches of them are refused")
    assert vlm_batch_generate.batch_generate_images_problem(model, model_type) is None


def test_batched_prefill_of_image_prompts_without_positions_is_refused():
    """mlx-vlm >= 0.5: a batched prefill on empty batch caches, given no positions, whose tokens
    hold an image placeholder raises (the language model cannot place image tokens without the
    grids); the same tokens handed their positions run mlx-vlm's own code."""
    import importlib

    import mlx.core as mx

    from mlx_lm_patches.mechanisms.vlm_positions import BatchedVisionPositions

    module = _prefill_patched_module("qwen3_vl")
    if ROWS[PREFILL["qwen3_vl"]].state != "applied":
        pytest.skip(f"{PREFILL['qwen3_vl']} is {ROWS[PREFILL['qwen3_vl']].state} here")
    caches = importlib.import_module("mlx_vlm.models.cache")
    lm = tiny_vlm.build("qwen3_vl").language_model
    assert module.LanguageModel is type(lm)
    tokens = mx.array([[0, 5, 6], [7, lm.config.image_token_id, 9]])
    with pytest.raises(BatchedVisionPositions, match="one at a time"):
        lm(tokens, cache=[caches.BatchKVCache([1, 0]) for _ in lm.layers])
    positions = mx.array([[0, 0, 1], [0, 1, 2]])
    lm(mx.minimum(tokens, 255), cache=[caches.BatchKVCache([1, 0]) for _ in lm.layers], position_ids=positions)


APC = ("mlx-vlm-apc-hybrid-batches-cold", "mlx-vlm-apc-hybrid-hits-refused")


def _apc_problem():
    """:func:`vlm_problems.apc_mixed_prefill_problem` on Qwen3.5 (an error it raises, as text); skips where
    mlx-vlm has no prefix cache for its BatchGenerator."""
    import importlib.util

    _skip_unless_driven("qwen3_5")
    if not vlm_api.takes_rows() or importlib.util.find_spec("mlx_vlm.apc") is None:
        pytest.skip("this mlx-vlm has no prefix cache for its BatchGenerator")
    try:
        return vlm_problems.apc_mixed_prefill_problem("qwen3_5")
    except (ValueError, TypeError) as exc:
        return f"raises {type(exc).__name__}: {exc}"


def test_prefix_cache_answers_hybrid_requests_as_without_it():
    """mlx-vlm's prefix cache (``APCManager``) with a tiny Qwen3.5: a 40-token prompt, then a
    request sharing 30 of its tokens and one extending it sent together, then an extension of
    the latter alone - each answered as without the cache. Where requests admitted together
    are prefilled cold (``mlx-vlm-apc-hybrid-batches-cold``) the last one must still hit."""
    problem = _apc_problem()
    states = {r.id: r.state for r in mlx_lm_patches.status()}
    if states["mlx-vlm-apc-hybrid-batches-cold"] == "applied":
        assert problem is None
    else:
        assert problem in (None, "no hit")


@pytest.mark.parametrize("pid,reverted", [pytest.param(pid, [pid], id=pid, marks=xfail_if_affected(pid))
                                          for pid in APC], indirect=["reverted"])
def test_stock_prefix_cache_is_wrong_where_affected(pid, reverted):
    """The patch reverted: requests beside cache hits answered wrong where the matrix says
    affected."""
    assert _apc_problem() in (None, "no hit")


def test_image_positions_at_different_row_offsets_are_refused():
    """With image/video rotary positions in play (non-zero ``_rope_deltas``), rows at one offset
    run mlx-vlm's own computation; rows at different offsets raise instead of decoding at row
    0's positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_patches.mechanisms.vlm_positions import BatchedVisionPositions

    if ROWS[POSITIONS["qwen3_vl"]].state != "applied":
        pytest.skip(f"{POSITIONS['qwen3_vl']} is {ROWS[POSITIONS['qwen3_vl']].state} here")
    lm = tiny_vlm.build("qwen3_vl").language_model

    def call(left_padding):
        lm._rope_deltas, lm._position_ids = mx.array([[3], [3]]), None  # as after an image prefill
        return lm(mx.array([[1, 2], [3, 4]]), cache=[BatchKVCache(left_padding) for _ in lm.layers])

    mx.eval(call([0, 0]).logits)  # one offset: mlx-vlm's own computation
    with pytest.raises(BatchedVisionPositions, match="row 0's position"):
        call([1, 0])


@pytest.mark.subprocess
def test_mlx_vlm_patches_are_decided_when_mlx_vlm_model_code_is_imported():
    """Automatic activation: importing mlx_lm leaves the mlx-vlm patches pending (mlx-vlm is not
    imported for them); importing mlx-vlm's language modules (the package, its generation module
    included, comes with them) decides them; ``status`` names the installed mlx-vlm and the range
    each of these patches is about."""
    from mlx_lm_patches.engine import versions

    ran = run_python(f"""
        import contextlib, importlib, importlib.util, io, json, mlx_lm, mlx_lm_patches
        from mlx_lm_patches.__main__ import main
        before = {{r.id: r.state for r in mlx_lm_patches.status() if r.package == "mlx-vlm"}}
        for model_type in {vlm_batching.MODEL_TYPES!r}:
            if importlib.util.find_spec("mlx_vlm.models." + model_type):
                importlib.import_module("mlx_vlm.models." + model_type + ".language")
        after = {{r.id: r.state for r in mlx_lm_patches.status() if r.package == "mlx-vlm"}}
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            main(["status"])
        print(json.dumps([before, after, text.getvalue()]))
    """)
    assert ran.returncode == 0, ran.stderr[-2000:]
    before, after, status = ran.json()
    expected = {pid: ROWS[pid].state for pid in before}
    assert set(before) == {*POSITIONS.values(), *PREFILL.values(), "mlx-vlm-gated-delta-advance", *DELTAS.values(), IMAGES_PATCH,
                           *APC, WIDENED}
    for pid, state in expected.items():
        if state == "applied":
            assert before[pid] == "pending" and after[pid] == "applied", (pid, before[pid], after[pid])
        else:
            assert before[pid] == after[pid] == state
    version = versions.installed("mlx-vlm").describe()
    assert f", mlx-vlm {version}," in status.splitlines()[1] + ",", status.splitlines()[1]
    line = next(x for x in status.splitlines() if x.split()[:1] == ["mlx-vlm-qwen3-5-batch-positions"])
    assert line.split()[1:3] == [ROWS["mlx-vlm-qwen3-5-batch-positions"].state, "affected"], line
    assert line.split()[3:] == ["mlx-vlm", ROWS["mlx-vlm-qwen3-5-batch-positions"].affected], line


@pytest.mark.subprocess
def test_batch_generate_fix_applies_in_a_process_that_never_imports_mlx_lm():
    """mlx-vlm 0.7 does not import mlx-lm: a script that only uses mlx-vlm activates the package
    at its first ``import mlx_vlm``, so the fix of ``batch_generate``'s hand-over is applied
    when mlx-vlm's generation module is imported, and batched rows equal each alone."""
    if HANDED not in DELTAS or ROWS[DELTAS[HANDED]].state != "applied":
        pytest.skip(f"this mlx-vlm's batch_generate hand-over is not one the package fixes ({HANDED})")
    pid = DELTAS[HANDED]
    ran = run_python(f"""
        import importlib, json, sys
        generation = importlib.import_module("mlx_vlm.generate")  # (the attribute is a function)
        importlib.import_module(generation.BatchGenerator.__module__)
        imported_mlx_lm = "mlx_lm" in sys.modules
        import mlx_lm_patches
        state = {{r.id: r.state for r in mlx_lm_patches.status()}}[{pid!r}]
        outcome = importlib.import_module("mlx_lm_patches.patches." + {pid!r}.replace("-", "_")).scenario()
        print(json.dumps([imported_mlx_lm, state, outcome.ok, outcome.summary]))
    """, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    imported_mlx_lm, state, ok, summary = ran.json()
    assert state == "applied", (imported_mlx_lm, state)
    assert ok, summary


def test_strip_padding_cuts_each_row_and_its_tensors_and_refuses_a_broken_mask():
    """``mlx-vlm-padded-rows-stripped``'s cut: a left-padded row loses its padding columns in its
    tokens, its embeddings and its M-RoPE positions, and gets the rope_deltas of its own positions;
    an unpadded row and the caller's dictionaries are left as they are; a mask row that is not one
    contiguous span is refused, naming the row."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.vlm_padding import PaddingNotContiguous, strip_padding

    mask = mx.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    positions = mx.broadcast_to(mx.array([[1, 1, 0, 1], [0, 1, 2, 3]])[None], (3, 2, 4))  # cumsum - 1, padding 1
    kwargs = [{"inputs_embeds": mx.arange(8 * row, 8 * row + 8).reshape(1, 4, 2),
               "position_ids": positions[:, row:row + 1], "rope_deltas": mx.array([[-2], [0]])[row:row + 1],
               "pixel_values": None} for row in range(2)]
    rows, cut = strip_padding([[0, 0, 5, 6], [7, 8, 9, 10]], mask, kwargs)
    assert rows == [[5, 6], [7, 8, 9, 10]]
    assert cut[0]["inputs_embeds"].tolist() == [[[4, 5], [6, 7]]]
    assert cut[0]["position_ids"].shape == (3, 1, 2) and cut[0]["position_ids"][0].tolist() == [[0, 1]]
    assert cut[0]["rope_deltas"].tolist() == [[0]] and cut[0]["pixel_values"] is None
    assert cut[1] is kwargs[1] and kwargs[0]["inputs_embeds"].shape == (1, 4, 2)
    with pytest.raises(PaddingNotContiguous, match="attention_mask row 1 is not one contiguous span"):
        strip_padding([[0, 5, 6], [7, 0, 9]], mx.array([[0, 1, 1], [1, 0, 1]]), None)

"""``max_kv_size`` on hybrids (patch ``hybrid-max-kv-size``), through mlx-lm's public entry points.

What it means for a dense model is the specification: every attention layer rotates
(``RotatingKVCache(max_kv_size, keep=4)``). For a hybrid, its plain attention layers rotate the
same way; its recurrent layers (and sliding windows the model already has) are what the model
made. So, for every hybrid family of the release that has plain attention layers:

* ``make_prompt_cache(model, max_kv_size=W)`` builds exactly that, and after a prompt longer
  than the window and more tokens than it holds, no attention layer holds more than W positions;
* ``generate_step(prompt, model, max_kv_size=W)`` (the cache built inside) yields, while the
  sequence fits in the window, the unbounded tokens and log-probabilities, and past the window
  those of a step-by-step greedy decode through the caches the specification builds (mlx-lm's
  own rotating semantics) - which differ from unbounded decoding there, so a cache left
  unbounded fails;
* ``BatchGenerator(max_kv_size=W)`` (releases whose BatchGenerator takes it) gives each row
  what ``generate_step`` gives it alone.
A dense model is the control (stock mlx-lm is right there). Stock hybrids keep every position:
strict xfail where the matrix says affected. A window of 4 or less is refused by name.
"""

import inspect

import pytest

from conftest import reverted, xfail_if_affected
from support.kv_window import hybrids_with_plain_attention, specified_caches
from mlx_lm_patches.mechanisms.caches import flat_caches
from mlx_lm_patches.mechanisms.probing.decoded import Decoded, prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model
from mlx_lm_patches.patches.hybrid_max_kv_size import positions_held


import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache  # noqa: E402

PATCH = "hybrid-max-kv-size"
WINDOW = 24
KEEP = 4


FAMILIES = hybrids_with_plain_attention()


def _specified(model, keep=KEEP):
    return specified_caches(model, WINDOW, keep)


def _stepwise(model, prompt, caches, max_tokens) -> Decoded:
    """Greedy decoding by hand: the prompt in one forward, then one token per forward."""
    tokens, logprobs = [], []
    logits = model(mx.array(prompt)[None], cache=caches)[:, -1, :]
    for _ in range(max_tokens):
        lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).squeeze(0)
        token = int(mx.argmax(lp).item())
        tokens.append(token)
        logprobs.append(lp)
        logits = model(mx.array([[token]]), cache=caches)[:, -1, :]
    return Decoded(tokens, logprobs)


def _describe(caches):
    return [type(c).__name__ + (f"({c.max_size},keep={c.keep})" if isinstance(c, RotatingKVCache) else "")
            for c in flat_caches(caches)]


@pytest.mark.family_sweep(FAMILIES)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_hybrid_attention_rotates_and_decoding_follows_the_window(model_type):
    model = build_tiny_model(model_type, seed=2)
    built = make_prompt_cache(model, max_kv_size=WINDOW)
    assert _describe(built) == _describe(_specified(model))
    for got, made in zip(flat_caches(built), flat_caches(model.make_cache())):
        if not type(made) is KVCache:
            assert type(got) is type(made)

    # Memory: a prompt longer than the window, then more tokens. Layers the model already
    # rotates (its own sliding windows) keep their window.
    greedy(model, prompt_tokens(30, seed=2), max_tokens=8, prompt_cache=built)
    plain = [got for got, made in zip(flat_caches(built), flat_caches(model.make_cache())) if type(made) is KVCache]
    assert positions_held(plain) <= WINDOW

    # Decoding through generate_step's own cache: unbounded while it fits, rotating after.
    prompt, new = prompt_tokens(12, seed=5), 20
    got = greedy(model, prompt, max_tokens=new, max_kv_size=WINDOW)
    fits = WINDOW - len(prompt)
    unbounded = greedy(model, prompt, max_tokens=new)
    problem = Decoded(unbounded.tokens[:fits], unbounded.logprobs[:fits]).compare(
        Decoded(got.tokens[:fits], got.logprobs[:fits]))
    assert problem is None, f"within the window: {problem}"
    reference = _stepwise(model, prompt, _specified(model), new)
    assert reference.compare(unbounded) is not None, "the window changes nothing: the test cannot fail"
    problem = reference.compare(got)
    assert problem is None, f"past the window: {problem}"


def test_dense_control_rotates_on_stock_and_patched():
    """qwen3 (no ``make_cache``): mlx-lm's own meaning of ``max_kv_size``."""
    model = build_tiny_model("qwen3", seed=2)
    built = make_prompt_cache(model, max_kv_size=WINDOW)
    assert all(isinstance(c, RotatingKVCache) and c.max_size == WINDOW and c.keep == KEEP for c in built)
    greedy(model, prompt_tokens(30, seed=2), max_tokens=8, prompt_cache=built)
    assert positions_held(built) <= WINDOW
    prompt = prompt_tokens(12, seed=5)
    got = greedy(model, prompt, max_tokens=20, max_kv_size=WINDOW)
    reference = _stepwise(model, prompt, make_prompt_cache(model, max_kv_size=WINDOW), 20)
    assert reference.compare(got) is None


def test_caches_without_max_kv_size_are_the_models_own():
    model = build_tiny_model("nemotron_h", seed=2)
    assert _describe(make_prompt_cache(model)) == _describe(model.make_cache())
    assert _describe(make_prompt_cache(model, None)) == _describe(model.make_cache())


def test_models_with_make_cache_and_no_recurrent_state_keep_mlx_lms_behaviour():
    """llama has ``make_cache`` (for sliding windows): mlx-lm documents that ``max_kv_size`` is
    then not applied, and without recurrent state the patch does not change that."""
    model = build_tiny_model(DENSE_MODEL_TYPE, seed=2)
    assert _describe(make_prompt_cache(model, max_kv_size=WINDOW)) == _describe(model.make_cache())


@pytest.mark.parametrize("bad", [0, 4, -8, 2.5, "32"])
def test_a_window_without_room_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="max_kv_size"):
        make_prompt_cache(build_tiny_model("nemotron_h", seed=2), max_kv_size=bad)


@pytest.fixture
def stock():
    with reverted(PATCH):
        yield


@xfail_if_affected(PATCH, "stock mlx-lm: a hybrid keeps every attention position whatever max_kv_size says")
@pytest.mark.parametrize("model_type", [t for t in ("qwen3_5", "nemotron_h") if t in FAMILIES][:1])
def test_stock_keeps_every_position(stock, model_type):
    model = build_tiny_model(model_type, seed=2)
    built = make_prompt_cache(model, max_kv_size=WINDOW)
    greedy(model, prompt_tokens(30, seed=2), max_tokens=8, prompt_cache=built)
    assert positions_held(built) <= WINDOW


def _batch_generator_takes_max_kv_size():
    from mlx_lm.generate import BatchGenerator

    return "max_kv_size" in inspect.signature(BatchGenerator.__init__).parameters


@pytest.mark.skipif(not _batch_generator_takes_max_kv_size(), reason="BatchGenerator takes no max_kv_size here")
@pytest.mark.parametrize("model_type", ["qwen3"] + [t for t in ("qwen3_next", "nemotron_h", "falcon_h1") if t in FAMILIES])
def test_batch_generator_rows_follow_the_window(model_type):
    """mlx-lm's batched rotating cache keeps none of the first positions (``keep`` is lost in
    the merge: the dense control shows it on stock mlx-lm), so each row equals single decoding
    through rotating caches with ``keep=0`` - and, while the sequence fits, unbounded decoding."""
    from mlx_lm.generate import BatchGenerator

    model = build_tiny_model(model_type, seed=2)
    prompts, new = [prompt_tokens(12, seed=5), prompt_tokens(12, seed=6)], 20
    generator = BatchGenerator(model, max_tokens=new, max_kv_size=WINDOW)
    step = getattr(generator, "next_generated", None) or generator.next
    uids = list(generator.insert(prompts, [new] * len(prompts)))
    got = {uid: Decoded([], []) for uid in uids}
    while True:
        responses = step()
        if not responses:
            break
        for r in responses:
            got[r.uid].tokens.append(int(r.token))
            got[r.uid].logprobs.append(r.logprobs)
    if hasattr(generator, "close"):
        generator.close()
    for uid, prompt in zip(uids, prompts):
        reference = greedy(model, prompt, max_tokens=new, prompt_cache=_specified(model, keep=0))
        assert reference.compare(greedy(model, prompt, max_tokens=new)) is not None, "the test cannot fail"
        problem = reference.compare(got[uid])
        assert problem is None, problem

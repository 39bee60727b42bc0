"""A prompt-cache file with a draft model (patch ``prompt-cache-file-draft``), in process, as
``mlx_lm.cache_prompt`` then ``mlx_lm.generate --prompt-cache-file F --draft-model D`` run it:
``mlx_lm.cache_prompt``'s own ``generate_step`` and ``save_prompt_cache`` write the file,
``mlx_lm.generate``'s ``load_prompt_cache`` reads it, and ``speculative_generate_step`` gets the
loaded list (the main model's caches only). The draft's cache is rebuilt from the tokens the
file records: speculation equals plain decoding on a fresh load of the same file (tokens and
log-probabilities), for hybrids of several cache layouts (``CacheList`` included) and a dense
main model, with a dense and a hybrid draft and with the checkpoint's own MTP head
(``--draft-model mtp``, which follows the main model and starts empty). A file saved without
the package (no tokens recorded) is refused at the first ``next()``, before any token.
"""

import importlib
import json

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model
from mlx_lm_patches.patches.prompt_cache_file_draft import TOKENS_KEY


import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache  # noqa: E402

cache_prompt = importlib.import_module("mlx_lm.cache_prompt")
generate = importlib.import_module("mlx_lm.generate")

SYSTEM, QUERY = prompt_tokens(21, seed=2), prompt_tokens(6, seed=8)
MAINS = [t for t in ("qwen3_next", "nemotron_h", "falcon_h1", "lfm2") if t in available_model_types()] + ["llama"]


def _cache_prompt(model, path):
    cache = make_prompt_cache(model)
    for _ in cache_prompt.generate_step(mx.array(SYSTEM), model, max_tokens=0, prompt_cache=cache):
        pass
    cache_prompt.save_prompt_cache(str(path), cache, {"model": "tiny"})


def _load(path):
    return generate.load_prompt_cache(str(path), return_metadata=True)


@pytest.mark.parametrize("main_type", MAINS)
def test_speculation_on_a_prompt_cache_file_equals_plain_decoding_on_it(tmp_path, main_type):
    model = build_tiny_model(main_type, seed=1)
    path = tmp_path / "system.safetensors"
    _cache_prompt(model, path)
    assert _load(path)[1][TOKENS_KEY]
    reference = greedy(model, QUERY, max_tokens=10, prompt_cache=_load(path)[0])
    drafts = [build_tiny_model("llama", seed=7)] + ([build_tiny_model("qwen3_next", seed=7)] if main_type == "llama" else [])
    for draft in drafts:  # a dense draft; the dense main model also with a hybrid one
        got = speculative_greedy(model, draft, QUERY, max_tokens=10, num_draft_tokens=3, prompt_cache=_load(path)[0])
        problem = reference.compare(got)
        assert problem is None, problem


def test_the_draft_cache_holds_the_files_tokens(tmp_path, monkeypatch):
    """The rebuilt draft cache equals the draft's own cold prefill of the system prompt: an
    agreeing draft (the main model itself) has every proposal accepted (three drafts a round:
    adaptive drafting off)."""
    from mlx_lm_patches.engine import env

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "0")
    model = build_tiny_model("llama", seed=1)
    path = tmp_path / "system.safetensors"
    _cache_prompt(model, path)
    steps = list(generate.speculative_generate_step(mx.array(QUERY), model, build_tiny_model("llama", seed=1),
                                                    num_draft_tokens=3, max_tokens=12,
                                                    prompt_cache=_load(path)[0]))
    assert sum(bool(d) for _, _, d in steps) == 9  # 3 rounds of 3 accepted drafts and a bonus token


def test_mtp_draft_on_a_prompt_cache_file(tmp_path):
    from mlx_lm import load
    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

    model, _ = load(str(write_mtp_checkpoint(tmp_path, "qwen3_next", dtype="float32").folder))
    path = tmp_path / "system.safetensors"
    _cache_prompt(model, path)
    reference = greedy(model, QUERY, max_tokens=10, prompt_cache=_load(path)[0])
    got = speculative_greedy(model, model.make_draft_model(), QUERY, max_tokens=10, num_draft_tokens=2,
                             prompt_cache=_load(path)[0])
    assert reference.compare(got) is None, reference.compare(got)


def test_a_file_without_tokens_is_refused_before_the_first_token(tmp_path):
    model = build_tiny_model("qwen3_next" if "qwen3_next" in MAINS else "llama", seed=1)
    cache = make_prompt_cache(model)
    model(mx.array(SYSTEM)[None], cache=cache)
    path = tmp_path / "stock.safetensors"
    save_prompt_cache(str(path), cache, {"model": "tiny"})  # not through mlx_lm.cache_prompt
    steps = generate.speculative_generate_step(mx.array(QUERY), model, build_tiny_model("llama", seed=7),
                                               prompt_cache=_load(path)[0])
    with pytest.raises(ValueError, match="re-create it with mlx_lm.cache_prompt"):
        next(steps)


def test_the_file_records_its_tokens_after_revert_and_apply_again(tmp_path):
    """``mlx_lm.cache_prompt`` binds ``generate_step`` when it is imported (here: before the
    revert), so the wrapper it calls is the first application's; every application shares the
    patch's state, so the file still records its tokens (it did not when each application had
    its own ``memo``: a test that reverted every patch before broke the rest of this file)."""
    import mlx_lm_patches

    mlx_lm_patches.revert()
    mlx_lm_patches.apply()
    model = build_tiny_model("llama", seed=1)
    path = tmp_path / "system.safetensors"
    _cache_prompt(model, path)
    assert json.loads(_load(path)[1][TOKENS_KEY]) == SYSTEM

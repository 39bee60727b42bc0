"""The fixtures themselves: a tiny model for every hybrid family of the installed mlx-lm, and
model folders that mlx-lm's own loader reads back exactly, offline."""

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy
from mlx_lm_patches.selftest.model_folder import write_model_folder
from mlx_lm_patches.selftest.tiny_models import (
    DENSE_MODEL_TYPE, HYBRID_MODEL_TYPES, available_model_types, build_tiny_model, cache_kinds,
    tiny_config,
)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

TYPES = available_model_types()


def test_every_listed_family_present_in_mlx_lm_is_available():
    import importlib.util

    present = [t for t in HYBRID_MODEL_TYPES if importlib.util.find_spec(f"mlx_lm.models.{t.replace('-', '_')}")]
    assert set(present) <= set(TYPES) | {t for t in present if "-" in t}
    assert {"qwen3_next", "nemotron_h", "falcon_h1", "jamba", "mamba", "mamba2", "lfm2"} <= set(TYPES)


@pytest.mark.parametrize("model_type", TYPES)
def test_tiny_hybrid_model_decodes_deterministically(model_type):
    model = build_tiny_model(model_type, seed=11)
    kinds = " ".join(cache_kinds(model))
    assert "ArraysCache" in kinds or "MambaCache" in kinds or "CacheList" in kinds
    prompt = prompt_tokens(9, seed=11)
    first = greedy(model, prompt, max_tokens=6)
    assert len(set(first.tokens)) > 1, first.tokens
    again = greedy(build_tiny_model(model_type, seed=11), prompt, max_tokens=6)
    assert first.compare(again) is None


def test_unknown_type_is_a_clear_error():
    with pytest.raises(KeyError, match="no-such-model"):
        tiny_config("no-such-model")


@pytest.mark.parametrize("model_type", [DENSE_MODEL_TYPE, "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("shard_size", [None, 20000])
def test_model_folder_loads_back_exactly(tmp_path, model_type, shard_size):
    from mlx_lm import load

    model = build_tiny_model(model_type, seed=12)
    folder = write_model_folder(tmp_path / model_type, model, tiny_config(model_type), shard_size=shard_size)
    loaded, tokenizer = load(str(folder))
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(loaded.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]) for k in ours)
    ids = tokenizer.encode("the quick brown fox")
    assert tokenizer.decode(ids).strip() == "the quick brown fox"
    assert greedy(model, ids).compare(greedy(loaded, ids)) is None

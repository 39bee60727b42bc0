"""Every load path keeps the MTP head with the backbone intact: ``mlx_lm.utils.load_model``
called directly, ``mlx_lm.load(lazy=True)``, and ``mlx_lm.utils.sharded_load`` on the
single-process group this machine has (where the release has it and the family can be
sharded), for every checkpoint form of ``test_mtp_load.py`` (MLX/HF layout, bf16/4-bit, head in
the shards, in an unlisted ``mtp.safetensors`` or in ``model-mtp.safetensors``). Checkpoints
are written once per module; patches on."""

import importlib.util

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
from mlx_lm_patches.selftest.mtp_checkpoints import check_loaded, write_mtp_checkpoint
from test_mtp_load import FORMS


FAMILIES = [f for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h")
            if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]
FORM_IDS = [f"{f}-{'q4' if q else 'bf16'}-{p}" for f, q, p in FORMS]
LAZY_FORMS = [0, 4, 5, 6]  # mlx shards, hf sidecar, q4 sidecar, model-mtp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-paths")
    cache = {}

    def get(family, index):
        if (family, index) not in cache:
            form, quantized, placement = FORMS[index]
            cache[family, index] = write_mtp_checkpoint(root, family, form=form, quantized=quantized,
                                                        placement=placement)
        return cache[family, index]

    return get


@pytest.mark.parametrize("index", range(len(FORMS)), ids=FORM_IDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_directly(checkpoints, family, index):
    from pathlib import Path

    from mlx_lm.utils import load_model

    written = checkpoints(family, index)
    model, config = load_model(Path(written.folder))
    assert check_loaded(model, written) is None, check_loaded(model, written)
    assert model.mtp_status.startswith("MTP head kept")
    assert ("quantization" in config) == FORMS[index][1]
    assert callable(model.make_draft_model)


@pytest.mark.parametrize("index", LAZY_FORMS, ids=[FORM_IDS[i] for i in LAZY_FORMS])
@pytest.mark.parametrize("family", FAMILIES)
def test_lazy_load(checkpoints, family, index):
    from mlx_lm import load

    written = checkpoints(family, index)
    model = load(str(written.folder), lazy=True)[0]
    assert check_loaded(model, written) is None, check_loaded(model, written)
    assert model.mtp_status.startswith("MTP head kept")


def test_lazy_load_decodes_exactly(tmp_path):
    """A lazily loaded head (nothing evaluated at load) drafts exactly."""
    from mlx_lm import load

    from support.mtp_drafts import hinted_draft

    written = write_mtp_checkpoint(tmp_path, FAMILIES[-1], dtype="float32", placement="sidecar")
    model = load(str(written.folder), lazy=True)[0]
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=8)
    got = speculative_greedy(model, hinted_draft(model, prompt + reference.tokens), prompt, max_tokens=8,
                             num_draft_tokens=2)
    assert reference.compare(got) is None, reference.compare(got)


def _sharding(family):
    """Why ``sharded_load`` cannot run for ``family`` on this release, or None."""
    import mlx_lm.utils

    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    if not hasattr(mlx_lm.utils, "sharded_load"):
        return "this mlx-lm has no sharded_load"
    model = build_tiny_model(family)
    pipelining = hasattr(model, "model") and hasattr(model.model, "pipeline")
    if not (pipelining or hasattr(model, "shard")):
        return f"{family} has neither Model.shard nor model.pipeline in this mlx-lm"
    return None


@pytest.mark.parametrize("index", [0, 4, 6], ids=[FORM_IDS[i] for i in (0, 4, 6)])
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_load_single_process(checkpoints, family, index):
    """``sharded_load`` (tensor parallel or pipeline, whichever the family has) on the
    one-process group ``mx.distributed.init()`` gives here: two lazy ``load_model`` calls, the
    shard step, then an eval of the parameters."""
    import mlx.core as mx

    why = _sharding(family)
    if why:
        pytest.skip(why)
    from mlx_lm.utils import sharded_load

    assert mx.distributed.init().size() == 1
    written = checkpoints(family, index)
    try:
        model, _ = sharded_load(str(written.folder))
    except ValueError as exc:
        if "only supported for MLX converted models" in str(exc):  # stock refusal (0.32.0, HF layout)
            pytest.skip(f"stock sharded_load refuses this checkpoint: {exc}")
        raise
    assert check_loaded(model, written) is None, check_loaded(model, written)
    assert model.mtp_status.startswith("MTP head kept")


def test_sharded_load_decodes_exactly(tmp_path):
    """The head kept by ``sharded_load`` drafts exactly (one process)."""
    family = next((f for f in FAMILIES if _sharding(f) is None), None)
    if family is None:
        pytest.skip("no family can be sharded with this mlx-lm")
    from mlx_lm.utils import sharded_load

    from support.mtp_drafts import hinted_draft

    written = write_mtp_checkpoint(tmp_path, family, dtype="float32")
    model, _ = sharded_load(str(written.folder))
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=8)
    got = speculative_greedy(model, hinted_draft(model, prompt + reference.tokens), prompt, max_tokens=8,
                             num_draft_tokens=2)
    assert reference.compare(got) is None, reference.compare(got)

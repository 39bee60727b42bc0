"""Checkpoints carrying an MTP head, written to disk in every form (MLX and HF layout, bf16 and
4-bit, head in the shards, in an unlisted ``mtp.safetensors`` sidecar or in
``model-mtp.safetensors``; dense and MoE), load through ``mlx_lm.load`` with every backbone
tensor equal to the checkpoint's and every MTP tensor kept (``model.mtp``), patches on."""

import importlib.util

import pytest

import mlx_lm_patches
from mlx_lm_patches.testing.mtp_checkpoints import check_loaded, write_mtp_checkpoint

mlx_lm_patches.apply()

FAMILIES = [f for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe")
            if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]
FORMS = [("mlx", False, "shards"), ("hf", False, "shards"), ("mlx", True, "shards"),
         ("mlx", False, "sidecar"), ("hf", False, "sidecar"), ("mlx", True, "sidecar"),
         ("mlx", False, "model-mtp")]


def _load(folder, **kwargs):
    from mlx_lm import load

    return load(str(folder), **kwargs)[0]


@pytest.mark.parametrize("form,quantized,placement", FORMS,
                         ids=[f"{f}-{'q4' if q else 'bf16'}-{p}" for f, q, p in FORMS])
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_head_and_backbone_round_trip(tmp_path, family, form, quantized, placement):
    written = write_mtp_checkpoint(tmp_path, family, form=form, quantized=quantized, placement=placement)
    model = _load(written.folder)
    assert check_loaded(model, written) is None, check_loaded(model, written)
    assert model.mtp_status.startswith("MTP head kept")
    if quantized:
        import mlx.nn as nn

        assert isinstance(model.mtp.fc, nn.QuantizedLinear)
        assert model.mtp.fc.bits == 4 and model.mtp.fc.group_size == 32


def test_lazy_load_keeps_the_head(tmp_path):
    written = write_mtp_checkpoint(tmp_path, "qwen3_next")
    model = _load(written.folder, lazy=True)
    assert check_loaded(model, written) is None


def test_declared_but_absent_head_loads_normally_and_says_so(tmp_path):
    from mlx.utils import tree_flatten

    full = write_mtp_checkpoint(tmp_path, "qwen3_next", name="full")
    written = write_mtp_checkpoint(tmp_path, "qwen3_next", drop=[f"mtp.{k}" for k in full.head], name="none")
    model = _load(written.folder)
    assert model.mtp is None
    assert model.mtp_status == "config declares 1 MTP layer(s) but the checkpoint has no mtp.* tensors"
    assert check_loaded(model, type(written)(written.folder, "qwen3_next", written.backbone)) is None
    assert not any("mtp" in k for k, _ in tree_flatten(model.parameters()))


def test_incomplete_head_is_not_attached_and_the_status_names_what_is_missing(tmp_path):
    written = write_mtp_checkpoint(tmp_path, "qwen3_next", drop=["mtp.fc.weight"])
    model = _load(written.folder)
    assert model.mtp is None
    assert "missing 1 tensors (mtp.fc.weight)" in model.mtp_status
    assert check_loaded(model, type(written)(written.folder, "qwen3_next", written.backbone)) is None


def test_checkpoint_without_mtp(tmp_path):
    from mlx_lm_patches.testing.model_folder import write_model_folder
    from mlx_lm_patches.testing.tiny_models import build_tiny_model, tiny_config

    folder = write_model_folder(tmp_path / "plain", build_tiny_model("qwen3_next"), tiny_config("qwen3_next"))
    model = _load(folder)
    assert model.mtp is None and model.mtp_status == "no MTP head in this checkpoint"


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm.models.nemotron_h") is None, reason="no nemotron_h")
def test_nemotron_h_with_mtp_tensors_loads_and_says_the_head_is_not_kept(tmp_path):
    written = write_mtp_checkpoint(tmp_path, "nemotron_h")
    model = _load(written.folder)
    assert check_loaded(model, written) is None
    assert model.mtp is None and "not kept yet" in model.mtp_status

"""Checkpoints carrying an MTP head, written to disk in every form (MLX and HF layout, bf16 and
4-bit, head in the shards, in an unlisted ``mtp.safetensors`` sidecar or in
``model-mtp.safetensors``; dense and MoE; Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Nemotron-H), load
through ``mlx_lm.load`` with every backbone tensor equal to the checkpoint's and every MTP
tensor kept (``model.mtp``), patches on."""

import importlib.util

import pytest

from mlx_lm_patches.selftest.mtp_checkpoints import check_loaded, write_mtp_checkpoint


FAMILIES = [f for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h")
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

        from mlx_lm_patches.mechanisms.mtp.families import family_of

        projection = family_of(model).fusion(model.mtp)[2]  # fc / eh_proj
        assert isinstance(projection, nn.QuantizedLinear)
        assert projection.bits == 4 and projection.group_size == 32


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
    assert model.mtp_status == ("config declares 1 MTP layer(s) but the checkpoint has no mtp.* tensors "
                                "(neither in its weight files nor in mtp.safetensors)")
    assert check_loaded(model, type(written)(written.folder, "qwen3_next", written.backbone)) is None
    assert not any("mtp" in k for k, _ in tree_flatten(model.parameters()))


def test_incomplete_head_is_not_attached_and_the_status_names_what_is_missing(tmp_path):
    written = write_mtp_checkpoint(tmp_path, "qwen3_next", drop=["mtp.fc.weight"])
    model = _load(written.folder)
    assert model.mtp is None
    assert "missing 1 tensors (mtp.fc.weight)" in model.mtp_status
    assert check_loaded(model, type(written)(written.folder, "qwen3_next", written.backbone)) is None


def test_checkpoint_without_mtp(tmp_path):
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

    folder = write_model_folder(tmp_path / "plain", build_tiny_model("qwen3_next"), tiny_config("qwen3_next"))
    model = _load(folder)
    assert model.mtp is None and model.mtp_status == "no MTP head in this checkpoint"


@pytest.mark.parametrize("family, why", [("kimi_linear", "its checkpoints ship no MTP layer"),
                                         ("kimi_k3", "its released checkpoints ship no MTP layer")])
def test_families_without_a_published_head_say_why(tmp_path, family, why):
    """Kimi-Linear and Kimi K3 checkpoints ship no MTP layer (mlx-lm's sanitize drops ``mtp`` keys
    defensively): a config declaring one loads the model as without the declaration, and the
    status says why no head is kept."""
    import copy

    import mlx.core as mx

    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

    if importlib.util.find_spec(f"mlx_lm.models.{family}") is None:
        pytest.skip(f"this mlx-lm has no {family}")
    config = tiny_config(family)
    declared = copy.deepcopy(config)
    declared.get("text_config", declared)["num_nextn_predict_layers"] = 1
    model = build_tiny_model(family, seed=3)
    plain = _load(write_model_folder(tmp_path / "plain", model, config))
    model = _load(write_model_folder(tmp_path / "declared", model, declared))
    assert model.mtp is None
    assert model.mtp_status.startswith(f"MTP heads of {family} are not kept yet: {why}"), model.mtp_status
    ids = mx.array([[3, 1, 4, 1, 5]])
    assert mx.array_equal(model(ids), plain(ids))


def test_other_families_say_their_head_is_not_kept(tmp_path):
    """A family whose MTP head is not kept (here llama declaring a DeepSeek-style MTP layer):
    the model loads as stock mlx-lm loads it and the status says the head is not kept."""
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

    folder = write_model_folder(tmp_path / "llama", build_tiny_model("llama"),
                                dict(tiny_config("llama"), num_nextn_predict_layers=1))
    model = _load(folder)
    assert model.mtp is None
    assert model.mtp_status == ("MTP heads of llama are not kept yet: the layout of its MTP layers has not been "
                                "read yet (kept: bailing_moe_v3, deepseek_v3, deepseek_v32, ernie4_5_moe, exaone_moe, glm4_moe, "
                                "glm4_moe_lite, glm_moe_dsa, longcat_flash, longcat_flash_ngram, mimo, mimo_v2_flash, nemotron_h, qwen3_5, qwen3_5_moe, "
                                "qwen3_next, step3p5)")


def _rewrite_config(folder, **changes):
    """Set (or, with None, remove) keys of the checkpoint's config.json."""
    import json

    path = folder / "config.json"
    config = dict(json.loads(path.read_text()), **changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def test_nemotron_h_head_follows_its_block_pattern(tmp_path):
    """Nemotron 3 Super's MTP blocks: attention (fusion in front), then MoE (final norm behind);
    MLP instead of MoE where this mlx-lm has no MoE block. The pattern comes from the config
    (``mtp_hybrid_override_pattern``, or ``mtp_layers_block_type``), else from the tensors."""
    from mlx_lm_patches.selftest.mtp_checkpoints import nemotron_mtp_pattern

    pattern = nemotron_mtp_pattern()
    written = write_mtp_checkpoint(tmp_path, "nemotron_h", name="pattern")
    model = _load(written.folder)
    assert "".join(layer.block_type for layer in model.mtp.layers) == pattern
    assert {"enorm", "hnorm", "eh_proj"} <= set(model.mtp.layers[0]) and "final_layernorm" in model.mtp.layers[-1]
    names = {"*": "attention", "E": "moe", "-": "mlp"}
    _rewrite_config(written.folder, mtp_hybrid_override_pattern=None,
                    mtp_layers_block_type=[names[kind] for kind in pattern])
    assert check_loaded(_load(written.folder), written) is None
    _rewrite_config(written.folder, mtp_layers_block_type=None)  # read off the tensors
    assert check_loaded(_load(written.folder), written) is None


def test_nemotron_h_head_this_release_cannot_build_says_why(tmp_path):
    from mlx_lm_patches.selftest.mtp_checkpoints import nemotron_mtp_pattern

    written = write_mtp_checkpoint(tmp_path, "nemotron_h", name="mamba-head")
    _rewrite_config(written.folder, mtp_hybrid_override_pattern="*M")
    model = _load(written.folder)
    assert model.mtp is None
    assert model.mtp_status == ("MTP head not built: MTP block pattern '*M': only attention ('*'), MoE ('E') "
                                "and MLP ('-') blocks are supported")
    assert check_loaded(model, type(written)(written.folder, "nemotron_h", written.backbone)) is None
    if nemotron_mtp_pattern() == "*-":  # this mlx-lm has no MoE block: a Nemotron 3 Super head cannot be built
        _rewrite_config(written.folder, mtp_hybrid_override_pattern="*E")
        model = _load(written.folder)
        assert model.mtp is None
        assert model.mtp_status == ("MTP head not built: this mlx-lm's NemotronHBlock has no 'E' block "
                                    "(MTP pattern '*E')")

"""Qwen3.5 / Qwen3.5-MoE: setting the MTP tensors aside before ``sanitize`` leaves stock's
"HF checkpoint: shift the norms" decision its own, patches on.

mlx-lm 0.30.7 - 0.31.3 read the presence of ``mtp.`` keys as the sign of a Hugging Face checkpoint
whose RMSNorm weights are zero-centred and get +1 (0.32 reads the conv1d layout only). Upstream
pins it with ``test_qwen3_5_family_convert_then_load_norm_not_shift_twice`` (tests/test_models.py
of the 0.30.7 - 0.32.2 sdists): convert an HF checkpoint (norms shifted once, MTP keys dropped),
load the converted weights (not shifted again). The first test is that upstream test, run with
the package active; the second compares the patched ``sanitize`` with stock's for every layout:
identical wherever the backbone is in HF layout, with the head kept; for an MLX-layout backbone
carrying MTP tensors (stock's corruption before 0.32) the norms are left as stored, as 0.32's
stock does."""

import importlib
import importlib.util
import inspect

import pytest


FAMILIES = [f for f in ("qwen3_5", "qwen3_5_moe") if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]
pytestmark = pytest.mark.skipif(not FAMILIES, reason="this mlx-lm has no qwen3_5 family")

# upstream's tiny text config; kernel size 1 leaves the conv1d layout ambiguous, so only the
# MTP keys can tell stock the checkpoint is HF
TEXT_CONFIG = {
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": 32, "linear_num_value_heads": 1,
    "linear_num_key_heads": 1, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 1, "full_attention_interval": 1, "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}
HF_NORM = "model.language_model.layers.0.input_layernorm.weight"
MLX_NORM = "language_model.model.layers.0.input_layernorm.weight"
HF_MTP_KEY = {"qwen3_5": "mtp.fc.weights", "qwen3_5_moe": "mtp.fc.weight"}  # as upstream writes them


def _model(model_type):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    args = module.ModelArgs.from_dict(
        {"model_type": model_type, "text_config": {"model_type": model_type, **TEXT_CONFIG}})
    return module.Model(args)


def _stock_sanitize(model):
    """The family's unpatched ``sanitize``, bound to ``model``."""
    return inspect.unwrap(type(model).__dict__["sanitize"]).__get__(model)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_qwen3_5_family_convert_then_load_norm_not_shift_twice(model_type):
    """Upstream's test (mlx-lm 0.31.3 tests/test_models.py), patches on."""
    import mlx.core as mx

    model = _model(model_type)
    base = mx.arange(8, dtype=mx.float32)
    converted = model.sanitize({HF_NORM: base, HF_MTP_KEY[model_type]: mx.zeros((1,), dtype=mx.float32)})
    assert MLX_NORM in converted
    stock = _stock_sanitize(_model(model_type))({HF_NORM: base, HF_MTP_KEY[model_type]: mx.zeros((1,))})
    assert mx.array_equal(converted[MLX_NORM], stock[MLX_NORM])  # 0.30.7 - 0.31.3: base + 1
    assert not any("mtp." in k for k in converted)
    loaded = model.sanitize(converted)
    assert mx.array_equal(loaded[MLX_NORM], converted[MLX_NORM])


LAYOUTS = ("hf+mtp", "hf+model.mtp", "hf-text+mtp", "hf-vlm+mtp", "hf", "mlx", "mlx+language_model.mtp",
           "mlx+mtp")


def _layouts(mx):
    base = mx.arange(8, dtype=mx.float32)
    head = {"fc.weight": mx.ones((8, 16)), "norm.weight": mx.zeros((8,))}
    hf_backbone = {HF_NORM: base, "lm_head.weight": mx.zeros((32, 8))}
    text_only_hf = {"model.layers.0.input_layernorm.weight": base, "lm_head.weight": mx.zeros((32, 8))}
    mlx_backbone = {MLX_NORM: base, "language_model.lm_head.weight": mx.zeros((32, 8))}
    return {
        "hf+mtp": (hf_backbone, {f"mtp.{k}": v for k, v in head.items()}),
        "hf+model.mtp": (hf_backbone, {f"model.mtp.{k}": v for k, v in head.items()}),
        "hf-text+mtp": (text_only_hf, {f"mtp.{k}": v for k, v in head.items()}),
        "hf-vlm+mtp": (dict(hf_backbone, **{"model.visual.patch_embed.weight": mx.zeros((2,))}),
                       {f"mtp.{k}": v for k, v in head.items()}),
        "hf": (hf_backbone, {}),
        "mlx": (mlx_backbone, {}),
        "mlx+language_model.mtp": (mlx_backbone, {f"language_model.mtp.{k}": v for k, v in head.items()}),
        "mlx+mtp": (mlx_backbone, {f"mtp.{k}": v for k, v in head.items()}),
    }


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sanitize_matches_stock_and_keeps_the_head(model_type, layout):
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.mtp.heads import STASH

    backbone, mtp = _layouts(mx)[layout]
    model = _model(model_type)
    got = model.sanitize(dict(backbone, **mtp))
    stock = _stock_sanitize(_model(model_type))(dict(backbone, **mtp))
    assert model.__dict__.get(STASH, {}).keys() == mtp.keys()  # the head is set aside, whole
    assert got.keys() == stock.keys()
    if layout.startswith("mlx") and mtp:
        # stock 0.30.7 - 0.31.3 shifts these already-shifted norms again; patched, they stay as stored
        stored = _stock_sanitize(_model(model_type))(backbone)
        assert all(mx.array_equal(got[k], stored[k]) for k in stored)
    else:
        assert all(mx.array_equal(got[k], stock[k]) for k in stock), layout

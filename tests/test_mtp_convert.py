"""``mlx_lm.convert`` keeps the MTP head (``mtp-heads-converted``): tiny Hugging Face-layout
checkpoints (HF key names, zero-centred Qwen norms, HF conv1d axes, per-expert / fused experts)
are converted in-process through mlx-lm's public ``convert`` - unquantized, 4-bit, and with a
mixed recipe - then loaded with ``mlx_lm.load``. The head comes back (from the
``mtp.safetensors`` sidecar), quantized as mlx-lm quantized the backbone's layers of the same
kind, and MTP speculation equals greedy decoding; the converted folders load and generate the
same greedy tokens in stock mlx-lm (a subprocess with ``MLX_LM_PATCHES=0``), which reads no
``mtp.*`` tensor. ``mlx_lm.fuse`` (with and without ``--dequantize``) and
``mlx_lm.utils.save_model`` keep the head the same way; a folder whose sidecar is gone says so.
Folders are converted once per module; patches on."""

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from mlx_lm_patches.selftest.mtp_checkpoints import (MTP_MODEL_TYPES, check_loaded, hf_layout_unreadable,
                                                  write_mtp_checkpoint)
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
from support.references import greedy_of


FAMILIES = [f for f in ("qwen3_next", "qwen3_5", "nemotron_h")
            if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]
# (family, how): every family unquantized, 4-bit (the release's defaults) and with a mixed
# recipe; on Qwen3-Next also 8-bit with group size 32 and mxfp4.
CASES = ([(f, how) for f in FAMILIES for how in ("fp", "q4", "mixed_3_6")]
         + [("qwen3_next", how) for how in ("q8g32", "mxfp4")]
         # DeepSeek-V3 layout (the head is the layer after the last) and MiMo: one case per family
         + [(f, how) for f, how in (("deepseek_v3", "q4"), ("deepseek_v32", "q4"), ("glm4_moe", "q4"),
                                    ("glm4_moe_lite", "fp"), ("glm_moe_dsa", "q4"), ("mimo", "q4"), ("ernie4_5_moe", "q4"),
                                    ("exaone_moe", "q4"), ("mimo_v2_flash", "q4"),
                                    ("step3p5", "q4"), ("bailing_moe_v3", "q4"), ("longcat_flash", "q4"),
                                    ("longcat_flash_ngram", "q4"))
            if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None])


def _head_full_precision(path, module):
    """A user's own predicate: the head stays full precision, the backbone 4-bit."""
    return not path.startswith("mtp.")
PROMPT = prompt_tokens(12, seed=3)
MAX_TOKENS = 10


def _stock_mlx_moe_bug(text):
    return "gather_qmm" in text and "global_scale" in text


MOE_BUG = ("stock mlx-lm's quantized MoE layers call mx.gather_qmm(global_scale=...), which this mlx "
           "lacks (mlx-lm 0.32.2 with mlx 0.32.2; fine with mlx 0.32.4)")


def skips_stock_moe_bug(test):
    """Running a quantized MoE model fails in stock mlx-lm on this mlx: skip, naming why."""
    import functools

    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except TypeError as exc:
            if _stock_mlx_moe_bug(str(exc)):
                pytest.skip(MOE_BUG)
            raise

    return run


def _convert(source, out, how):
    from mlx_lm.convert import convert

    options = {"fp": {}, "q4": {"quantize": True},
               "q8g32": {"quantize": True, "q_bits": 8, "q_group_size": 32},
               "mxfp4": {"quantize": True, "q_mode": "mxfp4", "q_bits": 4, "q_group_size": 32},
               "mixed_3_6": {"quantize": True, "quant_predicate": "mixed_3_6"},
               "head-fp": {"quantize": True, "quant_predicate": _head_full_precision}}[how]
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its progress
        convert(str(source), mlx_path=str(out), dtype="float32", **options)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(written HF checkpoint, converted folder) per case, converted lazily and once."""
    root = tmp_path_factory.mktemp("mtp-convert")
    sources, folders = {}, {}

    def get(family, how):
        unreadable = hf_layout_unreadable(family)
        if unreadable:
            pytest.skip(unreadable)
        if family not in sources:
            sources[family] = write_mtp_checkpoint(root, family, form="hf", dtype="float32")
        if (family, how) not in folders:
            folders[family, how] = _convert(sources[family].folder, root / f"{family}-{how}", how)
        return sources[family], folders[family, how]

    return get


@pytest.fixture(scope="module")
def loaded(converted):
    from mlx_lm import load

    cache = {}

    def get(family, how):
        if (family, how) not in cache:
            cache[family, how] = load(str(converted(family, how)[1]))[0]
        return cache[family, how]

    return get


def _safetensors_keys(folder, pattern):
    import mlx.core as mx

    return {k: v for f in sorted(folder.glob(pattern)) for k, v in mx.load(str(f)).items()}


@pytest.mark.parametrize("family,how", CASES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_head_in_a_sidecar_stock_does_not_read(converted, family, how):
    _, folder = converted(family, how)
    shards = _safetensors_keys(folder, "model*.safetensors")
    assert shards and not [k for k in shards if "mtp." in k]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if "mtp." in k]
    assert set(index["weight_map"].values()) == {p.name for p in folder.glob("model*.safetensors")}
    sidecar = _safetensors_keys(folder, "mtp.safetensors")
    assert sidecar and all(k.startswith("mtp.") for k in sidecar)


@pytest.mark.parametrize("family,how", CASES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
@skips_stock_moe_bug
def test_converted_head_loads_and_mtp_speculation_equals_greedy(converted, loaded, family, how):
    written, _ = converted(family, how)
    model = loaded(family, how)
    assert model.mtp is not None, model.mtp_status
    assert model.mtp_status.endswith("from mtp.safetensors (written by mlx-lm-patches)"), model.mtp_status
    if how == "fp":  # float32 all along: backbone and head exactly as in the HF checkpoint
        assert check_loaded(model, written) is None, check_loaded(model, written)
    reference = greedy_of(model, PROMPT, max_tokens=MAX_TOKENS)
    for num_draft in (1, 2):
        got = speculative_greedy(model, model.make_draft_model(), PROMPT, max_tokens=MAX_TOKENS,
                                 num_draft_tokens=num_draft)
        assert reference.compare(got) is None, f"num_draft_tokens={num_draft}: {reference.compare(got)}"


# Same-kind layers of backbone and head: (backbone path with {i} for a full-attention layer,
# head path) per family, attention projections and (where there is one) the MoE router.
SAME_KIND = {
    "qwen3_next": [("model.layers.{i}.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                   ("model.layers.{i}.self_attn.v_proj", "layers.0.self_attn.v_proj"),
                   ("model.layers.{i}.mlp.gate", "layers.0.mlp.gate"),
                   ("model.layers.{i}.mlp.switch_mlp.down_proj", "layers.0.mlp.switch_mlp.down_proj")],
    "qwen3_5": [("language_model.model.layers.{i}.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                ("language_model.model.layers.{i}.self_attn.v_proj", "layers.0.self_attn.v_proj"),
                ("language_model.model.layers.{i}.mlp.down_proj", "layers.0.mlp.down_proj")],
    "nemotron_h": [("backbone.layers.{i}.mixer.q_proj", "layers.0.mixer.q_proj"),
                   ("backbone.layers.{i}.mixer.o_proj", "layers.0.mixer.o_proj")],
    "deepseek_v3": [("model.layers.{i}.self_attn.q_a_proj", "layers.0.self_attn.q_a_proj"),
                    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa", "layers.0.self_attn.kv_a_proj_with_mqa"),
                    ("model.layers.{i}.self_attn.o_proj", "layers.0.self_attn.o_proj"),
                    ("model.layers.{i}.mlp.switch_mlp.gate_proj", "layers.0.mlp.switch_mlp.gate_proj")],
    "deepseek_v32": [("model.layers.{i}.self_attn.q_a_proj", "layers.0.self_attn.q_a_proj"),
                     ("model.layers.{i}.self_attn.indexer.wq_b", "layers.0.self_attn.indexer.wq_b"),
                     ("model.layers.{i}.self_attn.indexer.wk", "layers.0.self_attn.indexer.wk"),
                     ("model.layers.{i}.mlp.switch_mlp.gate_proj", "layers.0.mlp.switch_mlp.gate_proj")],
    "ernie4_5_moe": [("model.layers.{i}.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                     ("model.layers.{i}.self_attn.o_proj", "layers.0.self_attn.o_proj"),
                     ("model.layers.{i}.mlp.gate_proj", "layers.0.mlp.gate_proj")],
    "exaone_moe": [("model.layers.{i}.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                   ("model.layers.{i}.self_attn.o_proj", "layers.0.self_attn.o_proj"),
                   ("model.layers.{i}.mlp.gate_proj", "layers.0.mlp.gate_proj")],
    # the head's layer slides (as backbone layers 1-2 do) and has a dense MLP (as layer 0)
    "mimo_v2_flash": [("model.layers.2.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                      ("model.layers.2.self_attn.o_proj", "layers.0.self_attn.o_proj"),
                      ("model.layers.0.mlp.gate_proj", "layers.0.mlp.gate_proj")],
    # the head's layer slides (as backbone layer 1 does) and has a dense MLP (as layer 0)
    "step3p5": [("model.layers.1.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                ("model.layers.1.self_attn.g_proj", "layers.0.self_attn.g_proj"),
                ("model.layers.0.mlp.gate_proj", "layers.0.mlp.gate_proj")],
    # the head's layer: the first latent attention and dense MLP of a backbone block
    "longcat_flash": [("model.layers.{i}.self_attn.0.q_a_proj", "layers.0.self_attn.q_a_proj"),
                      ("model.layers.{i}.self_attn.0.o_proj", "layers.0.self_attn.o_proj"),
                      ("model.layers.{i}.mlps.0.gate_proj", "layers.0.mlp.gate_proj")],
    "longcat_flash_ngram": [("model.layers.{i}.self_attn.0.q_a_proj", "layers.0.self_attn.q_a_proj"),
                            ("model.layers.{i}.self_attn.0.o_proj", "layers.0.self_attn.o_proj"),
                            ("model.layers.{i}.mlps.0.gate_proj", "layers.0.mlp.gate_proj")],
    # the head's layer: gated latent attention (as the backbone's last) with the sparse MoE
    "bailing_moe_v3": [("model.layers.{i}.attention.g_proj", "layers.0.attention.g_proj"),
                       ("model.layers.{i}.attention.dense", "layers.0.attention.dense"),
                       ("model.layers.{i}.mlp.switch_mlp.gate_proj", "layers.0.mlp.switch_mlp.gate_proj")],
    "mimo": [("model.layers.{i}.self_attn.q_proj", "layers.0.self_attn.q_proj"),
             ("model.layers.{i}.self_attn.o_proj", "layers.0.self_attn.o_proj"),
             ("model.layers.{i}.mlp.gate_proj", "layers.0.mlp.gate_proj")],
    "glm4_moe": [("model.layers.{i}.self_attn.q_proj", "layers.0.self_attn.q_proj"),
                 ("model.layers.{i}.self_attn.o_proj", "layers.0.self_attn.o_proj"),
                 ("model.layers.{i}.mlp.switch_mlp.gate_proj", "layers.0.mlp.switch_mlp.gate_proj")],
}
SAME_KIND["glm_moe_dsa"] = SAME_KIND["deepseek_v32"]  # GLM-5: DeepSeek-V3.2's model


def _bits_and_group(tensors, path, in_dims):
    if f"{path}.scales" not in tensors:
        return None
    return (tensors[f"{path}.weight"].shape[-1] * 32 // in_dims, in_dims // tensors[f"{path}.scales"].shape[-1])


def _module(root, path):
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _last_attention_index(model, family):
    """The last full-attention layer of the backbone (a mixed recipe treats it as the head,
    which it sees after the last layer: both get its "more bits")."""
    if family == "nemotron_h":
        return max(i for i, layer in enumerate(model.layers) if layer.block_type == "*")
    return max(i for i, layer in enumerate(model.layers) if not getattr(layer, "is_linear", False))


@pytest.mark.parametrize("family,how", [c for c in CASES if c[1] != "fp"])
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_head_quantized_as_the_backbone_layers_of_its_kind(converted, loaded, family, how):
    """The written tensors: every head layer of a kind the backbone has is stored with the bits
    and group size of that backbone layer (as the config's quantization entries say)."""
    import mlx.nn as nn

    _, folder = converted(family, how)
    config = json.loads((folder / "config.json").read_text())["quantization"]
    model = loaded(family, how)
    shards = _safetensors_keys(folder, "model*.safetensors")
    head = _safetensors_keys(folder, "mtp.safetensors")
    index = _last_attention_index(model, family)
    default = (config["bits"], config["group_size"])
    checked = 0
    for backbone_path, head_path in SAME_KIND[family]:
        backbone_path = backbone_path.format(i=index)
        try:
            in_dims = _module(model, backbone_path)
        except (AttributeError, IndexError):
            continue  # this release's block has no such layer
        layer = in_dims
        in_dims = layer.weight.shape[-1] * 32 // layer.bits if "scales" in layer else layer.weight.shape[-1]
        stored = _bits_and_group(shards, backbone_path, in_dims)
        assert _bits_and_group(head, f"mtp.{head_path}", in_dims) == stored, (head_path, stored)
        if stored is None:  # left full precision (e.g. its input size is no multiple of the group)
            assert "scales" not in _module(model.mtp, head_path), head_path
            continue
        # The config says the same: the same per-layer entry, or none for both (top-level settings).
        entry, head_entry = config.get(backbone_path), config.get(f"mtp.{head_path}")
        assert head_entry == entry, (head_path, head_entry, entry)
        if entry is None:
            assert stored == default
        else:
            # (mlx-lm 0.31.1+ records a mixed recipe's group size as null: the mode's default)
            assert stored[0] == entry["bits"] and entry["group_size"] in (stored[1], None)
        loaded_layer = _module(model.mtp, head_path)
        assert isinstance(loaded_layer, nn.QuantizedLinear) or "Quantized" in type(loaded_layer).__name__
        assert (loaded_layer.bits, loaded_layer.group_size) == stored
        assert getattr(loaded_layer, "mode", "affine") == getattr(layer, "mode", "affine")
        checked += 1
    assert checked >= 2
    if how == "mixed_3_6" and family != "nemotron_h":  # after the last layer: "more bits" layers
        v = _module(model.mtp, "layers.0.self_attn.v_proj")
        assert (v.bits, config["mtp.layers.0.self_attn.v_proj"]["bits"]) == (6, 6)
        assert _module(model.mtp, "layers.0.self_attn.q_proj").bits == 3


STOCK = r"""
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
assert "mlx_lm_patches.engine.core" not in sys.modules
out = {}
for folder in sys.argv[2:]:
    model, _ = load(folder)
    assert not hasattr(model, "mtp_status")
    try:
        steps = generate_step(mx.array(json.loads(sys.argv[1])), model, max_tokens=%d)
        out[folder] = [int(t) for t, _ in steps]
    except TypeError as exc:  # quantized MoE on an mlx without gather_qmm(global_scale=)
        out[folder] = str(exc)
print(json.dumps(out))
""" % MAX_TOKENS


def test_stock_mlx_lm_loads_the_converted_folders_and_generates_the_same(converted, loaded):
    cases = [c for c in CASES if c[1] != "mixed_3_6" and not hf_layout_unreadable(c[0])]
    folders = [str(converted(*case)[1]) for case in cases]
    env = dict(os.environ, MLX_LM_PATCHES="0")
    run = subprocess.run([sys.executable, "-c", STOCK, json.dumps(PROMPT), *folders], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    stock = json.loads(run.stdout.strip().splitlines()[-1])
    not_run = []
    for case, folder in zip(cases, folders):
        if isinstance(stock[folder], str) and _stock_mlx_moe_bug(stock[folder]):
            not_run.append(case)
            continue
        assert stock[folder] == greedy_of(loaded(*case), PROMPT, max_tokens=MAX_TOKENS).tokens, case
    if not_run:  # the others were compared above
        pytest.skip(f"{not_run} not run: {MOE_BUG}")


def test_a_missing_sidecar_is_reported(converted, tmp_path):
    from mlx_lm import load
    from mlx_lm_patches.mechanisms.mtp.decoding import MTPUnavailable

    folder = tmp_path / "no-sidecar"
    shutil.copytree(converted("qwen3_next", "q4")[1], folder)
    (folder / "mtp.safetensors").unlink()
    model = load(str(folder))[0]
    assert model.mtp is None
    assert model.mtp_status == ("config declares 1 MTP layer(s) but the checkpoint has no mtp.* tensors "
                                "(neither in its weight files nor in mtp.safetensors)")
    with pytest.raises(MTPUnavailable, match="neither in its weight files nor in mtp.safetensors"):
        model.make_draft_model()


def test_save_model_keeps_the_head(converted, loaded, tmp_path):
    """``mlx_lm.utils.save_model`` (what ``save``, and so ``mlx_lm.fuse``, calls) of a model with
    a kept head: the head goes to the sidecar, quantized as it is, and loads back equal."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import save_model

    source = converted("qwen3_next", "q4")[1]
    model = loaded("qwen3_next", "q4")
    folder = tmp_path / "saved"
    save_model(str(folder), model)
    for f in source.iterdir():
        if not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy(f, folder)
    assert not [k for k in _safetensors_keys(folder, "model*.safetensors") if "mtp." in k]
    again = load(str(folder))[0]
    want, got = dict(tree_flatten(model.mtp.parameters())), dict(tree_flatten(again.mtp.parameters()))
    assert set(want) == set(got)
    assert all(mx.array_equal(want[k], got[k]).item() for k in want)


@skips_stock_moe_bug
def test_a_predicate_of_the_user_decides_for_the_head(converted, loaded):
    """``convert(quant_predicate=callable)`` sees the head's layers as ``mtp.<path>``: here it
    keeps them full precision while the backbone is quantized."""
    from mlx.utils import tree_flatten

    _, folder = converted("qwen3_next", "head-fp")
    head = _safetensors_keys(folder, "mtp.safetensors")
    assert head and not [k for k in head if k.endswith(".scales")]
    assert [k for k in _safetensors_keys(folder, "model*.safetensors") if k.endswith(".scales")]
    model = loaded("qwen3_next", "head-fp")
    assert not [k for k, _ in tree_flatten(model.mtp.parameters()) if k.endswith(".scales")]
    reference = greedy(model, PROMPT, max_tokens=MAX_TOKENS)
    got = speculative_greedy(model, model.make_draft_model(), PROMPT, max_tokens=MAX_TOKENS)
    assert reference.compare(got) is None, reference.compare(got)


def _adapters(model_folder, adapter_dir):
    """LoRA adapters for the last two backbone layers, with non-zero ``lora_b`` (so fusing
    changes the backbone), written as ``mlx_lm.lora`` writes them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load(str(model_folder))[0]
    model.freeze()
    lora = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    trainable = {k: 0.05 * mx.random.normal(v.shape, key=mx.random.key(i)).astype(v.dtype) if k.endswith("lora_b") else v
                 for i, (k, v) in enumerate(sorted(trainable.items()))}
    adapter_dir.mkdir()
    mx.save_safetensors(str(adapter_dir / "adapters.safetensors"), trainable)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    return adapter_dir


@pytest.mark.parametrize("dequantize", [False, True])
@skips_stock_moe_bug
def test_fuse_keeps_the_head(converted, loaded, tmp_path, monkeypatch, dequantize):
    """``mlx_lm.fuse`` of LoRA adapters on a converted 4-bit folder: the head goes along
    unchanged (LoRA never adapts it), or dequantized with the backbone under ``--dequantize``;
    the fused model drafts exactly."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import fuse, load

    import inspect

    if dequantize and "dequantize(model)" in inspect.getsource(fuse.main) and not hasattr(fuse, "dequantize"):
        pytest.skip("this mlx-lm's fuse --dequantize calls `dequantize`, which it never imports (NameError, stock)")
    source = converted("qwen3_next", "q4")[1]
    adapters = _adapters(source, tmp_path / "adapters")
    out = tmp_path / "fused"
    argv = ["mlx_lm.fuse", "--model", str(source), "--adapter-path", str(adapters), "--save-path", str(out)]
    monkeypatch.setattr(sys, "argv", argv + (["--dequantize"] if dequantize else []))
    with contextlib.redirect_stdout(sys.stderr):
        fuse.main()
    assert not [k for k in _safetensors_keys(out, "model*.safetensors") if "mtp." in k]
    sidecar = _safetensors_keys(out, "mtp.safetensors")
    assert bool([k for k in sidecar if k.endswith(".scales")]) is not dequantize
    fused = load(str(out))[0]
    assert fused.mtp is not None, fused.mtp_status
    original = loaded("qwen3_next", "q4")
    if dequantize:
        from mlx_lm.utils import dequantize_model

        want = dict(tree_flatten(dequantize_model(_fresh_head(source)).parameters()))
    else:
        want = dict(tree_flatten(original.mtp.parameters()))
    got = dict(tree_flatten(fused.mtp.parameters()))
    assert set(got) == set(want)
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
    before = dict(tree_flatten(original.parameters()))
    assert any(not mx.array_equal(v, before[k]).item() for k, v in tree_flatten(fused.parameters())
               if k in before and v.shape == before[k].shape), "the adapters changed nothing"
    reference = greedy(fused, PROMPT, max_tokens=MAX_TOKENS)
    got = speculative_greedy(fused, fused.make_draft_model(), PROMPT, max_tokens=MAX_TOKENS)
    assert reference.compare(got) is None, reference.compare(got)


def _fresh_head(folder):
    from mlx_lm import load

    return load(str(folder))[0].mtp


STOCK_CONVERT = r"""
import contextlib, json, sys
from mlx_lm.convert import convert
assert "mlx_lm_patches.engine.core" not in sys.modules
options = json.loads(sys.argv[1])
for out, kwargs in options.items():
    with contextlib.redirect_stdout(sys.stderr):
        convert(sys.argv[2], mlx_path=out, dtype="float32", **kwargs)
"""


def test_the_backbone_is_written_as_stock_mlx_lm_writes_it(converted, tmp_path):
    """Stock ``mlx_lm.convert`` (``MLX_LM_PATCHES=0``) of the same checkpoint, 4-bit and with a
    mixed recipe: the same weight files, tensor for tensor, the same index and the same
    config.json apart from the head's ``mtp.`` quantization entries."""
    import mlx.core as mx

    source = converted("qwen3_next", "fp")[0].folder
    hows = {"q4": {"quantize": True}, "mixed_3_6": {"quantize": True, "quant_predicate": "mixed_3_6"}}
    outs = {str(tmp_path / how): kwargs for how, kwargs in hows.items()}
    run = subprocess.run([sys.executable, "-c", STOCK_CONVERT, json.dumps(outs), str(source)],
                         env=dict(os.environ, MLX_LM_PATCHES="0"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for how in hows:
        stock, ours = tmp_path / how, converted("qwen3_next", how)[1]
        assert not (stock / "mtp.safetensors").exists()
        want, got = _safetensors_keys(stock, "model*.safetensors"), _safetensors_keys(ours, "model*.safetensors")
        assert set(got) == set(want), how
        assert all(mx.array_equal(got[k], want[k]).item() and got[k].dtype == want[k].dtype for k in want), how
        assert json.loads((ours / "model.safetensors.index.json").read_text()) == json.loads(
            (stock / "model.safetensors.index.json").read_text())
        config = json.loads((ours / "config.json").read_text())
        for key in ("quantization", "quantization_config"):
            if key in config:
                config[key] = {k: v for k, v in config[key].items() if not k.startswith("mtp.")}
        assert config == json.loads((stock / "config.json").read_text()), how


@skips_stock_moe_bug
def test_convert_dequantize_dequantizes_the_head(converted, loaded, tmp_path):
    """``convert(dequantize=True)`` of the converted 4-bit folder: the head is dequantized with
    the backbone (mlx-lm's ``dequantize_model`` on the same layers) and still drafts exactly."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.convert import convert
    from mlx_lm.utils import dequantize_model

    source = converted("qwen3_next", "q4")[1]
    out = tmp_path / "dequantized"
    with contextlib.redirect_stdout(sys.stderr):
        convert(str(source), mlx_path=str(out), dequantize=True, dtype="float32")
    sidecar = _safetensors_keys(out, "mtp.safetensors")
    assert sidecar and not [k for k in sidecar if k.endswith((".scales", ".biases"))]
    model = load(str(out))[0]
    want = dict(tree_flatten(dequantize_model(load(str(source))[0].mtp).parameters()))
    got = dict(tree_flatten(model.mtp.parameters()))
    assert set(got) == set(want) and all(mx.array_equal(got[k], want[k]).item() for k in want)
    reference = greedy(model, PROMPT, max_tokens=MAX_TOKENS)
    drafted = speculative_greedy(model, model.make_draft_model(), PROMPT, max_tokens=MAX_TOKENS)
    assert reference.compare(drafted) is None, reference.compare(drafted)


def test_a_head_that_cannot_be_kept_is_reported_when_converting(tmp_path):
    """A checkpoint whose config declares an MTP head it does not carry: convert warns (stderr),
    naming why, instead of silently writing a folder without it."""
    full = write_mtp_checkpoint(tmp_path, "qwen3_next", form="hf", dtype="float32", name="full")
    written = write_mtp_checkpoint(tmp_path, "qwen3_next", form="hf", dtype="float32", name="none",
                                   drop=[k for k in _safetensors_keys(full.folder, "model*.safetensors") if "mtp." in k])
    with pytest.warns(UserWarning, match="no MTP head: config declares 1 MTP layer"):
        _convert(written.folder, tmp_path / "converted", "fp")
    assert not (tmp_path / "converted" / "mtp.safetensors").exists()

"""Tiny checkpoints carrying a multi-token-prediction head, written to disk (never downloaded).

``write_mtp_checkpoint(root, family, form=..., quantized=..., placement=...)`` writes a model
folder for ``qwen3_next``, ``qwen3_5`` or ``qwen3_5_moe`` (random weights, local tokenizer) whose
weights include an MTP head:

* ``form="mlx"``: mlx-lm's own layout (what ``mlx_lm.convert`` and community MLX conversions
  write); ``form="hf"``: the Hugging Face layout (conv1d axes, zero-centred norms, per-expert
  experts for Qwen3-Next, fused experts for Qwen3.5-MoE, ``model.language_model.`` prefixes);
* ``quantized``: ``True`` quantizes backbone and head (MLX form) the way ``mlx_lm.convert``
  does: 4-bit, group size 32 where the layer's input size allows, with the family's
  ``quant_predicate`` (8-bit, group 64 for the MoE router gates) recorded as per-layer entries of
  ``config["quantization"]``; ``"backbone"`` or ``"head"`` quantizes that part only (the other
  stays full precision); ``overrides`` maps module paths to per-layer settings (a dict for
  ``to_quantized``, or ``False`` for full precision) that win and are written to the config:
  backbone paths as mlx-lm names them (``model.layers.0.mlp.gate``), head paths prefixed
  ``mtp.`` (or ``language_model.mtp.`` / ``model.mtp.``, as a converter might name them);
* ``placement``: ``"shards"`` (in the model shards), ``"sidecar"`` (an ``mtp.safetensors`` the
  index does not list) or ``"model-mtp"`` (a ``model-mtp.safetensors`` file);
* ``declare``: whether config.json declares the MTP layers; ``drop``: MTP tensors left out;
  ``dtype``: of the floating-point tensors written (default ``"bfloat16"``; ``"float32"`` for
  decoding on CPU, where mlx's MoE kernels need float32); ``config_overrides``: top-level keys of
  the tiny config replaced (e.g. more layers, wider, for ``benchmarks/speculation_costs.py``).

``deepseek_v3``, ``deepseek_v32``, ``glm4_moe`` and ``glm4_moe_lite`` (three layers) get the DeepSeek-V3 layout: in
HF form the head is ``model.layers.3`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
the decoder layer with one tensor per expert and multi-head latent attention's ``kv_b_proj``, and
copies of the embedding and output head), the backbone's experts per expert and ``kv_b_proj``
unsplit as well.

``bailing_moe_v3`` (four layers: linear, latent, linear, latent attention) in HF form stores its
head as ``model.layers.4`` (``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` and a gated
latent-attention MoE decoder layer, experts per expert, ``kv_b_proj`` unsplit; no copies of the
shared embedding and output head), the backbone likewise (its short convolutions as (C, 1, K)).

``longcat_flash`` (two layers) in HF form stores its head as ``model.mtp.layers.0`` (``enorm.m``,
``hnorm.m``, ``eh_proj``, ``input_layernorm``, ``self_attn.*`` with ``kv_b_proj`` unsplit,
``post_attention_layernorm``, ``transformer_layer.mlp.*``), ``model.mtp.norm`` and a copy of the
embedding (``model.mtp.embed_tokens``); the backbone's experts per expert, ``kv_b_proj`` unsplit.
``longcat_flash_ngram`` (LongCat-Flash-Lite) the same, its copy being of the n-gram embedding's
word embeddings.

``ernie4_5_moe`` (three layers) in HF form stores its head as ``model.mtp_emb_norm.0``,
``model.mtp_hidden_norm.0``, ``model.mtp_linear_proj.0`` and ``model.mtp_block.0.*`` (a dense
decoder layer), the backbone's experts per expert.

``mimo`` (two layers) in HF form stores its head as ``model.mtp_layers.0.*`` (``token_layernorm``,
``hidden_layernorm``, ``input_proj``, ``final_layernorm`` beside the decoder layer's tensors).

``nemotron_h`` gets the Nemotron 3 Super head layout (``mtp_hybrid_override_pattern`` ``"*E"``:
an attention block holding ``enorm``/``hnorm``/``eh_proj``, then an MoE block holding
``final_layernorm``; the config gains the MoE settings the head needs). Releases whose
``NemotronHBlock`` has no MoE block (before 0.30.0) get ``"*-"`` (attention, then MLP). Its HF
form stores experts per expert (``experts.{e}.up_proj``) and norms unshifted.
:func:`check_loaded` compares a loaded model with what was written.
"""

import copy
import re
import functools
import pathlib
from dataclasses import dataclass, field

GROUP_SIZE, BITS = 32, 4
QWEN_NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                      "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


@dataclass
class Written:
    folder: pathlib.Path
    family: str
    backbone: dict  # MLX parameter name -> array as stored (bf16 / quantized)
    head: dict = field(default_factory=dict)  # MTP head parameter name (MLX layout) -> array


HEAD_PREFIXES = ("mtp.", "language_model.mtp.", "model.mtp.")


def _quantize_part(module, *, default, family_predicate, overrides, prefixes, entries):
    """Quantize ``module`` in place as ``mlx_lm.convert`` would (``default``: quantize what the
    overrides do not name), recording per-layer settings in ``entries`` under their config key."""
    import mlx.nn as nn

    def predicate(path, leaf):
        if not hasattr(leaf, "to_quantized"):
            return False
        for prefix in prefixes:
            if prefix + path in overrides:
                entries[prefix + path] = overrides[prefix + path]
                return overrides[prefix + path]
        if not default:
            return False
        params = family_predicate(path, leaf) if family_predicate else True
        group = params["group_size"] if isinstance(params, dict) else GROUP_SIZE
        if leaf.weight.shape[-1] % group:
            return False
        if isinstance(params, dict):
            entries[prefixes[0] + path] = params
        return params

    nn.quantize(module, group_size=GROUP_SIZE, bits=BITS, class_predicate=predicate)


def _cast(params, dtype):
    import mlx.core as mx

    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in params.items()}


NEMOTRON_MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "moe_shared_expert_intermediate_size": 64, "n_shared_experts": 1, "n_group": 1,
                "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}
NEMOTRON_EXPERTS = {"fc1": "up_proj", "fc2": "down_proj"}  # mlx-lm name -> HF name


def nemotron_mtp_pattern():
    """``"*E"`` (Nemotron 3 Super's MTP blocks) where this mlx-lm has MoE blocks, else ``"*-"``."""
    from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock

    from mlx_lm_patches.selftest.tiny_models import tiny_config

    args = ModelArgs.from_dict(dict(tiny_config("nemotron_h"), **NEMOTRON_MOE))
    return "*E" if "mixer" in NemotronHBlock(args, "E") else "*-"


def _to_hf(family, params, *, shift_suffixes=QWEN_NORM_SUFFIXES, shift_all_norms=False):
    """Invert mlx-lm's sanitize for the Qwen families and Nemotron-H (enough for these tiny
    models)."""
    import mlx.core as mx

    out, fused = {}, {}
    for key, value in params.items():
        if family in ("qwen3_5", "qwen3_5_moe"):
            if key.startswith("language_model.model."):
                key = "model.language_model." + key[len("language_model.model."):]
            elif key.startswith("language_model."):
                key = key[len("language_model."):]
        if "conv1d.weight" in key and value.ndim == 3 and value.shape[-1] == 1:
            value = value.moveaxis(2, 1)
        is_norm = value.ndim == 1 and key.endswith(".weight") and "norm" in key.split(".")[-2]
        if is_norm and (shift_all_norms or any(key.endswith(s) for s in shift_suffixes)):
            value = value - 1.0
        if ".switch_mlp." in key:
            prefix, rest = key.split(".switch_mlp.")
            proj = rest.split(".")[0]
            if family == "qwen3_5_moe":
                fused.setdefault(prefix, {})[proj] = value
            else:
                proj = NEMOTRON_EXPERTS.get(proj, proj) if family == "nemotron_h" else proj
                for e in range(value.shape[0]):
                    out[f"{prefix}.experts.{e}.{proj}.weight"] = value[e]
            continue
        out[key] = value
    for prefix, parts in fused.items():
        out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([parts["gate_proj"], parts["up_proj"]], axis=-2)
        out[f"{prefix}.experts.down_proj"] = parts["down_proj"]
    return out


MIMO_V2_LAYERS = 3  # MTP layers in a MiMo-V2-Flash checkpoint
STEP_LAYERS = 2  # MTP layers written for Step-3.5 here (its checkpoints ship 3)
_STEP_NAMES = ((".mlp.switch_mlp.gate_proj.", ".moe.gate_proj."), (".mlp.switch_mlp.up_proj.", ".moe.up_proj."),
               (".mlp.switch_mlp.down_proj.", ".moe.down_proj."), (".mlp.gate.gate.", ".moe.gate."),
               (".mlp.gate.router_bias", ".moe.router_bias"), (".mlp.share_expert.", ".share_expert."))


def _step_to_hf(params):
    """Invert mlx-lm's step3p5 ``sanitize`` for an original ("vanilla") checkpoint: MoE names
    back, every norm weight zero-centred."""
    out = {}
    for key, value in params.items():
        key = f".{key}"
        for mlx_name, hf_name in _STEP_NAMES:
            if mlx_name in key:
                key = key.replace(mlx_name, hf_name)
                break
        if key.endswith(".weight") and "norm" in key:
            value = value - 1.0
        out[key[1:]] = value
    return out
DEEPSEEK_LAYOUT = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")  # the head is layer num_hidden_layers
# Every family whose tiny checkpoints get an MTP head here (the order: representatives of a cache
# layout first, see tests/support/sweeps.py)
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "deepseek_v3", "deepseek_v32",
                   "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "mimo", "ernie4_5_moe", "exaone_moe", "mimo_v2_flash",
                   "step3p5", "bailing_moe_v3", "longcat_flash", "longcat_flash_ngram")


def _deepseek_to_hf(params):
    """Invert mlx-lm's DeepSeek-V3-layout ``sanitize``: stacked experts back to one tensor per
    expert, and multi-head latent attention's ``embed_q`` / ``unembed_out`` back to the
    ``kv_b_proj`` they were split from (where this release splits it)."""
    import mlx.core as mx

    out = {}
    for key, value in params.items():
        if ".switch_mlp." in key:
            prefix, rest = key.split(".switch_mlp.")
            proj, leaf = rest.split(".")
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}.{leaf}"] = value[e]
        elif _LATENT.search(key) and key.endswith(".embed_q.weight"):
            prefix = key[: -len("embed_q.weight")]
            unembed = params[prefix + "unembed_out.weight"]  # (heads, v_head_dim, kv_lora_rank)
            stacked = mx.concatenate([value.swapaxes(-1, -2), unembed], axis=1)
            out[prefix + "kv_b_proj.weight"] = stacked.reshape(-1, stacked.shape[-1])
        elif not (_LATENT.search(key) and key.endswith(".unembed_out.weight")):
            out[key] = value
    return out


# latent attention modules: DeepSeek-V3 layout's self_attn, Ling 3.0's attention, LongCat's self_attn.{i}
_LATENT = re.compile(r"(^|\.)(self_attn(\.\d+)?|attention)\.(embed_q|unembed_out)\.weight$")


def _bailing_to_hf(params):
    """Invert mlx-lm's bailing_moe_v3 ``sanitize``: per-expert tensors, ``kv_b_proj`` unsplit
    (as for the DeepSeek-V3 layout), and the short convolutions' weights back to (C, 1, K)."""
    return {k: (v.moveaxis(1, 2) if "_conv1d.weight" in k else v) for k, v in _deepseek_to_hf(params).items()}


@functools.lru_cache(maxsize=None)
def hf_layout_unreadable(family):
    """Why the installed mlx-lm's own ``sanitize`` cannot read ``family``'s backbone in the Hugging
    Face layout written here (a bug of that release, not patched), or None. Probed on the tiny
    model: a DeepSeek-V3-layout backbone's unsplit ``kv_b_proj`` must not survive ``sanitize``
    where the model has no such parameter (mlx-lm 0.30.6's deepseek_v32 looks for it under
    ``model.layers.{l}`` instead of ``model.layers.{l}.self_attn``)."""
    from mlx.utils import tree_flatten

    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    if family not in DEEPSEEK_LAYOUT:
        return None
    model = build_tiny_model(family, seed=0)
    params = dict(tree_flatten(model.parameters()))
    left = sorted(k for k in model.sanitize(_deepseek_to_hf(params)) if k not in params)
    if left:
        return (f"this mlx-lm's {family} sanitize leaves {left[0]} of a Hugging Face checkpoint unconverted "
                "(stock mlx-lm cannot load one; a release bug, not patched)")
    return None


def _deepseek_head_to_hf(head_params, backbone, depth):
    """The head as the checkpoint's layer ``depth`` (Hugging Face names and layout), with the
    copies of the shared embedding and output head that DeepSeek-V3 and GLM checkpoints ship."""
    layer = {(k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in head_params.items()}
    out = {f"model.layers.{depth}.{k}": v for k, v in _deepseek_to_hf(layer).items()}
    out[f"model.layers.{depth}.embed_tokens.weight"] = backbone["model.embed_tokens.weight"]
    out[f"model.layers.{depth}.shared_head.head.weight"] = backbone["lm_head.weight"]
    return out


def _declare(config, family, layers):
    config = copy.deepcopy(config)
    if family in ("qwen3_5", "qwen3_5_moe"):
        config["text_config"]["mtp_num_hidden_layers"] = layers
    else:
        config["num_nextn_predict_layers"] = layers
    return config


def _nemotron_head_config(config):
    """The tiny nemotron_h config plus what its MTP head needs (MoE settings, block pattern)."""
    return dict(config, **NEMOTRON_MOE, mtp_hybrid_override_pattern=nemotron_mtp_pattern())


def write_mtp_checkpoint(root, family, *, form="mlx", quantized=False, placement="shards",
                         declare=True, drop=(), name=None, dtype="bfloat16", overrides=None,
                         config_overrides=None) -> Written:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_lm_patches.mechanisms.mtp.heads import build
    from mlx_lm_patches.mechanisms.probing.random_weights import random_like
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

    dtype = getattr(mx, dtype)
    config = dict(tiny_config(family), **(config_overrides or {}))
    model = build_tiny_model(family, seed=0, overrides=config_overrides)
    folder = pathlib.Path(root) / (name or f"{family}-{form}{'-q4' if quantized else ''}-{placement}")
    if family == "nemotron_h":
        config = _nemotron_head_config(config)
        model.args = type(model.args).from_dict(config)  # the head's blocks read the MoE settings
    # MiMo-V2-Flash and Step-3.5 heads draft with each of their MTP layers in turn
    shipped = {"mimo_v2_flash": MIMO_V2_LAYERS, "step3p5": STEP_LAYERS}.get(family, 1)
    head = build(model, 1, _declare(config, family, shipped))
    head.load_weights(list(random_like(dict(tree_flatten(head.parameters())), seed=1000).items()))
    if quantized or overrides:
        overrides = dict(overrides or {})
        entries = {}
        family_predicate = getattr(model, "quant_predicate", None)
        _quantize_part(model, default=quantized in (True, "backbone"), family_predicate=family_predicate,
                       overrides=overrides, prefixes=("",), entries=entries)
        _quantize_part(head, default=quantized in (True, "head"), family_predicate=family_predicate,
                       overrides=overrides, prefixes=HEAD_PREFIXES, entries=entries)
        unused = sorted(set(overrides) - set(entries))
        if unused:
            raise ValueError(f"overrides name no quantizable module: {unused}")
        config = dict(config, quantization={"group_size": GROUP_SIZE, "bits": BITS, **entries})
    mx.eval(model.parameters(), head.parameters())
    backbone = _cast(dict(tree_flatten(model.parameters())), dtype)
    head_params = _cast(dict(tree_flatten(head.parameters())), dtype)
    if form == "hf" and family == "mimo":  # model.mtp_layers.0, decoder layer and fusion side by side
        weights = backbone
        mtp = {f"model.mtp_layers.0.{k[len('layers.0.'):] if k.startswith('layers.0.') else k}": v
               for k, v in head_params.items()}
    elif form == "hf" and family == "ernie4_5_moe":  # model.mtp_<part>.0, the block as mtp_block.0
        weights = _deepseek_to_hf(backbone)  # (per-expert tensors, as ERNIE checkpoints store them)
        mtp = {(f"model.mtp_block.0.{k[len('layers.0.'):]}" if k.startswith("layers.0.")
                else "model.{}.0.{}".format(*k.split(".", 1))): v for k, v in head_params.items()}
    elif form == "hf" and family == "exaone_moe":  # per-expert backbone tensors; the head as mtp.*, norms as used
        weights = {k.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"): v
                   for k, v in _deepseek_to_hf(backbone).items()}
        mtp = {f"mtp.{k}": v for k, v in head_params.items()}
    elif form == "hf" and family == "mimo_v2_flash":  # model.mtp.layers.{i}: fusion, layer and final norm in one
        weights = _deepseek_to_hf(backbone)  # (per-expert tensors, as the checkpoints store them)
        mtp = {}
        for i in range(MIMO_V2_LAYERS):
            for k, v in _depth_params(head_params, i).items():
                k = k[len("layers.0."):] if k.startswith("layers.0.") else k
                mtp[f"model.mtp.layers.{i}.{k.replace('post_attention_layernorm.', 'pre_mlp_layernorm.')}"] = v
    elif form == "hf" and family == "step3p5":  # vanilla names, zero-centred norms; the head as layers 3, 4
        weights = _step_to_hf(backbone)
        depth = config["num_hidden_layers"]
        mtp = {}
        for i in range(STEP_LAYERS):
            flat = {(k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                    for k, v in _depth_params(head_params, i).items()}
            mtp.update({f"model.layers.{depth + i}.{k}": v for k, v in _step_to_hf(flat).items()})
    elif form == "hf" and family in ("longcat_flash", "longcat_flash_ngram"):  # model.mtp.layers.0 (.m fusion norms), model.mtp.norm
        weights = _deepseek_to_hf(backbone)
        mtp = {}
        for key, value in _deepseek_to_hf(head_params).items():
            if key.startswith(("enorm.", "hnorm.")):
                key = "layers.0.{}.m.{}".format(*key.split(".", 1))
            elif key.startswith("eh_proj."):
                key = f"layers.0.{key}"
            mtp[f"model.mtp.{key.replace('layers.0.mlp.', 'layers.0.transformer_layer.mlp.')}"] = value
        mtp["model.mtp.embed_tokens.weight"] = backbone.get("model.embed_tokens.weight",
                                                            backbone.get("model.ngram_embeddings.word_embeddings.weight"))
    elif form == "hf" and family == "bailing_moe_v3":  # the head is layer num_hidden_layers, no shared copies
        weights = _bailing_to_hf(backbone)
        layer = {(k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in head_params.items()}
        mtp = {f"model.layers.{config['num_hidden_layers']}.{k}": v for k, v in _bailing_to_hf(layer).items()}
    elif form == "hf" and family in DEEPSEEK_LAYOUT:  # the head is the layer after the last
        weights = _deepseek_to_hf(backbone)
        mtp = _deepseek_head_to_hf(head_params, backbone, config["num_hidden_layers"])
    elif form == "hf":
        qwen = family != "nemotron_h"  # Nemotron-H stores norms as used
        weights = _to_hf(family, backbone, shift_suffixes=QWEN_NORM_SUFFIXES if qwen else ())
        mtp = {f"mtp.{k}": v for k, v in _to_hf(family, head_params, shift_all_norms=qwen,
                                                   shift_suffixes=()).items()}
    else:
        weights = backbone
        mtp = {f"mtp.{k}": v for k, v in head_params.items()}
    mtp = {k: v for k, v in mtp.items() if k not in set(drop)}
    extra_files = {}
    if placement == "sidecar":
        extra_files["mtp.safetensors"] = mtp
    elif placement == "model-mtp":
        extra_files["model-mtp.safetensors"] = mtp
    else:
        weights = dict(weights, **mtp)
    # An empty module plus every tensor as extra_tensors lets any key layout through.
    write_model_folder(folder, nn.Module(), _declare(config, family, shipped) if declare else config,
                       vocab_size=_vocab(config), dtype=dtype, extra_tensors=weights,
                       extra_files=extra_files)
    return Written(folder, family, backbone, head_params)


def _depth_params(head_params, depth):
    """The parameters of the head's MTP layer ``depth`` (``depths.{depth-1}.*`` for a later one),
    named as layer 0's are."""
    if depth == 0:
        return {k: v for k, v in head_params.items() if not k.startswith("depths.")}
    prefix = f"depths.{depth - 1}."
    return {k[len(prefix):]: v for k, v in head_params.items() if k.startswith(prefix)}


def _vocab(config):
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def _differences(got, want, what):
    import mlx.core as mx

    problems = []
    for key, value in want.items():
        have = got.get(key)
        if have is None:
            problems.append(f"{what} {key} missing")
        elif have.shape != value.shape:
            problems.append(f"{what} {key} shape {have.shape} != {value.shape}")
        else:
            diff = mx.abs(have.astype(mx.float32) - value.astype(mx.float32)).max().item()
            if diff > 1e-2:
                problems.append(f"{what} {key} differs by {diff:.3g}")
    extra = sorted(set(got) - set(want))
    if extra:
        problems.append(f"{what}: unexpected {extra[:5]}")
    return problems


def check_loaded(model, written: Written):
    """``None`` if ``model`` has exactly the written backbone and (where kept) MTP head."""
    from mlx.utils import tree_flatten

    problems = _differences(dict(tree_flatten(model.parameters())), written.backbone, "backbone")
    if written.head:
        head = getattr(model, "mtp", None)
        if head is None:
            problems.append(f"no MTP head ({getattr(model, 'mtp_status', 'no mtp_status')})")
        else:
            problems += _differences(dict(tree_flatten(head.parameters())), written.head, "mtp")
    return "; ".join(problems[:6]) or None

"""Multi-token-prediction (MTP) heads kept through ``mlx_lm.load``.

Qwen3-Next and Qwen3.5/3.6 checkpoints carry a next-token-prediction head (``mtp.*`` tensors: a
fusion ``fc`` over ``[norm(embedding), norm(hidden)]``, one or more full-attention decoder
layers and a final norm). mlx-lm has no module for it and drops, rejects or mangles the tensors
(see the ``mtp-heads-kept`` patch). This module builds the head from the family's own decoder
layer class, converts the tensors from whichever layout the checkpoint uses to mlx-lm's, and
loads them strictly.

Layouts accepted, per tensor (checkpoints mix them):

* key prefixes ``mtp.``, ``model.mtp.``, ``language_model.mtp.``, ``model.language_model.mtp.``;
* experts per expert (``experts.{e}.gate_proj.weight``, HF Qwen3-Next/3.5), fused
  (``experts.gate_up_proj`` / ``experts.down_proj``, HF Qwen3.6-style) or stacked
  (``switch_mlp.*``, MLX);
* RMSNorm weights stored zero-centred (HF, the layer computes ``1 + w``) or shifted (MLX, where
  ``nn.RMSNorm`` computes ``w``): decided per tensor - a norm weight whose mean is below 0.5 is
  zero-centred and gets +1;
* quantized exactly where the checkpoint has ``.scales`` (bits and group size read from the
  tensor shapes; a per-layer entry in ``config["quantization"]`` wins), full precision elsewhere.

The head is kept *outside* the model's parameter tree (``model.mtp``, with ``model.mtp_status``
saying what happened), so ``mlx_lm.convert``, LoRA and ``save`` behave exactly as before.
"""

import re
from typing import Optional

MTP_KEY = re.compile(r"(^|\.)mtp\.")
STASH = "_mlx_lm_patches_mtp_tensors"
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
SIDECARS = ("mtp.safetensors",)  # model-mtp.safetensors is already read by mlx-lm's glob
NOT_KEPT = {
    "nemotron_h": "the nemotron_h MTP head is not kept yet (its tensors are set aside so the "
    "model loads)",
}


def split(weights):
    """``(backbone, mtp)``: the checkpoint tensors without and with an ``mtp.`` path part."""
    mtp = {k: v for k, v in weights.items() if MTP_KEY.search(k)}
    if not mtp:
        return weights, mtp
    return {k: v for k, v in weights.items() if k not in mtp}, mtp


def stash(model, tensors) -> None:
    """Set MTP tensors aside on the model instance (not in its parameter tree)."""
    if tensors:
        model.__dict__.setdefault(STASH, {}).update(tensors)


def declared_layers(config) -> int:
    """How many MTP layers the config declares (0 if none)."""
    text = config.get("text_config") or {}
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        for source in (config, text):
            value = source.get(key)
            if value:
                return int(value)
    return 0


def _relative(key):
    return key[MTP_KEY.search(key).end():]


def _backbone(model):
    """(decoder layer class, its args, the module holding embed/lm_head) for a supported model."""
    if model.model_type == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        return Qwen3NextDecoderLayer, model.args
    from mlx_lm.models.qwen3_5 import DecoderLayer

    return DecoderLayer, model.language_model.args


def build(model, n_layers: int):
    """An empty MTP head for ``model`` (MLX layout): ``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``layers`` (full attention, MoE where the backbone's would be),
    ``norm``."""
    import mlx.nn as nn

    layer_class, args = _backbone(model)
    hidden, eps = args.hidden_size, args.rms_norm_eps
    head = nn.Module()
    head.fc = nn.Linear(2 * hidden, hidden, bias=False)
    head.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
    head.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
    head.layers = [layer_class(args, args.full_attention_interval - 1) for _ in range(n_layers)]
    head.norm = nn.RMSNorm(hidden, eps=eps)
    return head


_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+_proj)\.(weight|scales|biases)$")
_FUSED = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


def to_mlx_layout(tensors) -> dict:
    """Checkpoint MTP tensors -> the head's parameter names and layout (see module docstring)."""
    import mlx.core as mx

    out, experts = {}, {}
    for key, value in tensors.items():
        key = _relative(key)
        per_expert = _PER_EXPERT.match(key)
        if per_expert:
            prefix, index, proj, leaf = per_expert.groups()
            experts.setdefault((prefix, proj, leaf), {})[int(index)] = value
            continue
        fused = _FUSED.match(key)
        if fused:
            prefix, name = fused.groups()
            if name == "gate_up_proj":
                middle = value.shape[-2] // 2
                out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[..., :middle, :]
                out[f"{prefix}.switch_mlp.up_proj.weight"] = value[..., middle:, :]
            else:
                out[f"{prefix}.switch_mlp.down_proj.weight"] = value
            continue
        parts = key.split(".")
        if value.ndim == 1 and parts[-1] == "weight" and "norm" in parts[-2]:
            if mx.mean(value.astype(mx.float32)).item() < 0.5:
                value = value + 1.0  # zero-centred (1 + w) storage
        out[key] = value
    for (prefix, proj, leaf), by_index in experts.items():
        out[f"{prefix}.switch_mlp.{proj}.{leaf}"] = mx.stack([by_index[e] for e in sorted(by_index)])
    return out


def _layer_count(weights) -> int:
    indices = {int(m.group(1)) for k in weights for m in [re.match(r"^layers\.(\d+)\.", k)] if m}
    return max(indices) + 1 if indices else 0


def _quantize_where_stored(head, weights, config) -> None:
    """Quantize exactly the layers the checkpoint stores quantized."""
    import mlx.nn as nn

    if not any(k.endswith(".scales") for k in weights):
        return
    settings = config.get("quantization") or {}

    def predicate(path, module):
        for key in (f"mtp.{path}", f"language_model.mtp.{path}", f"model.mtp.{path}"):
            if key in settings:
                return settings[key]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        in_dims = module.weight.shape[-1]
        group_size = in_dims // weights[f"{path}.scales"].shape[-1]
        bits = weights[f"{path}.weight"].shape[-1] * 32 // in_dims
        params = {"group_size": group_size, "bits": bits}
        if settings.get("mode", "affine") != "affine":
            params["mode"] = settings["mode"]
        return params

    nn.quantize(head, class_predicate=predicate)


def attach(model, model_path, config, lazy=False) -> None:
    """Build, load and attach the MTP head, or record why not (``model.mtp_status``)."""
    import pathlib

    import mlx.core as mx

    tensors = dict(model.__dict__.pop(STASH, {}))
    for name in SIDECARS:
        path = pathlib.Path(model_path) / name
        if path.exists():
            tensors.update(mx.load(str(path)))
    declared = declared_layers(config)
    model.__dict__["mtp"] = None
    model_type = getattr(model, "model_type", None)
    if not tensors:
        model.__dict__["mtp_status"] = (
            f"config declares {declared} MTP layer(s) but the checkpoint has no mtp.* tensors"
            if declared else "no MTP head in this checkpoint"
        )
        return
    if model_type not in FAMILIES:
        model.__dict__["mtp_status"] = NOT_KEPT.get(
            model_type, f"MTP heads of {model_type} are not kept yet ({len(tensors)} tensors set aside)"
        )
        return
    weights = to_mlx_layout(tensors)
    head = build(model, _layer_count(weights) or max(declared, 1))
    _quantize_where_stored(head, weights, config)
    problem = _strict_load(head, weights)
    if problem:
        model.__dict__["mtp_status"] = f"MTP head not loaded: {problem}"
        return
    if not lazy:
        mx.eval(head.parameters())
    model.__dict__["mtp"] = head
    model.__dict__["mtp_status"] = f"MTP head kept: {len(head.layers)} layer(s), {len(weights)} tensors"


def _strict_load(head, weights) -> Optional[str]:
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (mtp.{', mtp.'.join(missing[:6])}"
                         f"{', ...' if len(missing) > 6 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (mtp.{', mtp.'.join(unexpected[:6])})")
        return "; ".join(parts)
    wrong = [k for k, v in weights.items() if v.shape != expected[k].shape]
    if wrong:
        return f"shape mismatch for mtp.{', mtp.'.join(wrong[:6])}"
    head.load_weights(list(weights.items()), strict=True)
    return None

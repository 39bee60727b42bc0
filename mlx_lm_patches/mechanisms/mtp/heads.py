"""Multi-token-prediction (MTP) heads kept through ``mlx_lm.load``.

Qwen3-Next, Qwen3.5/3.6 and Nemotron-H (Nemotron 3 Super) checkpoints carry a
next-token-prediction head (``mtp.*`` tensors: a fusion projection over
``[norm(embedding), norm(hidden)]``, one or more decoder layers, a final norm). mlx-lm has no
module for it and drops, rejects or mangles the tensors (see the ``mtp-heads-kept`` patch). This
module builds the head from the family's own mlx-lm blocks (``families``), converts the
tensors from whichever layout the checkpoint uses to mlx-lm's, and loads them strictly.

Layouts accepted, per tensor (checkpoints mix them):

* key prefixes ``mtp.``, ``model.mtp.``, ``language_model.mtp.``, ``model.language_model.mtp.``;
  for the DeepSeek-V3 layout also the layer ``model.layers.{num_hidden_layers}`` (the family's
  ``split_checkpoint`` turns it into ``mtp.`` tensors in mlx-lm's layout);
* experts per expert (``experts.{e}.gate_proj.weight``, HF Qwen3-Next/3.5, Nemotron-H), fused
  (``experts.gate_up_proj`` / ``experts.down_proj``, HF Qwen3.6-style) or stacked
  (``switch_mlp.*``, MLX);
* Qwen RMSNorm weights stored zero-centred (HF, the layer computes ``1 + w``) or shifted (MLX,
  where ``nn.RMSNorm`` computes ``w``): decided per tensor - a norm weight whose mean is below
  0.5 is zero-centred and gets +1 (Nemotron-H norms are stored as used);
* quantized exactly where the checkpoint has ``.scales``, full precision elsewhere: a per-layer
  entry of ``config["quantization"]`` for the head path (``mtp.fc``, ``language_model.mtp.fc``
  or ``model.mtp.fc``) wins, as in mlx-lm's loader; without one, group size and bits come from
  the stored shapes and the mode from the scales' dtype (what mlx-lm 0.32's
  ``infer_quant_config`` does for the backbone), so a head quantized differently from the
  config's top-level settings still loads.

The head is kept *outside* the model's parameter tree (``model.mtp``, with ``model.mtp_status``
saying what happened), so LoRA and everything that walks the parameters behave exactly as
before; ``mtp-heads-converted`` puts it into the tree while ``mlx_lm.convert`` / ``mlx_lm.fuse``
run (``into_tree``) and ``save_model`` writes it to an ``mtp.safetensors`` sidecar
(``out_of_tree``, ``save_sidecar``), which ``attach`` reads back.
"""

import re
from typing import Optional

from mlx_lm_patches.mechanisms.mtp.families import (FAMILIES, NOT_KEPT, NOT_READ, HeadUnsupported, declared_layers,
                                                     family_name, family_of)

MTP_KEY = re.compile(r"(^|\.)mtp\.")
STASH = "_mlx_lm_patches_mtp_tensors"
SOURCE = "_mlx_lm_patches_mtp_source"  # where the stashed tensors came from, if not mtp.* keys
SIDECAR = "mtp.safetensors"  # outside mlx-lm's ``model*.safetensors`` glob: stock never reads it
SIDECARS = (SIDECAR,)  # model-mtp.safetensors is already read by mlx-lm's glob
# Metadata of the sidecar ``save_sidecar`` writes: its tensors are in mlx-lm's layout already (Qwen
# norms shifted), so no per-tensor layout guess is made when it is read back.
SIDECAR_METADATA = {"format": "mlx", "mtp_layout": "mlx-lm"}


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


def _relative(key):
    return key[MTP_KEY.search(key).end():]


def build(model, n_layers: int, config=None, weights=None):
    """An empty MTP head for ``model`` (MLX layout), built from the family's own blocks;
    ``config`` and ``weights`` (converted) let a family read what the head is made of.
    Raises ``HeadUnsupported`` if this mlx-lm cannot build it."""
    return family_of(model).build(model, config or {}, weights or {}, n_layers)


def to_mlx_layout(tensors, model, *, mlx_layout=False) -> dict:
    """Checkpoint MTP tensors -> the head's parameter names and layout (see module docstring);
    ``mlx_layout``: the tensors are known to be in mlx-lm's layout (no per-tensor norm guess)."""
    return family_of(model).convert({_relative(k): v for k, v in tensors.items()}, mlx_layout=mlx_layout)


CONFIG_PREFIXES = ("mtp.", "language_model.mtp.", "model.mtp.")  # head paths in config["quantization"]
_MICROSCALED = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}  # (bits, group) -> mode


def stored_quantization(path, module, weights, default_mode="affine") -> dict:
    """How the checkpoint stores layer ``path`` of the head (``module`` still unquantized):
    group size and bits from the stored shapes; the mode from the scales (affine keeps them in
    the weight dtype, the micro-scaled float formats in uint8, one mode per (bits, group))."""
    import mlx.core as mx

    scales = weights[f"{path}.scales"]
    in_dims = module.weight.shape[-1]
    params = {"group_size": in_dims // scales.shape[-1],
              "bits": weights[f"{path}.weight"].shape[-1] * 32 // in_dims}
    if scales.dtype == mx.uint8:
        params["mode"] = _MICROSCALED.get((params["bits"], params["group_size"]), default_mode)
    return params


def _quantize_where_stored(head, weights, config) -> None:
    """Quantize exactly the layers the checkpoint stores quantized: a per-layer entry of
    ``config["quantization"]`` for the head path wins (as in mlx-lm's own loader), otherwise the
    stored shapes decide, otherwise full precision."""
    import mlx.nn as nn

    settings = config.get("quantization") or {}
    if not any(k.endswith(".scales") for k in weights):
        return

    def predicate(path, module):
        for prefix in CONFIG_PREFIXES:
            if prefix + path in settings:
                return settings[prefix + path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return stored_quantization(path, module, weights, settings.get("mode", "affine"))

    nn.quantize(head, class_predicate=predicate)


def attach(model, model_path, config, lazy=False) -> None:
    """Build, load and attach the MTP head, or record why not (``model.mtp_status``)."""
    import pathlib

    import mlx.core as mx

    tensors = dict(model.__dict__.pop(STASH, {}))
    sources = [model.__dict__.pop(SOURCE, "the checkpoint's mtp.* keys")] if tensors else []
    mlx_layout = False
    for name in SIDECARS:
        path = pathlib.Path(model_path) / name
        if path.exists():
            sidecar, metadata = mx.load(str(path), return_metadata=True)
            if not sidecar:
                continue
            mlx_layout = metadata.get("mtp_layout") == SIDECAR_METADATA["mtp_layout"] and not tensors
            tensors.update(sidecar)
            sources.append(f"{name} (written by {'mlx-lm-patches' if mlx_layout else 'another tool'})")
    declared = declared_layers(config)
    model.__dict__["mtp"] = None
    model_type = family_name(model)
    if model_type not in FAMILIES and (tensors or declared):
        aside = f"; {len(tensors)} mtp.* tensors set aside" if tensors else ""
        model.__dict__["mtp_status"] = (
            f"MTP heads of {model_type} are not kept yet: {NOT_KEPT.get(model_type, NOT_READ)} "
            f"(kept: {', '.join(sorted(FAMILIES))}){aside}")
        return
    if not tensors:
        model.__dict__["mtp_status"] = (
            f"config declares {declared} MTP layer(s) but the checkpoint has no mtp.* tensors"
            f" (neither in its weight files nor in {SIDECAR})"
            if declared else "no MTP head in this checkpoint"
        )
        return
    family = family_of(model)
    weights = to_mlx_layout(tensors, model, mlx_layout=mlx_layout)
    shared = [k for k in tensors if _relative(k).startswith(family.SHARED)]
    steps = family.steps(declared, weights)
    try:
        head = build(model, steps, config, weights)
    except (HeadUnsupported, TypeError, ValueError) as exc:
        model.__dict__["mtp_status"] = f"MTP head not built: {exc}"
        return
    _quantize_where_stored(head, weights, config)
    problem = _strict_load(head, weights)
    if problem:
        model.__dict__["mtp_status"] = f"MTP head not loaded: {problem}"
        return
    if not lazy:
        mx.eval(head.parameters())
    note = family.status_note(tensors)
    model.__dict__["mtp"] = head
    depths = len(getattr(head, "depths", ())) + 1
    if depths > 1:  # MiMo-V2-Flash, Step-3.5: an MTP layer per draft step
        fed = "the previous one's output" if family.CHAINED else "the model's hidden state"
        kept = f"{depths} MTP layers (draft step k with layer k, each fed {fed})"
    else:
        kept = f"{len(head.layers)} layer(s)"
    model.__dict__["mtp_status"] = (f"MTP head kept: {kept}"
                                    + (f" ({note})" if note else "") + f", {len(weights)} tensors, "
                                    f"from {' and '.join(sources)}"
                                    + (f"; embedding and output head shared with the model (the checkpoint's "
                                       f"{len(shared)} copies of them not loaded)" if shared else ""))


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


# -- writing the head (mlx_lm.convert, mlx_lm.fuse, mlx_lm.utils.save_model) ------------------------
TREE_KEY = "mtp"  # where the head joins the parameter tree while mlx_lm.convert casts and quantizes it


def head_of(model):
    """The head attached at load (``model.mtp``), or ``None``."""
    return model.__dict__.get("mtp") if isinstance(model, dict) else None


def into_tree(model) -> bool:
    """Put the attached head into ``model``'s parameter tree (as ``mtp``), so mlx-lm's own code
    (dtype cast, ``quantize_model``, ``dequantize_model``) treats its layers as the backbone's."""
    head = head_of(model)
    if head is None:
        return False
    model[TREE_KEY] = head
    return True


def out_of_tree(model):
    """Take the head out of the parameter tree again (it stays ``model.mtp``); the head or None."""
    head = model.pop(TREE_KEY, None) if isinstance(model, dict) else None
    if head is not None:
        model.__dict__["mtp"] = head
    return head if head is not None else head_of(model)


def save_sidecar(folder, head) -> None:
    """Write ``head`` (mlx-lm layout, quantized as it is) to ``folder/mtp.safetensors``."""
    import pathlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    tensors = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(pathlib.Path(folder) / SIDECAR), tensors, metadata=dict(SIDECAR_METADATA))

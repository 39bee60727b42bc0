"""Qwen3-Next, Qwen3.5/3.6 (dense and MoE): ``fc``, ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``layers.{i}`` (the family's decoder layer, full attention), ``norm``.
HF checkpoints store RMSNorm weights zero-centred (the layer computes ``1 + w``); mlx-lm's
``nn.RMSNorm`` wants ``w``: decided per tensor, since shipped checkpoints mix conventions."""

import re

from mlx_lm_patches.mechanisms.mtp.families._tensors import set_aside_expert, stack_experts
from mlx_lm_patches.mechanisms.mtp.families.base import MtpFamily, register


@register
class Qwen(MtpFamily):
    """Qwen3-Next, Qwen3.5/3.6 (dense and MoE)."""

    MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
    SHARDS = ("qwen3_5",)  # (qwen3_5_moe's Model inherits it)
    # Qwen3.5 / Qwen3.5-MoE: stock ``sanitize`` (0.30.7 - 0.31.3) takes any ``mtp.`` key as the sign
    # of a Hugging Face checkpoint whose norms it must shift by +1 (and drops the ``mtp.`` keys itself).
    _HF_SIGNAL = ("qwen3_5", "qwen3_5_moe")
    _FUSED = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")

    @staticmethod
    def _text(model):
        return model if model.model_type == "qwen3_next" else model.language_model

    def _layer_class(self, model):
        if model.model_type == "qwen3_next":
            from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

            return Qwen3NextDecoderLayer
        from mlx_lm.models.qwen3_5 import DecoderLayer

        return DecoderLayer

    def for_stock_sanitize(self, model, backbone, mtp):
        """What the family's stock ``sanitize`` is given once the MTP tensors are set aside.

        For Qwen3.5 / Qwen3.5-MoE stock reads "has ``mtp.`` keys" as "HF checkpoint: shift the
        norms" (0.30.7 - 0.31.3; 0.32 reads the conv1d layout only). So one MTP tensor goes along
        - stock drops it itself - whenever the backbone is in HF layout: there stock's decision,
        and so its result, is exactly what it would be with the whole head present (a convert of an
        HF checkpoint shifts its norms once, as upstream's
        ``test_qwen3_5_family_convert_then_load_norm_not_shift_twice`` pins). A backbone already in
        MLX layout gets none: there the signal is wrong and stock would shift shifted norms a second
        time (the corruption this patch removes)."""
        if not mtp or getattr(model, "model_type", None) not in self._HF_SIGNAL or not is_hf_layout(backbone):
            return backbone
        key = min(mtp)
        return dict(backbone, **{key: mtp[key]})

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        args = self._text(model).args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        layer_class = self._layer_class(model)
        head = nn.Module()
        head.fc = nn.Linear(2 * hidden, hidden, bias=False)
        head.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        head.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        # full_attention_interval - 1: a full-attention layer (MoE where the backbone's are).
        head.layers = [layer_class(args, args.full_attention_interval - 1) for _ in range(n_layers)]
        head.norm = nn.RMSNorm(hidden, eps=eps)
        return head

    def convert(self, tensors, mlx_layout=False):
        import mlx.core as mx

        out, experts = {}, {}
        for key, value in tensors.items():
            if set_aside_expert(key, value, experts):
                continue
            fused = self._FUSED.match(key)
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
            if not mlx_layout and value.ndim == 1 and parts[-1] == "weight" and "norm" in parts[-2]:
                if mx.mean(value.astype(mx.float32)).item() < 0.5:
                    value = value + 1.0  # zero-centred (1 + w) storage
            out[key] = value
        return stack_experts(out, experts)

    def fusion(self, head):
        return head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.fc

    def head_norm(self, head):
        return head.norm

    def embed(self, model, ids, cache=None):
        return self._text(model).model.embed_tokens(ids)

    def final_norm(self, model):
        return self._text(model).model.norm

    def logits(self, model, out, head=None):
        text = self._text(model)
        if text.args.tie_word_embeddings:
            return text.model.embed_tokens.as_linear(out)
        out = text.lm_head(out)
        group = getattr(text, "sharding_group", None)
        if group is not None:  # Model.shard split lm_head over the vocabulary (0.32+): gather as the model does
            from mlx_lm.models.base import gather_last_axis

            out = gather_last_axis(out, group)
        return out

    def vocab_size(self, model):
        return self._text(model).args.vocab_size


_MLX_PREFIX = "language_model."  # every backbone key of a checkpoint mlx-lm (or mlx-vlm) saved
_SKIPPED_PREFIXES = ("vision_tower", "model.visual")  # dropped by stock before it looks


def is_hf_layout(backbone) -> bool:
    """Whether the Qwen3.5 backbone tensors are named as in a Hugging Face checkpoint
    (``model.language_model.``, or text-only ``model.`` / ``lm_head.``): any key outside
    ``language_model.`` that stock keeps. MLX-saved checkpoints name every one
    ``language_model.``."""
    return any(not k.startswith(_MLX_PREFIX) and not k.startswith(_SKIPPED_PREFIXES) for k in backbone)

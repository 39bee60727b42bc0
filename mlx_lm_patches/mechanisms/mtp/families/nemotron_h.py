"""Nemotron-H (Nemotron 3 Super): ``layers.{i}`` are ``NemotronHBlock``s (``norm``, ``mixer``)
following ``mtp_hybrid_override_pattern`` (or ``mtp_layers_block_type``; e.g. ``"*E"``:
attention, then MoE); the first also holds ``enorm``, ``hnorm`` and ``eh_proj``, the last
``final_layernorm``. Norms are stored as used (no shift); experts per expert
(``experts.{e}.up_proj`` / ``down_proj``) are stacked into ``switch_mlp.fc1`` / ``fc2`` as
mlx-lm's own ``sanitize`` does for the backbone. Same layout in vLLM's ``nemotron_h_mtp.py``."""

import re

from mlx_lm_patches.mechanisms.mtp.families._tensors import with_stacked_experts
from mlx_lm_patches.mechanisms.mtp.families.base import HeadUnsupported, MtpFamily, register


@register
class NemotronH(MtpFamily):
    """Nemotron-H (Nemotron 3 Super's MTP head)."""

    MODEL_TYPES = ("nemotron_h",)
    _BLOCK_NAMES = {"attention": "*", "full_attention": "*", "moe": "E", "mlp": "-",
                    "mamba": "M", "linear_attention": "M"}

    def _pattern(self, config, weights):
        """The head's block types: from the config, or read off the tensors."""
        pattern = config.get("mtp_hybrid_override_pattern")
        if not pattern and config.get("mtp_layers_block_type"):
            pattern = "".join(self._BLOCK_NAMES.get(b, "?") for b in config["mtp_layers_block_type"])
        if pattern:
            return pattern
        kinds = {}
        for key in weights:
            match = re.match(r"^layers\.(\d+)\.mixer\.(\w+)", key)
            if match:
                name = match.group(2)
                kind = ("*" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else
                        "E" if name in ("switch_mlp", "gate", "shared_experts") else
                        "M" if name in ("A_log", "in_proj", "conv1d", "dt_bias") else "-")
                kinds[int(match.group(1))] = kind
        return "".join(kinds.get(i, "?") for i in range(max(kinds) + 1)) if kinds else ""

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn
        from mlx_lm.models.nemotron_h import NemotronHBlock

        if n_layers != 1:
            raise HeadUnsupported(f"{n_layers} MTP steps declared; Nemotron-H heads have one")
        pattern = self._pattern(config, weights)
        if not pattern or set(pattern) - set("*E-"):
            raise HeadUnsupported(f"MTP block pattern {pattern!r}: only attention ('*'), MoE ('E') and "
                                  "MLP ('-') blocks are supported")
        args = model.args
        layers = [NemotronHBlock(args, kind) for kind in pattern]
        missing = [kind for kind, layer in zip(pattern, layers) if "mixer" not in layer]
        if missing:
            raise HeadUnsupported(f"this mlx-lm's NemotronHBlock has no {missing[0]!r} block "
                                  f"(MTP pattern {pattern!r})")
        hidden, eps = args.hidden_size, layers[0].norm.eps
        first, last = layers[0], layers[-1]
        first.enorm = nn.RMSNorm(hidden, eps=eps)
        first.hnorm = nn.RMSNorm(hidden, eps=eps)
        first.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        last.final_layernorm = nn.RMSNorm(hidden, eps=eps)
        head = nn.Module()
        head.layers = layers
        return head

    def steps(self, declared, weights):
        """One step (made of several blocks), whatever the tensors' layer count."""
        return declared or 1

    def convert(self, tensors, mlx_layout=False):
        return with_stacked_experts(tensors, rename={"up_proj": "fc1", "down_proj": "fc2"})

    def fusion(self, head):
        first = head.layers[0]
        return first.enorm, first.hnorm, first.eh_proj

    def attention_layers(self, head):
        return [layer for layer in head.layers if layer.block_type == "*"]

    def run_layers(self, head, z, mask, cache):
        caches = iter(cache)
        for layer in head.layers:
            z = layer(z, mask=mask, cache=next(caches)) if layer.block_type == "*" else layer(z)
        return z

    def head_norm(self, head):
        return head.layers[-1].final_layernorm

    def embed(self, model, ids, cache=None):
        return model.backbone.embeddings(ids)

    def final_norm(self, model):
        return model.backbone.norm_f

    def logits(self, model, out, head=None):
        return model.lm_head(out)

    def vocab_size(self, model):
        return model.args.vocab_size

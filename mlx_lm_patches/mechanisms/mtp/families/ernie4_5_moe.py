"""ERNIE 4.5 MoE (ernie4_5_moe): ``model.mtp_emb_norm.{i}``, ``model.mtp_hidden_norm.{i}``,
``model.mtp_linear_proj.{i}`` (the normalized embedding first) and ``model.mtp_block.{i}``, a
dense decoder layer whose output goes to the shared output head with no norm between (vLLM's
``ernie_mtp.py``, SGLang's ERNIE 4.5 MTP model)."""

import re

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead
from mlx_lm_patches.mechanisms.mtp.families._tensors import with_stacked_experts
from mlx_lm_patches.mechanisms.mtp.families.base import register


@register
class Ernie(ExtraLayerHead):
    """ERNIE 4.5 MoE (ernie4_5_moe): ``model.mtp_emb_norm.{i}``, ``model.mtp_hidden_norm.{i}``,
    ``model.mtp_linear_proj.{i}`` (with a bias where the model's linear layers have one) and
    ``model.mtp_block.{i}``, a dense decoder layer. Followed: vLLM's ``ernie_mtp.py`` and SGLang's
    ERNIE 4.5 MTP model (embedding half first, the main model's final hidden state as input, the
    block a decoder layer without MoE, no norm between the block and the shared output head)."""

    MODEL_TYPES = ("ernie4_5_moe",)
    _FUSION = ("mtp_emb_norm.", "mtp_hidden_norm.", "mtp_linear_proj.")

    def split_checkpoint(self, model, weights, stock_sanitize):
        """The ``model.mtp_*.{i}.`` tensors are the head's (plain tensors in mlx-lm's layout but
        for per-expert ones; stock ``sanitize`` only drops them): the block's as decoder layer
        ``i``, the fusion tensors beside it."""
        renamed = {}
        for key, value in weights.items():
            match = re.match(r"^model\.(mtp_emb_norm|mtp_hidden_norm|mtp_linear_proj|mtp_block)\.(\d+)\.(.+)$", key)
            if match:
                part, index, rest = match.groups()
                key = f"mtp_ernie.{index}.{rest}" if part == "mtp_block" else f"mtp_ernie.{index}.{part}.{rest}"
            renamed[key] = value
        return self._split(renamed, r"^mtp_ernie\.(\d+)\.(.+)$", self._FUSION)

    def source(self, model):
        return "the checkpoint's model.mtp_* tensors"

    def build(self, model, config, weights, n_layers):
        args = model.args
        head = self._fusion_head(model, n_layers, "ERNIE", ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj"),
                                 bias=bool(getattr(args, "use_bias", False)))
        # at index num_hidden_layers: past moe_layer_end_index, so dense (the references' block)
        head.layers = [type(self._inner(model).layers[0])(args, args.num_hidden_layers)]
        return head

    def convert(self, tensors, mlx_layout=False):
        return with_stacked_experts(tensors)

    def fusion(self, head):
        return head.mtp_emb_norm, head.mtp_hidden_norm, head.mtp_linear_proj

    def head_norm(self, head):
        return _identity


def _identity(x):
    return x

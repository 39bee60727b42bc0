"""K-EXAONE (exaone_moe): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``
(the normalized embedding first), ``mtp.layers.{i}`` (a decoder layer with a dense MLP; a
full-attention one is kept), ``mtp.norm``; shared embedding and output head (vLLM's
``exaone_moe_mtp.py``)."""

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead
from mlx_lm_patches.mechanisms.mtp.families.base import SLIDING_WINDOW, HeadUnsupported, register


@register
class Exaone(ExtraLayerHead):
    """K-EXAONE (exaone_moe): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``
    (the normalized embedding first), ``mtp.layers.{i}`` - a decoder layer of the family with a
    dense MLP (``intermediate_size``) and the attention ``mtp_layer_types`` names - and
    ``mtp.norm`` before the shared output head. Followed: vLLM's ``exaone_moe_mtp.py`` (the tensor
    names, the order of the halves, the main model's final hidden state as input, the shared
    embedding and output head) and its ``exaone_moe.py`` (an MTP layer's MLP is dense, its
    attention slides where ``mtp_layer_types`` says so, RoPE as in the backbone: where the layer
    slides, or everywhere when no backbone layer does). A sliding-window MTP layer attends to the
    last ``sliding_window`` positions as the backbone's do, through a plain cache and a window
    mask (``SLIDING_WINDOW``), so speculation can roll it back anywhere."""

    MODEL_TYPES = ("exaone_moe",)
    SHARDS = MODEL_TYPES

    def build(self, model, config, weights, n_layers):
        import dataclasses

        import mlx.nn as nn

        from mlx_lm.models.exaone_moe import DecoderLayer

        kind = (list(config.get("mtp_layer_types") or ["full_attention"]))[0]
        if kind not in ("full_attention", "sliding_attention"):
            raise HeadUnsupported(f"its MTP layer is {kind}: not an attention kind this head knows")
        head = self._fusion_head(model, n_layers, "K-EXAONE", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc"))
        args = model.args
        # The head's layer as layer 0 of a model whose first layer is a dense one of its kind; the
        # backbone's kinds follow, so "does any layer slide" (RoPE everywhere?) is the backbone's
        # (or true, for a sliding MTP layer).
        layer_args = dataclasses.replace(args, layer_types=[kind, *args.layer_types],
                                         is_moe_layer=[False, *args.is_moe_layer])
        head.layers = [DecoderLayer(layer_args, 0)]
        head.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if kind == "sliding_attention":
            head.__dict__[SLIDING_WINDOW] = args.sliding_window
        return head

    def convert(self, tensors, mlx_layout=False):
        return dict(tensors)

    def fusion(self, head):
        return head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.fc

    def head_norm(self, head):
        return head.norm

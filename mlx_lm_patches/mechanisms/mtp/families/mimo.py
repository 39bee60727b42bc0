"""MiMo (mimo): ``model.mtp_layers.{i}``: ``token_layernorm``, ``hidden_layernorm``, ``input_proj``
(the normalized hidden state first), the family's decoder layer, ``final_layernorm``; shared
embedding and output head (the MiMo report, arXiv:2505.07608; vLLM's ``mimo_mtp.py``)."""

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead
from mlx_lm_patches.mechanisms.mtp.families.base import register


@register
class MiMo(ExtraLayerHead):
    """Xiaomi MiMo-7B: ``model.mtp_layers.{i}``, each ``token_layernorm``, ``hidden_layernorm``,
    ``input_proj``, a decoder layer of the family and ``final_layernorm``. Followed: the MiMo
    report (arXiv:2505.07608, the MTP layers share embedding and output head with the model) and
    vLLM's ``mimo_mtp.py`` (the tensor names, the *hidden* half first, the main model's final
    hidden state as input)."""

    MODEL_TYPES = ("mimo",)
    FUSION = "hidden-first"
    _FUSION = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")

    def split_checkpoint(self, model, weights, stock_sanitize):
        """The ``model.mtp_layers.`` tensors are the head's (plain linear and norm weights, in
        mlx-lm's layout already; stock ``sanitize`` only drops them)."""
        weights = {k: v for k, v in weights.items() if not (k.startswith("model.mtp_layers.")
                                                             and "rotary_emb.inv_freq" in k)}
        return self._split(weights, r"^model\.mtp_layers\.(\d+)\.(.+)$", self._FUSION)

    def source(self, model):
        return "the checkpoint's model.mtp_layers"

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        args = model.args
        head = self._fusion_head(model, n_layers, "MiMo", ("token_layernorm", "hidden_layernorm", "input_proj"))
        head.layers = [type(self._inner(model).layers[0])(args)]
        head.final_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        return head

    def convert(self, tensors, mlx_layout=False):
        return dict(tensors)

    def fusion(self, head):
        return head.token_layernorm, head.hidden_layernorm, head.input_proj

    def head_norm(self, head):
        return head.final_layernorm

"""Ling / Ring 3.0 (bailing_moe_v3): DeepSeek-V3's layout with ``final_layernorm`` for the head's
norm; the layer at ``num_hidden_layers`` is gated latent attention with the sparse MoE (vLLM's
``bailing_moe_v3_mtp.py``)."""

import re

from mlx_lm_patches.mechanisms.mtp.families._tensors import layers_past
from mlx_lm_patches.mechanisms.mtp.families.base import HeadUnsupported, register
from mlx_lm_patches.mechanisms.mtp.families.deepseek_v3 import DeepSeekV3


@register
class BailingV3(DeepSeekV3):
    """Ling / Ring 3.0 (bailing_moe_v3; its checkpoints call themselves ``bailing_hybrid``): a hybrid
    of linear (KDA) and gated multi-head latent attention whose MTP layer is appended as
    ``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj`` (the normalized
    embedding first), the family's decoder layer at that index - gated latent attention, never
    linear (past the last full group of ``layer_group_size``), and the sparse MoE (past
    ``first_k_dense_replace``) - and ``final_layernorm`` before the shared output head; the main
    model's final (post-norm) hidden state goes in. Its tensors are in the checkpoint's layout
    (one tensor per expert, ``kv_b_proj`` unsplit): they go through the release's own
    ``sanitize`` as the backbone's last layer (past ``first_k_dense_replace``: its experts are
    stacked and its ``kv_b_proj`` split exactly as the backbone's are). Followed: vLLM's
    ``bailing_moe_v3_mtp.py`` (the names, the order of the halves, the layer, the final norm, the
    shared embedding and output head; one MTP layer) and SGLang's ``bailing_moe_v3.py`` (the
    layer index ``num_hidden_layers``, one layer, the shared embedding and head)."""

    MODEL_TYPES = ("bailing_moe_v3",)
    SHARDS = SUBCLASSES = ()  # (not DeepSeek-V3's)
    _FUSION = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")
    SHARED = ("word_embeddings.", "embed_tokens.", "shared_head.head.")

    def split_checkpoint(self, model, weights, stock_sanitize):
        """The tensors of layers ``>= num_hidden_layers`` are the head's; all but the fusion and the
        shared copies go through ``stock_sanitize`` renamed as the backbone's last layer."""
        args = model.args
        depth = args.num_hidden_layers
        stand_in = depth - 1  # sanitize stacks experts past first_k_dense_replace only
        keep = self._FUSION + self.SHARED

        def convert(i, tensors):
            if stand_in < args.first_k_dense_replace:
                raise HeadUnsupported(f"no backbone layer past first_k_dense_replace to convert MTP layer {i} as")
            own = {f"model.layers.{stand_in}.{k}": v for k, v in tensors.items() if not k.startswith(keep)}
            out = {key[len(f"model.layers.{stand_in}."):]: v for key, v in stock_sanitize(own).items()}
            out.update({k: v for k, v in tensors.items() if k.startswith(keep)})
            return out

        backbone, past = layers_past(weights, depth)
        return backbone, self._split(past, r"^(\d+)\.(.+)$", keep, convert)[1]

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        from mlx_lm.models.bailing_moe_v3 import BailingDecoderLayer

        args = model.args
        head = self._fusion_head(model, n_layers, "Ling 3.0", ("enorm", "hnorm", "eh_proj"))
        head.layers = [BailingDecoderLayer(args, args.num_hidden_layers)]
        if head.layers[0].is_linear:
            raise HeadUnsupported("the layer at num_hidden_layers would be linear attention in this mlx-lm")
        head.final_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        return head

    def layer_cache(self, model):
        from mlx_lm.models.cache import KVCache

        return KVCache()

    def quant_path(self, model, path):
        """A head path as the family's ``quant_predicate`` should see it (it looks layers up by
        index to tell linear from latent attention): the backbone's last latent-attention layer."""
        match = re.match(r"^mtp\.layers\.\d+\.(.+)$", path)
        if match is None:
            return path
        index = max(i for i, layer in enumerate(model.layers) if not layer.is_linear)
        return f"model.layers.{index}.{match.group(1)}"

    def head_norm(self, head):
        return head.final_layernorm

    def embed(self, model, ids, cache=None):
        return model.model.word_embeddings(ids)

    def logits(self, model, out, head=None):
        if model.lm_head is None:
            return model.model.word_embeddings.as_linear(out)
        return model.lm_head(out)

"""DeepSeek-V3 layout (deepseek_v3, deepseek_v32, glm4_moe, glm4_moe_lite, glm_moe_dsa): the
head is the checkpoint's layer ``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
and a decoder layer of the family (``self_attn``, ``mlp``, the two layer norms). Its tensors
are in the family's Hugging Face layout, so they go through the release's own ``sanitize``
under an index it processes (expert stacking, ``kv_b_proj`` split, fp8 dequantization: the
head's layer ends up exactly as the backbone's would). Followed: the DeepSeek-V3 Technical
Report (arXiv:2412.19437, section 2.2: each MTP module shares the main model's embedding and
output head and combines the normalized hidden state and the normalized embedding of the next
token by a linear projection) and vLLM's ``deepseek_mtp.py`` (the tensor names, the embedding
half first, the main model's final hidden state as input, ``shared_head.norm`` before the
output head)."""

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead, array_mask
from mlx_lm_patches.mechanisms.mtp.families._tensors import layers_past
from mlx_lm_patches.mechanisms.mtp.families.base import register


@register
class DeepSeekV3(ExtraLayerHead):
    """DeepSeek-V3, DeepSeek-V3.2 (deepseek_v32), GLM-4.5/4.6/4.7 (glm4_moe), GLM-4.7-Flash
    (glm4_moe_lite), GLM-5 (glm_moe_dsa): the MTP layer at index ``num_hidden_layers``, built from
    the family's own decoder layer. DeepSeek-V3.2 follows the DeepSeek-V3.2-Exp report
    (V3.1-Terminus's architecture, MTP module included, with sparse attention): V3's head around
    its own decoder layer, whose attention keeps a second cache for its indexer
    (``layer_cache``). GLM-5 is that model under GLM's config names (mlx-lm's glm_moe_dsa is
    deepseek_v32's model); its checkpoints ship the layer at index 78 of a 78-layer backbone,
    its sparse-attention indexer included (zai-org/GLM-5's weight index; vLLM and SGLang load
    it with their DeepSeek MTP model)."""

    MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
    SHARDS = MODEL_TYPES
    SUBCLASSES = ("glm_moe_dsa",)  # deepseek_v32's Model under GLM's config names
    _FUSION = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    # the checkpoint's copies of what the head shares with the model (the report: shared)
    SHARED = ("embed_tokens.", "shared_head.head.")

    def split_checkpoint(self, model, weights, stock_sanitize):
        """The tensors of layers ``>= num_hidden_layers`` are the head's; all but the shared
        copies go through ``stock_sanitize`` (the release's own) as layer ``i`` of the backbone
        would (fp8 dequantization covers ``eh_proj`` too)."""
        depth = model.args.num_hidden_layers

        def convert(i, tensors):
            own = {f"model.layers.{i}.{k}": v for k, v in tensors.items() if not k.startswith(self.SHARED)}
            out = {key[len(f"model.layers.{i}."):]: v for key, v in stock_sanitize(own).items()}
            out.update({k: v for k, v in tensors.items() if k.startswith(self.SHARED)})
            return out

        backbone, past = layers_past(weights, depth)
        return backbone, self._split(past, r"^(\d+)\.(.+)$", self._FUSION + self.SHARED, convert)[1]

    def source(self, model):
        return f"the checkpoint's layer model.layers.{model.args.num_hidden_layers}"

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        args = model.args
        head = self._fusion_head(model, n_layers, "DeepSeek-V3-layout", ("enorm", "hnorm", "eh_proj"))
        layer_class = type(self._inner(model).layers[0])
        head.shared_head = nn.Module()
        head.shared_head.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # its index decides dense or MoE as for the backbone (past first_k_dense_replace: MoE)
        head.layers = [layer_class(args, args.num_hidden_layers)]
        return head

    def convert(self, tensors, mlx_layout=False):
        """Already in mlx-lm's layout (``split_checkpoint``, or a sidecar); the checkpoint's copies
        of the shared embedding and output head are left out."""
        return {k: v for k, v in tensors.items() if not k.startswith(self.SHARED)}

    def fusion(self, head):
        return head.enorm, head.hnorm, head.eh_proj

    def layer_cache(self, model):
        """What the family's own model makes for a decoder layer (deepseek_v32: a ``CacheList``
        of the attention's and its indexer's caches), else a ``KVCache``."""
        own = getattr(model, "make_cache", None)
        return own()[0] if own is not None else super().layer_cache(model)

    def attention_mask(self, z, cache):
        return array_mask(z, cache)

    def head_norm(self, head):
        return head.shared_head.norm

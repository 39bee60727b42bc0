"""LongCat-Flash (longcat_flash): ``model.mtp.layers.0`` (``enorm.m``, ``hnorm.m``, ``eh_proj``,
one block of latent attention and dense MLP), ``model.mtp.norm`` (vLLM's
``longcat_flash_mtp.py``)."""

import functools
import re

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead, array_mask
from mlx_lm_patches.mechanisms.mtp.families._tensors import through_stock_sanitize
from mlx_lm_patches.mechanisms.mtp.families.base import register


@functools.lru_cache(maxsize=None)
def _longcat_mtp_layer_class():
    """LongCat-Flash's MTP decoder layer: one pre-norm block of the family's latent attention
    (``LongcatFlashMLA``) and dense MLP (``LongcatFlashMLP``), each behind a residual - the first
    half of the family's own two-attention block, without its shortcut MoE."""
    import mlx.nn as nn
    from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

    class LongcatMTPLayer(nn.Module):
        def __init__(self, args):
            super().__init__()
            self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.self_attn = LongcatFlashMLA(args)
            self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.mlp = LongcatFlashMLP(args, False)

        def __call__(self, x, mask=None, cache=None):
            h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
            return h + self.mlp(self.post_attention_layernorm(h))

    return LongcatMTPLayer


@register
class LongcatFlash(ExtraLayerHead):
    """Meituan LongCat-Flash (longcat_flash): ``model.mtp.layers.0``: ``enorm.m``, ``hnorm.m``,
    ``eh_proj`` (the normalized embedding first), one dense decoder block - latent attention
    (``self_attn``, with the family's q/kv LoRA scaling) and a dense MLP
    (``transformer_layer.mlp``), each pre-norm with a residual - then ``model.mtp.norm`` before the
    shared output head; the main model's final (post-norm) hidden state goes in. The checkpoint's
    ``model.mtp.embed_tokens`` copy is not loaded: the model's embedding is used (SGLang does so;
    vLLM loads the copy). The attention's ``kv_b_proj`` goes through the release's own
    ``sanitize`` as backbone layer 0's first attention (split into ``embed_q`` / ``unembed_out``
    where the release splits it, dequantized and requantized as there). Followed: vLLM's
    ``longcat_flash_mtp.py`` (the names, the ``.m`` of the fusion norms, the order of the halves,
    the dense layer, the final norm, the shared output head; one MTP layer) and SGLang's
    ``longcat_flash_nextn.py`` (the same layer, the shared embedding)."""

    MODEL_TYPES = ("longcat_flash",)
    SHARDS = MODEL_TYPES
    _LAYER = re.compile(r"^(.*\bmtp\.)layers\.0\.self_attn\.(.+)$")
    SHARED = ("embed_tokens.",)

    def sanitize_head(self, model, tensors, stock_sanitize):
        """The head's attention tensors through the release's own ``sanitize`` as backbone layer
        0's first attention, then back under their names."""
        prefixes, stand_in_prefix = [], "model.layers.0.self_attn.0."

        def stand_in(key):
            match = self._LAYER.match(key)
            if match is None:
                return None
            prefixes.append(match.group(1))
            return stand_in_prefix + match.group(2)

        def back(key):
            if not key.startswith(stand_in_prefix):
                return None
            return f"{prefixes[0]}layers.0.self_attn.{key[len(stand_in_prefix):]}"

        return through_stock_sanitize(tensors, stock_sanitize, stand_in, back)

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        args = model.args
        head = self._fusion_head(model, n_layers, "LongCat-Flash", ("enorm", "hnorm", "eh_proj"))
        head.layers = [_longcat_mtp_layer_class()(args)]
        head.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        return head

    def convert(self, tensors, mlx_layout=False):
        """Checkpoint names (``layers.0.enorm.m``, ``layers.0.transformer_layer.mlp``, ...) to the
        head's; the copy of the shared embedding is left out."""
        out = {}
        for key, value in tensors.items():
            if key.startswith(self.SHARED):
                continue
            match = re.match(r"^layers\.0\.(enorm|hnorm)\.m\.(.+)$", key) or re.match(r"^layers\.0\.(eh_proj)\.(.+)$", key)
            if match:
                out[f"{match.group(1)}.{match.group(2)}"] = value
            else:
                out[key.replace("layers.0.transformer_layer.mlp.", "layers.0.mlp.")] = value
        return out

    def fusion(self, head):
        return head.enorm, head.hnorm, head.eh_proj

    def head_norm(self, head):
        return head.norm

    def attention_mask(self, z, cache):
        return array_mask(z, cache)

    def shard_view(self, layers, group):
        """Each head layer as the family's two-attention block that ``Model.shard`` walks: its
        attention as the block's list of attentions, its MLP as the block's list of dense MLPs,
        and an expert stand-in (which the head does not have) for the block's shortcut MoE."""
        import types

        return [types.SimpleNamespace(self_attn=[layer.self_attn], mlps=[layer.mlp], mlp=_no_experts(group.size()))
                for layer in layers]


def _no_experts(ranks):
    """A throwaway sparse MoE for ``Model.shard`` to split (the head has none): projections of
    ``ranks`` rows, so any split of them is whole."""
    import mlx.nn as nn

    moe, moe.switch_mlp = nn.Module(), nn.Module()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(moe.switch_mlp, name, nn.Linear(ranks, ranks, bias=False))
    return moe

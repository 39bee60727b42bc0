"""MiMo-V2-Flash (mimo_v2_flash): ``model.mtp.layers.{i}``, three MTP layers, one per draft step,
each fed the main model's hidden state (the class says more)."""

import re

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead
from mlx_lm_patches.mechanisms.mtp.families._tensors import as_depth, depth_count, through_stock_sanitize, with_depths
from mlx_lm_patches.mechanisms.mtp.families.base import SLIDING_WINDOW, register


@register
class MiMoV2(ExtraLayerHead):
    """MiMo-V2-Flash (mimo_v2_flash): ``model.mtp.layers.{i}``, each ``enorm``, ``hnorm``,
    ``eh_proj`` (the normalized embedding first), a decoder layer of the family and
    ``final_layernorm`` before the shared output head. The layer attends over a sliding window
    (the ``swa_*`` head counts and dims, RoPE with ``swa_rope_theta``, attention sinks where
    ``add_swa_attention_sink_bias``) and has a dense MLP (``intermediate_size``); its
    ``pre_mlp_layernorm`` is mlx-lm's ``post_attention_layernorm``. Followed: vLLM's
    ``mimo_v2_mtp.py`` (the tensor names, the order of the halves, the main model's final normed
    hidden state as input, the shared embedding and output head, a sliding dense layer) and
    SGLang's ``mimo_v2_flash_nextn.py`` (the same layer, the norm's name in mlx-lm terms).
    Checkpoints ship three MTP layers, all kept: draft step ``k`` uses layer ``k``, and every
    layer takes the main model's hidden state (not the previous layer's output): the MiMo-V2-Flash
    report has each head read the main model's hidden state and a token embedding, SGLang's
    multi-layer worker feeds every MiMo layer the target's hidden state, and sglang-jax PR #1256
    measured chaining them as worse. fp8 tensors (``weight_scale_inv``) are dequantized by the
    release's own ``sanitize``, as the backbone's are."""

    MODEL_TYPES = ("mimo_v2_flash",)
    CHAINED = False
    _LAYER_KEY = re.compile(r"^(.*\bmtp\.)layers\.(\d+)\.(.+)$")
    _TOP = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")

    def sanitize_head(self, model, tensors, stock_sanitize):
        """The head's tensors through the release's own ``sanitize`` as backbone layer ``i``
        (its fp8 dequantization), then back under their names."""
        prefixes = {}

        def stand_in(key):
            match = self._LAYER_KEY.match(key)
            if match is None:
                return None
            prefix, index, tail = match.groups()
            prefixes[index] = prefix
            return f"model.layers.{index}.{tail}"

        def back(key):
            match = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
            if match and match.group(1) in prefixes:
                return f"{prefixes[match.group(1)]}layers.{match.group(1)}.{match.group(2)}"
            return None

        return through_stock_sanitize(tensors, stock_sanitize, stand_in, back)

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        from mlx_lm.models.mimo_v2_flash import DecoderLayer

        self._one_layer(n_layers, "MiMo-V2-Flash")
        args = model.args
        hidden, eps = args.hidden_size, args.layernorm_epsilon

        def one(_):
            head = nn.Module()
            head.enorm = nn.RMSNorm(hidden, eps=eps)
            head.hnorm = nn.RMSNorm(hidden, eps=eps)
            head.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            head.layers = [DecoderLayer(args, is_moe=False, is_sliding_window=True)]
            head.final_layernorm = nn.RMSNorm(hidden, eps=eps)
            head.__dict__[SLIDING_WINDOW] = args.sliding_window_size
            return head

        return with_depths(one, depth_count(weights, config))

    def convert(self, tensors, mlx_layout=False):
        """Checkpoint names (``layers.{i}.enorm``, ``layers.{i}.pre_mlp_layernorm``, ...) to the
        head's: layer 0 at the top, layer ``i`` under ``depths.{i-1}``."""
        out = {}
        for key, value in tensors.items():
            match = re.match(r"^layers\.(\d+)\.(.+)$", key)
            if match is None:
                out[key] = value
            else:
                tail = match.group(2).replace("pre_mlp_layernorm.", "post_attention_layernorm.")
                out[as_depth(int(match.group(1)), tail, self._TOP)] = value
        return out

    def fusion(self, head):
        return head.enorm, head.hnorm, head.eh_proj

    def head_norm(self, head):
        return head.final_layernorm

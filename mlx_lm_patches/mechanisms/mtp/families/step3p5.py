"""Step-3.5-Flash (step3p5): the MTP layers after the backbone's, ``model.layers.{num_hidden_layers + i}``,
one per draft step, chained, each with its own output head (the class says more)."""

import re

from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead
from mlx_lm_patches.mechanisms.mtp.families._tensors import as_depth, depth_count, layers_past, with_depths
from mlx_lm_patches.mechanisms.mtp.families.base import SLIDING_WINDOW, HeadUnsupported, register


@register
class Step3p5(ExtraLayerHead):
    """Step-3.5-Flash (step3p5): the MTP layers appended as ``model.layers.{num_hidden_layers + i}``,
    each ``enorm``, ``hnorm``, ``eh_proj`` (the normalized embedding first), the family's decoder
    layer at that index (its kind from ``layer_types``, dense or MoE from ``moe_layers_enum``, as
    mlx-lm builds any layer of that index) and its *own* output head ``shared_head.norm`` /
    ``shared_head.output`` (also stored under ``.transformer.shared_head``). Norms are stored
    zero-centred in the original checkpoints and converted by the release's own ``sanitize``
    (which decides that for the whole checkpoint). Followed: vLLM's ``step3p5_mtp.py`` and
    SGLang's ``step3p5_mtp.py`` (the names, the order of the halves, the main model's hidden
    state *before* its final norm as input, the per-layer output head, the shared embedding).
    Checkpoints ship three MTP layers, all kept and chained: draft step ``k`` uses layer ``k``,
    fed layer ``k-1``'s output before its ``shared_head.norm`` (vLLM's ``spec_decode/step3p5.py``
    proposer, SGLang's multi-layer worker for ``Step3p5MTP`` - its PR #18564 "standard
    multi-layer MTP for step3p5" - and llama.cpp's Step-3.5 MTP drafting all do so)."""

    MODEL_TYPES = ("step3p5",)
    SHARDS = MODEL_TYPES
    HIDDEN = "pre"
    CHAINED = True
    _FUSION = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")

    def split_checkpoint(self, model, weights, stock_sanitize):
        """The layers past the backbone's last are the head's; their tensors go through the
        release's own ``sanitize`` beside (empty stand-ins of) the backbone's, so its
        checkpoint-wide decisions (zero-centred norms) are the ones it takes for the backbone."""
        import mlx.core as mx

        depth = model.args.num_hidden_layers
        backbone, past = layers_past(weights, depth,
                                      lambda i, rest: f"mtp_step.{i}.{rest.replace('transformer.', '', 1)}")
        if not past:
            return backbone, {}
        stand_ins = {k: mx.zeros((0,)) for k in backbone}
        converted = {k[len("mtp_step."):]: v for k, v in stock_sanitize(dict(stand_ins, **past)).items()
                     if k.startswith("mtp_step.")}
        return backbone, self._split(converted, r"^(\d+)\.(.+)$", self._FUSION)[1]

    def source(self, model):
        return f"the checkpoint's layer model.layers.{model.args.num_hidden_layers}"

    def build(self, model, config, weights, n_layers):
        import mlx.nn as nn

        from mlx_lm.models.step3p5 import Step3p5DecoderLayer, ZeroCenteredRMSNorm

        self._one_layer(n_layers, "Step-3.5")
        args = model.args
        depth, hidden, eps = args.num_hidden_layers, args.hidden_size, args.rms_norm_eps
        count = depth_count(weights, config)
        if args.layer_types and len(args.layer_types) < depth + count:
            raise HeadUnsupported(f"layer_types lists {len(args.layer_types)} layers: not the MTP layers at "
                                  f"{depth}-{depth + count - 1}")

        def one(i):  # the layer at index depth + i: its kind (sliding or full, dense or MoE) as mlx-lm's
            head = nn.Module()
            head.enorm = ZeroCenteredRMSNorm(hidden, eps=eps)
            head.hnorm = ZeroCenteredRMSNorm(hidden, eps=eps)
            head.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            head.layers = [Step3p5DecoderLayer(args, depth + i)]
            head.shared_head = nn.Module()
            head.shared_head.norm = ZeroCenteredRMSNorm(hidden, eps=eps)
            head.shared_head.output = nn.Linear(hidden, args.vocab_size, bias=False)
            if head.layers[0].is_sliding:
                head.__dict__[SLIDING_WINDOW] = args.sliding_window
            return head

        return with_depths(one, count)

    def convert(self, tensors, mlx_layout=False):
        """Layer ``i > 0`` (``layers.{i}.*`` after ``split_checkpoint``) under ``depths.{i-1}``."""
        out = {}
        for key, value in tensors.items():
            match = re.match(r"^layers\.([1-9]\d*)\.(.+)$", key)
            out[as_depth(int(match.group(1)), match.group(2), self._FUSION) if match else key] = value
        return out

    def fusion(self, head):
        return head.enorm, head.hnorm, head.eh_proj

    def head_norm(self, head):
        return head.shared_head.norm

    def logits(self, model, out, head=None):
        """Each MTP layer's own output head (``head``: the layer's module; the first by default)."""
        return (head if head is not None else model.__dict__["mtp"]).shared_head.output(out)

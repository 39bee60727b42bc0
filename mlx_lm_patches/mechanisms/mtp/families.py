"""What differs between model families' MTP heads.

A head is built from the family's own mlx-lm blocks, so each release's numerics are the
release's own. Per family this module says how (``build``), how checkpoint tensors map to the
head's parameters (``convert``), and where the main model keeps what the head shares: the token
embedding, the final norm (whose input and output are the pre-/post-norm hidden states the head
reads) and the output projection. The forward itself is the same for every family
(``decoding.mtp_forward``): ``proj(concat[enorm(embed(x_{t+1})), hnorm(h_t)])``, the head's
layers (attention layers with their own KV cache), the head's final norm, the shared output.

* Qwen3-Next, Qwen3.5/3.6 (dense and MoE): ``fc``, ``pre_fc_norm_embedding``,
  ``pre_fc_norm_hidden``, ``layers.{i}`` (the family's decoder layer, full attention), ``norm``.
  HF checkpoints store RMSNorm weights zero-centred (the layer computes ``1 + w``); mlx-lm's
  ``nn.RMSNorm`` wants ``w``: decided per tensor, since shipped checkpoints mix conventions.
* Nemotron-H (Nemotron 3 Super): ``layers.{i}`` are ``NemotronHBlock``s (``norm``, ``mixer``)
  following ``mtp_hybrid_override_pattern`` (or ``mtp_layers_block_type``; e.g. ``"*E"``:
  attention, then MoE); the first also holds ``enorm``, ``hnorm`` and ``eh_proj``, the last
  ``final_layernorm``. Norms are stored as used (no shift); experts per expert
  (``experts.{e}.up_proj`` / ``down_proj``) are stacked into ``switch_mlp.fc1`` / ``fc2`` as
  mlx-lm's own ``sanitize`` does for the backbone. Same layout in vLLM's ``nemotron_h_mtp.py``.
* DeepSeek-V3 layout (deepseek_v3, deepseek_v32, glm4_moe, glm4_moe_lite, glm_moe_dsa): the head is the checkpoint's layer
  ``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
  and a decoder layer of the family (``self_attn``, ``mlp``, the two layer norms). Its tensors
  are in the family's Hugging Face layout, so they go through the release's own ``sanitize``
  under an index it processes (expert stacking, ``kv_b_proj`` split, fp8 dequantization: the
  head's layer ends up exactly as the backbone's would). Followed: the DeepSeek-V3 Technical
  Report (arXiv:2412.19437, section 2.2: each MTP module shares the main model's embedding and
  output head and combines the normalized hidden state and the normalized embedding of the next
  token by a linear projection) and vLLM's ``deepseek_mtp.py`` (the tensor names, the embedding
  half first, the main model's final hidden state as input, ``shared_head.norm`` before the
  output head).
* MiMo (mimo): ``model.mtp_layers.{i}``: ``token_layernorm``, ``hidden_layernorm``, ``input_proj``
  (the normalized hidden state first), the family's decoder layer, ``final_layernorm``; shared
  embedding and output head (the MiMo report, arXiv:2505.07608; vLLM's ``mimo_mtp.py``).
* K-EXAONE (exaone_moe): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``
  (the normalized embedding first), ``mtp.layers.{i}`` (a decoder layer with a dense MLP; a
  full-attention one is kept), ``mtp.norm``; shared embedding and output head (vLLM's
  ``exaone_moe_mtp.py``).
* Ling / Ring 3.0 (bailing_moe_v3): DeepSeek-V3's layout with ``final_layernorm`` for the head's
  norm; the layer at ``num_hidden_layers`` is gated latent attention with the sparse MoE (vLLM's
  ``bailing_moe_v3_mtp.py``).
* LongCat-Flash (longcat_flash): ``model.mtp.layers.0`` (``enorm.m``, ``hnorm.m``, ``eh_proj``,
  one block of latent attention and dense MLP), ``model.mtp.norm`` (vLLM's
  ``longcat_flash_mtp.py``). LongCat-Flash-Lite (longcat_flash_ngram): the same, the next token
  embedded by the model's own n-gram embedding over the draft's tokens (Meituan's engine).
* ERNIE 4.5 MoE (ernie4_5_moe): ``model.mtp_emb_norm.{i}``, ``model.mtp_hidden_norm.{i}``,
  ``model.mtp_linear_proj.{i}`` (the normalized embedding first) and ``model.mtp_block.{i}``, a
  dense decoder layer whose output goes to the shared output head with no norm between (vLLM's
  ``ernie_mtp.py``, SGLang's ERNIE 4.5 MTP model).
"""

import functools
import re

_PER_EXPERT = re.compile(r"^(layers\.\d+\.(?:mlp|mixer))\.experts\.(\d+)\.(\w+_proj)\.(weight|scales|biases)$")


def _set_aside_expert(key, value, experts) -> bool:
    """Collect a per-expert tensor into ``experts[(prefix, proj, leaf)][index]`` (for
    ``_stack_experts``); False if ``key`` is not one."""
    per_expert = _PER_EXPERT.match(key)
    if not per_expert:
        return False
    prefix, index, proj, leaf = per_expert.groups()
    experts.setdefault((prefix, proj, leaf), {})[int(index)] = value
    return True


# On a head whose attention layers slide: their window. Their cache is a plain ``KVCache`` (it can
# be trimmed to any length, as speculation needs; a ``RotatingKVCache`` that has wrapped cannot)
# and ``mtp_forward`` restricts each position to the last ``window`` keys with a mask, as the
# family's own sliding layers attend.
SLIDING_WINDOW = "_mlx_lm_patches_sliding_window"


class HeadUnsupported(ValueError):
    """The checkpoint's head cannot be built with this mlx-lm; the message says why."""


def _with_stacked_experts(tensors, rename=None):
    """``tensors`` with per-expert tensors stacked as mlx-lm's own ``sanitize`` stacks them."""
    out, experts = {}, {}
    for key, value in tensors.items():
        if not _set_aside_expert(key, value, experts):
            out[key] = value
    return _stack_experts(out, experts, rename=rename)


def _stack_experts(out, experts, rename=None):
    import mlx.core as mx

    for (prefix, proj, leaf), by_index in experts.items():
        name = (rename or {}).get(proj, proj)
        out[f"{prefix}.switch_mlp.{name}.{leaf}"] = mx.stack([by_index[e] for e in sorted(by_index)])
    return out


def _layers_past(weights, depth, name=lambda i, rest: f"{i}.{rest}"):
    """``(backbone, past)``: the checkpoint tensors of layers ``model.layers.{depth + i}`` set apart
    as ``name(i, rest of the key)`` (the layers after the backbone's last, numbered from 0)."""
    backbone, past = {}, {}
    for key, value in weights.items():
        match = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
        if match and int(match.group(1)) >= depth:
            past[name(int(match.group(1)) - depth, match.group(2))] = value
        else:
            backbone[key] = value
    return backbone, past


class _Family:
    """What every family descriptor has."""

    def layer_cache(self, model):
        """A new cache for one attention layer of the head (a ``KVCache``)."""
        from mlx_lm.models.cache import KVCache

        return KVCache()

    def shard_view(self, layers, group):
        """The head's ``layers`` as the family's ``Model.shard`` expects the backbone's (they are
        the family's own layer classes)."""
        return layers


class _DecoderLayers(_Family):
    """Heads whose layers are all attention decoder layers, each with its own KV cache."""

    def attention_layers(self, head):
        return list(head.layers)

    def run_layers(self, head, z, mask, cache):
        for layer, layer_cache in zip(head.layers, cache):
            z = layer(z, mask=mask, cache=layer_cache)
        return z


class Qwen(_DecoderLayers):
    """Qwen3-Next, Qwen3.5/3.6 (dense and MoE)."""

    names = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
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
            if _set_aside_expert(key, value, experts):
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
        return _stack_experts(out, experts)

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


class NemotronH(_Family):
    """Nemotron-H (Nemotron 3 Super's MTP head)."""

    names = ("nemotron_h",)
    _BLOCK_NAMES = {"attention": "*", "full_attention": "*", "moe": "E", "mlp": "-",
                    "mamba": "M", "linear_attention": "M"}

    def pattern(self, config, weights):
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
        pattern = self.pattern(config, weights)
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

    def convert(self, tensors, mlx_layout=False):
        return _with_stacked_experts(tensors, rename={"up_proj": "fc1", "down_proj": "fc2"})

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


class _ExtraLayerHead(_DecoderLayers):
    """What heads made of one more decoder layer of the family share, when the model keeps its
    blocks in ``model.model`` (embedding, final norm) and its output layer in ``lm_head``."""

    FUSION = "embedding-first"

    @staticmethod
    def _inner(model):
        return model.model

    def _split(self, weights, pattern, fusion_names, convert=None):
        """``(backbone, head)``: checkpoint keys ``pattern`` matches (groups: MTP layer index,
        rest) are the head's, as ``mtp.`` parameters: the fusion tensors of layer 0 at the top,
        the rest under ``mtp.layers.{i}.``; ``convert(i, tensors)`` maps a layer's tensors first."""
        backbone, by_layer = {}, {}
        for key, value in weights.items():
            match = re.match(pattern, key)
            if match:
                by_layer.setdefault(int(match.group(1)), {})[match.group(2)] = value
            else:
                backbone[key] = value
        head = {}
        for i, tensors in sorted(by_layer.items()):
            for key, value in (convert(i, tensors) if convert else tensors).items():
                top = i == 0 and key.startswith(fusion_names)
                head[f"mtp.{key}" if top else f"mtp.layers.{i}.{key}"] = value
        return backbone, head

    def _one_layer(self, n_layers, what):
        if n_layers != 1:
            raise HeadUnsupported(f"{n_layers} MTP layers; {what} heads are kept with one")

    def _fusion_head(self, model, n_layers, what, names, bias=False):
        """A head module holding the fusion: ``names`` = (embedding norm, hidden norm,
        projection of the two halves), sized from ``model.args``; one MTP layer only."""
        import mlx.nn as nn

        self._one_layer(n_layers, what)
        hidden, eps = model.args.hidden_size, model.args.rms_norm_eps
        head = nn.Module()
        embedding_norm, hidden_norm, projection = names
        setattr(head, embedding_norm, nn.RMSNorm(hidden, eps=eps))
        setattr(head, hidden_norm, nn.RMSNorm(hidden, eps=eps))
        setattr(head, projection, nn.Linear(2 * hidden, hidden, bias=bias))
        return head

    def embed(self, model, ids, cache=None):
        return self._inner(model).embed_tokens(ids)

    def final_norm(self, model):
        return self._inner(model).norm

    def logits(self, model, out, head=None):
        if getattr(model.args, "tie_word_embeddings", False) and not hasattr(model, "lm_head"):
            return self._inner(model).embed_tokens.as_linear(out)
        return model.lm_head(out)

    def vocab_size(self, model):
        return model.args.vocab_size


class DeepSeekV3(_ExtraLayerHead):
    """DeepSeek-V3, DeepSeek-V3.2 (deepseek_v32), GLM-4.5/4.6/4.7 (glm4_moe), GLM-4.7-Flash
    (glm4_moe_lite), GLM-5 (glm_moe_dsa): the MTP layer at index ``num_hidden_layers``, built from
    the family's own decoder layer. DeepSeek-V3.2 follows the DeepSeek-V3.2-Exp report
    (V3.1-Terminus's architecture, MTP module included, with sparse attention): V3's head around
    its own decoder layer, whose attention keeps a second cache for its indexer
    (``layer_cache``). GLM-5 is that model under GLM's config names (mlx-lm's glm_moe_dsa is
    deepseek_v32's model); its checkpoints ship the layer at index 78 of a 78-layer backbone,
    its sparse-attention indexer included (zai-org/GLM-5's weight index; vLLM and SGLang load
    it with their DeepSeek MTP model)."""

    names = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
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

        backbone, past = _layers_past(weights, depth)
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
        return _array_mask(z, cache)

    def head_norm(self, head):
        return head.shared_head.norm


class MiMo(_ExtraLayerHead):
    """Xiaomi MiMo-7B: ``model.mtp_layers.{i}``, each ``token_layernorm``, ``hidden_layernorm``,
    ``input_proj``, a decoder layer of the family and ``final_layernorm``. Followed: the MiMo
    report (arXiv:2505.07608, the MTP layers share embedding and output head with the model) and
    vLLM's ``mimo_mtp.py`` (the tensor names, the *hidden* half first, the main model's final
    hidden state as input)."""

    names = ("mimo",)
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


class Ernie(_ExtraLayerHead):
    """ERNIE 4.5 MoE (ernie4_5_moe): ``model.mtp_emb_norm.{i}``, ``model.mtp_hidden_norm.{i}``,
    ``model.mtp_linear_proj.{i}`` (with a bias where the model's linear layers have one) and
    ``model.mtp_block.{i}``, a dense decoder layer. Followed: vLLM's ``ernie_mtp.py`` and SGLang's
    ERNIE 4.5 MTP model (embedding half first, the main model's final hidden state as input, the
    block a decoder layer without MoE, no norm between the block and the shared output head)."""

    names = ("ernie4_5_moe",)
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
        return _with_stacked_experts(tensors)

    def fusion(self, head):
        return head.mtp_emb_norm, head.mtp_hidden_norm, head.mtp_linear_proj

    def head_norm(self, head):
        return _identity


class Exaone(_ExtraLayerHead):
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

    names = ("exaone_moe",)

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


def _through_stock_sanitize(tensors, stock_sanitize, stand_in, back):
    """``tensors`` with those ``stand_in(key)`` renames (to a backbone name the release's own
    ``sanitize`` converts) run through ``stock_sanitize`` and renamed back by ``back(key)`` (None:
    not the head's); the others as they are."""
    rest, renamed = {}, {}
    for key, value in tensors.items():
        name = stand_in(key)
        if name is None:
            rest[key] = value
        else:
            renamed[name] = value
    for key, value in stock_sanitize(renamed).items():
        name = back(key)
        if name is not None:
            rest[name] = value
    return rest


DEPTHS = re.compile(r"^depths\.(\d+)\.")  # the head's MTP layers after the first: depths.{i-1}.*


def _depth_count(weights, config):
    """How many MTP layers a head that drafts with each in turn has: those of the (converted)
    weights, else those the config declares, at least one."""
    from mlx_lm_patches.mechanisms.mtp.heads import declared_layers

    if weights:
        return 1 + len({m.group(1) for k in weights for m in [DEPTHS.match(k)] if m})
    return max(declared_layers(config), 1)


def _with_depths(build_one, count):
    """The head: MTP layer 0 (``build_one(0)``) with the later ones as ``depths``."""
    head = build_one(0)
    if count > 1:
        head.depths = [build_one(i) for i in range(1, count)]
    return head


def _as_depth(index, tail, top):
    """Where a checkpoint tensor of MTP layer ``index`` (``tail``: its name inside the layer)
    goes in the head: layer 0's at the top (``top``: fusion and final-norm names) or under
    ``layers.0.``; later layers' the same under ``depths.{index-1}.``."""
    inner = tail if tail.startswith(top) else f"layers.0.{tail}"
    return inner if index == 0 else f"depths.{index - 1}.{inner}"


class MiMoV2(_ExtraLayerHead):
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

    names = ("mimo_v2_flash",)
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

        return _through_stock_sanitize(tensors, stock_sanitize, stand_in, back)

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

        return _with_depths(one, _depth_count(weights, config))

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
                out[_as_depth(int(match.group(1)), tail, self._TOP)] = value
        return out

    def fusion(self, head):
        return head.enorm, head.hnorm, head.eh_proj

    def head_norm(self, head):
        return head.final_layernorm


class Step3p5(_ExtraLayerHead):
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

    names = ("step3p5",)
    HIDDEN = "pre"
    CHAINED = True
    _FUSION = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")

    def split_checkpoint(self, model, weights, stock_sanitize):
        """The layers past the backbone's last are the head's; their tensors go through the
        release's own ``sanitize`` beside (empty stand-ins of) the backbone's, so its
        checkpoint-wide decisions (zero-centred norms) are the ones it takes for the backbone."""
        import mlx.core as mx

        depth = model.args.num_hidden_layers
        backbone, past = _layers_past(weights, depth,
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
        count = _depth_count(weights, config)
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

        return _with_depths(one, count)

    def convert(self, tensors, mlx_layout=False):
        """Layer ``i > 0`` (``layers.{i}.*`` after ``split_checkpoint``) under ``depths.{i-1}``."""
        out = {}
        for key, value in tensors.items():
            match = re.match(r"^layers\.([1-9]\d*)\.(.+)$", key)
            out[_as_depth(int(match.group(1)), match.group(2), self._FUSION) if match else key] = value
        return out

    def fusion(self, head):
        return head.enorm, head.hnorm, head.eh_proj

    def head_norm(self, head):
        return head.shared_head.norm

    def logits(self, model, out, head=None):
        """Each MTP layer's own output head (``head``: the layer's module; the first by default)."""
        return (head if head is not None else model.__dict__["mtp"]).shared_head.output(out)


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

    names = ("bailing_moe_v3",)
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

        backbone, past = _layers_past(weights, depth)
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


class LongcatFlash(_ExtraLayerHead):
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

    names = ("longcat_flash",)
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

        return _through_stock_sanitize(tensors, stock_sanitize, stand_in, back)

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
        return _array_mask(z, cache)

    def shard_view(self, layers, group):
        """Each head layer as the family's two-attention block that ``Model.shard`` walks: its
        attention as the block's list of attentions, its MLP as the block's list of dense MLPs,
        and an expert stand-in (which the head does not have) for the block's shortcut MoE."""
        import types

        return [types.SimpleNamespace(self_attn=[layer.self_attn], mlps=[layer.mlp], mlp=_no_experts(group.size()))
                for layer in layers]



class LongcatFlashNgram(LongcatFlash):
    """LongCat-Flash-Lite (longcat_flash_ngram, 0.30.6 and later): the same MTP layer as
    LongCat-Flash (``model.mtp.layers.0``, ``model.mtp.norm``; one layer, no config key for it),
    behind a model whose input embedding adds hashed n-gram embeddings of the preceding tokens.
    The next token is embedded by the model's own n-gram embedding, over the draft's own token
    stream (the tokens ``x_{t+1}`` it has been given, so the first token of the sequence is never
    in its n-gram context): Meituan's own engine (meituan-longcat/SGLang-FluentLLM,
    ``flash_nextn.py`` and ``over_embedding.py``: the draft calls the target's n-gram embedding,
    the sequence's first token left out of it) does so; vLLM's ``longcat_flash_mtp.py`` uses the
    plain word embedding instead. The checkpoint's ``model.mtp.embed_tokens`` is not loaded
    (Meituan's engine skips it too). The head's caches carry the tokens they have seen, so the
    n-gram context follows every trim of the draft."""

    names = ("longcat_flash_ngram",)

    def layer_cache(self, model):
        return _tokens_kv_cache_class()()

    def status_note(self, tensors):
        return "the next token embedded by the model's n-gram embedding over the draft's tokens"

    def embed(self, model, ids, cache=None):
        """``ids`` embedded by the model's n-gram embedding after the tokens the head's first
        cache holds (its last ``emb_neighbor_num - 1``); then recorded there."""
        import mlx.core as mx

        ngram = model.model.ngram_embeddings
        seen = cache[0] if cache else None
        context = None
        if seen is not None and seen.tokens is not None and seen.tokens.shape[1]:
            context = seen.tokens[:, max(0, seen.tokens.shape[1] - ngram.n + 1):]
        out = ngram(ids, cache=[context])
        if seen is not None:
            seen.tokens = ids if seen.tokens is None else mx.concatenate([seen.tokens, ids.astype(seen.tokens.dtype)], axis=1)
        return out


@functools.lru_cache(maxsize=None)
def _tokens_kv_cache_class():
    """mlx-lm's ``KVCache`` that also keeps the token ids of its positions (``tokens``, [B, offset]
    once the layer has run), trimmed with it."""
    from mlx_lm.models.cache import KVCache

    class TokensKVCache(KVCache):
        def __init__(self):
            super().__init__()
            self.tokens = None

        def trim(self, n):
            n = super().trim(n)
            if self.tokens is not None:
                self.tokens = self.tokens[:, :self.offset]
            return n

    return TokensKVCache

def _no_experts(ranks):
    """A throwaway sparse MoE for ``Model.shard`` to split (the head has none): projections of
    ``ranks`` rows, so any split of them is whole."""
    import mlx.nn as nn

    moe, moe.switch_mlp = nn.Module(), nn.Module()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(moe.switch_mlp, name, nn.Linear(ranks, ranks, bias=False))
    return moe


def _array_mask(z, cache):
    """An array mask where the release has them (multi-head latent attention adds its
    positional scores to the mask, so it needs one; an array is exact for the others)."""
    from mlx_lm.models.base import create_attention_mask

    first = cache[0][0] if hasattr(cache[0], "caches") else cache[0]
    try:
        return create_attention_mask(z, first, return_array=True)
    except TypeError:  # releases before return_array: what the family's own model passes
        return create_attention_mask(z, first)


def _identity(x):
    return x


FAMILIES = {name: family for family in (Qwen(), NemotronH(), DeepSeekV3(), MiMo(), Ernie(), Exaone(), MiMoV2(), Step3p5(),
                                        BailingV3(), LongcatFlash(), LongcatFlashNgram())
            for name in family.names}


# Why the heads of families mlx-lm drops MTP layers for are not kept (what ``mtp_status`` says).
NOT_KEPT = {
    "kimi_k3": ("its released checkpoints ship no MTP layer (num_nextn_predict_layers 0, no such tensors in the "
                "weight index; vLLM's kimi_k3 MTP model is written for a head no checkpoint has published), so "
                "there is nothing to check a port against"),
    "kimi_linear": ("its checkpoints ship no MTP layer (no MTP setting in its config, no Kimi-Linear MTP model "
                    "in vLLM or SGLang, the published weight index lists the decoder layers only)"),
    "deepseek_v41": ("its mtp.* tensors are a block drafter (DeepSeek's DSpark: several tokens per pass from "
                     "chosen layers' hidden states), not a next-token MTP layer this package's decoding runs"),
}
NOT_READ = "the layout of its MTP layers has not been read yet"


def family_name(model):
    """The name ``model``'s family is kept under: its ``model_type``, or for a checkpoint whose
    ``model_type`` names another module (Ling 3.0's ``bailing_hybrid``, loaded by mlx-lm's
    ``bailing_moe_v3``) the module its class comes from."""
    model_type = getattr(model, "model_type", None)
    if model_type in FAMILIES:
        return model_type
    for cls in type(model).__mro__:  # (a subclass swapped in keeps its base's module)
        package, _, module = cls.__module__.rpartition(".")
        if package == "mlx_lm.models" and module in FAMILIES:
            return module
    return model_type


def family_of(model):
    """The family descriptor of ``model``, or ``None`` if its MTP heads are not kept."""
    return FAMILIES.get(family_name(model))

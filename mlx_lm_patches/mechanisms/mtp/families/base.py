"""``MtpFamily``, what every MTP family declares (its hooks, each with its default), and the
registry the family modules add themselves to (``@register``)."""

import re
from typing import Dict, Tuple

# On a head whose attention layers slide: their window. Their cache is a plain ``KVCache`` (it can
# be trimmed to any length, as speculation needs; a ``RotatingKVCache`` that has wrapped cannot)
# and ``mtp_forward`` restricts each position to the last ``window`` keys with a mask, as the
# family's own sliding layers attend.
SLIDING_WINDOW = "_mlx_lm_patches_sliding_window"


class HeadUnsupported(ValueError):
    """The checkpoint's head cannot be built with this mlx-lm; the message says why."""


def declared_layers(config) -> int:
    """How many MTP layers the config declares (0 if none)."""
    text = config.get("text_config") or {}
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        for source in (config, text):
            value = source.get(key)
            if value:
                return int(value)
    return 0


def layer_count(weights) -> int:
    """How many ``layers.{i}`` the head's (converted) tensors hold (0 if none)."""
    indices = {int(m.group(1)) for k in weights for m in [re.match(r"^layers\.(\d+)\.", k)] if m}
    return max(indices) + 1 if indices else 0


class MtpFamily:
    """What differs between model families' MTP heads. A subclass per family (one module each in
    this package, added to the registry with ``@register``); one instance serves every model of
    its ``MODEL_TYPES``.

    Required (no default; the head cannot be built or run without them): ``build``, ``convert``,
    ``fusion``, ``head_norm``, ``embed``, ``final_norm``, ``logits``, ``vocab_size``. Every other
    hook has the default written here, which is what most families need. ``head`` below is the
    head module ``build`` made (or, for a head with an MTP layer per draft step, the module of one
    layer: ``head`` or one of ``head.depths``)."""

    # -- declarations ------------------------------------------------------------------------------
    MODEL_TYPES: Tuple[str, ...] = ()  # the mlx-lm model types (``mlx_lm.models.<type>``) served
    # Of MODEL_TYPES: those whose ``Model.shard`` (tensor parallelism) splits the head's layers too.
    SHARDS: Tuple[str, ...] = ()
    # Of MODEL_TYPES: those whose ``Model`` subclasses another kept family's (their ``sanitize`` and
    # ``shard`` may be inherited, already wrapped there: wrapped only where they define their own).
    SUBCLASSES: Tuple[str, ...] = ()
    FUSION = "embedding-first"  # the order of the two halves the fusion projection takes
    HIDDEN = "post"  # the main model's hidden state the head reads: after ("post") or before its final norm
    CHAINED = False  # several MTP layers: layer k takes layer k-1's output (True) or the main model's hidden state
    SHARED: Tuple[str, ...] = ()  # prefixes of the checkpoint's copies of what the head shares (not loaded)

    # -- required ----------------------------------------------------------------------------------
    def build(self, model, config, weights, n_layers):
        """An empty head for ``model`` (``n_layers`` MTP layers or steps) from the family's own mlx-lm
        blocks; ``config`` and the converted ``weights`` may say what it is made of. Raises
        ``HeadUnsupported`` when this mlx-lm cannot build it."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to build its head")

    def convert(self, tensors, mlx_layout=False):
        """The checkpoint's MTP tensors (names relative to ``mtp.``) as the head's parameters, in
        mlx-lm's layout; ``mlx_layout``: they are known to be in it already (no per-tensor guess)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to convert its tensors")

    def fusion(self, head):
        """``(embedding norm, hidden norm, projection)``: the modules fusing the next token's
        embedding with the main model's hidden state."""
        raise NotImplementedError(f"{type(self).__name__} does not name its fusion")

    def head_norm(self, head):
        """The norm between the head's layers and the output head (a callable)."""
        raise NotImplementedError(f"{type(self).__name__} does not name its final norm")

    def embed(self, model, ids, cache=None):
        """The embedding of the next tokens ``ids`` (``cache``: the head's layer caches)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to embed")

    def final_norm(self, model):
        """The main model's final norm (its input and output are the pre- and post-norm hidden
        states the head reads)."""
        raise NotImplementedError(f"{type(self).__name__} does not name the model's final norm")

    def logits(self, model, out, head=None):
        """Logits of the head's normed output ``out`` (``head``: the MTP layer's module)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to make logits")

    def vocab_size(self, model):
        raise NotImplementedError(f"{type(self).__name__} does not give the vocabulary size")

    # -- optional, with defaults -------------------------------------------------------------------
    def for_stock_sanitize(self, model, backbone, mtp):
        """What the family's stock ``sanitize`` is given once the MTP tensors (``mtp``) are set
        aside: the backbone's tensors."""
        return backbone

    def sanitize_head(self, model, tensors, stock_sanitize):
        """The ``mtp.`` tensors before they are set aside, through what of the release's own
        ``sanitize`` (``stock_sanitize``) applies to them (e.g. fp8 dequantization): as they are."""
        return tensors

    def split_checkpoint(self, model, weights, stock_sanitize):
        """``(backbone, head)`` for a head stored outside ``mtp.`` keys (e.g. as the layer past the
        backbone's last): ``head`` as ``mtp.`` tensors in mlx-lm's layout. None such: nothing."""
        return weights, {}

    def source(self, model):
        """Where ``split_checkpoint`` found the head, in words (for ``model.mtp_status``)."""
        return "the checkpoint's MTP layers"

    def steps(self, declared, weights):
        """How many MTP layers (``build``'s ``n_layers``) the head has: those of its converted
        ``weights``, else those the config ``declared``, at least one."""
        return layer_count(weights) or max(declared, 1)

    def status_note(self, tensors):
        """Something ``model.mtp_status`` adds about a kept head, or None."""
        return None

    def layer_cache(self, model):
        """A new cache for one attention layer of the head (a ``KVCache``)."""
        from mlx_lm.models.cache import KVCache

        return KVCache()

    def attention_layers(self, head):
        """The head's layers that attend (each gets a ``layer_cache``): all of ``head.layers``."""
        return list(head.layers)

    def run_layers(self, head, z, mask, cache):
        """The head's layers over ``z``, each attention layer with its cache."""
        for layer, layer_cache in zip(head.layers, cache):
            z = layer(z, mask=mask, cache=layer_cache)
        return z

    def attention_mask(self, z, cache):
        """The mask of the head's attention layers (``cache``: theirs, not empty): mlx-lm's own."""
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(z, cache[0])

    def quant_path(self, model, path):
        """A head path as the family's ``quant_predicate`` should see it: as it is."""
        return path

    def shard_view(self, layers, group):
        """The head's ``layers`` as the family's ``Model.shard`` expects the backbone's (they are
        the family's own layer classes)."""
        return layers


REGISTRY: Dict[str, MtpFamily] = {}  # model type -> its family (one instance per family class)


def register(cls):
    """Class decorator: an instance of ``cls`` serves each of its ``MODEL_TYPES``."""
    if not cls.MODEL_TYPES or "MODEL_TYPES" not in vars(cls):
        raise TypeError(f"{cls.__name__} declares no MODEL_TYPES of its own")
    undeclared = sorted(set(cls.SHARDS + cls.SUBCLASSES) - set(cls.MODEL_TYPES))
    if undeclared:
        raise TypeError(f"{cls.__name__}: SHARDS / SUBCLASSES name {', '.join(undeclared)}, not in its MODEL_TYPES")
    taken = [t for t in cls.MODEL_TYPES if t in REGISTRY]
    if taken:
        raise TypeError(f"model type {taken[0]!r} is registered twice: by "
                        f"{type(REGISTRY[taken[0]]).__name__} and {cls.__name__}")
    family = cls()
    REGISTRY.update((model_type, family) for model_type in cls.MODEL_TYPES)
    return cls

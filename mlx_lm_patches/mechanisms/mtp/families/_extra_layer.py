"""What heads made of one more decoder layer of the family share."""

import re

from mlx_lm_patches.mechanisms.mtp.families.base import HeadUnsupported, MtpFamily


class ExtraLayerHead(MtpFamily):
    """What heads made of one more decoder layer of the family share, when the model keeps its
    blocks in ``model.model`` (embedding, final norm) and its output layer in ``lm_head``."""

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


def array_mask(z, cache):
    """An array mask where the release has them (multi-head latent attention adds its
    positional scores to the mask, so it needs one; an array is exact for the others)."""
    from mlx_lm.models.base import create_attention_mask

    first = cache[0][0] if hasattr(cache[0], "caches") else cache[0]
    try:
        return create_attention_mask(z, first, return_array=True)
    except TypeError:  # releases before return_array: what the family's own model passes
        return create_attention_mask(z, first)

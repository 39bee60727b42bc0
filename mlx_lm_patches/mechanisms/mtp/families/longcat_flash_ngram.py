"""LongCat-Flash-Lite (longcat_flash_ngram): LongCat-Flash's head, the next token embedded by
the model's own n-gram embedding over the draft's tokens (Meituan's engine)."""

import functools

from mlx_lm_patches.mechanisms.mtp.families.base import register
from mlx_lm_patches.mechanisms.mtp.families.longcat_flash import LongcatFlash


@register
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

    MODEL_TYPES = ("longcat_flash_ngram",)
    SHARDS = MODEL_TYPES

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

"""What ``max_kv_size`` specifies, built by hand for the tests: a model's own caches with each
plain ``KVCache`` (inside ``CacheList`` too) a ``RotatingKVCache(window, keep)`` - what mlx-lm
builds for a dense model - and everything else as the model made it."""


def specified_caches(model, window, keep=4):
    from mlx_lm.models import cache as cache_module

    def one(c):
        if type(c) is cache_module.KVCache:
            return cache_module.RotatingKVCache(max_size=window, keep=keep)
        if type(c) is cache_module.CacheList:
            return cache_module.CacheList(*(one(x) for x in c.caches))
        return c

    made = model.make_cache() if hasattr(model, "make_cache") else [cache_module.KVCache() for _ in model.layers]
    return [one(c) for c in made]


def hybrids_with_plain_attention():
    """Hybrid families of this release (a recurrent layer) with at least one plain ``KVCache``
    layer: those whose attention ``max_kv_size`` bounds."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model
    from mlx_lm_patches.mechanisms.caches import flat_caches

    found = []
    for model_type in available_model_types():
        leaves = flat_caches(build_tiny_model(model_type).make_cache())
        if any(isinstance(c, ArraysCache) for c in leaves) and any(type(c) is KVCache for c in leaves):
            found.append(model_type)
    return found

"""longcat_flash_ngram rows with different histories batch together.

Bug
    longcat_flash_ngram's n-gram embedding keeps the last ``min(seen, n - 1)`` token ids of a
    sequence in its ``ArraysCache`` slot: a row that has seen fewer than ``n - 1`` tokens holds a
    narrower array. ``ArraysCache.merge`` sizes its batch slot from the first row and copies each
    row into it, and ``ArraysCache.extend`` concatenates: rows of different widths crash
    (``Cannot broadcast array of shape (1,2) into shape (1,1)``, ``[concatenate] ...``) or, when
    the wider row comes first, the narrow row's ids are broadcast across the slot and it
    decodes silently wrong. In ``BatchGenerator`` this is any prompt of fewer than ``n``
    tokens beside longer ones from 0.31.2 (batched together: per-row prefill merges the rows;
    inserted while others decode; joining a prompt still being prefilled), and on every release
    a prompt cache holding fewer than ``n - 1`` tokens batched beside others.

Fix
    Before ``ArraysCache.merge`` and ``extend``, a slot holding token ids (an integer array)
    narrower than another row's is padded on the left with zeros to the widest. The model
    itself reads a position before the sequence's start as id 0 (its ``_shift_right`` fills
    zeros), so a context padded with zeros computes exactly what the shorter one does.

Retire
    When ``ArraysCache.merge``/``extend`` join rows whose n-gram contexts differ in width.

Metal
    Bookkeeping on the cache slots; the model's forward runs unchanged.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"


def pad_contexts(caches) -> None:
    """Left-pad with zeros, in place, every token-id slot of ``caches`` (``ArraysCache``
    instances) narrower than the same slot of another of them: the widths then agree."""
    from mlx_lm_patches.mechanisms.caches import widened_token_ids

    for e in range(min(len(c.cache) for c in caches)):
        for c, slot in zip(caches, widened_token_ids([c.cache[e] for c in caches])):
            c.cache[e] = slot


def _merge(wrapped, instance, args, kwargs):
    caches = list(args[0] if args else kwargs["caches"])
    if len(caches) > 1 and all(isinstance(getattr(c, "cache", None), list) for c in caches):
        pad_contexts(caches)
    return wrapped(*args, **kwargs)


def _extend(wrapped, instance, args, kwargs):
    other = args[0] if args else kwargs["other"]
    if isinstance(getattr(other, "cache", None), list) and isinstance(instance.cache, list):
        pad_contexts([instance, other])
    return wrapped(*args, **kwargs)


def _joined(how, narrow, wide):
    """What ``how`` (merge or extend) makes of a one-token context and a two-token one, or the
    error it raises."""
    arrays_cache = sys.modules[CACHE].ArraysCache
    a, b = arrays_cache(1), arrays_cache(1)
    a[0], b[0] = narrow, wide
    try:
        if how == "merge":
            return arrays_cache.merge([a, b])[0].tolist()
        a.extend(b)
        return a[0].tolist()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def probe():
    import mlx.core as mx

    narrow, wide = mx.array([[5]], dtype=mx.int64), mx.array([[6, 7]], dtype=mx.int64)
    want = [[0, 5], [6, 7]]
    for how in ("merge", "extend"):
        got = _joined(how, narrow, wide)
        if got != want:
            return (f"ArraysCache.{how} of n-gram contexts of one and two token ids gives {got!r}, "
                    f"not the shorter one padded ({want!r})")
    return None


def apply(p):
    p.wrap(f"{CACHE}:ArraysCache.merge", _merge)
    p.wrap(f"{CACHE}:ArraysCache.extend", _extend)


def scenario():
    """longcat_flash_ngram in BatchGenerator with prompts of 1 and 2 tokens beside a longer
    one: together, inserted while decoding, inserted while a prompt is prefilled."""
    from mlx_lm_patches.selftest.scenarios import short_prompts_beside_longer
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "longcat_flash_ngram" not in available_model_types():
        return Outcome.not_applicable("no longcat_flash_ngram in this mlx-lm")
    problem = short_prompts_beside_longer(build_tiny_model("longcat_flash_ngram", seed=1), "longcat_flash_ngram")
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, "longcat_flash_ngram rows with short prompts decode as alone",
                   ["prompts of 1, 2 and 7 tokens: together, inserted while decoding, inserted mid-prefill",
                    "prompt caches of 5 and 1 tokens continued beside a new prompt"])

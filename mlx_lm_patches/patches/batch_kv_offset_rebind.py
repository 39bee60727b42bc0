"""``BatchKVCache.offset`` is never mutated in place (mlx-lm < 0.32.0).

Bug
    ``BatchKVCache.offset`` is a per-row ``mx.array``. Before 0.32.0, ``update_and_fetch``,
    ``prepare``, ``finalize`` and ``trim`` update it with ``self.offset += n``, which changes the
    array object in place - so any code that read ``cache.offset`` earlier sees the value move
    under it. bailing_moe_linear reads the offset once per forward and hands it to every layer's
    rotary embedding; after the first attention layer advanced the cache, the later layers rotate
    at the wrong positions, and batched decoding is wrong even for rows of equal length.
    (mlx-vlm's Qwen3.5 / Qwen3-VL attention and other downstream code hold offsets the same way.)

Fix
    Before each of those methods runs, rebind ``offset`` to a fresh array with the same values, so
    the method's in-place update only touches an array nobody else holds - what 0.32.0 does by
    writing ``self.offset = self.offset + n``. Values are identical; only aliasing changes.

Retire
    When 0.31.3 drops out of the supported range.

Metal
    Array bookkeeping only; no kernel involved.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"
METHODS = ("update_and_fetch", "prepare", "finalize", "trim")


def _rebind_offset_first(wrapped, instance, args, kwargs):
    import mlx.core as mx

    offset = getattr(instance, "offset", None)
    if isinstance(offset, mx.array):
        instance.offset = mx.array(offset)
    return wrapped(*args, **kwargs)


def probe():
    import mlx.core as mx

    cache = sys.modules[CACHE].BatchKVCache([1, 0])
    held = cache.offset
    before = held.tolist()
    keys = mx.zeros((2, 1, 3, 4))
    cache.update_and_fetch(keys, keys)
    if held.tolist() != before:
        return f"BatchKVCache.update_and_fetch changed an offset array already handed out ({before} -> {held.tolist()})"
    return None


def apply(p):
    batch_kv = p.module(CACHE).BatchKVCache
    for name in METHODS:
        if name in vars(batch_kv):
            p.wrap(f"{CACHE}:BatchKVCache.{name}", _rebind_offset_first)


def scenario():
    """bailing_moe_linear, two prompts of equal length batched: equal to single decoding."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "bailing_moe_linear" not in available_model_types():
        return Outcome.not_applicable("no bailing_moe_linear in this mlx-lm")
    model = build_tiny_model("bailing_moe_linear", seed=1)
    prompts = [prompt_tokens(9, seed=s) for s in (3, 4)]
    try:
        got = batched_greedy(model, prompts)
    except Exception as exc:
        return Outcome.failure("bailing_moe_linear batched", exc)
    for i, (prompt, decoded) in enumerate(zip(prompts, got)):
        problem = greedy(model, prompt).compare(decoded)
        if problem:
            return Outcome.failure(f"bailing_moe_linear, equal-length prompt {i} batched: {problem}")
    return Outcome(True, "offsets handed to layers stay put; batched bailing_moe_linear exact",
                   ["bailing_moe_linear: 2 equal-length prompts batched exactly"])

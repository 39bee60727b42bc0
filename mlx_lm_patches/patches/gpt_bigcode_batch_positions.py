"""gpt_bigcode decodes in batches: position ids per row instead of ``np.arange(cache.offset)``.

Bug
    ``GPTBigCodeModel.__call__`` builds its learned position ids with
    ``np.arange(cache[0].offset, cache[0].offset + L)``, which needs the offset as a Python int.
    In batched generation the cache is a ``BatchKVCache`` whose ``offset`` is a per-row
    ``mx.array``, so ``BatchGenerator`` / ``batch_generate`` / the server's batched path crash
    with ``ValueError: [convert] Only length-1 arrays can be converted to Python scalars``. One of
    the "offset as int" consumers that ``tests/test_offset_consumers.py`` finds in mlx-lm's models
    (the others are listed there and in docs/archive/2026-11-research/offset_as_int.md).

Fix
    When the cache offset is an array (batched), compute each row's positions as
    ``offset[row] + arange(L)`` (clipped at 0 for left padding, which the attention mask hides)
    and run the same embedding, mask, blocks and final norm as the stock method; with an int
    offset or no cache the stock method runs unchanged. The cache's offset is only read.

Retire
    When gpt_bigcode computes positions from array offsets upstream.

Metal
    Same modules and kernels as the stock forward; only the position ids differ in how they are built.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome, missing
from mlx_lm_patches.engine.traceless import seeded

MODULE = "mlx_lm.models.gpt_bigcode"
CACHE = "mlx_lm.models.cache"


def _per_row_positions(wrapped, instance, args, kwargs):
    import mlx.core as mx

    inputs = args[0] if args else kwargs["inputs"]
    cache = args[1] if len(args) > 1 else kwargs.get("cache")
    offset = getattr(cache[0], "offset", None) if cache else None
    if not isinstance(offset, mx.array) or offset.ndim == 0:
        return wrapped(*args, **kwargs)
    create_attention_mask = sys.modules[MODULE].create_attention_mask
    length = inputs.shape[1]
    hidden = instance.wte(inputs)
    positions = mx.maximum(offset[:, None] + mx.arange(length)[None], 0)
    mask = create_attention_mask(hidden, cache[0])
    hidden = hidden + instance.wpe(positions)
    for block, layer_cache in zip(instance.h, cache):
        hidden = block(hidden, mask, cache=layer_cache)
    return instance.ln_f(hidden)


def _tiny_model():
    import mlx.core as mx

    module = sys.modules.get(MODULE) or __import__(MODULE, fromlist=["Model"])
    args = module.ModelArgs(model_type="gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4,
                            n_positions=256, layer_norm_epsilon=1e-5, vocab_size=256)
    with seeded(0):
        model = module.Model(args)
    mx.eval(model.parameters())
    return model


def probe():
    import mlx.core as mx

    gone = missing(f"{CACHE}:BatchKVCache", f"{MODULE}:ModelArgs", f"{MODULE}:Model")
    if gone is not None:
        return gone
    cache = sys.modules["mlx_lm.models.cache"].BatchKVCache([1, 0])
    model = _tiny_model()
    try:
        model(mx.array([[1, 2], [3, 4]]), cache=[cache] * 2)
    except (ValueError, TypeError) as exc:
        return f"gpt_bigcode forward with a BatchKVCache raises {type(exc).__name__}: {exc}"
    return None


def apply(p):
    p.wrap(f"{MODULE}:GPTBigCodeModel.__call__", _per_row_positions)


def scenario():
    """gpt_bigcode, three prompts of different lengths batched: equal to single decoding."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy

    model = _tiny_model()
    prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13)]
    try:
        got = batched_greedy(model, prompts)
    except Exception as exc:
        return Outcome.failure("gpt_bigcode batched", exc)
    for i, (prompt, decoded) in enumerate(zip(prompts, got)):
        problem = greedy(model, prompt).compare(decoded)
        if problem:
            return Outcome.failure(f"gpt_bigcode prompt {i} batched: {problem}")
    return Outcome(True, "gpt_bigcode batches with per-row positions; exact",
                   ["gpt_bigcode: 3 prompts of different lengths batched exactly"])

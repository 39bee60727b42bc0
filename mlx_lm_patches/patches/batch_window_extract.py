"""A finished batched row's sliding window is handed back without the unused buffer.

Bug
    Before 0.30.4 ``BatchRotatingKVCache.extract`` cuts the row's keys and values to the
    positions written only when the row has left padding. A row without any (one alone in its
    batch, or the longest) gets the whole pre-allocated buffer - 256 positions and more, zeros
    past the written ones - with ``_idx`` at its end: the next step writes after the zeros and
    attends to them. Continuing that cache (``mlx_lm.server``'s prompt cache after a batched
    request, ``batch_generate``'s returned caches, a follow-up inserted into ``BatchGenerator``)
    is silently wrong, or crashes when it is merged beside another row. Sliding-window hybrids
    (recurrent_gemma, baichuan_m1) reach it once ``arrays-cache-extract`` lets their rows leave
    a batch; dense sliding-window models (gemma3) have it in stock mlx-lm.

Fix
    After mlx-lm's ``extract``, a window longer than what the batch holds (``max_size`` once
    rotated, else the write index) is cut to it, as 0.30.4 does for every row.

Retire
    When 0.30.2 drops out of the supported range.

Metal
    Slicing of the extracted arrays; no kernel involved.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"


def _extract(wrapped, instance, args, kwargs):
    row = wrapped(*args, **kwargs)
    held = instance.max_size if instance.rotated else instance._idx
    if row.keys is not None and row.keys.shape[2] > held:
        row.keys = row.keys[:, :, :held]
        row.values = row.values[:, :, :held]
        row._idx = held
    return row


def probe():
    import mlx.core as mx

    cache = sys.modules[CACHE].BatchRotatingKVCache(8, [0])
    cache.update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
    cache.update_and_fetch(mx.ones((1, 1, 1, 4)), mx.ones((1, 1, 1, 4)))  # grows the buffer past 3
    row = cache.extract(0)
    if row.keys.shape[2] != 3 or row._idx != 3:
        return (f"BatchRotatingKVCache.extract of a row without left padding holding 3 positions "
                f"gives {row.keys.shape[2]} with _idx {row._idx}")
    return None


def apply(p):
    p.wrap(f"{CACHE}:BatchRotatingKVCache.extract", _extract)


def scenario():
    """recurrent_gemma prompts of 1, 5 and 20 tokens decoded alone by ``BatchGenerator``;
    decoding continued from the cache each finishes with equals greedy decoding of the whole
    sequence."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import _batched_one, greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "recurrent_gemma" not in available_model_types():
        return Outcome.not_applicable("no recurrent_gemma in this mlx-lm")
    model = build_tiny_model("recurrent_gemma", seed=1)
    more = prompt_tokens(3, seed=77)
    for n in (1, 5, 20):
        prompt = prompt_tokens(n, seed=n + 30)
        what = f"recurrent_gemma: continuing the cache of a finished batched {n}-token prompt"
        try:
            first, cache = _batched_one(model, prompt, None, 3, 2048)
            got = greedy(model, more, max_tokens=3, prompt_cache=cache)
        except Exception as exc:
            return Outcome.failure(what, exc)
        problem = greedy(model, prompt + first.tokens + more, max_tokens=3).compare(got)
        if problem:
            return Outcome.failure(f"{what}: {problem}")
    return Outcome(True, "finished batched rows' sliding windows continue exactly",
                   ["recurrent_gemma prompts of 1, 5 and 20 tokens"])

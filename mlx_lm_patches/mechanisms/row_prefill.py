"""Prefilling the rows of a ``PromptProcessingBatch`` (mlx-lm >= 0.31.2) one at a time.

Each row is taken out of the batch cache as the single-sequence cache the model uses alone,
prefilled through the model's own forward with batch size one, and the batch cache is rebuilt
with mlx-lm's ``_merge_caches``: what ``batch-prefill-per-row`` (hybrid families that ignore
padding), ``batch-fresh-row-state`` (rows that start beside rows with history) and
``prompt-cache-prefix-reuse`` (states kept per row) need.
:func:`generate_fresh_rows_apart` starts the rows whose prompt is one token (their first step is
``PromptProcessingBatch.generate``'s, not a prompt pass) from an empty state.

A row that has processed nothing starts from the cache a sequence alone starts from: empty
recurrent slots (``None``) and empty attention caches. In the batch it may hold the zeros
mlx-lm's ``ArraysCache.extend``/``merge`` put in for an empty slot beside rows with state.

Before 0.31.2 the unit is ``BatchGenerator._process_prompts``: :func:`process_prompts_alone`
runs it once per prompt.
"""

import sys

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


class _Unsupported(Exception):
    pass


def _row_cache(c, i, fresh=False):
    """Row ``i`` of a batch cache, as the single-sequence cache the model uses alone (``fresh``:
    the row has processed nothing, so that cache is empty)."""
    cm = sys.modules[CACHE]
    if isinstance(c, cm.CacheList):
        return cm.CacheList(*(_row_cache(sub, i, fresh) for sub in c.caches))
    if isinstance(c, cm.ArraysCache):
        row = type(c).__new__(type(c))
        row.cache = [None if s is None or fresh else s[i:i + 1] for s in c.cache]
        row.left_padding = None
        row.lengths = None
        return row
    if isinstance(c, cm.BatchKVCache):
        return cm.KVCache() if c.keys is None or fresh else c.extract(i)
    if isinstance(c, cm.BatchRotatingKVCache):
        if c.keys is None or fresh:
            return cm.RotatingKVCache(max_size=c.max_size)
        return c.extract(i)
    raise _Unsupported(type(c).__name__)


def zero_filled_rows(instance) -> set:
    """Rows of a ``PromptProcessingBatch`` that have processed nothing (no tokens in mlx-lm's
    record of the row) yet hold recurrent state: the zeros mlx-lm's ``ArraysCache.extend`` and
    ``merge`` put in for an empty slot. A row with state but no record (a cache handed to
    ``insert`` without its tokens) holds non-zero state and is not one of them."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.caches import arrays, recurrent_caches

    slots = [a for c in recurrent_caches(instance.prompt_cache) for s in c.cache for a in arrays(s)]
    candidates = [i for i, held in enumerate(instance.tokens) if not held]
    if not slots or not candidates:
        return set()
    zero = mx.stack([mx.stack([mx.all(s[i] == 0) for s in slots]).all() for i in candidates])
    return {i for i, z in zip(candidates, zero.tolist()) if z}


def prefill_rows_alone(instance, tokens, row_model=None) -> bool:
    """Prefill each row of a ``PromptProcessingBatch`` alone (a batch of one, through the
    model's own forward), then rebuild the batch cache with mlx-lm's ``_merge_caches``.
    ``row_model(i, row_caches, history)`` may give the callable to run row ``i`` through and a
    function to call when the row is done (default: the batch's model). ``False`` (nothing
    changed) if a row cache cannot be taken out of the batch."""
    import mlx.core as mx

    fresh = zero_filled_rows(instance)
    try:
        rows = [[_row_cache(c, i, i in fresh) for c in instance.prompt_cache] for i in range(len(tokens))]
    except _Unsupported:
        return False
    histories = [list(held) for held in instance.tokens]
    for held, new in zip(instance.tokens, tokens):  # the tokens now in each row's cache
        held += new
    step = max(1, int(instance.prefill_step_size))
    for i, (row_tokens, row) in enumerate(zip(tokens, rows)):
        model, done = row_model(i, row, histories[i]) if row_model else (instance.model, None)
        for start in range(0, len(row_tokens), step):
            chunk = mx.array([list(row_tokens[start:start + step])])
            model(chunk, cache=row)
            mx.eval([c.state for c in row])
        if done is not None:
            done()
        mx.clear_cache()
    instance.prompt_cache = sys.modules[GENERATE]._merge_caches(rows)
    mx.eval([c.state for c in instance.prompt_cache])
    return True


def generate_fresh_rows_apart(generate, instance, tokens, fresh):
    """``PromptProcessingBatch.generate(tokens)`` (``generate``, bound to ``instance``) with the
    rows ``fresh`` (processed nothing, one token left: their first pass is the generation
    batch's first step) started from empty recurrent slots, as a sequence alone starts. They
    are split off into a batch of their own whose recurrent slots are emptied; the generation
    batches of both parts are joined with mlx-lm's ``GenerationBatch.extend`` and put back in
    the rows' order."""
    from mlx_lm_patches.mechanisms.caches import recurrent_caches

    uids = list(instance.uids)
    rest = [i for i in range(len(tokens)) if i not in fresh]
    apart = instance.split(sorted(fresh)) if rest else instance
    for c in recurrent_caches(apart.prompt_cache):
        c.cache = [None] * len(c.cache)
    if not rest:
        return generate(tokens)
    batch = generate([tokens[i] for i in rest])
    batch.extend(apart.generate([tokens[i] for i in sorted(fresh)]))
    where = {uid: j for j, uid in enumerate(batch.uids)}
    batch.filter([where[uid] for uid in uids])
    return batch


def process_prompts_alone(process, prompts, otherwise: str):
    """<= 0.31.1: ``BatchGenerator._process_prompts`` (``process``) run once per prompt, each
    from its own cache, the batches joined with mlx-lm's ``Batch.extend``. Where they cannot be
    joined (kimi_linear <= 0.30.6 keeps tuples in its cache slots), the inputs were not consumed
    (fresh caches, or merged copies of the given ones): the prompts are processed together, as
    mlx-lm does, with a warning saying ``otherwise`` (what the caller's fix then does not do)."""
    import logging

    try:
        batch = process([prompts[0]])
        for prompt in prompts[1:]:
            batch.extend(process([prompt]))
        return batch
    except (TypeError, ValueError, AttributeError) as exc:
        logging.getLogger("mlx_lm_patches").warning("mlx-lm-patches: %s (%s: %s)", otherwise,
                                                    type(exc).__name__, exc)
        return process(prompts)

"""Prefilling the rows of a ``PromptProcessingBatch`` (mlx-lm >= 0.31.2) one at a time.

Each row is taken out of the batch cache as the single-sequence cache the model uses alone,
prefilled through the model's own forward with batch size one, and the batch cache is rebuilt
with mlx-lm's ``_merge_caches``: what ``batch-prefill-per-row`` (hybrid families that ignore
padding) and ``prompt-cache-prefix-reuse`` (states kept per row) need.
"""

import sys

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


class _Unsupported(Exception):
    pass


def _row_cache(c, i):
    """Row ``i`` of a batch cache, as the single-sequence cache the model uses alone."""
    cm = sys.modules[CACHE]
    if isinstance(c, cm.CacheList):
        return cm.CacheList(*(_row_cache(sub, i) for sub in c.caches))
    if isinstance(c, cm.ArraysCache):
        row = type(c).__new__(type(c))
        row.cache = [None if s is None else s[i:i + 1] for s in c.cache]
        row.left_padding = None
        row.lengths = None
        return row
    if isinstance(c, cm.BatchKVCache):
        return cm.KVCache() if c.keys is None else c.extract(i)
    if isinstance(c, cm.BatchRotatingKVCache):
        if c.keys is None:
            return cm.RotatingKVCache(max_size=c.max_size)
        return c.extract(i)
    raise _Unsupported(type(c).__name__)


def prefill_rows_alone(instance, tokens, row_model=None) -> bool:
    """Prefill each row of a ``PromptProcessingBatch`` alone (a batch of one, through the
    model's own forward), then rebuild the batch cache with mlx-lm's ``_merge_caches``.
    ``row_model(i, row_caches, history)`` may give the callable to run row ``i`` through and a
    function to call when the row is done (default: the batch's model). ``False`` (nothing
    changed) if a row cache cannot be taken out of the batch."""
    import mlx.core as mx

    try:
        rows = [[_row_cache(c, i) for c in instance.prompt_cache] for i in range(len(tokens))]
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

"""mlx-lm 0.31.2: a prompt inserted while another is still prefilled gets its own rows of state.

Bug
    From 0.31.2 a prompt inserted while another row of ``BatchGenerator`` is still in its prompt
    (prompts longer than ``prefill_step_size``, 2048 by default; a server with a long request in
    progress) joins that row's ``PromptProcessingBatch`` through ``extend``. In 0.31.2 that join
    miscounts rows for a side that has processed nothing:

    * ``ArraysCache.extend`` keeps the other side's slot when one side has none, so the new row
      gets no row of recurrent state: the next prompt pass crashes (``[concatenate] ... shapes
      are (1,3,128), (2,16,128)``) for every hybrid family;
    * ``BatchKVCache.extend`` and ``BatchRotatingKVCache.extend`` give a side without keys the
      other side's row count: two prompts joining one give two rows of keys for three sequences
      (any model). Rows then read keys that are not theirs, or memory past the array (measured:
      recurrent_gemma's one-token prompt decoded NaN in about one run in five).

Fix
    ``BatchKVCache.extend`` and ``BatchRotatingKVCache.extend`` first give a side without keys
    keys and values of no positions for its own rows (its ``offset`` has one entry per row), so
    an engine extending batch caches itself is covered too. Before ``PromptProcessingBatch.extend``
    (the only place that knows how many sequences an empty recurrent slot stands for), a
    recurrent slot that one side has and the other has not is given zeros for the other side's
    rows. Both are what ``extend`` does from 0.31.3. A zero state computes what an empty one does
    for every family but recurrent_gemma, which ``batch-fresh-row-state`` prefills from an empty
    state.

Retire
    When 0.31.2 drops out of the supported range.

Metal
    Python-side bookkeeping before the join; the model's own kernels run unchanged.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def _fill_missing(ours, our_rows, theirs, their_rows) -> None:
    """Zeros for each recurrent slot one side lacks, shaped as the other side's, for its rows."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.caches import arrays_cache_class, flat_caches

    arrays_cache = arrays_cache_class()
    for a, b in zip(flat_caches(ours), flat_caches(theirs)):
        if not (isinstance(a, arrays_cache) and isinstance(b, arrays_cache)):
            continue
        for slot, (x, y) in enumerate(zip(a.cache, b.cache)):
            if x is None and isinstance(y, mx.array):
                a.cache[slot] = mx.zeros((our_rows,) + y.shape[1:], y.dtype)
            elif y is None and isinstance(x, mx.array):
                b.cache[slot] = mx.zeros((their_rows,) + x.shape[1:], x.dtype)


def _extend(wrapped, instance, args, kwargs):
    batch = args[0] if args else kwargs["batch"]
    if instance.prompt_cache and batch.prompt_cache and instance.uids and batch.uids:
        _fill_missing(instance.prompt_cache, len(instance.uids), batch.prompt_cache, len(batch.uids))
    return wrapped(*args, **kwargs)


def _extend_keys(wrapped, instance, args, kwargs):
    """A side of a batch attention cache's ``extend`` that holds no keys yet gets keys and values
    of no positions, one row per entry of its ``offset``, shaped as the other side's."""
    import mlx.core as mx

    other = args[0] if args else kwargs["other"]
    for empty, full in ((instance, other), (other, instance)):
        if empty.keys is None and full.keys is not None:
            rows, k, v = empty.offset.shape[0], full.keys, full.values
            empty.keys = mx.zeros((rows, k.shape[1], 0, k.shape[3]), k.dtype)
            empty.values = mx.zeros((rows, v.shape[1], 0, v.shape[3]), v.dtype)
    return wrapped(*args, **kwargs)


def probe():
    import mlx.core as mx

    gen, cache = sys.modules[GENERATE], sys.modules[CACHE]
    if not hasattr(gen, "PromptProcessingBatch"):
        return None
    held = cache.ArraysCache(1)
    held[0] = mx.zeros((1, 2))
    batch = gen.PromptProcessingBatch(None, [0], [[held]])
    batch.extend(gen.PromptProcessingBatch(None, [1], [[cache.ArraysCache(1)]]))
    rows = batch.prompt_cache[0][0].shape[0]
    if rows != 2:
        return (f"a PromptProcessingBatch of a row with recurrent state extended by a new row holds "
                f"{rows} row(s) of state for 2 sequences")
    keys = cache.BatchKVCache([0])
    keys.update_and_fetch(mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)))
    keys.extend(cache.BatchKVCache([0, 0]))
    rows = keys.keys.shape[0]
    if rows != 3:
        return (f"a BatchKVCache of a row with keys extended by two new rows holds "
                f"{rows} row(s) of keys for 3 sequences")
    return None


def apply(p):
    p.wrap(f"{GENERATE}:PromptProcessingBatch.extend", _extend)
    p.wrap(f"{CACHE}:BatchKVCache.extend", _extend_keys)
    p.wrap(f"{CACHE}:BatchRotatingKVCache.extend", _extend_keys)


def scenario():
    """Prompts inserted while others are still prefilled, for a dense model and hybrid families:
    one beside one, two prefilled with one joining, one prefilled with two joining; each row
    equal to decoding it alone."""
    from mlx_lm_patches.selftest.scenarios import first_problem, greedy, staggered_greedy
    from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    if not hasattr(sys.modules[GENERATE], "PromptProcessingBatch"):
        return Outcome.not_applicable("this mlx-lm prefills each new prompt in a batch of its own")
    details = []
    long, other, short, shorter = (prompt_tokens(n, seed=n) for n in (40, 37, 9, 5))
    joins = {"one joining one": ([long, short], (0, 1)),
             "one joining two": ([long, other, short], (0, 0, 1)),
             "two joining one": ([long, short, shorter], (0, 1, 1))}
    for model_type in [t for t in (DENSE_MODEL_TYPE, "qwen3_5", "nemotron_h", "mamba")
                       if t == DENSE_MODEL_TYPE or t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        problem = first_problem(model_type, {
            f"inserted while another prompt is prefilled ({name})": (
                lambda prompts=prompts, at=at: staggered_greedy(model, prompts, at),
                [greedy(model, p) for p in prompts])
            for name, (prompts, at) in joins.items()})
        if problem:
            return Outcome.failure(problem)
        details.append(f"{model_type}: prompts joining others in their prefill (1 to 1, 1 to 2, 2 to 1), all exact")
    return Outcome(True, "prompts inserted while others are prefilled decode as alone", details)

"""Hybrid prompt caches are reused up to an exact state at or before where a request diverges.

Bug
    ``LRUPromptCache`` (``mlx_lm.server``) reuses a longer stored prompt by trimming a copy back
    to the common prefix, for trimmable caches only. ``ArraysCache`` holds only the state after
    all its tokens, so for hybrid models a request that diverges inside a stored prompt (another
    question about the same document, an edited last message) is a complete miss. Making it
    "trimmable" by a reset (mlx-lm PR #1254) changes every later token and makes
    ``insert_cache`` evict the shorter entries hybrids rely on.

Fix
    ``Model.__call__`` of every family with recurrent layers keeps the recurrent states at the
    end of each pass of one sequence whose history is known, by reference and bounded per
    sequence (``MLX_LM_PATCHES_PREFIX_CHECKPOINTS``, default 8); decode steps only append their
    token (one call into the package per token). While a prompt-cache store exists, prefills are
    also cut at powers of two and ``BatchGenerator`` prefills hybrid rows alone. Kept states
    travel with the caches and are stored by ``insert_cache`` (counted in ``nbytes``);
    ``fetch_nearest_cache`` restores one further along the request than mlx-lm's own search
    reaches (checked token by token; attention caches cut to the same position). Nothing is
    approximated: entries or requests whose KV caches are quantized are prefilled cold.
    Details: docs/prefix-reuse.md.

Retire
    When mlx-lm keeps or can recompute exact recurrent states at earlier positions itself.

Metal
    Prefill passes are cut at extra positions; on GPU, kernels over different chunk boundaries
    may differ in the last bits, as for any prompt-cache reuse of dense models.
"""

import logging
import sys
from collections import deque
from functools import partial

from mlx_lm_patches.engine.contract import Outcome

log = logging.getLogger("mlx_lm_patches")

CACHE = "mlx_lm.models.cache"
GENERATE = "mlx_lm.generate"
SERVER = "mlx_lm.server"


# -- keeping states while prefilling ----------------------------------------------------------

def _prefill_cut(memo, wrapped, instance, args, kwargs):
    """``generate_step``: while a prompt-cache store exists, the prefill is cut at powers of
    two. Its multi-token passes are all prefill, so the passes run while its generator runs
    are cut, and the generator itself is returned (decoding pays nothing here)."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    _note_quantization(memo, kwargs)
    steps = wrapped(*args, **kwargs)
    if not pc.capturing(memo) or pc.arm(steps):
        return steps
    return _cut_until_first(steps)


def _speculative_prefill_cut(memo, wrapped, instance, args, kwargs):
    """``speculative_generate_step``: while a prompt-cache store exists, the prefill (everything
    before the first token comes out) is cut at powers of two; its verification passes are not."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    _note_quantization(memo, kwargs)
    steps = wrapped(*args, **kwargs)
    if not pc.capturing(memo):
        return steps
    return _cut_until_first(steps)


def _note_quantization(memo, kwargs):
    """A generation asked to quantize its KV caches (``kv_bits``, keyword-only): restores of
    hybrid prompts whose prefill would quantize are declined from then on (see ``_fetch``)."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    if kwargs.get("kv_bits") is not None:
        start = kwargs.get("quantized_kv_start")
        if start is None:
            start = getattr(sys.modules[GENERATE], "DEFAULT_QUANTIZED_KV_START", 0)
        pc.note_kv_quantization(memo, kwargs["kv_bits"], start)


def _cut_until_first(steps):
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    try:
        with pc.cutting():
            first = next(steps)
    except StopIteration:
        return
    try:
        yield first
        yield from steps
    finally:
        steps.close()


def _row_history(row, history):
    """What a row of a ``PromptProcessingBatch`` holds, if certain: mlx-lm's own record of its
    tokens, checked against the attention caches' offsets."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import int_offset, flat_caches

    if not history:
        return () if pc.is_empty(row) else None
    arrays_cache = sys.modules[CACHE].ArraysCache
    for cache in flat_caches(row):
        if not isinstance(cache, arrays_cache) and int_offset(cache) != len(history):
            return None
    return tuple(history)


def _prompt(memo, wrapped, instance, args, kwargs):
    """>= 0.31.2: prefill hybrid rows alone (cut at powers of two), each from its known history."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import has_recurrent_state
    from mlx_lm_patches.mechanisms.row_prefill import prefill_rows_alone

    tokens = args[0] if args else kwargs.get("tokens")
    if not (tokens and pc.capturing(memo) and len(tokens) == len(instance.uids)
            and has_recurrent_state(instance.prompt_cache)):
        return wrapped(*args, **kwargs)
    batch_caches = instance.prompt_cache

    def row_model(i, row, history):
        pc.copy_row_trails(batch_caches, row, i)
        known = _row_history(row, history)
        if known is not None:
            pc.mark_exact(row, known)  # the row's slots are new objects holding that history
        return instance.model, None

    with pc.cutting():
        done = prefill_rows_alone(instance, tokens, row_model)
    if not done:
        return wrapped(*args, **kwargs)


def _process_prompts(memo, wrapped, instance, args, kwargs):
    """<= 0.31.1: each prompt is processed on its own (a batch of one), cut at powers of two,
    from the known history of its cache."""
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import has_recurrent_state

    prompts = list(args[0] if args else kwargs["prompts"])
    if not (pc.capturing(memo) and prompts and has_recurrent_state(prompts[0][3])):
        return wrapped(*args, **kwargs)
    batch = None
    try:
        for prompt in prompts:
            # the batch cache is built from this prompt's cache (new objects, same content)
            with pc.cutting(seed=pc.exact_history(prompt[3])):
                one = wrapped([prompt])
            if batch is None:
                batch = one
            else:
                batch.extend(one)
        return batch
    except (TypeError, ValueError, AttributeError) as exc:
        # As in batch-prefill-per-row: the inputs were not consumed (fresh caches, or merged
        # copies of the given ones), so the prompts are processed again without kept states.
        log.warning("mlx-lm-patches: prefix checkpoints not kept here (%s: %s)", type(exc).__name__, exc)
        return wrapped(*args, **kwargs)


# -- the prompt-cache store -------------------------------------------------------------------


def _lru_init(memo, wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    pc.note_prompt_cache_created(memo)
    return wrapped(*args, **kwargs)


def _entries(lru, model):
    """``(tokens, prompt_cache)`` of every entry stored for ``model`` (all releases' layouts)."""
    order = lru._lru
    if isinstance(order, deque):
        pairs = list(order)  # <= 0.30.7
    elif hasattr(order, "_lrus"):
        pairs = [pair for lru_type in order._lrus.values() for pair in lru_type]  # >= 0.31.2
    else:
        pairs = list(order._lru) + list(getattr(order, "_lru_checkpoints", ()))  # 0.31.1
    get = lru._trie.get if hasattr(lru, "_trie") else lru._get
    for owner, tokens in pairs:
        if owner == model:
            yield tokens, get(owner, tokens).prompt_cache


def _stock_reuse(lru, model, tokens) -> int:
    """How many tokens mlx-lm's own search would reuse for a hybrid model (exact or shorter)."""
    result = lru._trie.search(model, tokens) if hasattr(lru, "_trie") else lru._search(model, tokens)
    if result.exact is not None:
        return len(tokens)
    return len(result.shorter) if result.shorter is not None else 0


def _fetch(memo, wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import has_recurrent_state
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    model, tokens = bound.arguments["model"], bound.arguments["tokens"]
    entries = [(key, cache) for key, cache in _entries(instance, model) if has_recurrent_state(cache)]
    if entries and pc.quantized_prefill(memo, len(tokens)):
        log.debug("mlx-lm-patches: prompt cache: no kept state reused (KV caches quantized: not exact)")
    elif entries:
        found = pc.best_restore(entries, tokens, better_than=_stock_reuse(instance, model, tokens))
        if found is not None:
            cache, position = found
            log.debug("mlx-lm-patches: prompt cache: %d of %d tokens reused from a kept state",
                      position, len(tokens))
            return cache, tokens[position:]
    cache, rest = wrapped(*args, **kwargs)
    if cache is not None and has_recurrent_state(cache):
        pc.mark_exact(cache, tokens[: len(tokens) - len(rest)])
    return cache, rest


def _insert(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import has_recurrent_state
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    cache = bound.arguments["prompt_cache"]
    if isinstance(cache, (list, tuple)) and has_recurrent_state(cache):
        pc.settle(cache, bound.arguments["tokens"])
    return wrapped(*args, **kwargs)


def _plus_checkpoints(cache, nbytes):
    from mlx_lm_patches.mechanisms.prefix_reuse import retained_nbytes

    return nbytes + retained_nbytes(cache)


# -- probe, apply, scenario -------------------------------------------------------------------


def probe():
    import mlx.core as mx

    cache = sys.modules[CACHE].ArraysCache(1)
    cache[0] = mx.ones((1, 2))
    if not cache.is_trimmable():
        return ("ArraysCache cannot go back to an earlier state: LRUPromptCache reuses a stored "
                "hybrid prompt only if it is an exact prefix of the request")
    return None


def apply(p):
    from mlx_lm_patches.engine.patching import property_over

    cache_module = p.module(CACHE)
    arrays_cache = cache_module.ArraysCache
    for method, carry in (("merge", "carry_merge"), ("extend", "carry_extend"),
                          ("filter", "carry_filter"), ("extract", "carry_extract")):
        if hasattr(arrays_cache, method):
            from mlx_lm_patches.mechanisms import prefix_reuse as pc

            p.wrap(f"{CACHE}:ArraysCache.{method}", getattr(pc, carry))
    current_nbytes = vars(arrays_cache).get("nbytes")
    if isinstance(current_nbytes, property):
        p.set(f"{CACHE}:ArraysCache.nbytes", property_over(current_nbytes, _plus_checkpoints))
    store = CACHE if hasattr(cache_module, "LRUPromptCache") else SERVER
    memo = p.memo  # what the process has seen: not a module global (revert clears it, status lists it)
    p.wrap(f"{store}:LRUPromptCache.__init__", partial(_lru_init, memo))
    p.wrap(f"{store}:LRUPromptCache.fetch_nearest_cache", partial(_fetch, memo))
    p.wrap(f"{store}:LRUPromptCache.insert_cache", _insert)
    from mlx_lm_patches.mechanisms.prefix_reuse import recorded_forward

    # every model family with recurrent layers is a declared target (compat_matrix.yaml)
    for target in p.declared:
        if target.endswith(":Model.__call__"):
            p.wrap(target, recorded_forward)
    p.wrap(f"{GENERATE}:generate_step", partial(_prefill_cut, memo))
    p.wrap(f"{GENERATE}:speculative_generate_step", partial(_speculative_prefill_cut, memo))
    if hasattr(p.module(GENERATE), "PromptProcessingBatch"):
        p.wrap(f"{GENERATE}:PromptProcessingBatch.prompt", partial(_prompt, memo))
    else:
        p.wrap(f"{GENERATE}:BatchGenerator._process_prompts", partial(_process_prompts, memo))


def scenario():
    """A prompt stored after a 600-token shared prefix; a request diverging right after it: at
    least half the shared prefix is reused and the continuation equals a cold prefill - through
    ``generate_step`` (what the server does) and through an engine calling the model itself."""
    from mlx_lm_patches.selftest.scenarios import engine_prefix_reuse, prefix_reuse
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    details = []
    cases = [(t, "generate_step", prefix_reuse) for t in ("qwen3_next", "lfm2", "falcon_h1", "mamba2")]
    cases.append(("nemotron_h", "an engine's own prefill", engine_prefix_reuse))
    for model_type, path, run in [c for c in cases if c[0] in available_model_types()]:
        try:
            reused, problem = run(build_tiny_model(model_type, seed=1), shared=600)
        except Exception as exc:
            return Outcome.failure(f"{model_type} ({path}): prefix reuse", exc)
        if problem:
            return Outcome.failure(f"{model_type} ({path}): {problem}")
        if reused < 300:
            return Outcome.failure(f"{model_type} ({path}): a request diverging after 600 shared tokens reused "
                                   f"{reused} (a miss: the whole prompt is prefilled again)")
        details.append(f"{model_type} ({path}): {reused} of 600 shared tokens reused, continuation equal "
                       "to a cold prefill")
    return Outcome(True, "diverging requests reuse an exact earlier state of a stored hybrid prompt", details)

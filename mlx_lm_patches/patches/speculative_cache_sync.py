"""After speculative decoding, a supplied prompt cache holds exactly the prompt and the generated tokens.

Bug
    ``generate_step`` leaves a supplied ``prompt_cache`` holding the prompt and every yielded
    token; ``speculative_generate_step`` does not: when it ends, the main model's caches lack
    the last token whenever it was the main model's own (a correction or the bonus token), and
    the draft's lack one or two (dense models too). ``mlx_lm.server --draft-model`` stores that
    cache under ``prompt + generated tokens``: a follow-up request extending the conversation
    decodes from a cache that misses a token of it, silently wrong.

Fix
    When the generator ends (exhausted or closed) and the caller supplied the cache, each part
    (the main model's, then the draft's) is measured and moved until it holds exactly the prompt
    and every yielded token (``mechanisms/cache_sync.py``): missing tokens are fed through the
    model's own forward in one pass, extra ones trimmed (recurrent caches only through
    ``recurrent-rollback``'s journal; never a reset). A main part that cannot be measured
    raises ``CacheOutOfSync`` before the first token (the server answers an error and stores
    nothing); a draft part only decides proposals, so one that cannot be checked is left alone.

Retire
    When mlx-lm's speculative loop leaves a supplied prompt cache holding every yielded token
    (or the server stores it under the tokens it holds) in every supported release.

Metal
    The catch-up pass is the model's own forward over one or two tokens; on GPU it may differ
    from single-token decoding in the last bits, as any prompt-cache reuse does.
"""

import logging
import sys

from mlx_lm_patches.engine.contract import Outcome, missing

log = logging.getLogger("mlx_lm_patches")

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def _sync_supplied_cache(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.speculative import caller_parts
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    model, draft_model = bound.arguments["model"], bound.arguments["draft_model"]
    try:
        parts = caller_parts(model, draft_model, bound.arguments.get("prompt_cache"))
    except ValueError:
        parts = None  # a malformed prompt cache: mlx-lm (or speculative-cache-split) says so
    if parts is None:
        return wrapped(*args, **kwargs)
    return _synced_steps(wrapped, args, kwargs, bound, parts)


def _synced_steps(wrapped, args, kwargs, bound, parts):
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.cache_sync import CacheOutOfSync, CachePart

    main = CachePart("main", bound.arguments["model"], parts[0])
    draft = CachePart("draft", bound.arguments["draft_model"], parts[1])
    tokens = [int(t) for t in mx.array(bound.arguments["prompt"]).reshape(-1).tolist()]
    for part in (main, draft):
        part.begin()
    steps = wrapped(*args, **kwargs)
    first, ended = True, False
    try:
        for item in steps:
            if first:
                first = False
                # The loop is suspended here: journals of recurrent-rollback are attached.
                main.find_journal()
                draft.find_journal()
                why = main.unmeasurable()
                if why:
                    raise CacheOutOfSync(
                        "speculative decoding could not leave the supplied prompt cache holding "
                        f"exactly the prompt and the generated tokens: the main model's cache: {why}")
            tokens.append(int(item[0]))
            yield item
        ended = True
    except GeneratorExit:
        ended = True
        raise
    finally:
        steps.close()
        if ended:
            _bring_parts_to(main, draft, tokens, bound.arguments.get("stream"))


def _bring_parts_to(main, draft, tokens, stream):
    from mlx_lm_patches.mechanisms.cache_sync import CacheOutOfSync

    if stream is None:
        stream = getattr(sys.modules.get(GENERATE), "generation_stream", None)
    if draft.unmeasurable() is None:
        try:
            draft.bring_to(tokens, stream)
        except CacheOutOfSync as exc:
            log.warning("mlx-lm-patches: %s (the draft's cache only affects which tokens are "
                        "proposed, never the output)", exc)
    else:
        log.debug("mlx-lm-patches: draft cache left as it is: %s", draft.unmeasurable())
    try:
        main.bring_to(tokens, stream)
    except CacheOutOfSync as exc:
        log.error("mlx-lm-patches: %s; do not reuse this prompt cache", exc)
        raise


class _PredictsZero:
    """Stands in for a model: one attention cache, always predicts token 0."""

    layers = [None]

    def __call__(self, inputs, cache=None):
        import mlx.core as mx

        n = inputs.shape[1]
        cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
        return mx.broadcast_to(mx.array([4.0, 0.0, 0.0, 0.0]), (1, n, 4))


def probe():
    import mlx.core as mx

    gone = missing(f"{CACHE}:KVCache")
    if gone is not None:
        return gone
    kv_cache = sys.modules[CACHE].KVCache
    prompt_cache = [kv_cache(), kv_cache()]
    steps = sys.modules[GENERATE].speculative_generate_step(
        mx.array([1, 2], mx.uint32), _PredictsZero(), _PredictsZero(),
        num_draft_tokens=1, max_tokens=1, prompt_cache=prompt_cache,
    )
    yielded = len(list(steps))
    want = 2 + yielded
    held = [c.offset for c in prompt_cache]
    if held == [want, want]:
        return None
    return (f"after speculative_generate_step the supplied prompt cache holds {held[0]} (main) and "
            f"{held[1]} (draft) tokens, not the {want} of the prompt and the generated tokens")


def apply(p):
    p.wrap(f"{GENERATE}:speculative_generate_step", _sync_supplied_cache)


def scenario():
    """What mlx_lm.server does for a two-turn conversation with a draft model: decode turn 1
    speculatively into a supplied prompt cache, then continue that cache with turn 2."""
    from mlx_lm_patches.selftest.scenarios import continue_after_speculation
    from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model

    cases = [(DENSE_MODEL_TYPE, DENSE_MODEL_TYPE)]
    cases += [("qwen3_next", DENSE_MODEL_TYPE)] if "qwen3_next" in available_model_types() else []
    details = []
    for main_type, draft_type in cases:
        model, draft = build_tiny_model(main_type, seed=1), build_tiny_model(draft_type, seed=5)
        for stop_after in (None, 3):
            what = (f"{main_type} with a {draft_type} draft, "
                    + ("max_tokens reached" if stop_after is None else f"closed after {stop_after} tokens"))
            try:
                problem = continue_after_speculation(model, draft, stop_after=stop_after)
            except Exception as exc:
                return Outcome.failure(what, exc)
            if problem:
                return Outcome.failure(f"{what}: {problem}")
            details.append(f"{what}: the next turn from the cache equals a cold prefill")
    return Outcome(True, "supplied prompt caches hold exactly the prompt and the generated tokens "
                   "after speculative decoding", details)

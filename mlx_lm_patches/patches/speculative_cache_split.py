"""A supplied ``prompt_cache`` is split between main and draft model where their caches are.

Bug
    ``speculative_generate_step(prompt, model, draft_model, prompt_cache=...)`` takes the main
    model's caches as ``prompt_cache[:len(model.layers)]`` and the draft's as the rest. But a
    prompt cache is ``make_prompt_cache(model) + make_prompt_cache(draft_model)``, and a model's
    ``make_cache()`` need not give one cache per layer: nemotron_h gives none to its MLP/MoE
    layers (4 layers, 3 caches in the tiny model), longcat_flash_ngram (>= 0.30.6) adds a
    model-level n-gram cache. The main model then runs on part of the draft's caches: a crash
    (``make_mask() got an unexpected keyword argument 'return_array'``) or, with a dense draft,
    silently wrong tokens. The server passes such a combined cache whenever a draft model is set.

Fix
    Split at ``len(make_prompt_cache(model))`` - the contract the docstring states - and hand
    each part to the stock loop through ``make_cache()`` of a stand-in (``prompt_cache=None``),
    so the loop itself is mlx-lm's. A prompt cache whose length matches neither split raises a
    ``ValueError`` naming the expected lengths. Models with one cache per layer take the stock
    path untouched.

Retire
    When mlx-lm splits a supplied prompt cache by cache count in every supported release.

Metal
    Python-side bookkeeping only; the model forward and its kernels are unchanged.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome, missing

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def _split_by_cache_count(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.speculative import ModelWithCaches, split_prompt_cache
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    prompt_cache = bound.arguments.get("prompt_cache")
    if prompt_cache is None:
        return wrapped(*args, **kwargs)
    model, draft_model = bound.arguments["model"], bound.arguments["draft_model"]
    main, draft = split_prompt_cache(model, draft_model, prompt_cache)
    if len(main) == len(model.layers):
        return wrapped(*args, **kwargs)
    bound.arguments.update(
        model=ModelWithCaches(model, main),
        draft_model=ModelWithCaches(draft_model, draft),
        prompt_cache=None,
    )
    return wrapped(*bound.args, **bound.kwargs)


class _Reached(Exception):
    pass


def probe():
    import mlx.core as mx

    gone = missing(f"{CACHE}:KVCache")
    if gone is not None:
        return gone
    kv_cache = sys.modules[CACHE].KVCache

    class TwoLayersOneCache:
        layers = [None, None]

        def make_cache(self):
            return [kv_cache()]

        def __call__(self, inputs, cache=None):
            raise _Reached(cache)

    main, draft = TwoLayersOneCache(), TwoLayersOneCache()
    prompt_cache = [kv_cache(), kv_cache()]
    steps = sys.modules[GENERATE].speculative_generate_step(
        mx.array([1, 2], mx.uint32), main, draft, prompt_cache=prompt_cache
    )
    try:
        next(steps)
    except _Reached as reached:
        handed = reached.args[0]
    else:
        return "probe model was never called"
    finally:
        steps.close()
    if len(handed) == 1 and handed[0] is prompt_cache[1]:
        return None
    return (
        f"speculative_generate_step handed the draft model {len(handed)} of the 2 caches "
        "(split at len(model.layers), not at the main model's cache count)"
    )


def apply(p):
    p.wrap(f"{GENERATE}:speculative_generate_step", _split_by_cache_count)


def scenario():
    """nemotron_h (fewer caches than layers) speculating with a supplied combined prompt cache."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "nemotron_h" not in available_model_types():
        return Outcome.not_applicable("no nemotron_h in this mlx-lm")
    from mlx_lm.models.cache import make_prompt_cache

    model = build_tiny_model("nemotron_h", seed=1)
    draft = build_tiny_model("llama", seed=2)
    prompt = prompt_tokens(14, seed=5)
    reference = greedy(model, prompt, max_tokens=8)
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    try:
        got = speculative_greedy(model, draft, prompt, max_tokens=8, prompt_cache=cache)
    except Exception as exc:
        return Outcome.failure("nemotron_h with a dense draft and a supplied prompt_cache", exc)
    problem = reference.compare(got)
    if problem:
        return Outcome.failure(f"nemotron_h with a dense draft and a supplied prompt_cache: {problem}")
    return Outcome(True, "supplied prompt caches split by cache count; nemotron_h speculation exact",
                   ["nemotron_h + llama draft, prompt_cache supplied: tokens and logprobs exact"])

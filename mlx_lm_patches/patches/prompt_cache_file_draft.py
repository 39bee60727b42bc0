"""``--prompt-cache-file`` with ``--draft-model``: the draft's cache is rebuilt from the file's tokens.

Bug
    ``mlx_lm.cache_prompt`` saves the main model's caches only, and ``mlx_lm.generate
    --prompt-cache-file F --draft-model D`` hands that list to ``speculative_generate_step``,
    which expects ``make_prompt_cache(model) + make_prompt_cache(draft_model)``: every model
    fails (stock: ``IndexError`` or wrong caches for the draft; with ``speculative-cache-split``:
    a ``ValueError`` saying the list is short). A user who cached a long system prompt cannot
    speculate on it.

Fix
    The file records its tokens: ``generate_step`` filling a fresh prompt cache (what
    ``mlx_lm.cache_prompt`` runs) remembers the prompt, weakly keyed by the cache, and
    ``save_prompt_cache`` writes its token ids to the file's metadata
    (``mlx_lm_patches_tokens``). ``mlx_lm.generate``'s ``load_prompt_cache`` remembers them
    with the loaded list, and when ``speculative_generate_step`` gets that list - the main
    model's caches only - with a draft model, the draft's caches are rebuilt: a fresh
    ``make_prompt_cache(draft_model)`` prefilled with the tokens the main caches hold, in
    ``prefill_step_size`` chunks. The main model's caches are the file's, untouched, so the
    tokens and log-probabilities are those of ``mlx_lm.generate --prompt-cache-file F`` without
    a draft. An MTP draft (``--draft-model mtp``) reads the main model's passes and starts from
    an empty cache. A file without recorded tokens (saved without the package) is refused at
    the first ``next()``, before any token, with a ``ValueError`` saying to re-create it.

Retire
    When ``mlx_lm.generate`` builds the draft's cache for a prompt-cache file itself.
"""

import json
import threading
import weakref
from functools import partial

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms.calls import bind_arguments

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"
TOKENS_KEY = "mlx_lm_patches_tokens"  # no dot: load_prompt_cache unflattens dotted keys

_lock = threading.Lock()
# in the patcher's memo (revert clears it, status lists it), not module globals:
PREFILLED = "prompts of the prompt caches generate_step filled"  # first cache of a list -> prompt (weakly)
LOADED = "the last prompt-cache file mlx_lm.generate loaded"  # (cache, tokens)

NO_TOKENS = (
    "--prompt-cache-file with --draft-model: the prompt cache file does not record its tokens "
    "(it was saved without mlx-lm-patches), so the draft model's cache cannot be rebuilt; "
    "re-create it with mlx_lm.cache_prompt while mlx-lm-patches is active"
)


def _record_prompt(memo, wrapped, instance, args, kwargs):
    """``generate_step`` with a ``prompt_cache`` (what ``mlx_lm.cache_prompt`` runs, on a fresh
    cache): remember the prompt with the cache it fills (weakly: nothing is kept alive). A cache
    that held tokens before holds more than the prompt: the rebuild refuses it (count check)."""
    bound = bind_arguments(wrapped, args, kwargs).arguments
    cache = bound.get("prompt_cache")
    if cache:
        try:
            with _lock:
                memo.setdefault(PREFILLED, weakref.WeakKeyDictionary())[cache[0]] = bound["prompt"]
        except TypeError:
            pass
    return wrapped(*args, **kwargs)


def _save_with_tokens(memo, wrapped, instance, args, kwargs):
    bound = bind_arguments(wrapped, args, kwargs)
    cache = bound.arguments["cache"]
    try:
        with _lock:
            prompt = memo.get(PREFILLED, {}).get(cache[0]) if cache else None
    except TypeError:
        prompt = None
    if prompt is not None:
        metadata = dict(bound.arguments.get("metadata") or {})
        metadata[TOKENS_KEY] = json.dumps([int(t) for t in prompt.tolist()])
        bound.arguments["metadata"] = metadata
    return wrapped(*bound.args, **bound.kwargs)


def _remember_loaded(memo, wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        cache, metadata = result
        tokens = metadata.get(TOKENS_KEY)
        with _lock:
            memo[LOADED] = (cache, json.loads(tokens) if tokens else None)
    return result


def _held_tokens(caches):
    """How many tokens ``caches`` hold (an attention cache's offset), or ``None``."""
    from mlx_lm_patches.mechanisms.caches import flat_caches, int_offset

    for cache in flat_caches(caches):
        offset = int_offset(cache)
        if offset is not None:
            return offset
    return None


def rebuild_draft_cache(draft_model, tokens, prefill_step_size):
    """A fresh cache of ``draft_model`` holding ``tokens``, prefilled chunk by chunk."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(draft_model)
    if getattr(draft_model, "reads_main_model", False):
        return caches  # an MTP head follows the main model's passes
    step = max(int(prefill_step_size or 512), 1)
    ids = mx.array(tokens, dtype=mx.uint32)
    for start in range(0, len(tokens), step):
        draft_model(ids[None, start:start + step], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def _refused(exc):
    raise exc
    yield  # a generator: the refusal comes from the first next()


def _speculative(memo, wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.speculative import cache_count

    bound = bind_arguments(wrapped, args, kwargs)
    arguments = bound.arguments
    cache = arguments.get("prompt_cache")
    with _lock:
        loaded, tokens = memo.get(LOADED, (None, None))
    if cache is None or cache is not loaded or arguments.get("draft_model") is None:
        return wrapped(*args, **kwargs)
    if len(cache) != cache_count(arguments["model"]):
        return wrapped(*args, **kwargs)  # the draft's caches are there already
    if tokens is None:
        return _refused(ValueError(NO_TOKENS))
    held = _held_tokens(cache)
    held = len(tokens) if held is None else held
    if held not in (len(tokens), len(tokens) - 1):
        return _refused(ValueError(
            f"--prompt-cache-file with --draft-model: the file's caches hold {held} tokens but "
            f"it records a prompt of {len(tokens)}; re-create it with mlx_lm.cache_prompt"))
    draft = rebuild_draft_cache(arguments["draft_model"], tokens[:held], arguments.get("prefill_step_size"))
    arguments["prompt_cache"] = list(cache) + list(draft)
    return wrapped(*bound.args, **bound.kwargs)


def probe():
    from mlx_lm_patches.engine.contract import missing

    gone = missing(f"{GENERATE}:speculative_generate_step", f"{GENERATE}:load_prompt_cache")
    if gone:
        return gone
    return "mlx_lm.cache_prompt saves the main model's caches only and nothing rebuilds a draft's"


def apply(p):
    memo = p.memo
    p.wrap(f"{GENERATE}:speculative_generate_step", partial(_speculative, memo))
    p.wrap(f"{GENERATE}:load_prompt_cache", partial(_remember_loaded, memo))
    p.wrap(f"{GENERATE}:generate_step", partial(_record_prompt, memo))
    p.wrap(f"{CACHE}:save_prompt_cache", partial(_save_with_tokens, memo))
    p.wrap_if_present("mlx_lm.cache_prompt:save_prompt_cache", partial(_save_with_tokens, memo))


def scenario():
    """What ``mlx_lm.cache_prompt`` then ``mlx_lm.generate --prompt-cache-file F --draft-model D``
    run, in process: speculation on the loaded file equals plain decoding on it."""
    import importlib
    import os
    import tempfile

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    generate_module = importlib.import_module(GENERATE)

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    details = []
    for model_type in ("qwen3_next", "llama"):
        model, draft = build_tiny_model(model_type, seed=1), build_tiny_model("llama", seed=7)
        system, query = prompt_tokens(20, seed=2), prompt_tokens(6, seed=8)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "prompt.safetensors")
            cache = make_prompt_cache(model)  # what mlx_lm.cache_prompt's main does:
            for _ in generate_module.generate_step(mx.array(system), model, max_tokens=0, prompt_cache=cache):
                pass
            save_prompt_cache(path, cache, {"model": model_type})
            reference = greedy(model, query, max_tokens=8,
                               prompt_cache=generate_module.load_prompt_cache(path, return_metadata=True)[0])
            loaded, _ = generate_module.load_prompt_cache(path, return_metadata=True)
            try:
                got = speculative_greedy(model, draft, query, max_tokens=8, num_draft_tokens=3, prompt_cache=loaded)
            except Exception as exc:
                return Outcome.failure(f"{model_type}: speculation on a prompt-cache file", exc)
        problem = reference.compare(got)
        if problem:
            return Outcome.failure(f"{model_type}: speculation on a prompt-cache file: {problem}")
        details.append(f"{model_type}: speculation on a prompt-cache file equals plain decoding on it")
    return Outcome(True, "prompt-cache files work with a draft model (its cache rebuilt from the file's tokens)",
                   details)

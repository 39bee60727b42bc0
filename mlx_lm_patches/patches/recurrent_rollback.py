"""Speculative decoding with hybrid models: recurrent caches go back exactly, or refuse.

Bug
    ``ArraysCache`` (gated-delta, Mamba, short-conv, RG-LRU, RWKV ... states) has no ``trim``,
    but mlx-lm's speculative loop trims the main model's cache after every rejected draft
    token: the state keeps the rejected tokens (silently wrong), or newer releases refuse
    ("requires a trimmable prompt cache"). A full sliding window (``RotatingKVCache``) cannot
    go back either, and the loop trims nothing there: K-EXAONE, MiMo-V2-Flash, Step-3.5,
    Gemma-style, RecurrentGemma, Baichuan-M1 ... speculate wrongly past the window. Resetting
    the state on trim (mlx-lm PR #1254) changes every later token.

Fix
    Inside ``speculative_generate_step`` only, each model with recurrent caches or sliding
    windows runs through a journal (``mechanisms/journal.py``): recurrent states (and window
    views) are kept by reference before each pass; a trim restores the newest kept state at or
    before the target, trims attention caches to the same position and re-runs the accepted
    tokens through the model's own forward (fused into the next verify pass). Gated-delta
    and Mamba-2 layers also keep their states after each token of a verify pass
    (``mechanisms/step_states.py``): their trims land on a kept state and re-run nothing. All layers move
    together or none does (``RollbackRefused``, never a reset). Kept states are bounded
    (``MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS``): the main model's drafts are capped before the first
    token, a draft's rollback never refuses. Details: docs/rollback.md.

Retire
    When every supported mlx-lm trims recurrent caches exactly (or refuses) on its own.

Metal
    The replay is the model's own forward (the kernels of a cold prefill). On GPU verify and
    replay passes run multi-token kernels where the greedy reference decodes one token at a
    time: expect ~1e-6 rounding differences, as for dense models. A gated-delta layer's
    recurrence in a verify pass is mlx-lm's kernel called once per token instead of once; a
    Mamba-2 state restored inside a pass is mlx-lm's ``ssm_update`` over the tokens kept.
"""

import sys

from mlx_lm_patches.engine.patching import property_over
from mlx_lm_patches.engine.contract import Outcome

CACHE = "mlx_lm.models.cache"
GENERATE = "mlx_lm.generate"
CAPPED = "num_draft_tokens settings already reported as capped"



def _is_trimmable(self):
    from mlx_lm_patches.mechanisms.journal import journal_of_cache

    return journal_of_cache(self) is not None


def _window_trimmable(wrapped, instance, args, kwargs):
    """A sliding window whose cache list is journaled goes back through the journal."""
    from mlx_lm_patches.mechanisms.journal import journal_of_cache

    return journal_of_cache(instance) is not None or wrapped(*args, **kwargs)


def _trim(self, n):
    """A recurrent layer cannot go back alone: a cache list goes back as a unit through
    ``trim_prompt_cache``. Alone, trimming is refused (0) - never a reset."""
    return 0


def _plus_journal(cache, nbytes):
    from mlx_lm_patches.mechanisms.journal import journal_of_cache

    journal = journal_of_cache(cache)
    return nbytes + (journal.retained_nbytes(cache) if journal is not None else 0)


def _trim_prompt_cache(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.journal import journal_of
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    cache, n = bound.arguments["cache"], bound.arguments["num_tokens"]
    journal = journal_of(cache) if cache else None
    if journal is None:
        return wrapped(*args, **kwargs)
    return journal.trim(cache, n)


class _JournaledModel:
    """A model inside the speculative loop: its caches are journaled (see journal.py).
    ``caller_caches``: the caches, when they are the caller's prompt cache (see speculative.py).
    ``fuse``: accepted tokens a rollback went back over are re-run with the next pass - unless
    the draft reads this model's caches between the two (it says so: ``reads_main_model``; the
    MTP draft does not need it: it counts the tokens left to re-run as committed)."""

    def __init__(self, model, caches, window, supplied=False, fuse=True, draft=False):
        from mlx_lm_patches.mechanisms.journal import Journal
        from mlx_lm_patches.mechanisms.caches import kept_caches

        self._model = model
        self._caches = caches
        self.caller_caches = caches if supplied else None
        # The main model goes back exactly or refuses; a draft only decides what is proposed (the
        # main model verifies every token), so its journal never refuses (journal.py, ``resync``).
        self.journal = (Journal(model, caches, window, strict=not draft, fuse=fuse, resync=draft)
                        if kept_caches(caches) else None)

    def make_cache(self):
        return self._caches

    def __call__(self, inputs, cache=None, **kwargs):
        if self.journal is not None and cache is not None and self.journal.covers(cache):
            return self.journal.forward(inputs, cache, **kwargs)
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _longest_round(num_draft, max_tokens) -> int:
    """The most draft tokens mlx-lm's loop puts in one round: ``min(max_tokens - generated,
    num_draft_tokens)``, so never more than ``max_tokens`` (when that is not negative)."""
    return num_draft if max_tokens is None or max_tokens < 0 else min(num_draft, max_tokens)


def _within_budget(num_draft, longest, memo):
    """``num_draft`` capped so that a main model's rollback stays within the kept states
    (``journal.draft_budget``), one warning per process and setting; ``longest``: the longest
    round asked for (:func:`_longest_round`); ``memo``: the patcher's (the settings reported)."""
    from mlx_lm_patches.mechanisms.journal import draft_budget

    return draft_budget(num_draft, longest, memo.setdefault(CAPPED, set()))


def _speculative_with_rollback(memo, wrapped, instance, args, kwargs):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.caches import kept_caches
    from mlx_lm_patches.mechanisms.speculative import caller_parts
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    model, draft_model = bound.arguments["model"], bound.arguments["draft_model"]
    parts = caller_parts(model, draft_model, bound.arguments.get("prompt_cache"))
    supplied = parts is not None
    main, draft = parts if supplied else (make_prompt_cache(model), make_prompt_cache(draft_model))
    if not (kept_caches(main) or kept_caches(draft)):
        return wrapped(*args, **kwargs)
    num_draft = int(bound.arguments.get("num_draft_tokens") or 0)
    max_tokens = bound.arguments.get("max_tokens")
    if kept_caches(main):
        num_draft = _within_budget(num_draft, _longest_round(num_draft, max_tokens), memo)
        bound.arguments["num_draft_tokens"] = num_draft
    longest = _longest_round(num_draft, max_tokens)
    window = longest + 1 if longest > 0 else 0
    fuse = not getattr(draft_model, "reads_main_model", False)
    views = (_JournaledModel(model, main, window, supplied, fuse=fuse),
             _JournaledModel(draft_model, draft, window, supplied, draft=True))
    bound.arguments.update(model=views[0], draft_model=views[1], prompt_cache=None)
    return _detach_when_done(wrapped(*bound.args, **bound.kwargs), views)


def _detach_when_done(steps, views):
    try:
        yield from steps
    finally:
        steps.close()
        for view in views:
            if view.journal is not None:
                view.journal.detach()


def probe():
    import mlx.core as mx

    cache = sys.modules[CACHE].ArraysCache(1)
    cache[0] = mx.ones((1, 2))
    if not cache.is_trimmable():
        return "ArraysCache is not trimmable: hybrid speculative decoding is refused or silently wrong"
    state = cache[0]
    if cache.trim(1) and (cache[0] is None or not mx.array_equal(cache[0], state).item()):
        return "ArraysCache.trim resets the recurrent state (inexact)"
    return None


def apply(p):
    arrays_cache = p.module(CACHE).ArraysCache
    p.set(f"{CACHE}:ArraysCache.is_trimmable", _is_trimmable)
    p.set(f"{CACHE}:ArraysCache.trim", _trim)
    current_nbytes = vars(arrays_cache).get("nbytes")
    if isinstance(current_nbytes, property):
        p.set(f"{CACHE}:ArraysCache.nbytes", property_over(current_nbytes, _plus_journal))
    p.wrap(f"{CACHE}:trim_prompt_cache", _trim_prompt_cache)
    p.wrap(f"{CACHE}:RotatingKVCache.is_trimmable", _window_trimmable)
    # 0.32.x generate.py imports trim_prompt_cache by name; older releases call cache.trim_prompt_cache.
    if "trim_prompt_cache" in vars(sys.modules.get(GENERATE) or object):
        p.wrap(f"{GENERATE}:trim_prompt_cache", _trim_prompt_cache)
    memo = p.memo  # not a module global: revert clears it, status lists it

    def speculative_generate_step(wrapped, instance, args, kwargs):
        return _speculative_with_rollback(memo, wrapped, instance, args, kwargs)

    p.wrap(f"{GENERATE}:speculative_generate_step", speculative_generate_step)


def scenario():
    """Hybrid main models speculating with a rejecting hybrid draft and a dense draft; a
    sliding-window model past its window; a dense main model with a hybrid draft asked for
    more draft tokens than the kept states allow (the draft re-synchronises, never refuses)."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    details = []
    for model_type in [t for t in ("qwen3_next", "lfm2", "mamba2") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        prompt = prompt_tokens(13, seed=3)
        reference = greedy(model, prompt, max_tokens=10)
        for label, draft in (
            ("rejecting hybrid draft", build_tiny_model(model_type, seed=7)),
            ("dense draft", build_tiny_model("llama", seed=2)),
        ):
            try:
                got = speculative_greedy(model, draft, prompt, max_tokens=10, num_draft_tokens=3)
            except Exception as exc:
                return Outcome.failure(f"{model_type} with a {label}", exc)
            problem = reference.compare(got)
            if problem:
                return Outcome.failure(f"{model_type} with a {label}: {problem}")
            details.append(f"{model_type}, {label}: equal to greedy decoding")
    problem = _past_a_window(details) or _draft_beyond_the_budget(details)
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, "hybrid and sliding-window speculative decoding exact (rejected drafts rolled back)",
                   details)


def _past_a_window(details):
    """A sliding-window model (exaone_moe, window 6) speculating past its window with a dense
    draft; what went wrong, or None (the detail is added)."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import _module_exists, build_tiny_model

    if not _module_exists("exaone_moe"):
        return None
    model = build_tiny_model("exaone_moe", seed=1, overrides={"sliding_window": 6})
    prompt = prompt_tokens(13, seed=3)
    try:
        got = speculative_greedy(model, build_tiny_model("llama", seed=2), prompt, max_tokens=10, num_draft_tokens=3)
    except Exception as exc:
        return f"exaone_moe (window 6) with a dense draft: {type(exc).__name__}: {exc}"
    problem = greedy(model, prompt, max_tokens=10).compare(got)
    if problem:
        return f"exaone_moe past its sliding window (6) with a dense draft: {problem}"
    details.append("exaone_moe past its sliding window (6), dense draft: equal to greedy decoding")
    return None


def _draft_beyond_the_budget(details):
    """A dense main model with a hybrid draft asked for 40 draft tokens (more than the default
    32 kept states allow a rollback of): the draft re-synchronises, never refuses - the main
    model's greedy tokens, as stock mlx-lm gives them. Three rounds (the first 3 tokens) show
    it (rounds of 40 forced: adaptive drafting would draft one); what went wrong, or None (the
    detail is added)."""
    import itertools

    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded, prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model
    from mlx_lm_patches.mechanisms.adaptive import forced

    model, draft = build_tiny_model("llama", seed=1), build_tiny_model("qwen3_next", seed=7)
    prompt = prompt_tokens(13, seed=3)
    steps = None
    try:
        steps = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=40, max_tokens=40)
        with forced([40]):
            first = list(itertools.islice(steps, 3))
    except Exception as exc:
        return f"dense main model, hybrid draft, num_draft_tokens=40: {type(exc).__name__}: {exc}"
    finally:
        if steps is not None:
            steps.close()
    problem = greedy(model, prompt, max_tokens=3).compare(
        Decoded([int(t) for t, _, _ in first], [lp for _, lp, _ in first]))
    if problem:
        return f"dense main model, hybrid draft, num_draft_tokens=40: {problem}"
    details.append("dense main model, hybrid draft, num_draft_tokens=40 (over the kept states): "
                   "equal to greedy decoding")
    return None

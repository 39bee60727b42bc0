"""Shared by the speculative-decoding patches: splitting a supplied prompt cache between the main
and the draft model, and a stand-in that hands mlx-lm's own speculative loop given caches.

mlx-lm's ``speculative_generate_step`` builds its caches with ``make_prompt_cache(model)`` when
no ``prompt_cache`` is passed, and ``make_prompt_cache`` calls ``model.make_cache()``. So passing
``prompt_cache=None`` and a stand-in whose ``make_cache()`` returns the caches we chose runs the
stock loop, unchanged, on those caches.

A stand-in that hands the loop the *caller's* caches says so in ``caller_caches`` (``None`` for
caches the loop may discard), so a wrapper further in still knows the caches are the caller's
(:func:`caller_parts`): several patches wrap ``speculative_generate_step``, in any order.
"""


def cache_count(model) -> int:
    """How many prompt-cache entries ``make_prompt_cache(model)`` gives this model."""
    from mlx_lm.models.cache import make_prompt_cache

    return len(make_prompt_cache(model))


def split_prompt_cache(model, draft_model, prompt_cache):
    """``(main, draft)`` parts of a prompt cache built as
    ``make_prompt_cache(model) + make_prompt_cache(draft_model)``; a clear error otherwise."""
    n_main, n_draft = cache_count(model), cache_count(draft_model)
    if len(prompt_cache) != n_main + n_draft:
        raise ValueError(
            f"prompt_cache has {len(prompt_cache)} entries, but speculative decoding expects "
            f"make_prompt_cache(model) + make_prompt_cache(draft_model): {n_main} + {n_draft}"
        )
    return list(prompt_cache[:n_main]), list(prompt_cache[n_main:])


def caller_parts(model, draft_model, prompt_cache):
    """The caller's prompt cache as ``(main, draft)`` lists: split from ``prompt_cache``, or
    the caches that stand-ins for both models carry as ``caller_caches`` when a wrapper further
    out already replaced ``prompt_cache`` by stand-ins. ``None`` when the loop makes its own
    caches (nobody can see them afterwards). A malformed ``prompt_cache`` raises ``ValueError``."""
    if prompt_cache is not None:
        return split_prompt_cache(model, draft_model, prompt_cache)
    main = getattr(model, "caller_caches", None)
    draft = getattr(draft_model, "caller_caches", None)
    if main is None or draft is None:
        return None
    return list(main), list(draft)


class ModelWithCaches:
    """Stands in for ``model``: ``make_cache()`` returns ``caches``; calls and every other
    attribute are the model's own. ``supplied``: the caches are the caller's prompt cache
    (kept as ``caller_caches``)."""

    def __init__(self, model, caches, supplied=True):
        self._model = model
        self._caches = caches
        self.caller_caches = caches if supplied else None

    def make_cache(self):
        return self._caches

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __repr__(self):
        return f"<{type(self).__name__} of {type(self._model).__name__}>"

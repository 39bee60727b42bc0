"""Speculative decoding with ``max_kv_size`` windows follows the plain path; with ``kv_bits`` it refuses.

Bug
    Past the window, a ``RotatingKVCache(max_size, keep=4)`` (what ``max_kv_size`` builds) gives
    a token another context in a pass of several tokens (masked by distance) than in a pass of
    one (the ``keep`` first positions and the last ``max_size - keep``): speculative decoding,
    which verifies several tokens per pass, gives other tokens than ``generate_step`` with the
    same caches (dense models too), and ``stream_generate`` drops ``max_kv_size`` when it
    speculates. With ``kv_bits`` the loop quantizes after a verify pass and may trim back over
    the conversion: other log-probabilities, or a refusal after tokens were yielded.

Fix
    When the main model's supplied caches hold a window with ``keep > 0``, the main model runs
    behind a stand-in that shapes its passes as ``generate_step``'s (its prefill chunks, then
    each position with the mask a single-token step gives it; one model call per verify pass as
    before); rollbacks go through ``recurrent-rollback``'s journal. ``stream_generate`` with
    ``max_kv_size`` hands the loop the caches ``generate_step`` builds for it. With ``kv_bits``,
    where a cache could reach ``quantized_kv_start`` in this generation, the generator raises
    ``ValueError`` before its first token. Details: docs/cache-options.md.

Retire
    When mlx-lm's windows mask a multi-token pass as its single-token steps see it, and its
    speculative loop quantizes at the plain path's step (or refuses ``kv_bits``).
"""

import contextvars
import sys

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms.calls import bind_arguments, signature_of

CACHE = "mlx_lm.models.cache"
GENERATE = "mlx_lm.generate"

# per call, in a context variable (a thread-local would be shared by an asyncio server's tasks):
_WINDOWS = contextvars.ContextVar("mlx_lm_patches_single_step_windows", default=None)  # ids of the
# windows whose next multi-token mask is a single step's

KV_BITS_REFUSAL = (
    "speculative decoding with kv_bits is refused: plain decoding quantizes the cache right "
    "after the step that passes quantized_kv_start, and a verify pass of several tokens cannot "
    "reproduce that step exactly; decode without draft_model, or without kv_bits"
)


def single_step_mask(cache, n):
    """The mask of a pass of ``n`` tokens through window ``cache`` (taken before the pass) in
    which each token sees what a single-token step at its position sees; ``None`` where the
    layout after the pass is not the one this assumes (mlx-lm's own mask is used then)."""
    import mlx.core as mx

    offset, size, keep = cache.offset, cache.max_size, cache.keep
    if cache.keys is None:
        held = 0
    elif cache._idx == cache.keys.shape[2] or cache._idx < offset:
        held = cache.keys.shape[2]
    else:
        held = cache._idx
    trimmed = held >= size
    if not trimmed and held != offset:
        return None
    length = min(held, size - 1) + n
    start = offset + n - length  # position of the first key after the kept ones
    positions = [j if (trimmed and j < keep) or not trimmed else start + j for j in range(length)]
    pos = mx.array(positions)[None, :]
    query = (offset + mx.arange(n))[:, None]
    return (pos <= query) & ((pos < keep) | (pos > query - (size - keep)))


def _make_mask(wrapped, instance, args, kwargs):
    active = _WINDOWS.get()
    if active and id(instance) in active:
        bound = bind_arguments(wrapped, args, kwargs).arguments
        n, window = bound.get("N"), bound.get("window_size")
        if isinstance(n, int) and n > 1 and window in (None, instance.max_size):
            mask = single_step_mask(instance, n)
            if mask is not None:
                return mask
    return wrapped(*args, **kwargs)


class PlainPathModel:
    """The main model inside the speculative loop, its passes shaped as ``generate_step``'s
    (see the module docstring). ``windows``: its caches' windows with ``keep > 0``."""

    def __init__(self, model, windows, prompt_length, chunk):
        self._model = model
        self._windows = windows
        self._chunk = max(int(chunk), 1)
        self._start = windows[0].offset
        self._prefill_end = self._start + max(int(prompt_length) - 1, 0)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __repr__(self):
        return f"<{type(self).__name__} of {type(self._model).__name__}>"

    def _pieces(self, first, last):
        """``(start, end, single)`` spans of positions ``first``..``last`` - 1."""
        pieces, pos = [], first
        while pos < min(last, self._prefill_end):
            boundary = self._start + ((pos - self._start) // self._chunk + 1) * self._chunk
            end = min(boundary, self._prefill_end, last)
            pieces.append((pos, end, False))
            pos = end
        if pos < last:
            pieces.append((pos, last, True))
        return pieces

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        from mlx_lm_patches.mechanisms.caches import flat_caches

        window = self._windows[0]
        ours = cache is not None and any(c is window for c in flat_caches(cache))
        if kwargs or not ours or not isinstance(inputs, mx.array) or inputs.ndim != 2:
            return self._model(inputs, cache=cache, **kwargs)
        first = window.offset
        outputs = []
        for start, end, single in self._pieces(first, first + inputs.shape[1]):
            part = inputs[:, start - first:end - first]
            if single:
                token = _WINDOWS.set({id(w) for w in self._windows})
                try:
                    outputs.append(self._model(part, cache=cache))
                finally:
                    _WINDOWS.reset(token)
            else:
                outputs.append(self._model(part, cache=cache))
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)


def _refused(exc):
    raise exc
    yield  # a generator: the refusal comes from the first next(), before any token


def _may_quantize(wrapped, arguments) -> bool:
    """Whether a cache could reach ``quantized_kv_start`` in this generation (a verify pass
    runs up to ``num_draft_tokens`` past the tokens kept). Below it nothing converts, the
    loop is the plain path's and stock's answer is exact: it runs as it is."""
    from mlx_lm_patches.mechanisms.caches import flat_caches, int_offset

    defaults = {k: p.default for k, p in signature_of(wrapped).parameters.items()}
    get = lambda name: arguments.get(name, defaults.get(name))  # noqa: E731
    max_tokens = get("max_tokens")
    if max_tokens is None or max_tokens < 0:
        return True
    held = max((int_offset(c) or 0 for c in flat_caches(arguments.get("prompt_cache") or [])), default=0)
    reach = held + len(arguments["prompt"]) + max_tokens + (get("num_draft_tokens") or 0)
    return reach >= get("quantized_kv_start")


def _given(wrapped, args, kwargs, name) -> bool:
    try:
        return name in signature_of(wrapped).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return False


def _speculative(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.caches import flat_caches
    from mlx_lm_patches.mechanisms.speculative import caller_parts

    bound = bind_arguments(wrapped, args, kwargs)
    arguments = bound.arguments
    if arguments.get("kv_bits") is not None and _may_quantize(wrapped, arguments):
        return _refused(ValueError(KV_BITS_REFUSAL))
    parts = caller_parts(arguments["model"], arguments["draft_model"], arguments.get("prompt_cache"))
    rotating = sys.modules[CACHE].RotatingKVCache
    windows = [c for c in flat_caches(parts[0]) if isinstance(c, rotating) and c.keep > 0] if parts else []
    if not windows:
        return wrapped(*args, **kwargs)
    if _given(wrapped, args, kwargs, "prefill_step_size"):
        chunk = arguments["prefill_step_size"]
    else:
        plain = signature_of(sys.modules[GENERATE].generate_step).parameters["prefill_step_size"]
        chunk = plain.default
    arguments["prefill_step_size"] = chunk
    arguments["model"] = PlainPathModel(arguments["model"], windows, len(arguments["prompt"]), chunk)
    return wrapped(*bound.args, **bound.kwargs)


def _stream_generate(wrapped, instance, args, kwargs):
    """``stream_generate(..., draft_model=D, max_kv_size=W)`` drops ``max_kv_size`` before the
    speculative loop: the loop gets the caches ``generate_step`` would build for it instead."""
    from mlx_lm.models.cache import make_prompt_cache

    bound = bind_arguments(wrapped, args, kwargs)
    extra = bound.arguments.get("kwargs", {})
    draft = bound.arguments.get("draft_model", extra.get("draft_model"))
    window = extra.get("max_kv_size")
    if draft is None or window is None or extra.get("prompt_cache") is not None:
        return wrapped(*args, **kwargs)
    model = bound.arguments["model"]
    extra["prompt_cache"] = make_prompt_cache(model, max_kv_size=window) + make_prompt_cache(draft, max_kv_size=window)
    return wrapped(*bound.args, **bound.kwargs)


def probe():
    import mlx.core as mx

    rotating = sys.modules[CACHE].RotatingKVCache
    cache = rotating(max_size=4, keep=2)
    for _ in range(6):
        cache.update_and_fetch(mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)))
    mask = cache.make_mask(2, return_array=True)
    # The second token (position 7) of a 2-token pass: a single step there sees positions 0, 1, 6, 7.
    if isinstance(mask, mx.array) and mask.shape == (2, 5) and mask[1].tolist() != [True, True, False, True, True]:
        return ("RotatingKVCache(keep=2) masks a multi-token pass by distance: past the window it "
                "differs from single-token steps, so speculative decoding differs from generate_step")
    return None


def apply(p):
    p.wrap(f"{CACHE}:RotatingKVCache.make_mask", _make_mask)
    p.wrap(f"{GENERATE}:speculative_generate_step", _speculative)
    p.wrap(f"{GENERATE}:stream_generate", _stream_generate)


def scenario():
    """Speculation through ``max_kv_size`` windows past the window (hybrid and dense main
    models, dense draft) equals ``generate_step`` through the same kind of caches; with
    ``kv_bits`` it refuses before the first token where the cache would convert, and runs
    exactly below ``quantized_kv_start``."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    window, details = 24, []
    draft = build_tiny_model("qwen3", seed=7)
    for model_type in ["qwen3"] + [t for t in ("qwen3_next", "nemotron_h") if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        prompt = prompt_tokens(30, seed=3)

        def caches():
            main = make_prompt_cache(model, max_kv_size=window)
            if not any(getattr(c, "keep", 0) for c in main):
                main = [sys.modules[CACHE].RotatingKVCache(max_size=window, keep=4)
                        if type(c) is sys.modules[CACHE].KVCache else c for c in main]
            return main

        reference = greedy(model, prompt, max_tokens=12, prompt_cache=caches())
        try:
            got = speculative_greedy(model, draft, prompt, max_tokens=12, num_draft_tokens=3,
                                     prompt_cache=caches() + make_prompt_cache(draft, max_kv_size=window))
        except Exception as exc:
            return Outcome.failure(f"{model_type} speculating through a window of {window}", exc)
        problem = reference.compare(got)
        if problem:
            return Outcome.failure(f"{model_type} speculating through a window of {window}: {problem}")
        details.append(f"{model_type}: window {window}, 30-token prompt: equal to generate_step")
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    model, quantized = build_tiny_model("qwen3", seed=1), dict(kv_bits=4, kv_group_size=16)
    steps = speculative_generate_step(mx.array(prompt_tokens(8)), model, draft, max_tokens=4,
                                      quantized_kv_start=0, **quantized)
    try:
        next(steps)
    except Exception as exc:
        if KV_BITS_REFUSAL not in str(exc):
            return Outcome.failure("speculation with kv_bits", exc)
        details.append("kv_bits from token 0: refused before the first token")
    else:
        return Outcome.failure("speculation with kv_bits yielded a token instead of refusing")
    # quantized_kv_start beyond this generation (mlx-lm's default: 5000 on 0.32.2, 0 on 0.30.5):
    # nothing converts
    quantized["quantized_kv_start"] = 5000
    try:
        got = speculative_greedy(model, draft, prompt_tokens(8), max_tokens=4, **quantized)
    except Exception as exc:
        return Outcome.failure("speculation with kv_bits below quantized_kv_start", exc)
    problem = greedy(model, prompt_tokens(8), max_tokens=4, **quantized).compare(got)
    if problem:
        return Outcome.failure(f"speculation with kv_bits below quantized_kv_start: {problem}")
    details.append("kv_bits below quantized_kv_start: runs, equal to generate_step")
    return Outcome(True, "speculation through max_kv_size windows exact; kv_bits refused up front where "
                   "the cache would convert", details)

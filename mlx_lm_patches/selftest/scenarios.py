"""Building blocks for patch scenarios: run what a user runs, compare with the reference path.

The reference is single-sequence greedy decoding with a cold prefill through mlx-lm's own
``generate_step``. "Exact" means the same greedy tokens and log-probabilities within
:data:`~mlx_lm_patches.mechanisms.probing.decoded.LOGPROB_TOLERANCE` (CPU, float32), as
:class:`~mlx_lm_patches.mechanisms.probing.decoded.Decoded` compares them.
"""

from typing import Optional

from mlx_lm_patches.engine.contract import Outcome  # noqa: F401  (scenario helpers return it)
from mlx_lm_patches.mechanisms.probing.decoded import Decoded, prompt_tokens


def greedy(model, prompt, max_tokens=8, prompt_cache=None, **kwargs) -> Decoded:
    """Greedy decoding through mlx-lm's ``generate_step`` (the reference path); ``kwargs`` go
    to ``generate_step`` (e.g. ``logits_processors``)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=prompt_cache, **kwargs
    )
    for token, lp in steps:
        tokens.append(int(token))
        logprobs.append(lp)
    mx.eval(logprobs)
    return Decoded(tokens, logprobs)


def speculative_greedy(model, draft_model, prompt, max_tokens=8, num_draft_tokens=2,
                       prompt_cache=None, **kwargs) -> Decoded:
    """Greedy speculative decoding through mlx-lm's ``speculative_generate_step``; the tokens
    and log-probabilities it yields, comparable with :func:`greedy`."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    tokens, logprobs = [], []
    steps = speculative_generate_step(
        mx.array(prompt), model, draft_model, num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens, prompt_cache=prompt_cache, **kwargs
    )
    for token, lp, _from_draft in steps:
        tokens.append(int(token))
        logprobs.append(lp)
    mx.eval(logprobs)
    return Decoded(tokens, logprobs)


def continue_after_speculation(model, draft_model, prompt=None, follow_up=None, *,
                               num_draft_tokens=3, max_tokens=8, stop_after=None,
                               continue_tokens=4) -> Optional[str]:
    """What ``mlx_lm.server`` with a draft model does over two turns: decode ``prompt``
    speculatively into a supplied prompt cache (``make_prompt_cache(model) +
    make_prompt_cache(draft_model)``) up to ``max_tokens``, or close the generator after
    ``stop_after`` tokens (a stop token); then continue each model's part of that cache with
    ``follow_up`` through ``generate_step``. ``None`` if both continuations equal greedy decoding
    of prompt + generated tokens + ``follow_up`` with a cold prefill, else what differs."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    prompt = list(prompt or prompt_tokens(14, seed=2))
    follow_up = list(follow_up or prompt_tokens(5, seed=9))
    main_count = len(make_prompt_cache(model))
    cache = make_prompt_cache(model) + make_prompt_cache(draft_model)
    steps = speculative_generate_step(mx.array(prompt), model, draft_model, max_tokens=max_tokens,
                                      num_draft_tokens=num_draft_tokens, prompt_cache=cache)
    generated = []
    for token, _logprobs, _from_draft in steps:
        generated.append(int(token))
        if stop_after is not None and len(generated) >= stop_after:
            break
    steps.close()
    history = prompt + generated + follow_up
    for role, part_model, part in (("main", model, cache[:main_count]),
                                   ("draft", draft_model, cache[main_count:])):
        reference = greedy(part_model, history, max_tokens=continue_tokens)
        got = greedy(part_model, follow_up, max_tokens=continue_tokens, prompt_cache=part)
        problem = reference.compare(got)
        if problem:
            return (f"the {role} model continuing from its part of the cache "
                    f"({len(generated)} tokens generated): {problem}")
    return None


def prefill(model, tokens, cache):
    """Run ``tokens`` through ``model`` into ``cache`` (one forward pass), evaluated."""
    import mlx.core as mx

    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])


def round_trip_prompt_cache(model, prompt, make_cache=None, max_tokens=6) -> Optional[str]:
    """Prefill all but the last prompt token, save the prompt cache to a file, load it back and
    decode greedily from the last token. ``None`` if that equals the cold reference exactly,
    else what differs. ``make_cache(model)`` builds the cache (default: mlx-lm's own)."""
    import os
    import tempfile

    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    reference = greedy(model, prompt, max_tokens=max_tokens)
    cache = (make_cache or make_prompt_cache)(model)
    prefill(model, prompt[:-1], cache)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompt_cache.safetensors")
        save_prompt_cache(path, cache)
        loaded = load_prompt_cache(path)
    kinds = [type(c).__name__ for c in loaded], [type(c).__name__ for c in cache]
    if kinds[0] != kinds[1]:
        return f"loaded cache classes {kinds[0]} differ from saved {kinds[1]}"
    return reference.compare(greedy(model, prompt[-1:], max_tokens=max_tokens, prompt_cache=loaded))


def batched_greedy(model, prompts, max_tokens=8, caches=None, late_prompts=(), late_after=2):
    """Greedy decoding of ``prompts`` together through mlx-lm's ``BatchGenerator`` (every
    supported release's API). ``late_prompts`` are inserted after ``late_after`` decode steps,
    into a generator that is already decoding. ``caches``: pre-filled per-prompt caches.
    Returns one :class:`Decoded` per prompt, in order (``prompts`` then ``late_prompts``)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens)
    step = getattr(gen, "next_generated", None) or gen.next
    uids = list(gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts), caches=caches))
    results = {uid: Decoded([], []) for uid in uids}
    late, steps = list(late_prompts), 0
    while True:
        responses = step()
        for r in responses:
            results[r.uid].tokens.append(int(r.token))
            results[r.uid].logprobs.append(r.logprobs)
        steps += 1
        if late and steps >= late_after:
            new = list(gen.insert([list(p) for p in late], [max_tokens] * len(late)))
            results.update({uid: Decoded([], []) for uid in new})
            uids += new
            late = []
            continue
        if not responses:
            break
    if hasattr(gen, "close"):
        gen.close()
    for decoded in results.values():
        mx.eval(decoded.logprobs)
    return [results[uid] for uid in uids]


def staggered_greedy(model, prompts, insert_at, max_tokens=8, prefill_step_size=16):
    """Greedy decoding through ``BatchGenerator.next`` with prompt ``i`` inserted before call
    ``insert_at[i]`` (call 0: before the first), prompts prefilled ``prefill_step_size`` tokens
    at a time: from 0.31.2 one ``next()`` processes one chunk, so a prompt can arrive while
    another is still in its prompt. Returns one :class:`Decoded` per prompt, in order."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=prefill_step_size)
    results, order, calls = {}, [], 0
    while len(order) < len(prompts) or any(len(results[u].tokens) < max_tokens for u in order):
        for i in range(len(prompts)):
            if insert_at[i] == calls:
                (uid,) = gen.insert([list(prompts[i])], [max_tokens])
                results[uid] = Decoded([], [])
                order.append(uid)
        responses = gen.next()
        if isinstance(responses, tuple):  # >= 0.31.2: (prompt responses, generated tokens)
            responses = responses[1]
        for r in responses:
            results[r.uid].tokens.append(int(r.token))
            results[r.uid].logprobs.append(r.logprobs)
        calls += 1
        if calls > 100 * (len(prompts) + max_tokens + sum(len(p) for p in prompts)):
            raise RuntimeError("BatchGenerator stopped producing tokens")
    if hasattr(gen, "close"):
        gen.close()
    for decoded in results.values():
        mx.eval(decoded.logprobs)
    return [results[uid] for uid in order]


def fresh_rows_beside_history(model, model_type="recurrent_gemma") -> Optional[str]:
    """New prompts batched beside rows that already hold tokens: two (one of a single token)
    inserted while another is still in its prompt, one batched with a prompt continuing a
    pre-filled cache (same length, so no per-row prefill is needed for padding), and a one-token
    prompt beside a cached prompt with one token left. ``None`` if each equals decoding it
    alone, else what went wrong."""
    from mlx_lm.models.cache import make_prompt_cache

    long, short, one = prompt_tokens(40, seed=40), prompt_tokens(9, seed=9), prompt_tokens(1, seed=3)
    cached = prompt_tokens(15, seed=15)
    caches, rest = split_prefilled(model, [cached, cached], (6, 14))
    situations = {
        "inserted while another prompt is prefilled": (
            lambda: staggered_greedy(model, [long, short, one], (0, 1, 1)),
            [greedy(model, long), greedy(model, short), greedy(model, one)],
        ),
        "batched with a prompt continuing its cache": (
            lambda: batched_greedy(model, [rest[0], short], caches=[caches[0], make_prompt_cache(model)]),
            [greedy(model, cached), greedy(model, short)],
        ),
        # both rows' first pass is the generation batch's first step, the new one first
        "a one-token prompt batched with a prompt whose cache holds all but its last token": (
            lambda: batched_greedy(model, [one, rest[1]], caches=[make_prompt_cache(model), caches[1]]),
            [greedy(model, one), greedy(model, cached)],
        ),
    }
    return first_problem(model_type, situations)


def short_prompts_beside_longer(model, model_type) -> Optional[str]:
    """Prompts of 1 and 2 tokens batched beside a longer one: together, inserted while the batch
    decodes, inserted while a 40-token prompt is still prefilled, and prompt caches holding 5
    and 1 tokens continued beside a new 2-token prompt. ``None`` if each equals decoding it
    alone, else what went wrong."""
    from mlx_lm.models.cache import make_prompt_cache

    one, two, seven, long = (prompt_tokens(n, seed=n + 100) for n in (1, 2, 7, 40))
    caches, rest = split_prefilled(model, [seven, seven], (5, 1))
    situations = {
        "together": (lambda: batched_greedy(model, [one, two, seven]),
                     [greedy(model, p) for p in (one, two, seven)]),
        "inserted while decoding": (lambda: batched_greedy(model, [seven], late_prompts=[one, two]),
                                    [greedy(model, p) for p in (seven, one, two)]),
        "inserted while a prompt is prefilled": (lambda: staggered_greedy(model, [long, two, one], (0, 1, 1)),
                                                 [greedy(model, p) for p in (long, two, one)]),
        "continuing prompt caches of 5 and 1 tokens, beside a new prompt": (
            lambda: batched_greedy(model, [rest[0], rest[1], two], caches=caches + [make_prompt_cache(model)]),
            [greedy(model, p) for p in (seven, seven, two)]),
    }
    return first_problem(model_type, situations)


def round_trip_families(models, seed, summary) -> Outcome:
    """:func:`round_trip_prompt_cache` for each ``(model_type, model)`` in ``models``; the first
    problem fails the outcome, otherwise ``summary`` with one detail line per family."""
    details = []
    for model_type, model in models:
        what = f"{model_type}: decoding from a loaded prompt cache"
        try:
            problem = round_trip_prompt_cache(model, prompt_tokens(12, seed=seed))
        except Exception as exc:
            return Outcome.failure(what, exc)
        if problem:
            return Outcome.failure(f"{what}: {problem}")
        details.append(f"{model_type}: save/load/continue exact")
    if not details:
        return Outcome.failure("no tiny model of the kind this scenario needs is available")
    return Outcome(True, summary, details)


def split_prefilled(model, prompts, splits):
    """Per prompt, a prompt cache already holding its first ``k`` tokens (``k`` from ``splits``)
    and the tokens still to process: the "continue from pre-filled prompt caches" situation."""
    from mlx_lm.models.cache import make_prompt_cache

    caches, rest = [], []
    for prompt, k in zip(prompts, splits):
        cache = make_prompt_cache(model)
        prefill(model, prompt[:k], cache)
        caches.append(cache)
        rest.append(list(prompt[k:]))
    return caches, rest


def batching_situations(model, model_type) -> Optional[str]:
    """The three batched-generation situations (prompts of different lengths, a prompt inserted
    while the generator decodes, prompts continuing pre-filled caches), each compared with
    single-sequence greedy decoding. ``None`` if all are exact, else what went wrong."""
    prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13)]
    reference = [greedy(model, p) for p in prompts]
    caches, rest = split_prefilled(model, prompts, (3, 6, 4))
    situations = {
        "different lengths": (lambda: batched_greedy(model, prompts), reference),
        "inserted while decoding": (lambda: batched_greedy(model, prompts[:2], late_prompts=prompts[2:]), reference),
        "pre-filled prompt caches": (lambda: batched_greedy(model, rest, caches=caches), reference),
    }
    return first_problem(model_type, situations)


def first_problem(model_type, situations) -> Optional[str]:
    """Run each situation (``name -> (run, references)``; ``run()`` returns one :class:`Decoded`
    per reference) and say what first differs from its reference, or ``None``."""
    for name, (run, reference) in situations.items():
        try:
            got = run()
        except Exception as exc:
            return f"{model_type}, {name}: {type(exc).__name__}: {exc}"
        for i, (ref, decoded) in enumerate(zip(reference, got)):
            problem = ref.compare(decoded)
            if problem:
                return f"{model_type}, {name}, prompt {i}: {problem}"
    return None


def lru_prompt_cache_class():
    """mlx-lm's ``LRUPromptCache`` (``models/cache.py`` from 0.31.2, ``server.py`` before)."""
    import importlib

    cache_module = importlib.import_module("mlx_lm.models.cache")
    if hasattr(cache_module, "LRUPromptCache"):
        return cache_module.LRUPromptCache
    return importlib.import_module("mlx_lm.server").LRUPromptCache


def _two_requests(shared, tail):
    prefix = prompt_tokens(shared, seed=5)
    return prefix + prompt_tokens(tail[0], seed=6), prefix + prompt_tokens(tail[1], seed=8)


def prefix_reuse(model, shared=600, prefill_step_size=256, max_tokens=6, tail=(9, 7), batched=False):
    """What ``mlx_lm.server`` does for two requests sharing ``shared`` tokens: request A is
    decoded from an empty cache and stored in an ``LRUPromptCache`` (prompt + generated tokens,
    as the server stores it); request B (same prefix, another tail) fetches from the store and
    is decoded from what it gets - with ``generate_step`` (the server's single-sequence path)
    or, ``batched``, with ``BatchGenerator`` (its batched path). Returns ``(tokens reused,
    None or how B differs from its cold greedy decoding)``."""
    from mlx_lm.models.cache import make_prompt_cache

    store = lru_prompt_cache_class()()
    a, b = _two_requests(shared, tail)
    decode = _batched_one if batched else _single_one
    first, cache = decode(model, a, None, max_tokens, prefill_step_size)
    store.insert_cache("model", a + first.tokens, cache)
    fetched, rest = store.fetch_nearest_cache("model", b)
    reused = len(b) - len(rest)
    cold = greedy(model, b, max_tokens=max_tokens, prefill_step_size=prefill_step_size)
    if fetched is None:
        fetched = make_prompt_cache(model)
    warm, _ = decode(model, list(rest), (fetched, b[:reused]), max_tokens, prefill_step_size)
    return reused, cold.compare(warm)


def engine_prefill(model, tokens, cache, chunk=256):
    """What an engine does without mlx-lm's generate loop: the model called on chunks of
    ``tokens`` into ``cache``; the last chunk's logits."""
    import mlx.core as mx

    logits = None
    for start in range(0, len(tokens), chunk):
        logits = model(mx.array([list(tokens[start:start + chunk])]), cache=cache)
        mx.eval([c.state for c in cache])
    return logits


def engine_greedy(model, tokens, cache, max_tokens=4, chunk=256) -> Decoded:
    """An engine's own greedy loop from ``cache``: :func:`engine_prefill`, then one token at a
    time; comparable with :func:`greedy`."""
    import mlx.core as mx

    logits = engine_prefill(model, tokens, cache, chunk)
    out = Decoded([], [])
    for _ in range(max_tokens):
        last = logits[0, -1].astype(mx.float32)
        logprobs = last - mx.logsumexp(last, keepdims=True)
        token = int(mx.argmax(logprobs).item())
        out.tokens.append(token)
        out.logprobs.append(logprobs)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def engine_prefix_reuse(model, shared=600, chunk=256, max_tokens=4, tail=(9, 7)):
    """:func:`prefix_reuse` for an engine that prefills by calling the model itself: request A
    is prefilled in chunks and stored (prompt + generated tokens); request B fetches from the
    store and the engine continues from what it gets. ``(tokens reused, None or how B differs
    from cold greedy decoding through generate_step)``."""
    from mlx_lm.models.cache import make_prompt_cache

    store = lru_prompt_cache_class()()
    a, b = _two_requests(shared, tail)
    cache = make_prompt_cache(model)
    first = engine_greedy(model, a, cache, max_tokens=3, chunk=chunk)
    store.insert_cache("model", a + first.tokens, cache)
    fetched, rest = store.fetch_nearest_cache("model", b)
    warm = engine_greedy(model, list(rest), fetched if fetched is not None else make_prompt_cache(model),
                         max_tokens=max_tokens, chunk=chunk)
    return len(b) - len(rest), greedy(model, b, max_tokens=max_tokens).compare(warm)


def _single_one(model, prompt, start, max_tokens, prefill_step_size):
    from mlx_lm.models.cache import make_prompt_cache

    cache = start[0] if start else make_prompt_cache(model)
    return greedy(model, prompt, max_tokens=max_tokens, prompt_cache=cache,
                  prefill_step_size=prefill_step_size), cache


def _batched_one(model, prompt, start, max_tokens, prefill_step_size):
    """One request through ``BatchGenerator`` as the server inserts it (``start``: the fetched
    cache and the tokens it holds); its decoding and the cache it finishes with."""
    import inspect

    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=prefill_step_size)
    kwargs = {}
    if start is not None:
        kwargs["caches"] = [start[0]]
        if "all_tokens" in inspect.signature(gen.insert).parameters:
            kwargs["all_tokens"] = [list(start[1])]
    gen.insert([list(prompt)], [max_tokens], **kwargs)
    step = getattr(gen, "next_generated", None) or gen.next
    decoded, final = Decoded([], []), None
    while final is None:
        for r in step():
            decoded.tokens.append(int(r.token))
            decoded.logprobs.append(r.logprobs)
            if r.finish_reason is not None:
                final = r.prompt_cache() if callable(r.prompt_cache) else r.prompt_cache
    if hasattr(gen, "close"):
        gen.close()
    mx.eval(decoded.logprobs)
    return decoded, final

"""Speculative decoding chooses how many tokens to draft each round, so turning it on never loses.

Bug
    mlx-lm's ``speculative_generate_step`` (``stream_generate(draft_model=...)``,
    ``mlx_lm.generate --draft-model``, ``mlx_lm.server --draft-model``, MTP drafts) drafts
    ``num_draft_tokens`` tokens in every round whatever the draft's acceptance: with a draft
    that is rarely accepted, or one that costs nearly what the main model costs, or on a machine
    where a verify pass of several tokens is not much cheaper than that many steps (CPU, M1/M2),
    speculation runs at a fraction of plain decoding (0.2x measured on a hybrid with a draft
    never accepted). Nothing adapts; users pick ``--num-draft-tokens`` once.

Fix
    The innermost layer on ``speculative_generate_step`` runs mlx-lm's own loops in segments on
    the same caches: before each round a controller (``mechanisms/adaptive.py``) picks ``k`` in
    ``0..num_draft_tokens`` from the acceptance seen in this sequence and the round times
    measured in this run. Rounds of ``k >= 1`` run mlx-lm's speculative loop (closed at the end
    of a round when ``k`` changes: its own ``finally`` rewinds the caches); rounds of ``k = 0``
    run mlx-lm's own ``generate_step`` (plain decoding itself, pipelined; the token it sampled
    ahead ends the run and starts the next one), with a hybrid's rollback journal paused. A
    separate draft model catches up on the tokens it missed in chunked forward passes before
    its next draft (after a plain start, that is its prefill); an MTP draft follows the main
    model's recorded passes. Every token is verified by the main model or decoded plainly, so
    the output is unchanged whatever the schedule. A sequence starts from the costs and the
    acceptance the last one with the same model and draft measured (the first of a process
    measures them), so a draft that does not pay is not called again at every start.
    ``MLX_LM_PATCHES_ADAPTIVE_DRAFTING=0`` turns it off (``k`` fixed as in stock mlx-lm); with
    ``logits_processors`` or ``max_tokens < 0`` the loop also runs as it is (its history of
    tokens for processors does not survive a restart). The ranks of a distributed model
    (``mlx.launch``, ``--draft-model mtp``) must run the same passes: rank 0's controller
    decides and the others take its choice through a collective (every drafting round; every
    8th plain round).

Retire
    When mlx-lm's speculative loop adapts its draft length by itself.
"""

import contextlib
import sys
import time
from functools import partial

from mlx_lm_patches.engine.contract import Outcome, missing
from mlx_lm_patches.mechanisms.speculative import ModelWithCaches

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"
# the patch's memo: per (model, draft), what the last sequence measured (mechanisms/adaptive.py)
SEQUENCES = "the costs and acceptance of the last sequence per model and draft"
# set by mlx.launch (ring, jaccl) and MPI launchers in each rank's environment
LAUNCHED = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def enabled() -> bool:
    from mlx_lm_patches.engine import env

    return bool(env.setting(env.ADAPTIVE_DRAFTING))


class _Draft(ModelWithCaches):
    """The draft model for one segment: its first call is preceded by forward passes over what it
    does not hold yet, ``chunk`` tokens a pass as mlx-lm prefills: ``prompt`` (after a plain
    start: the prefill stock's loop would have begun with) and ``lag`` (decoded while no draft
    ran). ``catch_up_s`` times the lag's passes only: they are what plain rounds cost a draft
    (a long prompt's prefill, divided by the few plain rounds before it, would rule probing out)."""

    def __init__(self, model, caches, prompt, lag, chunk):
        super().__init__(model, caches, supplied=False)
        self.prompt = prompt
        self.lag = lag
        self.chunk = max(int(chunk or 0), 1)
        self.catch_up_s = 0.0

    def __call__(self, inputs, cache=None, **kwargs):
        if self.prompt or self.lag:
            prompt, lag, self.prompt, self.lag = self.prompt, self.lag, None, None
            self._feed(prompt, inputs.dtype, cache, kwargs)
            start = time.perf_counter()
            self._feed(lag, inputs.dtype, cache, kwargs)
            self.catch_up_s = time.perf_counter() - start if lag else 0.0
        return self._model(inputs, cache=cache, **kwargs)

    def _feed(self, tokens, dtype, cache, kwargs):
        import mlx.core as mx

        for at in range(0, len(tokens or ()), self.chunk):
            self._model(mx.array([tokens[at:at + self.chunk]], dtype), cache=cache, **kwargs)
            mx.eval([c.state for c in cache])


def forget_sequences():
    """Forget what earlier sequences measured: the next sequence starts as a process's first
    (tests; benchmarks timing first sequences). ``revert()`` forgets it too."""
    from mlx_lm_patches.engine import core

    memo = core.memo("adaptive-drafting")
    if memo is not None:
        memo.pop(SEQUENCES, None)


def _adaptive(memo, wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.adaptive import forced_schedule
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    bound = bind_arguments(wrapped, args, kwargs)
    arguments = bound.arguments
    most = int(arguments.get("num_draft_tokens") or 0)
    max_tokens = arguments.get("max_tokens", 256)
    schedule = forced_schedule()
    if (not enabled() and schedule is None) or most <= 0 or arguments.get("logits_processors") \
            or max_tokens is None or max_tokens < 0:
        return wrapped(*args, **kwargs)
    return _segments(wrapped, bound, most, max_tokens, schedule, _ranks(), memo.setdefault(SEQUENCES, {}))


def _ranks():
    """The distributed group this process runs a model in, with more than one rank, or None:
    its ranks must choose the same draft lengths."""
    import os

    from mlx_lm_patches.mechanisms.server_ranks import group

    if not any(os.environ.get(name) for name in LAUNCHED):
        return None  # not started by a distributed launcher: no group to ask (init() is not free)
    try:
        return group()
    except Exception:  # no usable backend: a single process
        return None


class _KeepsLastSample:
    """The sampler given to ``generate_step`` for plain stretches: the caller's (greedy when
    none), and it keeps what it was last given and gave, so the token ``generate_step`` has
    sampled one step ahead is not lost when the stretch ends."""

    def __init__(self, sampler):
        import mlx.core as mx

        self.sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))
        self.last = None

    def __call__(self, logprobs):
        token = self.sampler(logprobs)
        self.last = (token, logprobs)
        return token


PLAIN_OPTIONS = ("prefill_step_size", "kv_bits", "kv_group_size", "quantized_kv_start")


def _segments(wrapped, bound, most, max_tokens, schedule, ranks, remembered):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.engine.patching import beneath_layers
    from mlx_lm_patches.mechanisms.adaptive import Controller, RankZeroChooses, recall, remember
    from mlx_lm_patches.mechanisms.journal import journal_of

    arguments = bound.arguments
    model, draft_model = arguments["model"], arguments["draft_model"]
    prompt_cache = arguments.get("prompt_cache")
    if prompt_cache is not None:  # split as mlx-lm's loop splits it (speculative-cache-split is outside)
        main_caches = prompt_cache[: len(model.layers)]
        draft_caches = prompt_cache[len(model.layers):]
    else:
        main_caches, draft_caches = make_prompt_cache(model), make_prompt_cache(draft_model)
    # plain stretches: mlx-lm's own generate_step (its pipelined decoding), under the wrappers of
    # ours on it, which are for calls from outside (this call is inside a speculative one)
    plain_step = beneath_layers(sys.modules[GENERATE], "generate_step")
    plain_options = {name: arguments[name] for name in PLAIN_OPTIONS if name in arguments}
    follows = bool(getattr(draft_model, "follows_main_model", False))  # an MTP draft catches up itself
    # fresh caches and a separate draft model: the sequence starts with plain decoding (the
    # prompt through generate_step), the draft prefilled by its first catch-up; a supplied cache
    # (the outer wrappers hand it over as the stand-in's caller_caches) is prefilled by mlx-lm's
    # loop as in stock, where prefix reuse keeps its states
    supplied = prompt_cache is not None or getattr(model, "caller_caches", None) is not None
    plain_start = not supplied and not follows
    own = Controller(most, schedule, plain_start=plain_start, memory=recall(remembered, model, draft_model))
    controller = RankZeroChooses(own, ranks) if ranks is not None and schedule is None else own
    sequence = [int(t) for t in mx.array(arguments["prompt"]).reshape(-1).tolist()]
    prompt_length = len(sequence)
    draft_seen = 0 if plain_start else None  # positions of `sequence` the draft holds (None: the first segment's own count)
    produced = 0
    steps = None
    first_segment = True
    k = controller.choose(max_tokens)
    try:
        while produced < max_tokens:
            if k == 0:
                prompt = arguments["prompt"] if first_segment else mx.array(sequence[-1:], mx.uint32)
                first_segment = False
                before = len(sequence)
                k = yield from _plain_rounds(plain_step, prompt, model, main_caches, arguments.get("sampler"),
                                             plain_options, controller, sequence, max_tokens - produced)
                if len(sequence) == before:
                    return  # (generate_step ended: it only does at max_tokens)
                produced += len(sequence) - before
                continue
            unseen_prompt, lag = [], []
            if not first_segment and not follows and draft_seen is not None:
                unseen_prompt = sequence[draft_seen:prompt_length]  # after a plain start: the whole prompt
                lag = sequence[max(draft_seen, prompt_length):-1]
            draft = _Draft(draft_model, draft_caches, unseen_prompt, lag, arguments.get("prefill_step_size") or 2048)
            arguments.update(model=ModelWithCaches(model, main_caches, supplied=False), draft_model=draft, prompt_cache=None,
                             num_draft_tokens=k, max_tokens=max_tokens - produced)
            if not first_segment:
                arguments["prompt"] = mx.array(sequence[-1:], mx.uint32)
            steps = wrapped(*bound.args, **bound.kwargs)
            timed, first_round = not first_segment, True
            first_segment = False
            # rounds of this segment, while the controller keeps k
            while True:
                kept, spent, round_over = 0, 0.0, False
                while produced < max_tokens:
                    start = time.perf_counter()
                    item = next(steps, None)
                    spent += time.perf_counter() - start
                    if item is None:  # the loop ended (it never yields None)
                        break
                    produced += 1
                    sequence.append(int(item[0]))
                    yield item
                    if not item[2]:
                        round_over = True
                        break
                    kept += 1
                if not round_over:  # max_tokens reached, or the loop ended
                    return
                catch_up, draft.catch_up_s = draft.catch_up_s, 0.0
                controller.observe(k, kept, spent - catch_up if timed else None, catch_up, first=first_round)
                timed, first_round = True, False
                # the draft holds all but the main model's token (and, all accepted, the last draft)
                draft_seen = len(sequence) - 1 - (1 if kept == k else 0)
                if produced >= max_tokens:
                    return
                chosen = controller.choose(max_tokens - produced)
                if chosen != k:
                    break
            start = time.perf_counter()
            steps.close()  # mlx-lm's loop rewinds the caches as after any round
            steps = None
            if chosen == 0:
                # plain decoding next: a rejected round's re-run is done now, timed as its rollback
                journal = journal_of(main_caches)
                if journal is not None:
                    journal.flush()
                controller.rolled_back(time.perf_counter() - start)
            k = chosen
    finally:
        if steps is not None:
            steps.close()
        remember(remembered, model, draft_model, own)  # this machine's costs and the acceptance, for the next sequence


def _plain_rounds(plain_step, prompt, model, caches, sampler, options, controller, sequence, left):
    """Plain rounds through mlx-lm's own ``generate_step`` (pipelined), a token each, until the
    controller drafts again or ``left`` tokens are out; yields the tokens, appends them to
    ``sequence``; returns the controller's next draft length (0 when the tokens ran out). A
    hybrid's rollback journal is paused: nothing here is ever rolled back."""
    from mlx_lm_patches.mechanisms.journal import journal_of

    sampler = _KeepsLastSample(sampler)
    steps = plain_step(prompt, model, max_tokens=left, sampler=sampler, prompt_cache=caches, **options)
    journal = journal_of(caches)
    produced, chosen, timed = 0, 0, False
    try:
        with journal.paused() if journal is not None else contextlib.nullcontext():
            while chosen == 0:
                start = time.perf_counter()
                item = next(steps, None)
                spent = time.perf_counter() - start
                if item is None:
                    return 0
                produced += 1
                sequence.append(int(item[0]))
                yield item[0], item[1], False
                if produced >= left:
                    return 0
                # the first token's time holds the run's start (a step not overlapped yet)
                controller.observe(0, 0, spent if timed else None)
                timed = True
                chosen = controller.choose(left - produced)
    finally:
        steps.close()
    # generate_step runs a token ahead: the caches hold every token yielded and the next one is
    # sampled; it is the last plain token, and the next speculative run's prompt
    token, logprobs = sampler.last
    sequence.append(int(token.item()))
    yield sequence[-1], logprobs.squeeze(0), False
    return chosen


def _draft_calls(wrapped, limit=12):
    """Draft calls of ``wrapped`` (the loop, however wrapped) over 24 tokens with a draft that is
    never accepted and costs more than the main model (2 ms a call, about ten of the probe's main
    steps: the probe runs at ``import mlx_lm``), ``num_draft_tokens=2``; counting stops past
    ``limit``."""
    import mlx.core as mx

    kv_cache = sys.modules[CACHE].KVCache
    calls = [0]

    class Predicts:
        layers = [None]

        def __init__(self, token, count=False):
            self.token, self.count = token, count

        def make_cache(self):
            return [kv_cache()]

        def __call__(self, inputs, cache=None):
            n = inputs.shape[1]
            if self.count:  # a draft step that costs more than the main model's
                calls[0] += 1
                time.sleep(0.002)
            cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
            return mx.broadcast_to(mx.array([0.0] * 4).at[self.token].add(4.0), (1, n, 4))

    steps = wrapped(mx.array([1, 2], mx.uint32), Predicts(0), Predicts(1, count=True),
                    num_draft_tokens=2, max_tokens=24)
    for _ in steps:
        if calls[0] > limit:  # enough to tell
            break
    steps.close()
    return calls[0]


def probe():
    gone = missing(f"{CACHE}:KVCache")
    if gone is not None:
        return gone
    calls = _draft_calls(sys.modules[GENERATE].speculative_generate_step)
    if calls > 12:  # adapting: a few rounds with a draft, then plain steps and rare probes
        return (f"speculative_generate_step drafted {calls} times for 24 tokens with a draft never "
                "accepted (num_draft_tokens=2): the draft length does not adapt")
    return None


def apply(p):
    p.wrap(f"{GENERATE}:speculative_generate_step", partial(_adaptive, p.memo))


def scenario():
    """A hybrid main model with a draft never accepted and a schedule forced through k = 2, 0, 1,
    0, 2: equal to greedy decoding; unforced, the loop stops drafting."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model
    from mlx_lm_patches.mechanisms.adaptive import forced

    main_type = "qwen3_next" if "qwen3_next" in available_model_types() else DENSE_MODEL_TYPE
    model = build_tiny_model(main_type, seed=1)
    draft = build_tiny_model(DENSE_MODEL_TYPE, seed=2)
    prompt = prompt_tokens(13, seed=3)
    reference = greedy(model, prompt, max_tokens=12)
    try:
        with forced([2, 2, 0, 0, 1, 0, 2, 1]):
            got = speculative_greedy(model, draft, prompt, max_tokens=12, num_draft_tokens=2)
    except Exception as exc:
        return Outcome.failure(f"{main_type} with a forced schedule", exc)
    problem = reference.compare(got)
    if problem:
        return Outcome.failure(f"{main_type}, draft lengths forced through 2, 0, 1, 0: {problem}")
    calls = _draft_calls(sys.modules[GENERATE].speculative_generate_step)
    if calls > 12:
        return Outcome.failure(f"a draft never accepted was called {calls} times for 24 tokens")
    return Outcome(True, "the draft length adapts; output equal to greedy decoding whatever the schedule",
                   [f"{main_type}, schedule 2, 2, 0, 0, 1, 0, 2, 1: equal to greedy decoding",
                    f"a draft never accepted: {calls} draft calls for 24 tokens (stock mlx-lm: 47-48)"])

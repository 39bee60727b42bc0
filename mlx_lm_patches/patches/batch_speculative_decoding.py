"""Concurrent requests with a draft model or an MTP head decode together, speculatively.

Bug
    ``BatchGenerator`` has no draft model, and ``mlx_lm.server --draft-model PATH`` (or ``mtp``)
    sets ``is_batchable = False``: concurrent requests are served one at a time, so turning on
    speculation to go faster loses the server's batching (4 concurrent chats took 1.08x the time
    of the same 4 sent one after another).

Fix
    ``BatchGenerator(model, draft_model=..., num_draft_tokens=k)`` speculates in its generation
    batch (``mechanisms/batch_speculation.py``): every row drafts, one batched pass verifies all,
    each row accepts its own tokens and goes back on its own (a gated-delta or Mamba-2 row to the
    state after what it accepted, ``mechanisms/step_states.py``; other recurrent rows to the
    round's start, their accepted tokens fed again). The draft is a draft model, or
    ``model.make_draft_model()``: the model's MTP head drafting for all rows in one pass
    (``mechanisms/mtp/batched.py``). A row's extracted cache is its main caches then its draft
    caches, as ``mlx_lm.server``'s one-at-a-time path stores them; a supplied cache of that
    shape gives the main model its part and, with ``all_tokens``, a draft model its start. The
    server (not distributed) keeps batching and hands its generators the draft and
    ``--num-draft-tokens``. The main model's sliding windows go back per row too; before a
    verify pass a window mlx-lm's own steps left as a ring is put in temporal order (mlx-lm's
    mask of a pass of several tokens over a ring is one position off for a row still holding
    left padding). A draft model's windows, quantized caches, a head's caches other than
    ``KVCache`` or a head of several layers leave the generator decoding plainly, batched, with
    one warning.

Retire
    When mlx-lm's ``BatchGenerator`` speculates itself.

Metal
    The models' own forwards; moving a row inside its attention cache is an mlx gather. A
    gated-delta layer's recurrence in a verify pass is mlx-lm's kernel called once per token; a
    Mamba-2 row's state after what it kept is mlx-lm's ``ssm_update`` over those tokens.
"""

import functools
import logging
import sys
import types

from mlx_lm_patches.engine.contract import Outcome

GENERATE = "mlx_lm.generate"
SERVER = "mlx_lm.server"
CACHE = "mlx_lm.models.cache"
ATTR = "_mlx_lm_patches_speculation"
CAPPED = "num_draft_tokens settings already reported as capped"

PROMPTS = "_mlx_lm_patches_head_drafts"  # on a prompt batch whose passes an MTP head reads: its HeadDrafts
SERVER_DRAFT = "_mlx_lm_patches_server_draft"  # on a main model the server loaded: (draft, num_draft_tokens)

log = logging.getLogger("mlx_lm_patches")


def _speculation(batch):
    return vars(batch).get(ATTR)


def _detach(batch) -> None:
    vars(batch).pop(ATTR, None)
    vars(batch).pop("next", None)


def _drafting(draft, main_caches, prefill_step_size):
    """``(drafts, why not)``: the batch drafting for ``draft`` (a draft model, or a model's MTP
    draft), or why these caches cannot host it."""
    from mlx_lm_patches.mechanisms import batch_speculation
    from mlx_lm_patches.mechanisms.mtp import batched
    from mlx_lm_patches.mechanisms.mtp.decoding import MTPDraft

    why = batch_speculation.unhostable(main_caches, verified=True)
    if isinstance(draft, MTPDraft):
        return batched.HeadDrafts(draft), why or batched.unhostable(draft)
    make_prompt_cache = sys.modules[CACHE].make_prompt_cache
    drafts = batch_speculation.ModelDrafts(draft, prefill_step_size)
    return drafts, why or batch_speculation.unhostable(make_prompt_cache(draft))


def _attach(p, generator, model, draft, num_draft_tokens) -> None:
    from mlx_lm_patches.mechanisms.batch_speculation import Speculation
    from mlx_lm_patches.mechanisms.caches import has_recurrent_state
    from mlx_lm_patches.mechanisms.journal import draft_budget

    make_prompt_cache = sys.modules[CACHE].make_prompt_cache
    main_caches = make_prompt_cache(model, generator.max_kv_size)
    drafts, why = _drafting(draft, main_caches, generator.prefill_step_size)
    if has_recurrent_state(main_caches):  # the same bound as one sequence's rollback (a round keeps k + 2 states)
        num_draft_tokens = draft_budget(num_draft_tokens, num_draft_tokens, p.memo.setdefault(CAPPED, set()))
        why = why or (None if num_draft_tokens else "no draft token fits the rollback budget")
    if why:
        log.warning("mlx-lm-patches: BatchGenerator with a draft model decodes without drafting: %s", why)
        return
    spec = Speculation(drafts, num_draft_tokens, has_recurrent_state(main_caches))
    if hasattr(drafts, "prompt_pass"):  # the head reads the prompt passes of this generator's prompt batch
        vars(generator._prompt_batch)[PROMPTS] = drafts
        p.track(generator._prompt_batch, _forget_prompts, "a prompt batch whose passes an MTP head reads")
    batch = generator._generation_batch
    vars(batch)[ATTR] = spec
    # only this generator's batch decodes speculatively: plain batches never call into the package
    vars(batch)["next"] = types.MethodType(_speculative_next, batch)
    p.track(batch, _detach, "a generation batch that speculates with a draft model")
    log.debug("mlx-lm-patches: BatchGenerator speculates with a draft model, up to %d draft tokens a round",
              spec.most)
    vars(generator)[ATTR] = (len(main_caches), len(make_prompt_cache(draft)), draft)


def _forget_prompts(prompt_batch) -> None:
    vars(prompt_batch).pop(PROMPTS, None)


def _prompt_split(wrapped, instance, args, kwargs):
    """``PromptProcessingBatch.split``: the rows split off (to start generating: their last
    prompt pass comes in ``generate``) stay read by the head."""
    out = wrapped(*args, **kwargs)
    drafts = vars(instance).get(PROMPTS)
    if drafts is not None:
        vars(out)[PROMPTS] = drafts
    return out


def _prompt_pass(wrapped, instance, args, kwargs):
    """``PromptProcessingBatch.prompt`` of a generator drafting with an MTP head: the main
    model's hidden states of its passes go to the head (each row's part of the right-padded
    tokens, from the position its tokens so far end at)."""
    drafts = vars(instance).get(PROMPTS)
    tokens = args[0] if args else kwargs.get("tokens")
    if drafts is None or not tokens:
        return wrapped(*args, **kwargs)
    uids, starts, lengths = list(instance.uids), [len(t) for t in instance.tokens], [len(t) for t in tokens]
    passes = []
    drafts.capture.taps.append(passes.append)
    try:
        out = wrapped(*args, **kwargs)
    finally:
        drafts.capture.taps.remove(passes.append)
    states = [p[drafts.kind] for p in passes if p.get(drafts.kind) is not None]
    if states and len(uids) == len(tokens):
        drafts.prompt_pass(uids, starts, lengths, states)
    return out


def _init(p, wrapped, instance, args, kwargs):
    draft = kwargs.pop("draft_model", None)
    num_draft_tokens = kwargs.pop("num_draft_tokens", None)
    wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    if draft is None and SERVER_DRAFT in vars(model):
        draft, default = vars(model)[SERVER_DRAFT]
        num_draft_tokens = num_draft_tokens or default
    if draft is not None:
        _attach(p, instance, model, draft, num_draft_tokens or 3)


def _insert_segments(wrapped, instance, args, kwargs):
    """A supplied cache of main then draft caches (what this generator extracts, and what the
    server's one-at-a-time path stores) gives the main model its part; the draft part, where
    ``all_tokens`` says what it holds, is where the row's draft starts (fed the tokens after
    them when the row starts generating), else the draft is prefilled from the row's tokens."""
    shape = vars(instance).get(ATTR)
    if shape is None:
        return wrapped(*args, **kwargs)
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    spec = _speculation(instance._generation_batch)
    if spec is not None:
        spec.drafts.forget_supplied(lambda wanted: instance._find_uids(wanted))
    bound = bind_arguments(wrapped, args, kwargs)
    caches = bound.arguments.get("caches")
    if not caches:
        return wrapped(*args, **kwargs)
    n_main, n_draft, _ = shape
    full = [c is not None and len(c) == n_main + n_draft for c in caches]
    bound.arguments["caches"] = [c[:n_main] if whole else c for c, whole in zip(caches, full)]
    held = [list(t) if t else None for t in bound.arguments.get("all_tokens") or [None] * len(caches)]
    uids = wrapped(*bound.args, **bound.kwargs)
    if spec is not None:
        for uid, c, whole, tokens in zip(uids, caches, full, held):
            if whole and tokens:
                spec.drafts.supply(uid, list(c[n_main:]), tokens)
    return uids


def _extract_cache(wrapped, instance, args, kwargs):
    """``BatchGenerator.extract_cache``: rows still in prompt processing get empty draft caches
    after their main ones (generating rows get theirs from the generation batch)."""
    out = wrapped(*args, **kwargs)
    shape = vars(instance).get(ATTR)
    if shape is None:
        return out
    n_main, n_draft, draft = shape
    make_prompt_cache = sys.modules[CACHE].make_prompt_cache
    for uid, (cache, tokens) in list(out.items()):
        if len(cache) == n_main:
            out[uid] = (list(cache) + make_prompt_cache(draft), tokens)
    return out


def _batch_extract(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    spec = _speculation(instance)
    if spec is None:
        return out
    idx = args[0] if args else kwargs["idx"]
    return list(out) + spec.draft_of_finished(instance, idx)


def _batch_extend(wrapped, instance, args, kwargs):
    batch = args[0] if args else kwargs["batch"]
    first_tokens, first_logprobs, tokens = batch._next_tokens, list(batch._next_logprobs), list(batch.tokens)
    uids = list(batch.uids)
    out = wrapped(*args, **kwargs)
    spec = _speculation(instance)
    if spec is not None and uids:
        spec.join(tokens, first_tokens, first_logprobs, uids=uids)
    return out


def _batch_filter(wrapped, instance, args, kwargs):
    keep = list(args[0] if args else kwargs["keep"])
    out = wrapped(*args, **kwargs)
    spec = _speculation(instance)
    if spec is not None:
        spec.keep_rows(keep)
    return out


def _speculative_next(instance):
    """``GenerationBatch.next`` of a batch that speculates: one round, every row's tokens."""
    spec = _speculation(instance)
    if spec is None or not instance.uids:
        return type(instance).next(instance)
    import mlx.core as mx

    k = spec.choose()
    if k == 0 and spec.stock_can_step(instance):
        return spec.stock_step(instance, lambda: type(instance).next(instance))
    spec.take_back(instance)
    emitted = spec.round(instance, k)
    responses, keep = [], []
    for i, tokens in enumerate(emitted):
        finish = None
        for j, (token, logprobs) in enumerate(tokens):
            instance._num_tokens[i] += 1
            if instance._num_tokens[i] >= instance.max_tokens[i]:
                finish = "length"
            stopped, matched = _stop(instance, i, token)
            finish = "stop" if stopped else finish
            response = dict(uid=instance.uids[i], token=token, logprobs=logprobs, finish_reason=finish,
                            prompt_cache=None, all_tokens=None, **matched)
            if finish is not None:
                response["prompt_cache"], response["all_tokens"] = spec.finished_row(
                    instance, i, discarded=len(tokens) - j - 1)
            responses.append(instance.Response(**response))
            if finish is not None:
                break
        if finish is None:
            keep.append(i)
    instance._next_tokens = mx.array([p[-1][0] for p in spec.pending])
    instance._next_logprobs = [p[-1][1] for p in spec.pending]
    if len(keep) < len(instance.uids):
        instance.filter(keep)
    return responses


def _stop(batch, i, token):
    """Whether ``token`` ends row ``i`` on a stop sequence, and the response fields the release
    reports with it: 0.32 matches ``StopSequences``; 0.31.2-0.31.3 run a state machine whose
    state and match go into every response."""
    if hasattr(batch, "_matchers"):
        return batch._matchers[i].advance(token), {}
    batch._matcher_states[i], match, state = batch.state_machines[i].match(batch._matcher_states[i], token)
    return match is not None and state is None, {"current_state": state, "match_sequence": match}


def _forget_server_draft(model):
    vars(model).pop(SERVER_DRAFT, None)


# why a distributed server drafting with an MTP head serves its requests one at a time (a
# distributed server takes no draft path, only ``mtp``)
MTP_DISTRIBUTED = ("batched drafting across ranks is not built (every rank would have to take the same "
                   "draft length for every round)")


def _server_load(p, wrapped, instance, args, kwargs):
    """``ModelProvider._load``: with a draft model (a path, or ``mtp`` on one machine) the server
    keeps batching, and its generators speculate with the draft; otherwise it says why it
    serves requests one at a time."""
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    out = wrapped(*args, **kwargs)
    path = bind_arguments(wrapped, args, kwargs).arguments.get("draft_model_path")
    draft = getattr(instance, "draft_model", None)
    if draft is None:
        return out
    model = instance.model
    main = sys.modules[CACHE].make_prompt_cache(model)
    if path == "mtp" and getattr(instance, "is_distributed", False):
        why = MTP_DISTRIBUTED
    else:
        drafts, why = _drafting(draft, main, 2048)
        own = [] if hasattr(drafts, "prompt_pass") else sys.modules[CACHE].make_prompt_cache(draft)  # an MTP head's are its own
        merging = all(hasattr(c, "merge") for c in main + own)
        why = why or (None if merging else "a cache of the models cannot be batched")
    if why:
        log.warning("mlx-lm-patches: mlx_lm.server --draft-model %s serves concurrent requests one at a time: %s",
                    path, why)
        return out
    vars(model)[SERVER_DRAFT] = (draft, getattr(instance.cli_args, "num_draft_tokens", None) or 3)
    p.track(model, _forget_server_draft, "the server's draft model, for its BatchGenerators")
    instance.is_batchable = True
    return out


def apply(p):
    p.wrap(f"{GENERATE}:BatchGenerator.__init__", functools.partial(_init, p))
    p.wrap(f"{GENERATE}:BatchGenerator.insert_segments", _insert_segments)
    p.wrap(f"{GENERATE}:BatchGenerator.extract_cache", _extract_cache)
    p.wrap(f"{GENERATE}:GenerationBatch.extend", _batch_extend)
    p.wrap(f"{GENERATE}:GenerationBatch.filter", _batch_filter)
    p.wrap(f"{GENERATE}:GenerationBatch.extract_cache", _batch_extract)
    p.wrap(f"{GENERATE}:PromptProcessingBatch.prompt", _prompt_pass)
    p.wrap(f"{GENERATE}:PromptProcessingBatch.split", _prompt_split)
    p.wrap_if_present(f"{SERVER}:ModelProvider._load", functools.partial(_server_load, p))


def probe():
    import inspect

    from mlx_lm_patches.engine.contract import missing

    gone = missing(f"{GENERATE}:GenerationBatch.next")
    if gone is not None:
        return gone
    if "draft_model" in inspect.signature(sys.modules[GENERATE].BatchGenerator.__init__).parameters:
        return None
    return "BatchGenerator takes no draft model (mlx_lm.server --draft-model serves one request at a time)"


SCHEDULE = (3, 3, 0, 0, 2, 1, 3)  # the scenario's draft lengths: up, down, rounds without drafts and back


def scenario():
    """Four prompts of different lengths through ``BatchGenerator`` with a draft that agrees on
    most tokens (rows accept different numbers of them), a hybrid and a dense model, and a
    hybrid drafting with its own MTP head: every row equals greedy decoding alone (with the
    draft model in fewer steps than tokens)."""
    from mlx_lm_patches.selftest.scenarios import greedy, prompt_tokens
    from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, available_model_types, build_tiny_model, nearby_model
    from mlx_lm_patches.mechanisms.adaptive import forced

    if not hasattr(sys.modules[GENERATE], "GenerationBatch"):
        return Outcome.not_applicable("this mlx-lm's BatchGenerator (before 0.31.2) cannot host speculation: "
                                      "the server serves speculative requests one at a time")
    details = []
    prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13, 30)]
    hybrids = [t for t in ("qwen3_next",) if t in available_model_types()]
    # (name, model, draft, whether rows must take drafts: a random MTP head's are refused)
    runs = [(t, build_tiny_model(t, seed=1), nearby_model(t, seed=1, scale=0.01), True)
            for t in hybrids + [DENSE_MODEL_TYPE]]
    runs += [(f"{t} with its MTP head", *_with_head(t), False) for t in hybrids]
    for name, model, draft, accepts in runs:
        try:
            with forced(SCHEDULE):
                got, steps = batched_speculative(model, draft, prompts, max_tokens=16, num_draft_tokens=3)
        except Exception as exc:
            return Outcome.failure(f"{name}: BatchGenerator with a draft", exc)
        for i, (prompt, decoded) in enumerate(zip(prompts, got)):
            problem = greedy(model, prompt, max_tokens=16).compare(decoded)
            if problem:
                return Outcome.failure(f"{name}: row {i} ({len(prompt)} tokens): {problem}")
        if not accepts:
            details.append(f"{name} (random: its proposals are refused): 4 rows of 5-30 tokens, draft lengths "
                           f"{SCHEDULE}, equal to greedy")
            continue
        if steps >= 16 * len(prompts):
            return Outcome.failure(f"{name}: its rows took {steps} steps for 16 tokens each: the draft was not used")
        details.append(f"{name}: 4 rows of 5-30 tokens, draft lengths {SCHEDULE}: 16 tokens each in "
                       f"{steps} row-steps (64 without drafts), equal to greedy")
    return Outcome(True, "concurrent rows decode speculatively, each equal to greedy decoding alone", details)


def _with_head(model_type):
    """A tiny ``model_type`` with a random one-layer MTP head built from its own blocks (as
    ``mtp-heads-kept`` attaches it at load), and the head's draft."""
    from mlx.utils import tree_flatten

    from mlx_lm_patches.mechanisms.mtp.decoding import add_interface
    from mlx_lm_patches.mechanisms.mtp.heads import build
    from mlx_lm_patches.mechanisms.probing.random_weights import random_like
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

    model = build_tiny_model(model_type, seed=1)
    head = build(model, 1, tiny_config(model_type))
    head.load_weights(list(random_like(dict(tree_flatten(head.parameters())), seed=1000).items()))
    model.__dict__["mtp"] = head
    add_interface(model)
    return model, model.make_draft_model()


def batched_speculative(model, draft, prompts, max_tokens, num_draft_tokens):
    """``BatchGenerator`` with ``draft_model``: each row's decoding, and the steps its rows took
    (per step, the rows that emitted tokens: ``len(prompts) * max_tokens`` without drafts)."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    generator, problem = sys.modules[GENERATE].BatchGenerator, None
    hook = sys.unraisablehook  # stock's __del__ of a generator whose __init__ raised raises too
    sys.unraisablehook = lambda unraisable: None
    try:
        gen = generator(model, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=num_draft_tokens)
    except TypeError as exc:
        problem = str(exc)
    finally:
        sys.unraisablehook = hook
    if problem:
        raise RuntimeError(f"BatchGenerator takes no draft model ({problem})")
    uids = gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
    decoded = {uid: Decoded([], []) for uid in uids}
    steps, left = 0, set(uids)
    while left:
        responses = gen.next_generated()
        steps += len({r.uid for r in responses})
        for r in responses:
            decoded[r.uid].tokens.append(int(r.token))
            decoded[r.uid].logprobs.append(r.logprobs)
            if r.finish_reason is not None:
                left.discard(r.uid)
    gen.close()
    mx.eval([d.logprobs for d in decoded.values()])
    return [decoded[uid] for uid in uids], steps

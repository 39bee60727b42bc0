"""``--draft-model mtp`` selects the main model's own MTP head as the speculative draft.

Bug
    mlx-lm can only draft with a separate model (``--draft-model PATH``, a request's
    ``draft_model``): a checkpoint's MTP head (kept by ``mtp-heads-kept``) cannot be selected
    without writing code, and a distributed server refuses every draft model.

Fix
    Wrap the ``load`` that ``mlx_lm.generate`` and ``mlx_lm.server`` call: the path ``mtp``
    returns the most recently loaded main model's ``make_draft_model()`` and its tokenizer
    (remembered in the patcher's memo); every other path, and a real folder named ``mtp``, loads
    as before; without a loaded model with a head the error says why (``model.mtp_status``).
    Distributed (``mlx.launch ... --draft-model mtp``): the head is loaded by ``sharded_load``
    with the model and reads only what every rank has, so for ``mtp`` alone the model is loaded
    as stock does and every rank must have a head (one collective; else the load fails on every
    rank). Details: docs/mtp.md, docs/distributed.md.

Retire
    When mlx-lm selects MTP drafting itself in every supported release.

Metal
    Selection only; the draft runs the head's layers through mlx-lm's own modules.
"""

import logging
import os
import sys
import time
import weakref

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms.calls import bind_arguments

GENERATE = "mlx_lm.generate"
SERVER = "mlx_lm.server"
SENTINEL = "mtp"

MODEL, TOKENIZER = "the last loaded model (weakly)", "its tokenizer"
SHARDED = "whether sharded_load loaded it"

log = logging.getLogger("mlx_lm_patches")


class NoMTPDraft(ValueError):
    """``--draft-model mtp`` on a model without a usable MTP head; the message says why and how
    to get one. ``mlx_lm.generate`` prints it as one line."""


HOW_TO_GET_ONE = ("to draft with an MTP head, load a checkpoint that ships one (the Hugging Face "
                  "original, or a conversion made with mlx-lm-patches installed, which writes "
                  "mtp.safetensors; most published MLX conversions dropped it), or give "
                  "--draft-model a draft model's folder")


def _mtp_draft(model):
    """The draft of ``model``'s own MTP head; :class:`NoMTPDraft` naming why there is none."""
    from mlx_lm_patches.mechanisms.mtp.decoding import MTPUnavailable, model_label

    make_draft = model.__dict__.get("make_draft_model")
    if make_draft is None:
        status = model.__dict__.get("mtp_status", "not a family whose MTP head is kept")
        raise NoMTPDraft(f"--draft-model mtp: {model_label(model)} has no MTP interface ({status}); "
                         f"{HOW_TO_GET_ONE}")
    try:
        return make_draft()
    except MTPUnavailable as exc:
        raise NoMTPDraft(f"--draft-model mtp: {exc}; {HOW_TO_GET_ONE}") from None


def _one_line(wrapped, instance, args, kwargs):
    """``mlx_lm.generate``'s ``main``: a refused ``--draft-model mtp`` is one line on stderr
    (exit status 1), not a traceback."""
    try:
        return wrapped(*args, **kwargs)
    except NoMTPDraft as exc:
        raise SystemExit(f"{GENERATE}: {exc}") from None


def _load_or_mtp_draft(last, wrapped, instance, args, kwargs):
    """``last``: the patcher's memo (cleared by revert), which remembers the last main model."""
    path = args[0] if args else kwargs.get("path_or_hf_repo")
    if path != SENTINEL or os.path.exists(SENTINEL):  # a real folder named "mtp" wins
        return _remembered(last, wrapped(*args, **kwargs), sharded=False)
    model = last[MODEL]() if last.get(MODEL) is not None else None
    if model is None:
        raise ValueError("--draft-model mtp drafts with the main model's MTP head: load the main model first")
    if not last.get(SHARDED):
        return _mtp_draft(model), last.get(TOKENIZER)
    # The server of 0.31.2 and earlier loads a draft with ``load`` after ``sharded_load``, on
    # every rank: the ranks must agree that each has the head (one collective), as below.
    import mlx.core as mx

    draft, problem = None, None
    try:
        draft = _mtp_draft(model)
    except Exception as exc:  # MTPUnavailable, or no interface: reported on every rank below
        problem = str(exc)
    _every_rank_has_a_draft(mx.distributed.init(), problem, model)
    return draft, last.get(TOKENIZER)


def _remembered(last, loaded, sharded):
    """``loaded`` (``(model, tokenizer, ...)``) remembered as the last main model."""
    last[MODEL], last[TOKENIZER], last[SHARDED] = weakref.ref(loaded[0]), loaded[1], sharded
    return loaded


def mx_group_size() -> int:
    import mlx.core as mx

    return mx.distributed.init().size()


def _every_rank_has_a_draft(group, problem, model) -> None:
    """One collective over ``group``, the world group (every rank loads at the same point of the
    request stream): raise the same error on every rank if any rank has no draft; else say how
    the head is spread over the ranks (``model.mtp_status``, and a debug line per rank)."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.mtp.sharding import sharding_of

    flags = mx.distributed.all_gather(mx.array([0 if problem else 1], dtype=mx.int32), group=group, stream=mx.cpu)
    missing = [rank for rank, flag in enumerate(flags.tolist()) if not flag]
    if missing:
        why = f": {problem}" if problem else " (see their logs)"
        refusal = ValueError(f"--draft-model mtp: no MTP head on rank(s) {', '.join(map(str, missing))} "
                             f"of {group.size()}{why}")
        # Said before it is raised, with a moment for mlx.launch to forward it: the ranks end on
        # it, and a launcher before mlx 0.32.4 stops reading a rank's output once it has exited.
        log.error("mlx-lm-patches: %s: %s", type(refusal).__name__, refusal)
        time.sleep(1.0)
        raise refusal
    how = sharding_of(model)
    if how not in model.__dict__.get("mtp_status", ""):
        model.__dict__["mtp_status"] = f"{model.__dict__.get('mtp_status', 'MTP head kept')}; {how}"
    log.debug("mlx-lm-patches: --draft-model mtp: rank %d of %d drafts with the model's MTP head (%s)",
              group.rank(), group.size(), how)


def _distributed_load_with_mtp_draft(wrapped, instance, args, kwargs):
    """``ModelProvider._load`` in distributed mode with ``draft_model_path == "mtp"``: load the
    model as stock does (``sharded_load``), then its own head is the draft, on every rank."""
    import mlx.core as mx

    bound = bind_arguments(wrapped, args, kwargs)
    draft_path = bound.arguments.get("draft_model_path")
    # No check for a folder named "mtp" here (unlike ``load``): stock refuses every draft path in
    # distributed mode, and a folder present on one host only would split the ranks' decisions.
    if draft_path != SENTINEL or not getattr(instance, "is_distributed", False):
        return wrapped(*args, **kwargs)
    bound.arguments["draft_model_path"] = None  # stock still refuses adapters here
    wrapped(*bound.args, **bound.kwargs)
    draft, problem = None, None
    try:
        draft = _mtp_draft(instance.model)
    except Exception as exc:  # MTPUnavailable, or no interface: reported on every rank below
        problem = str(exc)
    _every_rank_has_a_draft(mx.distributed.init(), problem, instance.model)
    instance.draft_model = draft
    instance.model_key = (*instance.model_key[:2], draft_path)
    instance.is_batchable = False


def probe():
    upstream = [name for name in vars(sys.modules[GENERATE]) if "mtp" in name.lower()]
    if upstream:
        return None  # mlx-lm has MTP decoding of its own: leave its selection alone
    return "mlx_lm.generate has no MTP drafting; load('mtp') looks for a model named 'mtp'"


def apply(p):
    last = p.memo  # not a module global: revert clears it, status lists it

    def load(wrapped, instance, args, kwargs):
        return _load_or_mtp_draft(last, wrapped, instance, args, kwargs)

    p.wrap(f"{GENERATE}:load", load)
    p.wrap_if_present(f"{GENERATE}:main", _one_line)
    p.wrap(f"{SERVER}:load", load)
    p.wrap_if_present(f"{SERVER}:ModelProvider._load", _distributed_load_with_mtp_draft)  # 0.31.3+

    def sharded_load(wrapped, instance, args, kwargs):  # distributed: <= 0.31.2 drafts through load()
        return _remembered(last, wrapped(*args, **kwargs), sharded=mx_group_size() > 1)

    p.wrap_if_present(f"{SERVER}:sharded_load", sharded_load)


def scenario():
    """Load a Qwen3-Next checkpoint with an MTP head, then the draft through ``load("mtp")``
    (what ``--draft-model mtp`` does); speculative decoding with it equals greedy decoding."""
    import tempfile

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

    load = sys.modules[GENERATE].load
    with tempfile.TemporaryDirectory() as tmp:
        # HF layout: stock mlx-lm loads it (dropping the head), so what fails is load("mtp").
        written = write_mtp_checkpoint(tmp, "qwen3_next", form="hf", dtype="float32")
        try:
            model, _ = load(str(written.folder))
            draft, _ = load(SENTINEL)
        except Exception as exc:
            return Outcome.failure("load('mtp') after loading a model with an MTP head", exc)
        prompt = prompt_tokens(15, seed=2)
        try:
            got = speculative_greedy(model, draft, prompt, max_tokens=10, num_draft_tokens=2)
        except Exception as exc:
            return Outcome.failure("speculative decoding with the MTP draft", exc)
        problem = greedy(model, prompt, max_tokens=10).compare(got)
    if problem:
        return Outcome.failure(f"MTP speculative decoding: {problem}")
    return Outcome(True, "--draft-model mtp drafts with the model's MTP head; output equals greedy",
                   ["qwen3_next: load('mtp') gives the MTP draft; speculation exact"])

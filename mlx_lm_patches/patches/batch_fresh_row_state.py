"""recurrent_gemma rows that start beside rows with history start from an empty state.

Bug
    When a batch's rows do not all start together, mlx-lm's ``ArraysCache.extend`` and ``merge``
    give a row that has processed nothing zeros for its empty recurrent slots. For every other
    recurrent family a zero state computes what an empty one does. recurrent_gemma's RG-LRU does
    not: it leaves the first input of a sequence unnormalised only when its state is ``None``,
    so a row started from zeros gets other logits for its whole prompt, and other tokens. It
    happens in ``BatchGenerator`` when a prompt is inserted while another row is still being
    prefilled (>= 0.31.2: it joins that row's ``PromptProcessingBatch``), and when a new prompt
    is batched with one that continues a prompt cache (>= 0.30.4; before, ``batch-prefill-per-row``
    prefills every recurrent prompt alone).

Fix
    A prompt pass of a recurrent_gemma batch with such a row is run row by row, through the
    model's own forward with a batch of one, each row from the cache it has alone: the new row
    from an empty one (``mechanisms/row_prefill.py``). A new row whose prompt is one token has
    no prompt pass (its first pass is the generation batch's first step): it is split off into a
    batch of its own with empty recurrent slots before that step. Before 0.31.2, prompts are processed
    one at a time when new and continuing prompts would be merged. Other batches, other families
    and decoding take the stock path.

Retire
    When recurrent_gemma's RG-LRU gives a zero state's output for a missing state (the probe
    then says the bug is absent), or mlx-lm keeps a new row's state empty in a batch.

Metal
    Uses the model's own forward (its Metal kernels) with batch size one; nothing is bypassed.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms.row_prefill import (
    generate_fresh_rows_apart,
    prefill_rows_alone,
    process_prompts_alone,
    zero_filled_rows,
)

GENERATE = "mlx_lm.generate"
RECURRENT_GEMMA = "mlx_lm.models.recurrent_gemma"
_KNOWN = "_mlx_lm_patches_starts_from_none"


def _starts_from_none(model) -> bool:
    """``model`` holds a recurrence that computes a sequence's start from a missing state
    differently than from zeros (recurrent_gemma's RG-LRU; found once per model)."""
    known = getattr(model, "__dict__", {})
    found = known.get(_KNOWN)
    if found is None:
        rglru = getattr(sys.modules.get(RECURRENT_GEMMA), "RGLRU", None)
        modules = getattr(model, "modules", None)  # a model that is not an mlx Module: none
        found = rglru is not None and callable(modules) and any(isinstance(m, rglru) for m in modules())
        known[_KNOWN] = found
    return found


def _prompt(wrapped, instance, args, kwargs):
    tokens = args[0] if args else kwargs.get("tokens")
    if (
        not tokens
        or len(tokens) != len(instance.uids)
        or not _starts_from_none(instance.model)
        or not zero_filled_rows(instance)
        or not prefill_rows_alone(instance, tokens)
    ):
        return wrapped(*args, **kwargs)


def _generate(wrapped, instance, args, kwargs):
    """A new row whose prompt is one token has no prompt pass: its first pass is the generation
    batch's first step, here."""
    tokens = args[0] if args else kwargs.get("tokens")
    if not tokens or len(tokens) != len(instance.uids) or not _starts_from_none(instance.model):
        return wrapped(*args, **kwargs)
    fresh = {i for i in zero_filled_rows(instance) if len(tokens[i]) == 1}
    if not fresh:
        return wrapped(*args, **kwargs)
    return generate_fresh_rows_apart(wrapped, instance, list(tokens), fresh)


def _is_new(caches) -> bool:
    from mlx_lm_patches.mechanisms.prefix_reuse.trails import is_empty

    return caches is None or is_empty(caches)


def _process_prompts(wrapped, instance, args, kwargs):
    prompts = list(args[0] if args else kwargs["prompts"])
    if (
        len(prompts) < 2
        or not _starts_from_none(instance.model)
        or len({_is_new(p[3]) for p in prompts}) < 2
    ):
        return wrapped(*args, **kwargs)
    return process_prompts_alone(wrapped, prompts, "new and continuing recurrent_gemma prompts processed together")


def probe():
    import mlx.core as mx

    rglru = sys.modules[RECURRENT_GEMMA].RGLRU(width=2, num_heads=1)  # zero weights: no randomness
    x = mx.ones((1, 1, 2))
    from_none, _ = rglru(x)
    from_zeros, _ = rglru(x, cache=mx.zeros((1, 2)))
    if not mx.array_equal(from_none, from_zeros).item():
        return ("recurrent_gemma's RG-LRU gives a different output from a zero state than from no "
                f"state ({from_zeros.tolist()} vs {from_none.tolist()}), and a batch gives a row that "
                "starts beside rows with history zeros")
    return None


def apply(p):
    gen = p.module(GENERATE)
    if hasattr(gen, "PromptProcessingBatch"):
        p.wrap(f"{GENERATE}:PromptProcessingBatch.prompt", _prompt)
        p.wrap(f"{GENERATE}:PromptProcessingBatch.generate", _generate)
    else:
        p.wrap(f"{GENERATE}:BatchGenerator._process_prompts", _process_prompts)


def scenario():
    """recurrent_gemma in BatchGenerator: a prompt inserted while another is still prefilled,
    and a new prompt batched with one continuing a prompt cache, each equal to decoding alone."""
    from mlx_lm_patches.selftest.scenarios import fresh_rows_beside_history
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    if "recurrent_gemma" not in available_model_types():
        return Outcome.not_applicable("no recurrent_gemma in this mlx-lm")
    problem = fresh_rows_beside_history(build_tiny_model("recurrent_gemma", seed=1))
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, "new recurrent_gemma rows beside rows with history decode as alone",
                   ["prompts (one of one token) inserted mid-prefill; a new prompt beside a cached one; "
                    "a one-token prompt beside a cached prompt with one token left"])

"""Batched generation of hybrid models is exact: rows of different lengths are prefilled alone.

Bug
    ``BatchGenerator`` prefills a batch's prompts together, padding the shorter rows. Attention
    layers mask the padding, but many recurrent layers fold it into their state (mamba, jamba,
    nemotron_h, bailing_moe_linear, olmo_hybrid, recurrent_gemma, rwkv7, baichuan_m1,
    longcat_flash_ngram): silently wrong tokens once prompts (or prompt-cache continuations) of
    different lengths share a batch; older releases crash in a batched recurrent prefill. Models
    whose rotary frequencies depend on the sequence length (``mechanisms/rope_rows.py``) cannot
    be prefilled padded either.

Fix
    Prefill such rows alone through the model's own forward with a batch of one (the reference
    path), then batch them for decoding with mlx-lm's own machinery (``PromptProcessingBatch.
    prompt`` where it exists: rows taken out and merged back, ``mechanisms/row_prefill.py``;
    else ``BatchGenerator._process_prompts`` once per prompt, joined with ``Batch.extend``).
    Decoding stays batched; equal-length batches and attention-only models take the stock path.
    Cost: prompts of different lengths are no longer prefilled in one pass. Details:
    docs/batching.md.

Retire
    When every recurrent family in mlx-lm masks padded positions in batched prefill (the probe
    then says the bug is absent), or mlx-lm prefills hybrid rows separately itself.

Metal
    Uses the models' own forward (their Metal kernels) with batch size one; nothing is bypassed.
"""

import sys

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms import rope_rows
from mlx_lm_patches.mechanisms.row_prefill import prefill_rows_alone, process_prompts_alone

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def _has_recurrent(caches) -> bool:
    arrays_cache = sys.modules[CACHE].ArraysCache
    for c in caches:
        if isinstance(c, arrays_cache) or _has_recurrent(getattr(c, "caches", ())):
            return True
    return False


def _prompt(wrapped, instance, args, kwargs):
    tokens = args[0] if args else kwargs.get("tokens")
    if (
        tokens is None
        or len(tokens) < 2
        or len({len(t) for t in tokens}) < 2
        or len(tokens) != len(instance.uids)
        or not (_has_recurrent(instance.prompt_cache) or rope_rows.has_length_dependent_rope(instance.model))
        or not prefill_rows_alone(instance, tokens)
    ):
        return wrapped(*args, **kwargs)


def _process_prompts(wrapped, instance, args, kwargs):
    prompts = list(args[0] if args else kwargs["prompts"])
    batched_recurrent_prefill_works = hasattr(sys.modules[CACHE].ArraysCache, "merge")
    lengths_differ = len({len(p[1]) for p in prompts}) > 1
    recurrent = _has_recurrent(prompts[0][3])
    if (
        len(prompts) < 2
        or not (
            (recurrent and (lengths_differ or not batched_recurrent_prefill_works))
            or (lengths_differ and rope_rows.has_length_dependent_rope(instance.model))
        )
    ):
        return wrapped(*args, **kwargs)
    # where the rows cannot be joined, mlx-lm's own batched prefill: no worse than without this patch
    return process_prompts_alone(wrapped, prompts, "per-row prefill not possible here; using mlx-lm's batched prefill")


class _ShapeRecorder:
    """Stands in for a model: one attention layer's cache, next-token logits of zeros, and a
    record of the shape of every batch it is called with."""

    def __init__(self):
        self.shapes = []

    def make_cache(self):
        return [sys.modules[CACHE].KVCache()]

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        self.shapes.append(tuple(inputs.shape))
        batch, length = inputs.shape
        for layer_cache in cache or ():
            kv = mx.zeros((batch, 1, length, 2))
            layer_cache.update_and_fetch(kv, kv)
        return mx.zeros((batch, length, 4))


def probe():
    gen = sys.modules[GENERATE]
    if not hasattr(gen, "PromptProcessingBatch") and not hasattr(gen.BatchGenerator, "_process_prompts"):
        return None
    recorder = _ShapeRecorder()
    if hasattr(gen, "PromptProcessingBatch"):
        batch = gen.PromptProcessingBatch(recorder, [0, 1], [recorder.make_cache(), recorder.make_cache()])
        batch.prompt([[1, 2, 3], [4]])
    else:
        generator = gen.BatchGenerator(recorder, max_tokens=1)
        generator.insert([[1, 2, 3, 4], [5, 6]], [1, 1])
        generator.next()
    padded = [shape for shape in recorder.shapes if shape[0] > 1 and shape[1] > 1]
    if padded:
        return (f"batched prefill runs prompts of different lengths together, padded (model "
                f"called with {padded[0]}): recurrent layers that ignore the padding mask fold "
                "it into their state")
    return None


def apply(p):
    gen = p.module(GENERATE)
    if hasattr(gen, "PromptProcessingBatch"):
        p.wrap(f"{GENERATE}:PromptProcessingBatch.prompt", _prompt)
    else:
        p.wrap(f"{GENERATE}:BatchGenerator._process_prompts", _process_prompts)


FAMILIES = ("nemotron_h", "jamba", "mamba", "olmo_hybrid")


def scenario():
    """BatchGenerator with mask-ignoring recurrent families: different lengths, a late insert,
    and pre-filled prompt caches, each equal to single-sequence decoding."""
    from mlx_lm_patches.selftest.scenarios import batching_situations
    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

    details = []
    for model_type in [t for t in FAMILIES if t in available_model_types()]:
        problem = batching_situations(build_tiny_model(model_type, seed=1), model_type)
        if problem:
            return Outcome.failure(problem)
        details.append(f"{model_type}: 3 situations x 3 prompts exact")
    return Outcome(True, "batched decoding equals single-sequence decoding", details)

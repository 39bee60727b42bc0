"""Batched generation of hybrid models is exact: rows of different lengths are prefilled alone.

Bug
    ``BatchGenerator`` prefills the prompts of a batch together, padding the shorter rows
    (``PromptProcessingBatch.prompt`` right-pads and relies on ``cache.prepare(lengths=...)``).
    Attention layers mask the padding, but many recurrent layers fold the padded positions into
    their state: mamba, jamba, nemotron_h (``lengths`` never reaches ``ssm_update``),
    bailing_moe_linear, olmo_hybrid, recurrent_gemma, rwkv7, baichuan_m1 and
    longcat_flash_ngram decode to silently wrong tokens as soon as prompts of different lengths
    (or continuations of prompt caches of different lengths) share a batch.

    Models whose rotary frequencies depend on the sequence length (dynamic-NTK scaling, the
    two-factor longrope of 0.29.x-0.30.0; ``mlx_lm_patches/mechanisms/rope_rows.py``) cannot be prefilled
    padded either: a padded row is rotated with the frequencies of the padded length (or, left
    padded on <= 0.31.1, of a shifted one for internlm2/3), not of its own.

Fix
    Prefill hybrid rows alone, through the model's own forward with a batch of one and no
    padding (the reference path), then batch them for decoding with mlx-lm's own machinery.
    Rows of different lengths of a model with such a rotary embedding are prefilled alone too
    (their decoding is made batchable by ``internlm2-batch-rope``, ``internlm3-batch-rope``,
    ``su-scaled-rope-batch`` and ``dynamic-ntk-rope-batch``).
    Decoding stays batched: one token per row needs no padding and no mask. Batches of
    equal-length rows and attention-only models take the stock path unchanged. Cost: prompts of
    different lengths are no longer prefilled in one forward pass.

    * >= 0.31.2, ``PromptProcessingBatch.prompt``: when the batch holds recurrent caches
      (``ArraysCache``, also inside ``CacheList``) and the rows differ in length, take each row's
      cache out of the batch, prefill the row alone, rebuild the batch cache with
      ``_merge_caches``.
    * <= 0.31.1, ``BatchGenerator._process_prompts``: for several prompts with recurrent
      caches, call the original once per prompt and join the single-prompt batches with
      ``Batch.extend``. On <= 0.30.2 this is done for equal lengths too: a batched recurrent
      prefill there crashes in the gated-delta CPU path (``[broadcast_shapes]``, the mask is
      shaped for one row); there it works with ``arrays-cache-extract`` (finished sequences hand
      back their caches) and ``batch-history-backport`` (continuing from prompt caches).

Affected
    Every supported release (0.28.4 - 0.32.2); the probe decides on newer ones.

Upstream
    https://github.com/ml-explore/mlx-lm/blob/v0.32.2/mlx_lm/generate.py
    (``PromptProcessingBatch.prompt``); per-model root causes in docs/archive/2026-11-research/batching.md.

Retire
    When every recurrent family in mlx-lm masks padded positions in batched prefill (the probe
    then says the bug is absent), or mlx-lm prefills hybrid rows separately itself.

Metal
    Uses the models' own forward (their Metal kernels) with batch size one; nothing is bypassed.
"""

import logging
import sys

from mlx_lm_patches.engine.contract import Outcome
from mlx_lm_patches.mechanisms import rope_rows
from mlx_lm_patches.mechanisms.row_prefill import prefill_rows_alone

log = logging.getLogger("mlx_lm_patches")

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
    try:
        batch = wrapped([prompts[0]])
        for prompt in prompts[1:]:
            batch.extend(wrapped([prompt]))
        return batch
    except (TypeError, ValueError, AttributeError) as exc:
        # e.g. kimi_linear <= 0.30.6 keeps tuples in its cache slots, which Batch.extend cannot
        # join; the inputs were not consumed (fresh caches, or merged copies of the given ones),
        # so mlx-lm's own batched prefill runs instead: no worse than without this patch.
        log.warning("mlx-lm-patches: per-row prefill not possible here (%s: %s); using mlx-lm's "
                    "batched prefill", type(exc).__name__, exc)
        return wrapped(*args, **kwargs)


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
    from mlx_lm_patches.demos.scenarios import batching_situations
    from mlx_lm_patches.demos.tiny_models import available_model_types, build_tiny_model

    details = []
    for model_type in [t for t in FAMILIES if t in available_model_types()]:
        problem = batching_situations(build_tiny_model(model_type, seed=1), model_type)
        if problem:
            return Outcome.failure(problem)
        details.append(f"{model_type}: 3 situations x 3 prompts exact")
    return Outcome(True, "batched decoding equals single-sequence decoding", details)

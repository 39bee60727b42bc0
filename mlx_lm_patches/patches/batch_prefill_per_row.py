"""Batched generation of hybrid models is exact: rows of different lengths are prefilled alone.

Bug
    ``BatchGenerator`` prefills the prompts of a batch together, padding the shorter rows
    (``PromptProcessingBatch.prompt`` right-pads and relies on ``cache.prepare(lengths=...)``).
    Attention layers mask the padding, but many recurrent layers fold the padded positions into
    their state: mamba, jamba, nemotron_h (``lengths`` never reaches ``ssm_update``),
    bailing_moe_linear, olmo_hybrid, recurrent_gemma, rwkv7, baichuan_m1 and
    longcat_flash_ngram decode to silently wrong tokens as soon as prompts of different lengths
    (or continuations of prompt caches of different lengths) share a batch.

Fix
    Wrap ``PromptProcessingBatch.prompt``: when the batch holds recurrent caches (``ArraysCache``,
    also inside ``CacheList``) and the rows have different lengths, take each row's cache out of
    the batch, run that row's tokens through the model's own forward alone (batch of one, no
    padding - the reference path), then rebuild the batch cache with mlx-lm's own
    ``_merge_caches``. Decoding stays batched: one token per row needs no padding and no mask.
    Batches of equal-length rows and attention-only models take the stock path unchanged.
    Cost: prompts of different lengths are no longer prefilled in one forward pass.

Affected
    mlx-lm >= 0.31.2 (the releases with ``PromptProcessingBatch``); older releases batch through
    ``BatchGenerator._process_prompts`` and need their own backport (issue 3, pending).

Upstream
    https://github.com/ml-explore/mlx-lm/blob/v0.32.2/mlx_lm/generate.py
    (``PromptProcessingBatch.prompt``); per-model root causes in docs/research/batching.md.

Retire
    When every recurrent family in mlx-lm masks padded positions in batched prefill (the probe
    then says the bug is absent), or mlx-lm prefills hybrid rows separately itself.

Metal
    Uses the models' own forward (their Metal kernels) with batch size one; nothing is bypassed.
"""

import sys

from ..scenarios import Outcome

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def _has_recurrent(caches) -> bool:
    arrays_cache = sys.modules[CACHE].ArraysCache
    for c in caches:
        if isinstance(c, arrays_cache) or _has_recurrent(getattr(c, "caches", ())):
            return True
    return False


class _Unsupported(Exception):
    pass


def _row_cache(c, i):
    """Row ``i`` of a batch cache, as the single-sequence cache the model uses alone."""
    cm = sys.modules[CACHE]
    if isinstance(c, cm.CacheList):
        return cm.CacheList(*(_row_cache(sub, i) for sub in c.caches))
    if isinstance(c, cm.ArraysCache):
        row = type(c).__new__(type(c))
        row.cache = [None if s is None else s[i:i + 1] for s in c.cache]
        row.left_padding = None
        row.lengths = None
        return row
    if isinstance(c, cm.BatchKVCache):
        return cm.KVCache() if c.keys is None else c.extract(i)
    if isinstance(c, cm.BatchRotatingKVCache):
        if c.keys is None:
            return cm.RotatingKVCache(max_size=c.max_size)
        return c.extract(i)
    raise _Unsupported(type(c).__name__)


def _prompt(wrapped, instance, args, kwargs):
    import mlx.core as mx

    tokens = args[0] if args else kwargs.get("tokens")
    if (
        tokens is None
        or len(tokens) < 2
        or len({len(t) for t in tokens}) < 2
        or len(tokens) != len(instance.uids)
        or not _has_recurrent(instance.prompt_cache)
    ):
        return wrapped(*args, **kwargs)
    try:
        rows = [[_row_cache(c, i) for c in instance.prompt_cache] for i in range(len(tokens))]
    except _Unsupported:
        return wrapped(*args, **kwargs)
    for held, new in zip(instance.tokens, tokens):  # the tokens now in each row's cache
        held += new
    step = max(1, int(instance.prefill_step_size))
    for row_tokens, row in zip(tokens, rows):
        for start in range(0, len(row_tokens), step):
            chunk = mx.array([list(row_tokens[start:start + step])])
            instance.model(chunk, cache=row)
            mx.eval([c.state for c in row])
        mx.clear_cache()
    instance.prompt_cache = sys.modules[GENERATE]._merge_caches(rows)
    mx.eval([c.state for c in instance.prompt_cache])


class _ShapeRecorder:
    """Stands in for a model: records the shape of every batch it is called with."""

    def __init__(self):
        self.shapes = []

    def __call__(self, inputs, cache=None):
        self.shapes.append(tuple(inputs.shape))


def probe():
    gen = sys.modules[GENERATE]
    if not hasattr(gen, "PromptProcessingBatch"):
        return None
    recorder = _ShapeRecorder()
    batch = gen.PromptProcessingBatch(recorder, [0, 1], [[], []])
    batch.prompt([[1, 2, 3], [4]])
    padded = [shape for shape in recorder.shapes if shape[0] > 1]
    if padded:
        return (f"PromptProcessingBatch.prompt runs rows of lengths 3 and 1 together, padded "
                f"(model called with {padded[0]}): recurrent layers that ignore the padding mask "
                "fold it into their state")
    return None


def apply(p):
    p.wrap(f"{GENERATE}:PromptProcessingBatch.prompt", _prompt)


FAMILIES = ("nemotron_h", "jamba", "mamba", "olmo_hybrid")


def scenario():
    """BatchGenerator with mask-ignoring recurrent families: different lengths, a late insert,
    and pre-filled prompt caches, each equal to single-sequence decoding."""
    from ..scenarios import batched_greedy, greedy, prefill, prompt_tokens
    from ..testing.tiny_models import available_model_types, build_tiny_model
    from mlx_lm.models.cache import make_prompt_cache

    gen = sys.modules.get(GENERATE) or __import__(GENERATE, fromlist=["_"])
    if not hasattr(gen, "PromptProcessingBatch"):
        return Outcome.not_applicable("this mlx-lm batches through BatchGenerator._process_prompts (backport pending)")
    details = []
    for model_type in [t for t in FAMILIES if t in available_model_types()]:
        model = build_tiny_model(model_type, seed=1)
        prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13)]
        reference = [greedy(model, p) for p in prompts]
        caches, rest = [], []
        for prompt, k in zip(prompts, (3, 6, 4)):
            cache = make_prompt_cache(model)
            prefill(model, prompt[:k], cache)
            caches.append(cache)
            rest.append(prompt[k:])
        situations = {
            "different lengths": lambda: batched_greedy(model, prompts),
            "inserted while decoding": lambda: batched_greedy(model, prompts[:2], late_prompts=prompts[2:]),
            "pre-filled prompt caches": lambda: batched_greedy(model, rest, caches=caches),
        }
        for name, run in situations.items():
            try:
                got = run()
            except Exception as exc:
                return Outcome.failure(f"{model_type}, {name}", exc)
            for i, (ref, decoded) in enumerate(zip(reference, got)):
                problem = ref.compare(decoded)
                if problem:
                    return Outcome.failure(f"{model_type}, {name}, prompt {i}: {problem}")
        details.append(f"{model_type}: 3 situations x 3 prompts exact")
    return Outcome(True, "batched decoding equals single-sequence decoding", details)

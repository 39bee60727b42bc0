"""Batched decoding keeps the recurrent caches' ``left_padding``/``lengths`` graphs bounded.

Bug
    A hybrid's recurrent layers call ``ArraysCache.advance(n)`` in every forward pass, which
    subtracts from ``left_padding`` and ``lengths`` lazily. When a sequence joins a batch that is
    already decoding (``BatchGenerator.insert`` between steps: every ``mlx_lm.server`` under
    load), the merged caches keep that metadata for the rest of the decode, and only the layer
    whose cache builds the mask ever evaluates it: every other recurrent layer's chain grows by
    one subtraction per step, forever (5 graph edges a step, measured with
    ``mx.export_to_dot``). On Metal each node holds a buffer, and a long generation ends with
    ``[metal::malloc] Resource limit (499000) exceeded``. Measured on CPU with a tiny qwen3_next,
    stock, one sequence inserted at step 10: 0.31.3 - 0.32.2 (``GenerationBatch``) grow by 5
    edges a step (about 50 000 after 10 000 steps), with mlx 0.32.4 too; 0.28.4 - 0.31.1 clear the
    metadata before decoding (no growth).

Fix
    Wrap ``GenerationBatch._step``: after mlx-lm's step, the metadata arrays of the batch's
    recurrent caches (those that are set) are handed to ``mx.async_eval`` with the step's own
    work, so each chain is cut every step. Values are unchanged; one call per batched step.

Retire
    When mlx-lm's batched decode keeps the metadata graphs bounded in every supported release.

Metal
    The point of the fix: each graph node keeps a Metal buffer alive. On CPU it bounds memory
    and graph size only.
"""

import io
import sys

from mlx_lm_patches.engine.contract import Outcome

GENERATE = "mlx_lm.generate"
CACHE = "mlx_lm.models.cache"


def graph_edges(arrays) -> int:
    """Edges of the lazy graph reachable from ``arrays`` (0 when all are evaluated)."""
    import mlx.core as mx

    arrays = [a for a in arrays if isinstance(a, mx.array)]
    if not arrays:
        return 0
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return out.getvalue().count("->")


def metadata(caches) -> list:
    """The ``left_padding``/``lengths`` arrays that are set in ``caches``' recurrent caches."""
    from mlx_lm_patches.mechanisms.caches import recurrent_caches

    found = []
    for cache in recurrent_caches(caches or []):
        for name in ("left_padding", "lengths"):
            value = getattr(cache, name, None)
            if value is not None:
                found.append(value)
    return found


def _step(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    pending = metadata(getattr(instance, "prompt_cache", None))
    if pending:
        import mlx.core as mx

        mx.async_eval(pending)
    return result


def _live_recurrent_caches():
    import gc

    arrays_cache = sys.modules[CACHE].ArraysCache
    return [o for o in gc.get_objects() if isinstance(o, arrays_cache)]


def probe():
    import mlx.core as mx

    cache = sys.modules[CACHE].ArraysCache(1, left_padding=[1, 0])
    if not hasattr(cache, "advance"):
        return None
    cache[0] = mx.zeros((2, 1))
    cache.advance(1)
    cache.advance(1)
    if graph_edges([cache.left_padding]):
        return "ArraysCache.advance builds a lazy graph on left_padding that GenerationBatch._step never evaluates"
    return None


def apply(p):
    p.wrap(f"{GENERATE}:GenerationBatch._step", _step)


def scenario():
    """A batch that decodes 150 steps with a sequence inserted at step 10: the metadata graph
    after 150 steps is the size it was after 20."""
    from mlx_lm.generate import BatchGenerator

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    if not hasattr(sys.modules[GENERATE], "GenerationBatch"):
        return Outcome.not_applicable(
            "no GenerationBatch in this mlx-lm (before 0.31.3): its batched decode clears the "
            "metadata before decoding (measured: no growth), and hybrid batching needs other fixes here")
    model = build_tiny_model("qwen3_next", seed=1)
    gen = BatchGenerator(model, max_tokens=200)
    step = getattr(gen, "next_generated", None) or gen.next
    gen.insert([prompt_tokens(9, seed=1), prompt_tokens(17, seed=2)], [200, 200])
    seen = {}
    try:
        for n in range(1, 151):
            if not step():
                return Outcome.failure(f"the batch ended at step {n}")
            if n == 10:
                gen.insert([prompt_tokens(5, seed=3)], [200])
            if n in (20, 150):
                seen[n] = graph_edges(metadata(_live_recurrent_caches()))
    finally:
        if hasattr(gen, "close"):
            gen.close()
    if seen[150] > seen[20]:
        return Outcome.failure(f"ArraysCache metadata graph grows: {seen[20]} edges at step 20, {seen[150]} at 150")
    return Outcome(True, f"metadata graph bounded: {seen[20]} edges at step 20, {seen[150]} at 150")

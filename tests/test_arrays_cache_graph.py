"""Long decodes keep the recurrent caches' lazy graphs bounded (patch
``arrays-cache-metadata-graph``; what mlx-lm PR #1632 is about: ``ArraysCache.advance()``
subtracts from ``left_padding``/``lengths`` lazily every step, and a chain nothing evaluates
grows until Metal's resource limit ends the generation).

Measured with ``mx.export_to_dot`` (edges of the graph reachable from every live
``ArraysCache``'s metadata and slots): through mlx-lm's own loops - ``BatchGenerator`` with
prompts of different lengths and a sequence inserted while the batch decodes, and
``generate_step`` - the counts after 80 decode steps equal those after 20. Stock mlx-lm grows
5 edges a step after the late insert where the matrix says affected (strict xfail). A driver
that keeps the metadata and calls ``advance`` itself, evaluating only the states, grows on every
release with ``advance`` (0.30.4+); that is outside mlx-lm's loops and not measured here.
"""

import gc

import pytest

from conftest import reverted, xfail_if_affected
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model


import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import ArraysCache  # noqa: E402

from mlx_lm_patches.patches.arrays_cache_metadata_graph import graph_edges  # noqa: E402

MODEL = "qwen3_next" if "qwen3_next" in available_model_types() else available_model_types()[0]


def _graph():
    caches = [o for o in gc.get_objects() if isinstance(o, ArraysCache)]
    meta = [getattr(c, name, None) for c in caches for name in ("left_padding", "lengths")]
    return graph_edges(meta), graph_edges([a for c in caches for a in c.cache])


PATCH = "arrays-cache-metadata-graph"
REUSE = "prompt-cache-prefix-reuse"


def _late_insert_batch():
    from mlx_lm.generate import BatchGenerator

    model = build_tiny_model(MODEL, seed=1)
    gen = BatchGenerator(model, max_tokens=200)
    step = getattr(gen, "next_generated", None) or gen.next
    gen.insert([prompt_tokens(9, seed=1), prompt_tokens(17, seed=2)], [200, 200])
    seen = {}
    for n in range(1, 81):
        assert step(), f"the batch ended at step {n}"
        if n == 10:
            gen.insert([prompt_tokens(5, seed=3)], [200])
        if n in (20, 80):
            seen[n] = _graph()
    if hasattr(gen, "close"):
        gen.close()
    return seen


def test_batch_generator_decode_keeps_the_graph_bounded():
    seen = _late_insert_batch()
    assert seen[80] == seen[20], f"graph edges (metadata, slots) at step 20 and 80: {seen}"


@pytest.fixture
def stock():
    """This patch reverted, and prefix reuse too: once a prompt was stored in this process (an
    ``LRUPromptCache`` test ran before), prefix reuse prefills a batch's rows apart, no row is
    left-padded and the stock graph does not grow (an order-dependent XPASS)."""
    with reverted(PATCH, REUSE):
        yield


@xfail_if_affected(PATCH, "stock mlx-lm: the metadata of a batch joined while decoding grows every step")
def test_stock_batch_generator_decode(stock):
    seen = _late_insert_batch()
    assert seen[80] == seen[20], f"graph edges (metadata, slots) at step 20 and 80: {seen}"


def test_generate_step_keeps_the_graph_bounded():
    from mlx_lm.generate import generate_step

    model = build_tiny_model(MODEL, seed=1)
    seen = {}
    for n, _ in enumerate(generate_step(mx.array(prompt_tokens(12, seed=1)), model, max_tokens=80), start=1):
        if n in (20, 80):
            seen[n] = _graph()
    assert seen[80] == seen[20], f"graph edges (metadata, slots) at step 20 and 80: {seen}"

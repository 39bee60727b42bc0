""""Offset as int" (issue 3, part 3): in batched generation ``BatchKVCache.offset`` (and
``BatchRotatingKVCache.offset``) is a per-row ``mx.array`` of shape (B,), so model code that needs
a cache offset as a Python int breaks in batched decoding. This test scans the *installed*
mlx-lm's ``mlx_lm/models/*.py`` with ``ast`` for such uses, fails on any it does not know (naming
file:line), and runs every known consumer that batched generation can reach through mlx-lm's own
``BatchGenerator`` on a tiny random-weight model, against single-sequence greedy decoding: with
the patches (exact), and for patched consumers also with every patch reverted (a strict xfail on
the releases the patch's matrix entry names).

What fails with an offset ``o = mx.array([3, 5])`` (checked on mlx 0.29.2 and 0.32.4):

* slice bounds ``x[..., :o]``, ``x[:, o + T:]`` - "Slice indices must be integers or None"
  (a 0-d array fails too);
* ``range(o)``, ``int(o)``, ``float(o)``, ``bool(o)``, ``o.item()``, ``max(o, n)``,
  ``min(o, n)``, ``math.floor(o)``, ``np.arange(o, o + T)`` - "[convert] Only length-1 arrays
  can be converted to Python scalars" or "... cannot be interpreted as an integer";
* ``mx.arange(o)``, ``mx.arange(o, o + T)`` - "arange(): incompatible function arguments"
  (for *any* mx.array, even 0-d, and with any mlx);
* shapes: ``mx.zeros((o,))``, ``mx.tri(T, o + T)``, ``mx.split(x, [o])``, ``mx.pad``;
* the truth value of a comparison: ``if o > 0:``, ``if o == 0:``, ``a if o else b``;
* a Python list index ``lst[o]``.

What works and is not flagged: arithmetic (``o + T``, ``o // 2``), ``mx.arange(T) + o[:, None]``,
``mx.array(o)``, ``np.array(o)``, ``mx.full(shape, o)``, gathers ``x[:, o]`` / ``mx.take``,
``rope(x, offset=o)`` / ``mx.fast.rope(..., offset=o)``, ``len(o)`` and f-strings (no error; the
text shows the array). With B == 1 the (1,)-shaped offset converts to a scalar, so a consumer
only breaks with two or more rows: the exercises below batch three prompts.

The scan follows a cache offset into local variables (``offset = cache.offset``,
``seq_len = x.shape[1] + offset``, not through other calls' results) and treats a parameter named
``offset`` or ``start_pos`` as one (that is how rotary classes receive it). ``self.offset`` is
not a cache offset here (caches defined in model files, norm offsets), and ``cache.py`` is not
scanned (its caches own their int offsets; the batch caches pass their int ``_idx`` to
``create_causal_mask``).
"""

import ast
import functools
import importlib.util
import os
import pathlib
import traceback

import pytest

import mlx_lm_patches
from mlx_lm_patches.selftest.scenarios import batching_situations
from conftest import xfail_if_affected
from mlx_lm_patches.mechanisms.probing.random_weights import randomize_parameters
from mlx_lm_patches.selftest import tiny_models
from mlx_lm_patches.selftest import tiny_rope_models


os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ---------------------------------------------------------------------------------------------
# The scanner
# ---------------------------------------------------------------------------------------------

INT_ONLY_CALLS = {"range", "int", "float", "bool", "max", "min", "math.floor", "math.ceil",
                  "np.arange", "numpy.arange", "mx.arange"}
SHAPE_CALLS = {"mx.zeros", "mx.ones", "mx.full", "mx.tri", "mx.split", "mx.pad",
               "np.zeros", "np.ones"}
OFFSET_PARAMETERS = {"offset", "start_pos"}
# Calls whose result is still the per-row offset (other calls' results are not followed).
PASS_THROUGH_CALLS = {"mx.array", "mx.maximum", "mx.minimum"}
TESTS = (ast.If, ast.While, ast.IfExp, ast.Assert)


def _name(func):
    """The dotted name of a called expression (``mx.arange``): as ``ast.unparse`` writes it, but
    without unparsing the plain ``a.b.c`` chains that nearly every call is (the scan's hot spot)."""
    parts, node = [], func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return ast.unparse(func)


def _is_cache_offset(node):
    return (isinstance(node, ast.Attribute) and node.attr == "offset" and isinstance(node.ctx, ast.Load)
            and not (isinstance(node.value, ast.Name) and node.value.id == "self"))


def _value_nodes(expr):
    stack = [expr]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.Call):
            if _name(node.func) in PASS_THROUGH_CALLS:
                stack.extend(node.args)
            continue
        if not isinstance(node, (ast.Lambda, ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
            stack.extend(ast.iter_child_nodes(node))


def _int_context(node, parents):
    """How ``node`` (an offset) is used, if that use needs a Python int; else None."""
    current, parent = node, parents.get(node)
    while isinstance(parent, ast.BinOp) or (isinstance(parent, ast.UnaryOp) and not isinstance(parent.op, ast.Not)):
        current, parent = parent, parents.get(parent)
    if isinstance(parent, ast.Slice):
        return "slice bound"
    if isinstance(parent, ast.Subscript) and parent.slice is current:
        return "index"  # a list/tuple index fails; an mx.array gather would work (review)
    if isinstance(parent, ast.Attribute) and parent.attr == "item" and isinstance(parents.get(parent), ast.Call):
        return ".item()"
    if isinstance(parent, ast.Call) and current in parent.args:
        name = _name(parent.func)
        if name in INT_ONLY_CALLS:
            return f"{name}()"
        if name.endswith("create_causal_mask"):
            return "create_causal_mask() argument"
    if isinstance(parent, ast.keyword) and isinstance(parents.get(parent), ast.Call):
        if _name(parents[parent].func).endswith("create_causal_mask"):
            return "create_causal_mask() argument"
    shape, owner = current, parent
    while isinstance(owner, (ast.Tuple, ast.List)):
        shape, owner = owner, parents.get(owner)
    if shape is not current and isinstance(owner, ast.Call) and shape in owner.args:
        if _name(owner.func) in SHAPE_CALLS:
            return f"{_name(owner.func)}() shape"
    test, owner = current, parent
    if isinstance(owner, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in owner.ops):
        return None
    while isinstance(owner, (ast.Compare, ast.BoolOp)) or (isinstance(owner, ast.UnaryOp) and isinstance(owner.op, ast.Not)):
        test, owner = owner, parents.get(owner)
    if isinstance(owner, TESTS) and owner.test is test:
        return "truth value"
    return None


def int_offset_uses(source, filename="<source>"):
    """``[(filename, line, qualname, context, expression)]``: every use of a cache offset in
    ``source`` that needs a Python int."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function(child, f"{prefix}{child.name}")
                visit(child, f"{prefix}{child.name}.")
            elif not isinstance(child, ast.expr):  # no definition lives inside an expression
                visit(child, prefix)

    def own_nodes(function_node):
        stack = list(ast.iter_child_nodes(function_node))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.extend(ast.iter_child_nodes(node))

    def function(node, qualname):
        a = node.args
        tainted = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg in OFFSET_PARAMETERS}
        body = list(own_nodes(node))
        if not tainted and not any(_is_cache_offset(n) for n in body):
            return  # no offset reaches this function: nothing to follow
        changed = True
        while changed:
            changed = False
            for n in body:
                if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and n.value is not None:
                    if any(_is_cache_offset(v) or (isinstance(v, ast.Name) and v.id in tainted)
                           for v in _value_nodes(n.value)):
                        for target in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                            if isinstance(target, ast.Name) and target.id not in tainted:
                                tainted.add(target.id)
                                changed = True
        for n in body:
            if _is_cache_offset(n) or (isinstance(n, ast.Name) and n.id in tainted and isinstance(n.ctx, ast.Load)):
                context = _int_context(n, parents)
                if context:
                    found.add((filename, n.lineno, qualname, context, ast.unparse(n)))

    visit(tree, "")
    return sorted(found)


def _models_dir():
    return pathlib.Path(importlib.util.find_spec("mlx_lm").origin).parent / "models"


@functools.lru_cache(maxsize=None)
def findings():
    """The scan of the installed mlx-lm's model files (run once, when a test first needs it)."""
    return [f for path in sorted(_models_dir().glob("*.py")) if path.name != "cache.py"
            for f in int_offset_uses(path.read_text(), path.name)]


# ---------------------------------------------------------------------------------------------
# Known consumers: (file, function) -> the (context, expression) pairs known there, and why they
# are fine or how they are exercised. Anything else the scan finds fails the test.
# ---------------------------------------------------------------------------------------------

def _with(model_type, **overrides):
    config = tiny_models.tiny_config(model_type)
    config.update(overrides)
    return model_type, config


def _rope_probes(pid):
    """The tiny models of a length-dependent rotary class, rows crossing its threshold while
    decoding (prefills stay below it, so the shared situations' cold references apply; crossing
    it in the prefill is tested in tests/test_rope_rows.py)."""
    return tiny_rope_models.configs(pid, "decode")

GPT_BIGCODE = ("gpt_bigcode", {"model_type": "gpt_bigcode", "n_embd": 64, "n_layer": 2, "n_inner": 128,
                               "n_head": 4, "n_positions": 256, "layer_norm_epsilon": 1e-5,
                               "vocab_size": 256})
LLAMA4 = ("llama4", {"model_type": "llama4", "vocab_size": 256, "text_config": {
    "model_type": "llama4_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "intermediate_size_mlp": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "attention_chunk_size": 8, "num_local_experts": 2,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "use_qk_norm": True,
    "no_rope_layers": [1, 1, 1, 0], "attn_temperature_tuning": True, "floor_scale": 8,
    "attn_scale": 0.1, "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False}})

# how: "patched <id>" (must batch exactly; with every patch reverted, a strict xfail where the
# matrix says <id> affects the release), "unpatched" (a crash at one of the file's findings is an
# expected failure; anything else, or an inexact result, fails), "not batchable" (batching the
# model must fail before a finding is reached), "ints only" (never receives an array).
KNOWN = {
    ("gpt_bigcode.py", "GPTBigCodeModel.__call__"): dict(
        uses={("np.arange()", "cache[0].offset")},
        how="patched gpt-bigcode-batch-positions",
        why="learned position ids from np.arange(offset, offset + L); crashes batched decoding on "
            "every release 0.28.4-0.32.2",
        probes=[GPT_BIGCODE]),
    ("internlm2.py", "DynamicNTKScalingRoPE.__call__"): dict(
        uses={("truth value", "seq_len")},
        how="patched internlm2-batch-rope",
        why="`if x.shape[1] + offset > max_position_embeddings`; internlm2 always uses this rope "
            "up to 0.31.3 (0.32.0 moved it to rope_utils.initialize_rope)",
        probes=_rope_probes("internlm2-batch-rope")),
    ("internlm3.py", "DynamicNTKScalingRoPE.__call__"): dict(
        uses={("truth value", "seq_len")},
        how="patched internlm3-batch-rope",
        why="same as internlm2; from 0.32.0 the class is still defined but unused "
            "(the model calls initialize_rope), so the probe is exact there, stock too",
        probes=_rope_probes("internlm3-batch-rope")),
    ("rope_utils.py", "SuScaledRoPE.__call__"): dict(
        uses={("truth value", "seq_len")},
        how="patched su-scaled-rope-batch",
        why="`if offset + L > original_max_position_embeddings` (longrope: phi3, phimoe, minicpm3); "
            "only in 0.29.0-0.30.0",
        probes=_rope_probes("su-scaled-rope-batch")),
    ("rope_utils.py", "DynamicNTKScalingRoPE.__call__"): dict(
        uses={("max()", "offset")},
        how="patched dynamic-ntk-rope-batch",
        why="`max(L + offset, max_position_embeddings)`: every model whose initialize_rope gets "
            "rope_scaling type 'dynamic' (llama, and hybrids qwen3_next, falcon_h1, bailing_*, ...), "
            "0.32.0+",
        probes=_rope_probes("dynamic-ntk-rope-batch")),
    ("llama4.py", "Attention.__call__"): dict(
        uses={("mx.arange()", "offset")},
        how="not batchable",
        why="ChunkedKVCache layers: BatchGenerator refuses them from 0.30.0 ('does not yet support "
            "batching'); 0.28.4-0.29.1 turn them into BatchKVCache and crash on maybe_trim_front first",
        probes=[LLAMA4]),
    ("llama4.py", "LlamaModel.__call__"): dict(
        uses={("mx.arange()", "offset"), ("mx.arange()", "end")},
        how="not batchable", why="as llama4 Attention.__call__", probes=[LLAMA4]),
    ("base.py", "create_causal_mask"): dict(
        uses={("mx.arange()", "offset"), ("truth value", "offset")},
        how="ints only",
        why="called only from cache.py: KVCache/RotatingKVCache pass their int offset, "
            "BatchKVCache/BatchRotatingKVCache their int _idx; the scan flags any model file "
            "passing a cache offset to it",
        probes=[_with(tiny_models.DENSE_MODEL_TYPE)]),
}


def _known(finding):
    file, _, qualname, context, expression = finding
    entry = KNOWN.get((file, qualname))
    return entry is not None and (context, expression) in entry["uses"]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_the_scanner_sees_what_fails_and_not_what_works():
    source = '''
class Rope:
    def __call__(self, x, offset=0):
        if x.shape[-2] + offset > self.max:
            pass
        return rope(x, offset=offset)

def f(x, cache, c, T):
    a = x[:, : cache.offset]
    for i in range(c[0].offset):
        pass
    offset = cache.offset
    b = np.arange(offset, offset + 3)
    m = mx.zeros((offset + T,))
    n = max(T + offset, 4) + int(offset) + offset.item()
    y = mx.arange(offset, offset + T)
    if offset is not None and offset == 0:
        pass
    fine = mx.arange(3) + cache.offset
    fine = mx.array(cache.offset)[:, None] + mx.arange(T)
    fine = f"{cache.offset}"
    fine = x[:, offset]
    first = [1, 2, 3][offset]
    rope(x, offset=cache.offset)
    keys = self.rope(x, offset=offset)
    if keys.shape[0] > 1:
        pass
    if self.offset == 0:
        pass
'''
    got = {(qualname, context, expression) for _, _, qualname, context, expression in int_offset_uses(source)}
    assert got == {
        ("Rope.__call__", "truth value", "offset"),
        ("f", "slice bound", "cache.offset"),
        ("f", "range()", "c[0].offset"),
        ("f", "np.arange()", "offset"),
        ("f", "mx.zeros() shape", "offset"),
        ("f", "int()", "offset"),
        ("f", "max()", "offset"),
        ("f", ".item()", "offset"),
        ("f", "mx.arange()", "offset"),
        ("f", "truth value", "offset"),
        ("f", "index", "offset"),
    }, got


def test_scanner_examples_fail_on_real_mlx():
    """The contexts the scanner flags really fail with a (B,) offset, the ones it skips work."""
    import mlx.core as mx
    import numpy as np

    offset, x = mx.array([3, 5]), mx.zeros((2, 4, 16, 16))
    fails = [lambda: x[..., :offset], lambda: range(offset), lambda: int(offset),
             lambda: np.arange(offset, offset + 2), lambda: mx.arange(offset, offset + 2),
             lambda: max(offset + 2, 4), lambda: bool(offset > 0), lambda: offset.item(),
             lambda: [1, 2, 3, 4, 5, 6][offset], lambda: mx.zeros((offset,))]
    for i, fn in enumerate(fails):
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            fn()
    works = [lambda: mx.arange(2) + offset[:, None], lambda: mx.array(offset), lambda: f"{offset}",
             lambda: x[:, :, offset], lambda: mx.full((2,), offset), lambda: np.array(offset)]
    for fn in works:
        fn()


def test_no_unknown_int_offset_consumer():
    unknown = [f"{file}:{line} {qualname} ({context}: {expression})"
               for file, line, qualname, context, expression in findings()
               if not _known((file, line, qualname, context, expression))]
    assert not unknown, (
        "cache offset used as a Python int (breaks batched decoding, where it is a per-row "
        "mx.array); check it and add it to KNOWN: " + "; ".join(unknown))


def _build(model_type, config, seed=1):
    import mlx.core as mx

    model_cls, args_cls = tiny_models._model_classes(config, model_type)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    randomize_parameters(model, model_type, seed, mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def _crash_site(exc):
    """``(file, line)`` of the innermost frame in mlx_lm/models."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        parts = pathlib.Path(frame.filename).parts
        if "mlx_lm" in parts and "models" in parts:
            return pathlib.Path(frame.filename).name, frame.lineno
    return None


def _run_situations(model, model_type):
    """batching_situations re-raised: None if exact, a string if inexact, raises on a crash."""
    from mlx_lm_patches.selftest import scenarios

    captured = {}
    original = scenarios.batched_greedy

    def recording(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            captured["exc"] = exc
            raise

    scenarios.batched_greedy = recording
    try:
        problem = batching_situations(model, model_type)
    finally:
        scenarios.batched_greedy = original
    if "exc" in captured:
        raise captured["exc"]
    return problem


PROBES = [pytest.param(key, i, id=f"{key[0]}:{key[1]}:{probe[0]}")
          for key, entry in KNOWN.items() for i, probe in enumerate(entry["probes"])]


def _patch_id(entry):
    return entry["how"].split(" ", 1)[1] if entry["how"].startswith("patched ") else None


STOCK_PROBES = [pytest.param(key, i, id=f"{key[0]}:{key[1]}:{probe[0]}",
                             marks=xfail_if_affected(_patch_id(entry), reason=f"stock mlx-lm crashes at {key[0]} "
                                                     f"{key[1]}: {_patch_id(entry)} affects this release"))
                for key, entry in KNOWN.items() if _patch_id(entry)
                for i, probe in enumerate(entry["probes"])]


def _probe_model(entry, index):
    model_type, config = entry["probes"][index]
    if importlib.util.find_spec(f"mlx_lm.models.{model_type}") is None:
        pytest.skip(f"no mlx_lm.models.{model_type} in this mlx-lm")
    try:
        return model_type, _build(model_type, config)
    except Exception as exc:  # e.g. rope type 'dynamic' unknown before 0.32.0
        pytest.skip(f"{model_type} with this config does not build here: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("key,index", PROBES)
def test_known_consumer_in_batched_generation(key, index):
    entry = KNOWN[key]
    model_type, model = _probe_model(entry, index)
    here = {(f[0], f[1]) for f in findings() if (f[0], f[2]) == key}
    if entry["how"] == "not batchable":
        with pytest.raises(Exception) as caught:
            _run_situations(model, model_type)
        assert _crash_site(caught.value) not in here, (
            f"{model_type} got as far as a known int-offset use: {caught.value}")
        return
    try:
        problem = _run_situations(model, model_type)
    except Exception as exc:
        site = _crash_site(exc)
        if entry["how"] == "unpatched" and site in here:
            pytest.xfail(f"known unpatched consumer {site[0]}:{site[1]}: {type(exc).__name__}: {exc}")
        raise
    assert problem is None, problem


def test_int_offset_files_that_tiny_models_build_batch_exactly():
    """Every model type with a finding in its own module that tiny_models can build: the three
    batching situations equal single-sequence greedy decoding."""
    candidates = {t for t in tiny_models.HYBRID_MODEL_TYPES + (tiny_models.DENSE_MODEL_TYPE,)
                  if f"{t.replace('-', '_')}.py" in {f[0] for f in findings()}}
    types = sorted(t for t in candidates if t in tiny_models.available_model_types(hybrid_only=False))
    if not types:
        pytest.skip("no model type with an int-offset finding in its own module is in tiny_models")
    problems = [batching_situations(tiny_models.build_tiny_model(t, seed=1), t) for t in types]
    assert not any(problems), [p for p in problems if p]


@pytest.fixture
def stock_mlx_lm():
    """Every patch reverted for the test (as ``python -m mlx_lm_patches check`` does for its
    stock run), then applied again."""
    mlx_lm_patches.revert()
    try:
        yield
    finally:
        mlx_lm_patches.apply()


@pytest.mark.parametrize("key,index", STOCK_PROBES)
def test_patched_consumer_fails_on_stock_where_affected(key, index, stock_mlx_lm):
    """The probes of patched consumers with every patch reverted: a strict xfail where the
    matrix says the release is affected (the crash, or an inexact row), exact elsewhere."""
    model_type, model = _probe_model(KNOWN[key], index)
    problem = _run_situations(model, model_type)
    assert problem is None, problem

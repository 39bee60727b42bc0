""""Offset as int": in batched generation ``BatchKVCache.offset`` is a per-row ``mx.array``, so model
code that uses a cache's ``offset`` as a Python int (slice bounds, ``range``, ``int``,
``np.arange``, an ``if`` comparison, an f-string) breaks there. This scans the installed mlx-lm's
model files for such uses - directly or through a local variable bound from ``.offset`` - and
exercises what it finds. A consumer that is not known and handled fails the test, naming
file:line, so a new one in a future mlx-lm release is caught."""

import ast
import importlib.util
import pathlib

import pytest

import mlx_lm_patches
from mlx_lm_patches.testing.tiny_models import HYBRID_MODEL_TYPES

mlx_lm_patches.apply()

# model file -> how its int-offset use is handled
HANDLED = {
    "gpt_bigcode.py": "gpt-bigcode-batch-positions computes per-row positions",
}
INT_ONLY_CALLS = {"range", "int", "float", "np.arange", "numpy.arange"}


def _int_context(node, parents):
    current, parent = node, parents.get(node)
    while isinstance(parent, (ast.BinOp, ast.UnaryOp)):
        current, parent = parent, parents.get(parent)
    if isinstance(parent, ast.Slice):
        return "slice bound"
    if isinstance(parent, ast.Call) and current in parent.args and ast.unparse(parent.func) in INT_ONLY_CALLS:
        return f"{ast.unparse(parent.func)}()"
    if isinstance(parent, ast.Compare) and isinstance(parents.get(parent), (ast.If, ast.While)):
        return "if comparison"
    if isinstance(parent, ast.FormattedValue):
        return "f-string"
    return None


def int_offset_uses(source, filename="<source>"):
    """``[(filename, line, function, context)]`` for every int-only use of a cache offset."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        bound = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and any(
                isinstance(a, ast.Attribute) and a.attr == "offset" for a in ast.walk(node.value)
            ):
                bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(function):
            is_offset = (
                isinstance(node, ast.Attribute) and node.attr == "offset" and isinstance(node.ctx, ast.Load)
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ) or (isinstance(node, ast.Name) and node.id in bound and isinstance(node.ctx, ast.Load))
            context = _int_context(node, parents) if is_offset else None
            if context:
                found.add((filename, node.lineno, function.name, context))
    return sorted(found)


def _model_files():
    root = pathlib.Path(importlib.util.find_spec("mlx_lm").origin).parent / "models"
    # cache.py holds the caches themselves: their offsets are ints by construction, and
    # BatchKVCache has its own methods.
    return [p for p in sorted(root.glob("*.py")) if p.name != "cache.py"]


FINDINGS = [f for path in _model_files() for f in int_offset_uses(path.read_text(), path.name)]


def test_the_scanner_sees_every_int_only_use():
    source = '''
def f(x, cache, c):
    a = x[:, : cache.offset]
    for i in range(c[0].offset):
        pass
    offset = cache.offset
    b = np.arange(offset, offset + 3)
    if offset > 0:
        pass
    fine = mx.arange(3) + cache.offset
    rope(x, offset=cache.offset)
'''
    contexts = [context for *_, context in int_offset_uses(source)]
    assert contexts == ["slice bound", "range()", "np.arange()", "if comparison"]  # one per line


def test_every_int_offset_consumer_is_handled():
    unknown = [f"{file}:{line} in {function} ({context})" for file, line, function, context in FINDINGS
               if file not in HANDLED]
    assert not unknown, "cache.offset used as a Python int (breaks batched decoding): " + ", ".join(unknown)


def test_no_hybrid_family_uses_the_offset_as_an_int():
    hybrid_files = {f"{t.replace('-', '_')}.py" for t in HYBRID_MODEL_TYPES}
    assert not [f for f in FINDINGS if f[0] in hybrid_files]


@pytest.mark.parametrize("filename", sorted(HANDLED))
def test_handled_consumers_batch_exactly(filename):
    from mlx_lm_patches import matrix

    if not any(f[0] == filename for f in FINDINGS):
        pytest.skip(f"{filename} has no int-offset use in this mlx-lm")
    patch_id = HANDLED[filename].split()[0]
    module = matrix.load().get(patch_id).module_name
    outcome = importlib.import_module(module).scenario()
    assert outcome.ok, outcome.summary

"""State a patch keeps between calls lives in its patcher's ``memo`` (status lists it, ``revert()``
forgets it), and per-call scope in context variables (isolated between asyncio tasks).

* prompt-cache-prefix-reuse: once an ``LRUPromptCache`` exists, ``generate_step``'s prefill is
  cut at powers of two; after revert and apply again the process is as fresh (no cuts);
* no module of ``patches/`` or ``mechanisms/`` keeps side state in a module global (``global``
  statements, lowercase module-level containers, ``threading.local``), read from their source;
* the prefix-reuse cutting scope set in one asyncio task is not seen by another task.
"""

import ast
import asyncio
import pathlib

import pytest

import mlx_lm_patches
from conftest import reverted
from mlx_lm_patches.engine import core
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import lru_prompt_cache_class
from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model

PACKAGE = pathlib.Path(mlx_lm_patches.__file__).parent
PATCH = "prompt-cache-prefix-reuse"

# Module-level names that are not side state of a patch.
NOT_SIDE_STATE = {
    ("mechanisms/journal.py", "_journals"): "journals attached to live caches (weak keys), detached after each call",
    ("mechanisms/prefix_reuse/forward.py", "_ARRAY"): "mx.array, looked up once (mlx is imported lazily)",
    ("mechanisms/prefix_reuse/forward.py", "_INTEGER_DTYPES"): "mlx's integer dtypes, looked up once",
    ("mechanisms/calls.py", "_signatures"): "what inspect.signature gives for live functions (weak keys): "
                                            "the same before and after revert",
}


def _kept_positions(model, length=70):
    """Where the recurrent states of a ``generate_step`` prefill of ``length`` tokens are kept."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms import prefix_reuse as pc

    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(prompt_tokens(length, seed=3)), model, max_tokens=1, prompt_cache=cache):
        pass
    return [pos for pos, _, _ in pc.checkpoints(cache)]


def test_a_prompt_cache_store_is_forgotten_by_revert(monkeypatch):
    monkeypatch.delenv("MLX_LM_PATCHES_PREFIX_CHECKPOINTS", raising=False)
    mlx_lm_patches.apply([PATCH])
    if {r.id: r.state for r in mlx_lm_patches.status()}[PATCH] != "applied":
        pytest.skip(f"{PATCH} is not applied on this release")
    model_type = "qwen3_next" if "qwen3_next" in available_model_types() else available_model_types()[0]
    model = build_tiny_model(model_type, seed=1)
    with reverted(PATCH):
        pass  # a fresh start of the patch: no store seen
    assert _kept_positions(model) == [69], "no prompt-cache store: the prefill is mlx-lm's own pass"
    lru_prompt_cache_class()()  # as mlx_lm.server creates at start
    assert _kept_positions(model) == [32, 64, 69], "a store exists: the prefill is cut at powers of two"
    assert any("LRUPromptCache" in held for held in core.changes()[PATCH])
    with reverted(PATCH):
        assert PATCH not in core.changes()
    assert _kept_positions(model) == [69], "the store seen before the revert outlived it"


def _module_side_state(path: pathlib.Path):
    """``(name, line)`` of side state kept at module level: names a function declares
    ``global``, lowercase module-level names bound to containers, and ``threading.local()``."""
    tree = ast.parse(path.read_text(), str(path))
    found = [(name, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names]
    containers = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        call = node.value.func if isinstance(node.value, ast.Call) else None
        called = getattr(call, "attr", getattr(call, "id", ""))
        if called == "local":
            found += [(name, node.lineno) for name in names]
        elif isinstance(node.value, containers) or called in ("WeakKeyDictionary", "WeakValueDictionary", "dict",
                                                               "list", "set", "deque", "defaultdict"):
            found += [(name, node.lineno) for name in names if name.lstrip("_") and not name.isupper()
                      and not name.startswith("__")]
    return found


@pytest.mark.python_only
def test_no_side_state_in_module_globals():
    problems = []
    for folder in ("patches", "mechanisms"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            relative = path.relative_to(PACKAGE).as_posix()
            for name, line in _module_side_state(path):
                if (relative, name) not in NOT_SIDE_STATE:
                    problems.append(f"{relative}:{line}: {name}")
    assert not problems, ("module globals that outlive revert(); keep them in the patcher's memo "
                          "(p.memo) or a contextvars.ContextVar: " + ", ".join(problems))


@pytest.mark.python_only
def test_the_cutting_scope_is_per_asyncio_task():
    """An asyncio server runs many requests' tasks in one thread: a prefill cut in one task must
    not cut the passes of another running meanwhile."""
    from mlx_lm_patches.mechanisms.prefix_reuse import forward

    seen = {}

    async def cutting_task(entered, checked):
        with forward.cutting():
            entered.set()
            await checked.wait()
            seen["inside"] = forward._cuts_on()

    async def other_task(entered, checked):
        await entered.wait()
        seen["other"] = forward._cuts_on()
        checked.set()

    async def main():
        entered, checked = asyncio.Event(), asyncio.Event()
        await asyncio.gather(cutting_task(entered, checked), other_task(entered, checked))

    asyncio.run(main())
    assert seen == {"inside": True, "other": False}, seen


@pytest.mark.python_only
def test_signatures_read_once_keep_nothing_alive():
    """``calls.signature_of`` (the wrappers read a call's arguments by it) gives what
    ``inspect.signature`` gives, for functions, bound methods, partials and unhashable callables,
    and its cache does not keep a function alive (a reverted wrapper goes with its entry)."""
    import functools
    import gc
    import inspect
    import weakref

    from mlx_lm_patches.mechanisms import calls

    def function(prompt, model, *, max_tokens=256, **kwargs):
        return prompt

    class Unhashable:
        __hash__ = None

        def __call__(self, tokens, cache=None):
            return tokens

        def method(self, x, y=2):
            return x

    holder = Unhashable()
    for target in (function, holder.method, functools.partial(function, 1), holder):
        assert calls.signature_of(target) == inspect.signature(target)
        assert calls.signature_of(target) == inspect.signature(target)  # from the cache where kept
    assert calls.bind_arguments(function, (1, 2), {}).arguments == {"prompt": 1, "model": 2, "max_tokens": 256,
                                                                     "kwargs": {}}
    gone = weakref.ref(function)
    assert function in calls._signatures
    del function, target
    gc.collect()
    assert gone() is None, "the signature cache kept a function alive"

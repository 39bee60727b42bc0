"""Imports only run downward, read from the source (every module under ``mlx_lm_patches/``):
a patch never imports another patch (shared code lives in ``mechanisms/``), a mechanism
never imports a patch or the self-test kit (``selftest/``, what ``check`` runs; the helpers a
production probe runs live in ``mechanisms/probing/``), and the kit never imports a patch. A
patch imports the kit only inside its ``scenario`` (and what only the scenario calls): never
at import, nor in ``probe`` or ``apply``. No mechanism imports one that imports it back.
"""

import ast
import pathlib

import pytest

import mlx_lm_patches

PACKAGE = pathlib.Path(mlx_lm_patches.__file__).parent
PATCHES = "mlx_lm_patches.patches"
MECHANISMS = "mlx_lm_patches.mechanisms"
SELFTEST = "mlx_lm_patches.selftest"

# (importing module, imported module) pairs allowed for now, each with why.
EXCEPTIONS = set()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path):
    """Every module ``path`` imports (at top level or inside functions), absolute names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)  # ``from pkg import mod``


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        if _under(importer, PATCHES) and importer != PATCHES:
            forbidden = [PATCHES]
        elif _under(importer, MECHANISMS):
            forbidden = [PATCHES, SELFTEST]
        elif _under(importer, SELFTEST):
            forbidden = [PATCHES]
        else:
            continue
        for imported in sorted(set(_imports(path))):
            if imported == importer or any(importer == a and _under(imported, b) for a, b in EXCEPTIONS):
                continue
            if any(_under(imported, f) for f in forbidden):
                found.append(f"{importer} imports {imported}")
    return found


@pytest.mark.python_only
def test_imports_only_run_downward():
    assert _violations() == []


def _kit_imports_outside_scenarios():
    """``module.function imports kit-module`` for every import of the kit in a patch module
    outside a function whose name holds ``scenario`` or starts with ``_`` (helpers)."""
    found = []
    for path in sorted((PACKAGE / "patches").glob("*.py")):
        importer = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        scopes = [("<module>", [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))])]
        scopes += [(n.name, [n]) for n in tree.body if isinstance(n, ast.FunctionDef)
                   and "scenario" not in n.name and not n.name.startswith("_")]
        for name, nodes in scopes:
            for node in (sub for top in nodes for sub in ast.walk(top)):
                module = getattr(node, "module", None) if isinstance(node, ast.ImportFrom) else None
                names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
                if any(_under(m, SELFTEST) for m in ([module] if module else []) + names):
                    found.append(f"{importer}.{name} imports {module or names}")
    return found


@pytest.mark.python_only
def test_probes_never_import_the_kit():
    """A probe runs in the user's process: what it needs lives in ``mechanisms/probing/``."""
    assert _kit_imports_outside_scenarios() == []


@pytest.mark.python_only
def test_the_exceptions_are_still_needed():
    """An exception nothing needs any more is taken off the list."""
    needed = set()
    for path in PACKAGE.rglob("*.py"):
        importer = _module_name(path)
        needed |= {(importer, imported) for imported in _imports(path)}
    assert EXCEPTIONS <= needed, EXCEPTIONS - needed


def _import_cycles(package: str):
    """The import cycles among the modules under ``package`` (each a sorted list of module names),
    read from the source: an edge per module a module names in an import (at top level or inside
    functions)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py") if _under(_module_name(path), package)}
    edges = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for following in edges[todo.pop()] - seen:
                seen.add(following)
                todo.append(following)
        return seen

    cycles = []
    for name in sorted(modules):
        if name in reachable(name) and not any(name in cycle for cycle in cycles):
            cycles.append(sorted(m for m in reachable(name) if name in reachable(m)))
    return cycles

@pytest.mark.python_only
def test_no_import_cycle_among_the_mechanisms():
    """No module of ``mechanisms/`` imports one that imports it back, directly or through others
    (e.g. ``mtp.heads`` reads the families; the families never read ``heads``)."""
    assert _import_cycles(MECHANISMS) == []

"""Which model families a family sweep runs in full on the installed (mlx-lm, mlx) row.

A family sweep (every hybrid family × every situation) proves per release that each family's
model code works with the patched machinery. Most families' code does not change between
releases: running them again on a row whose mlx-lm ships the same model source, with the same
mlx, as an earlier row of the matrix proves nothing new. So on each row of
``tested_versions``:

* a family runs in full where its source (its module under ``mlx_lm/models`` and the model
  modules it imports, e.g. ``ssm.py``, ``gated_delta.py``; not ``cache.py``) differs from every
  earlier row with the same mlx version (rows ordered by mlx-lm, then mlx, then extra packages)
  that ran the test (a test not marked ``core`` runs on the ``suite: full`` rows only);
* elsewhere one family per cache layout (the set of cache classes its prompt cache holds) still
  runs, as does the dense control: the shared machinery - caches, generation, batching, our
  patches - changes on every row, and they exercise it;
* the others are skipped, naming the earlier row that ran them with the same source.

``family_sources.json`` (beside this file) holds the digests of every tested release; it is
written by ``tools/family_sources.py`` from the released wheels. Outside the matrix (a release
or mlx not listed, a git install) everything runs; ``pytest --full-sweeps`` forces that too.
"""

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Dict, Optional

RECORD = Path(__file__).with_name("family_sources.json")
SHARED = {"cache"}  # the machinery every family uses: exercised on every row by the representatives
IMPORT = re.compile(r"^\s*from\s+\.(\w*)\s+import\s+([\w\s,()]+)", re.M)


def module_name(model_type: str) -> str:
    return model_type.replace("-", "_")


def source_digest(model_type: str, read: Callable[[str], Optional[str]]) -> Optional[str]:
    """sha256 over a family's model module and the model modules it imports (recursively),
    ``read(name)`` giving ``models/<name>.py``'s text or ``None``; ``None`` if the family's
    module does not exist."""
    seen, order, stack = set(), [], [module_name(model_type)]
    while stack:
        name = stack.pop()
        if name in seen or name in SHARED:
            continue
        text = read(name)
        if text is None:
            if name == module_name(model_type):
                return None
            continue
        seen.add(name)
        order.append((name, text))
        for source, names in IMPORT.findall(text):
            if source:  # from .ssm import ...
                stack.append(source)
            else:  # from . import ssm, gated_delta
                stack.extend(n.strip() for n in names.replace("(", "").replace(")", "").split(",") if n.strip())
    digest = hashlib.sha256()
    for name, text in sorted(order):
        digest.update(f"{name}\0{text}\0".encode())
    return digest.hexdigest()[:16]


def installed_reader() -> Callable[[str], Optional[str]]:
    import importlib.util

    models = Path(importlib.util.find_spec("mlx_lm").origin).parent / "models"

    def read(name):
        path = models / f"{name}.py"
        return path.read_text() if path.is_file() else None

    return read


def _release(version: str) -> tuple:
    return tuple(int(p) for p in version.split("."))


@functools.lru_cache(maxsize=None)
def _context(core: bool = False):
    """(digests of the installed mlx-lm's families reader, earlier rows with this mlx that ran
    the test: every row for a ``core`` test, else the ``suite: full`` rows) or None when the
    installed versions are not a row of the matrix."""
    from mlx_lm_patches.engine import matrix, versions

    mlx_lm, mlx = versions.mlx_lm(), versions.installed("mlx")
    if mlx_lm.parsed is None or mlx.parsed is None:
        return None
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    extra = {name: versions.installed(name) for row in matrix.load().tested_versions for name, _ in row.packages}
    here = None
    rows = sorted(matrix.load().tested_versions,
                  key=lambda r: (_release(r.mlx_lm), _release(r.mlx), len(r.packages)))
    for row in rows:
        if (row.mlx_lm == str(mlx_lm.parsed) and row.mlx == str(mlx.parsed)
                and all(str(extra[n].parsed) == v for n, v in row.packages)
                and not any(extra[n].parsed is not None for n in extra if n not in dict(row.packages))):
            here = row
            break
    if here is None or here.mlx_lm not in record:
        return None
    earlier = [r for r in rows[: rows.index(here)]
               if r.mlx == here.mlx and r.mlx_lm in record and (core or r.suite == "full")]
    return record, earlier


def layout_of(model_type: str) -> str:
    from mlx_lm_patches.selftest.tiny_models import cache_layout

    return cache_layout(model_type)


@functools.lru_cache(maxsize=None)
def representatives(families: tuple) -> Dict[str, str]:
    """One family per cache layout among ``families`` (the first listed): ``{family: layout}``."""
    chosen = {}
    for family in families:
        layout = layout_of(family)
        if layout not in chosen.values():
            chosen[family] = layout
    return chosen


def skip_reason(family: str, families: tuple, full: bool = False, core: bool = False) -> Optional[str]:
    """Why ``family``'s cells are skipped on this row, or ``None`` when they run (``core``: the
    test runs on every row, not only on ``suite: full`` ones)."""
    context = None if full else _context(core)
    if context is None or family in representatives(families):
        return None
    record, earlier = context
    digest = source_digest(family, installed_reader())
    for row in earlier:
        if digest is not None and record[row.mlx_lm].get(family) == digest:
            return (f"{family}'s model source is the same as in mlx-lm {row.mlx_lm} (swept there with mlx "
                    f"{row.mlx}); its cache layout runs here through {_representative_for(family, families)}")
    return None


def _representative_for(family: str, families: tuple) -> str:
    layout = layout_of(family)
    return next(f for f, l in representatives(families).items() if l == layout)

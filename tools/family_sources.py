"""Write tests/support/family_sources.json: per tested mlx-lm release, a digest of each tiny-model
family's model source (see tests/support/sweeps.py, which decides the family sweeps from it).

Reads the released wheels (downloaded once into ~/.cache/mlx-lm-patches/wheels with python3 -m pip, from
PyPI); run it after adding a row to ``tested_versions``:

    uv run -q --no-project --with pyyaml --with packaging python tools/family_sources.py
"""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support.sweeps import RECORD, source_digest  # noqa: E402

WHEELS = Path.home() / ".cache" / "mlx-lm-patches" / "wheels"


def _constant(module: str, name: str):
    """A tuple constant of ``mlx_lm_patches/selftest/<module>.py``, read without importing mlx."""
    import ast

    tree = ast.parse((REPO / "mlx_lm_patches" / "selftest" / f"{module}.py").read_text())
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(getattr(t, "id", "") == name for t in targets):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit(f"{name} not found in selftest/{module}.py")


def swept_model_types():
    """The families the sweeps cover: HYBRID_MODEL_TYPES (tiny_models.py), then the MTP families
    (MTP_MODEL_TYPES, mtp_checkpoints.py)."""
    hybrid = _constant("tiny_models", "HYBRID_MODEL_TYPES")
    return hybrid + tuple(f for f in _constant("mtp_checkpoints", "MTP_MODEL_TYPES") if f not in hybrid)


def wheel(version: str) -> Path:
    found = sorted(WHEELS.glob(f"mlx_lm-{version}-*.whl"))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["python3", "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(WHEELS), f"mlx-lm=={version}"], check=True)
        found = sorted(WHEELS.glob(f"mlx_lm-{version}-*.whl"))
    return found[0]


def main() -> int:
    from mlx_lm_patches.engine import matrix

    tested = matrix.load(str(REPO / "compat_matrix.yaml")).tested_versions
    releases = sorted({row.mlx_lm for row in tested},
                      key=lambda v: tuple(int(p) for p in v.split(".")))
    families = swept_model_types()
    record = {}
    for version in releases:
        with zipfile.ZipFile(wheel(version)) as whl:
            names = set(whl.namelist())

            def read(name):
                path = f"mlx_lm/models/{name}.py"
                return whl.read(path).decode() if path in names else None

            record[version] = {f: d for f in families if (d := source_digest(f, read)) is not None}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    changed = {v: [f for f in record[v] if i == 0 or record[releases[i - 1]].get(f) != record[v][f]]
               for i, v in enumerate(releases)}
    for version in releases:
        print(f"{version}: {len(record[version])} families, changed since the previous release: "
              f"{', '.join(changed[version]) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

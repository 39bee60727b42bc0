"""Write tests/support/family_sources.json: per tested mlx-lm release, a digest of each tiny-model
family's model source (see tests/support/sweeps.py, which decides the family sweeps from it).

Reads the released wheels (downloaded once into ~/.cache/mlx-lm-patches/wheels with python3 -m pip, from
PyPI); run it after adding a row to ``tested_versions``:

    uv run -q --no-project --with pyyaml python tools/family_sources.py
"""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support.sweeps import RECORD, source_digest  # noqa: E402

WHEELS = Path.home() / ".cache" / "mlx-lm-patches" / "wheels"


def hybrid_model_types():
    """HYBRID_MODEL_TYPES from demos/tiny_models.py, read without importing mlx."""
    import ast

    tree = ast.parse((REPO / "mlx_lm_patches" / "demos" / "tiny_models.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "HYBRID_MODEL_TYPES":
            return ast.literal_eval(node.value)
    raise SystemExit("HYBRID_MODEL_TYPES not found in demos/tiny_models.py")


def wheel(version: str) -> Path:
    found = sorted(WHEELS.glob(f"mlx_lm-{version}-*.whl"))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["python3", "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(WHEELS), f"mlx-lm=={version}"], check=True)
        found = sorted(WHEELS.glob(f"mlx_lm-{version}-*.whl"))
    return found[0]


def main() -> int:
    data = yaml.safe_load((REPO / "compat_matrix.yaml").read_text())
    releases = sorted({str(row["mlx_lm"]) for row in data["tested_versions"]},
                      key=lambda v: tuple(int(p) for p in v.split(".")))
    families = hybrid_model_types()
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

"""compat_matrix.yaml: valid, and in agreement with the patch modules and docs/patches.md."""

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest
from packaging.version import Version

from mlx_lm_patches import patches
from mlx_lm_patches.engine import contract, matrix
from mlx_lm_patches.__main__ import render_table

REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = Path(patches.__file__).resolve().parent


def test_shipped_matrix_is_the_repository_matrix(the_matrix):
    source = REPO / "compat_matrix.yaml"
    if source.is_file():  # running from a checkout: the wheel must carry the same file
        assert the_matrix.path.read_text() == source.read_text()


def test_every_patch_has_a_module_with_the_interface(the_matrix):
    for spec in the_matrix.patches:
        module = importlib.import_module(spec.module_name)
        for name in contract.REQUIRED:
            assert callable(getattr(module, name, None)), f"{spec.module_name} lacks {name}()"
        doc = inspect.getdoc(module) or ""
        for section in contract.DOCSTRING_SECTIONS:
            assert f"\n{section}\n" in f"\n{doc}\n", f"{spec.module_name} docstring lacks {section}"
        for section in contract.MATRIX_ONLY_SECTIONS:  # one place per fact: the matrix
            assert f"\n{section}\n" not in f"\n{doc}\n", f"{spec.module_name}: {section} belongs in the matrix"
        assert "https://" not in doc, f"{spec.module_name}: upstream links belong in the matrix"
        assert spec.upstream, spec.id
        assert all(u.startswith("https://") for u in spec.upstream), spec.id


def test_every_patch_module_has_a_matrix_entry(the_matrix):
    modules = {p.stem for p in PATCH_DIR.glob("*.py") if p.stem != "__init__"}
    assert modules == {s.id.replace("-", "_") for s in the_matrix.patches}


def test_patch_modules_only_declare_targets_under_their_entry(the_matrix):
    """String targets passed to p.wrap/p.set in the source lie under the declared targets."""
    for spec in the_matrix.patches:
        source = (PATCH_DIR / f"{spec.id.replace('-', '_')}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(("mlx_lm.", "mlx_vlm.")) and ":" in node.value:
                assert any(node.value == t or node.value.startswith(t + ".") for t in spec.targets), node.value


def test_patches_of_other_distributions_anchor_in_them(the_matrix):
    """A patch about another distribution's bug (``package``, e.g. mlx-vlm) is decided when that
    distribution's module is imported, and touches nothing else."""
    for spec in the_matrix.patches:
        top = spec.package.replace("-", "_")
        assert all(t.split(":")[0] == top or t.startswith(top + ".") for t in spec.targets), spec.id


def test_tested_versions_cover_the_supported_range(the_matrix):
    tested = {Version(t.mlx_lm) for t in the_matrix.tested_versions}
    required = {"0.28.4", "0.29.1", "0.30.0", "0.30.2", "0.30.4", "0.30.5", "0.30.6", "0.30.7", "0.31.1", "0.31.2", "0.31.3", "0.32.0", "0.32.2"}
    assert {Version(v) for v in required} <= tested
    assert all(the_matrix.supported.contains(v) for v in tested)
    newest = max(tested)
    mlx_for_newest = {Version(t.mlx) for t in the_matrix.tested_versions if Version(t.mlx_lm) == newest}
    assert len(mlx_for_newest) >= 2, "newest mlx-lm must be tested with its release-time and the newest mlx"
    assert {t.python for t in the_matrix.tested_versions} >= {"3.10", "3.11", "3.12", "3.13"}


@pytest.mark.python_only
def test_the_patch_table_is_generated_from_the_matrix(the_matrix):
    """docs/patches.md is what tools/patch_table.py writes from the matrix, and its table is what
    ``python -m mlx_lm_patches table`` prints."""
    tool, written = REPO / "tools" / "patch_table.py", REPO / "docs" / "patches.md"
    if not (tool.is_file() and written.is_file()):
        pytest.skip("tools/ and docs/ are not beside the tests (installed-only run)")
    spec = importlib.util.spec_from_file_location("patch_table", tool)
    patch_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patch_table)
    assert written.read_text() == patch_table.render(the_matrix), "docs/patches.md is stale: python tools/patch_table.py"
    assert render_table(the_matrix) in written.read_text()


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(schema=2), "schema: 1"),
    (lambda d: d["patches"][0].update(id="Bad_Id"), "kebab-case"),
    (lambda d: d["patches"][0].update(affected=">=zero"), "PEP 440"),
    (lambda d: d["patches"][0].update(targets=["no_colon"]), "module:qualname"),
    (lambda d: d["patches"][0].update(fixed_in="0.29.0", affected=">=0.28.4"), "inside affected"),
    (lambda d: d["patches"][0].update(surprise=1), "unknown keys"),
    (lambda d: d["patches"].append(dict(d["patches"][0])), "duplicate"),
    (lambda d: d["tested_versions"].append({"mlx_lm": "x"}), "expected keys"),
    (lambda d: d["tested_versions"].append({"mlx_lm": "0.32.2", "mlx": "0.32.4", "python": "3.12",
                                            "packages": {"mlx-vlm": "new"}}), "not a version"),
    (lambda d: d["tested_versions"].append({"mlx_lm": "0.32.2", "mlx": "0.32.4", "python": "3.12",
                                            "packages": ["mlx-vlm"]}), "must map"),
    (lambda d: d["tested_versions"].append({"mlx_lm": "0.32.2", "mlx": "0.32.4", "python": "3.12",
                                            "suite": "smoke"}), "not one of full, core"),
    (lambda d: d["patches"][0].update(package="mlx vlm"), "not a distribution name"),
    (lambda d: d["patches"][0].update(package="mlx-vlm"), "must lie in mlx-vlm's modules"),
])
def test_malformed_matrix_is_rejected_clearly(the_matrix, mutate, message):
    import copy

    import yaml

    data = yaml.safe_load(the_matrix.path.read_text())
    data = copy.deepcopy(data)
    mutate(data)
    with pytest.raises(matrix.MatrixError, match=message):
        matrix.parse(data, Path("compat_matrix.yaml"))


def test_ci_runs_the_readme_test_command():
    readme, ci = REPO / "README.md", REPO / ".ci" / "run"
    if not (readme.is_file() and ci.is_file()):
        pytest.skip("not running from a checkout")
    commands = [block.split("```", 1)[0].strip() for block in readme.read_text().split("```sh\n")[1:]]
    test_command = next(c for c in commands if "run_matrix.py" in c)
    assert test_command in ci.read_text().splitlines()


def test_the_readme_commands_can_run_again():
    """Both commands for a fresh machine are run again on the same clone (after a pull, or for
    another release): a ``uv venv`` of theirs must accept the folder it made the first time
    (``uv venv`` refuses an existing one unless told). tools/run_matrix.py removes its venvs
    itself before making them again."""
    readme = REPO / "README.md"
    if not readme.is_file():
        pytest.skip("not running from a checkout")
    commands = [block.split("```", 1)[0].strip() for block in readme.read_text().split("```sh\n")[1:]]
    steps = [step.strip() for command in commands for step in command.split("&&")]
    venvs = [step for step in steps if step.startswith("uv venv")]
    assert venvs, "the README's setup command makes a venv"
    assert all("--allow-existing" in step.split() or "--clear" in step.split() for step in venvs), venvs


def test_full_rows_span_the_releases(the_matrix):
    """``suite: core`` rows run a subset (tools/run_matrix.py): the oldest release keeps a full
    row with its release-time mlx, and the newest mlx on the newest release runs the full suite."""
    rows = [r for r in the_matrix.tested_versions if not r.packages]
    releases = sorted({Version(r.mlx_lm) for r in rows})
    full = {(Version(r.mlx_lm), r.mlx) for r in rows if r.suite == "full"}
    oldest_mlx = min((row.mlx for row in rows if Version(row.mlx_lm) == releases[0]), key=Version)
    assert (releases[0], oldest_mlx) in full, f"{releases[0]} lost its full row"
    newest_mlx = max((r.mlx for r in rows), key=Version)
    assert (releases[-1], newest_mlx) in full, "the newest mlx on the newest mlx-lm runs the full suite"

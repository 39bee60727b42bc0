"""tools/run_matrix.py's own logic: the schedule (every row once, longest first, no two cold
compilations of one mlx version at once while anything else is left) and the kernel caches
(a session's private copy, merged back file by file)."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "run_matrix.py"


@pytest.fixture(scope="module")
def run_matrix():
    if not TOOL.is_file():
        pytest.skip("not running from a checkout")
    spec = importlib.util.spec_from_file_location("run_matrix", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(*pairs):
    return [dict(name=f"row{i}-mlx{mlx}", mlx=mlx) for i, (mlx, _) in enumerate(pairs)], {
        f"row{i}-mlx{mlx}": seconds for i, (mlx, seconds) in enumerate(pairs)}


def _timeline(plans, durations):
    """(start, end, row) of every planned row, workers running their plans back to back."""
    spans = []
    for plan in plans:
        clock = 0.0
        for row in plan:
            spans.append((clock, clock + durations[row["name"]], row))
            clock += durations[row["name"]]
    return spans


def test_every_row_runs_once_longest_first_and_balanced(run_matrix):
    rows, durations = _rows(("a", 400), ("b", 350), ("c", 300), ("a", 250), ("d", 200), ("b", 150),
                            ("c", 100), ("d", 50), ("e", 40))
    plans = run_matrix.schedule(rows, durations, 2)
    planned = [row["name"] for plan in plans for row in plan]
    assert sorted(planned) == sorted(durations) and len(planned) == len(set(planned))
    loads = [sum(durations[row["name"]] for row in plan) for plan in plans]
    assert max(loads) - min(loads) <= 100, loads  # a greedy longest-first split of 1840 s
    for plan in plans:
        assert plan[0]["name"] in ("row0-mlxa", "row1-mlxb")


def test_a_version_compiling_cold_is_not_started_twice_at_once(run_matrix):
    rows, durations = _rows(("a", 400), ("a", 300), ("d", 300), ("b", 100), ("b", 90), ("c", 80))
    spans = {row["name"]: (start, end) for start, end, row in
             _timeline(run_matrix.schedule(rows, durations, 2), durations)}
    # longest first would start the second "a" row at once, beside the first, both compiling
    assert spans["row0-mlxa"] == (0, 400) and spans["row2-mlxd"] == (0, 300)
    assert spans["row1-mlxa"][0] >= 400, spans


def test_with_only_one_version_left_both_workers_still_run(run_matrix):
    rows, durations = _rows(("a", 100), ("a", 100))
    plans = run_matrix.schedule(rows, durations, 2)
    assert sorted(len(plan) for plan in plans) == [1, 1]


def test_a_session_copies_the_shared_kernels_and_merges_back_only_new_files(run_matrix, tmp_path, monkeypatch):
    monkeypatch.setattr(run_matrix, "WORK", tmp_path / "work")
    monkeypatch.setattr(run_matrix, "KERNEL_CACHES", tmp_path / "caches")
    shared = tmp_path / "caches" / "0.30.4" / "mlx" / "0.30.4"
    shared.mkdir(parents=True)
    (shared / "old.so").write_bytes(b"old")
    tmp = run_matrix.session_tmp(dict(name="row", mlx="0.30.4"))
    copied = tmp / "mlx" / "0.30.4"
    assert (copied / "old.so").read_bytes() == b"old"
    (copied / "old.so").write_bytes(b"rewritten")  # the shared file is a copy, never written through
    assert (shared / "old.so").read_bytes() == b"old"
    (copied / "new.so").write_bytes(b"new")
    long_name = "lib" + "B" * 240 + ".so"  # mlx's kernel names come close to the 255-byte limit
    (copied / long_name).write_bytes(b"long")
    (tmp / "pytest-of-someone").mkdir()  # what tests leave in TMPDIR is not a kernel
    assert run_matrix.keep_kernels(tmp, "0.30.4") == 2
    assert sorted(p.name for p in shared.iterdir()) == sorted([long_name, "new.so", "old.so"])
    assert (shared / "old.so").read_bytes() == b"old" and (shared / "new.so").read_bytes() == b"new"
    assert not (tmp_path / "caches" / "0.30.4" / "pytest-of-someone").exists()
    fresh = run_matrix.session_tmp(dict(name="row", mlx="0.30.4"))  # a rerun starts clean
    assert sorted(p.name for p in (fresh / "mlx" / "0.30.4").iterdir()) == sorted([long_name, "new.so", "old.so"])


def test_upstream_tests_run_in_their_own_rootdir(tmp_path):
    """tools/upstream_tests.py runs an sdist's tests under their own (empty) pytest configuration,
    even inside a project that has one (CI's TMPDIR lies inside the clone): the enclosing
    project's options do not apply, and the ids it reads back name the tests it ran, so the
    stock rerun runs only those."""
    import io
    import sys
    import tarfile

    path = TOOL.parent / "upstream_tests.py"
    spec = importlib.util.spec_from_file_location("upstream_tests", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    project = tmp_path / "project"  # an enclosing project whose options would deselect everything
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\nxfail_strict = true\n')
    archive = tmp_path / "pkg-1.0.tar.gz"
    source = (b"import unittest\nimport pytest\n\nclass TestThings(unittest.TestCase):\n"
              b"    def test_passes(self):\n        pass\n    def test_fails(self):\n        self.fail('no')\n\n"
              b"@pytest.mark.xfail(reason='known')\ndef test_known_to_fail_but_passes():\n    pass\n")
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("pkg-1.0/tests/test_things.py", source), ("pkg-1.0/setup.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    run = project / "run"
    run.mkdir()
    tests = tool.extract_tests(archive, run)
    assert sorted(p.name for p in tests.iterdir()) == ["test_things.py"]
    assert not (run / "setup.py").exists()

    passed, outcomes, _, _ = tool.run_pytest(sys.executable, ["tests/test_things.py"], run, patched=True,
                                             report=run / "report.xml")
    # without its own rootdir: classnames carry the path from the project, and xfail_strict fails the xpass
    assert outcomes == {"tests.test_things.TestThings::test_passes": "passed",
                        "tests.test_things.TestThings::test_fails": "failed",
                        "tests.test_things::test_known_to_fail_but_passes": "passed"}, outcomes
    failing = [t for t, o in outcomes.items() if o != "passed"]
    assert tool._node_ids(failing, ["tests/test_things.py"]) == ["tests/test_things.py::TestThings::test_fails"]


@pytest.mark.parametrize("suite,python_only,twin,expected", [
    ("full", False, False, "not python_only"),
    ("full", True, False, ""),
    ("full", False, True, "not python_only and not release_only"),
    ("core", False, False, "core and not python_only"),
    ("core", True, False, "(core or python_only)"),
    ("core", False, True, "core and not python_only and not release_only"),
])
def test_a_row_selects_its_suite(run_matrix, suite, python_only, twin, expected):
    row = dict(suite=suite, python_only=python_only, mlx_twin=twin)
    assert run_matrix.marker_expression(row) == expected


def test_a_core_row_collects_the_core_files(run_matrix):
    """The expression selects what it says on a real collection (one, for time): a ``core`` row
    collects the files tests/row_selection.py lists in CORE, each of them."""
    import subprocess
    import sys

    from conftest import REPO
    from row_selection import CORE

    def collected(expression):
        ran = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", expression, "tests"], capture_output=True, text=True, cwd=REPO)
        return {line.split("::")[0].rsplit("/", 1)[-1] for line in ran.stdout.splitlines() if "::" in line}

    core = collected(run_matrix.marker_expression(dict(suite="core", python_only=False, mlx_twin=False)))
    assert core == set(CORE), sorted(core ^ set(CORE))


def test_rows_are_the_matrix_rows_and_every_selected_file_exists(run_matrix):
    """The tool reads ``tested_versions`` through the package's matrix reader, and every file
    tests/row_selection.py names is a test module (a rename would otherwise drop it silently)."""
    from conftest import REPO
    from mlx_lm_patches.engine import matrix

    import row_selection

    rows = run_matrix.load_rows()
    assert [r["name"] for r in rows] == [t.name for t in matrix.load().tested_versions]
    named = [n.split("::")[0] for n in row_selection.PYTHON_ONLY + row_selection.CORE]
    named += [f.rsplit("/", 1)[-1] for f in row_selection.package_row_files(row_selection.PACKAGES)]
    missing = sorted({n for n in named if not (REPO / "tests" / n).is_file()})
    assert not missing, missing
    with_vlm = run_matrix.row_selection().package_row_files(["mlx-vlm"])
    assert with_vlm[-1] == "tests/test_mlx_vlm_batching.py" and "tests/test_matrix_cells.py" in with_vlm


def test_a_package_row_judges_only_its_packages_where_its_versions_have_a_row_of_their_own(run_matrix):
    """On the real matrix: mlx-vlm rows on mlx-lm 0.32.2 with mlx 0.32.4 (a row of its own) judge
    only mlx-vlm's patches; a package row whose mlx-lm and mlx pair is found nowhere else judges
    every patch; rows without packages judge every patch."""
    rows = run_matrix.load_rows()
    run_matrix.mark_package_judging(rows)
    plain = {(r["mlx_lm"], r["mlx"]) for r in rows if not r["packages"]}
    with_packages = [r for r in rows if r["packages"]]
    assert with_packages and not any(r["judges_only_packages"] for r in rows if not r["packages"])
    for row in with_packages:
        assert row["judges_only_packages"] == ((row["mlx_lm"], row["mlx"]) in plain), row["name"]
    assert any(r["judges_only_packages"] for r in with_packages)


def test_judging_only_a_package_deselects_the_other_patches_cells(tmp_path):
    """``--judge-only-packages=mlx-vlm`` on a real collection: the matrix cells and probe traces
    left are exactly mlx-vlm's patches'."""
    import subprocess
    import sys

    from conftest import REPO
    from mlx_lm_patches.engine import matrix

    ran = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "--judge-only-packages=mlx-vlm", "tests/test_matrix_cells.py"],
                         capture_output=True, text=True, cwd=REPO)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    pids = {line.rsplit("[", 1)[1].rstrip("]") for line in ran.stdout.splitlines() if "::" in line and "[" in line}
    assert pids == {spec.id for spec in matrix.load().patches if spec.package == "mlx-vlm"}


def test_a_core_row_names_every_file_its_markers_select():
    """A ``core`` row names its files (collecting only those): every CORE file, and on its
    Python's ``python_only`` row every file holding a ``python_only`` test."""
    import row_selection

    plain, with_python = row_selection.core_row_files(False), row_selection.core_row_files(True)
    assert plain == [f"tests/{name}" for name in row_selection.CORE]
    assert set(with_python) == set(plain) | {f"tests/{entry.split('::')[0]}" for entry in row_selection.PYTHON_ONLY}

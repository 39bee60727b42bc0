"""Run the test suite once per row of ``tested_versions`` in compat_matrix.yaml.

Each session: a fresh uv venv on that row's Python (found under pyenv or on PATH; never
downloaded), the package installed *non-editable* from a wheel built once (so the real ``.pth``
is exercised), ``mlx-lm==X`` with its release-time ``mlx[cpu]==Y`` plus the row's ``packages``
(e.g. ``mlx-vlm==0.4.0``), then pytest with ``MLX_LM_PATCHES_STRICT=1``. Logs go to ``.matrix/``.
The last line is the plain total, ``matrix: N passed, N failed``.

What keeps a full run inside CI's budget (2 cores), without dropping a cell:

* a row's venv is installed in the background while the row before it (same worker) runs its
  tests (``Prefetch``): installs are mostly downloads and copies, tests are CPU.

* mlx's CPU backend compiles kernels once and caches them under ``$TMPDIR/mlx/<mlx version>``
  (60-85 MB for mlx 0.29-0.31, ~1 MB for 0.32): a test file took 52.7 s cold and 13.9 s warm.
  Each session runs in a private ``TMPDIR`` (``.matrix/tmp/<row>``, removed afterwards: what
  tests leave there goes with it) seeded with a copy of its mlx version's shared kernel cache
  (``~/.cache/mlx-lm-patches/mlx-tmp/<mlx version>/mlx``, kept across rows and runs); after a
  passing session the kernels it compiled are added to the shared cache, file by file, each
  renamed into place. So two sessions never write one cache, and rows are free to run anywhere.
* Rows are scheduled longest first (the seconds they took in the last full run,
  ``tools/matrix_durations.json``, rewritten after every full run): a free worker takes the
  longest row left, but not one whose mlx version another worker is still compiling cold while
  any other row is left.
* no ``--compile-bytecode``: sessions write the bytecode of what they import (see ``_env``).
* A row with ``suite: core`` (compat_matrix.yaml) runs the tests marked ``core`` (the matrix
  cells and what changes with every release; tests/row_selection.py ``CORE``), the others everything:
  the full suite on every release took 85 minutes on 2 cores; a few full rows spread over the
  releases keep the run inside the budget (the matrix file says which and why).
* Tests marked ``python_only`` (activation, the engine on a fake package, variables, the matrix
  file, CLI status/table) do not depend on mlx-lm: they run on one row per Python version, the
  newest mlx-lm row of that Python, and are deselected elsewhere (``-m "not python_only"``).

* Tests marked ``release_only`` (entry points in fresh processes: the CLIs, ``mlx_lm.server``
  over HTTP, distributed launches, import/apply/revert orders) depend on the mlx-lm release, not
  on mlx: they run on the release's own row (its release-time mlx) and are deselected on a row
  that only pairs the same release with a newer mlx; that row runs everything else in-process.
* A row with further ``packages`` runs the tests of those packages, the matrix cells, the CLI and
  the probes' traces: everything else is its mlx-lm release's, proven on the release's own row.
  Where its mlx-lm and mlx also make a row without packages, it judges only its packages'
  patches (``--judge-only-packages``): the others' cells are that row's.
* Which tests are ``core``, ``python_only`` or a package row's is declared once, in
  tests/row_selection.py (tests/conftest.py marks the tests from it); the rows are read through
  the package's own matrix reader (``mlx_lm_patches.engine.matrix``).
* Packages whose default install drags in what no test uses are installed without their
  dependencies, plus the ones their tested code imports (``WITHOUT_DEPENDENCIES``): a default
  vllm-mlx install pulls torch with CUDA wheels (~2.5 GB) through torchvision.

After pytest, one row per mlx-lm release (its release-time mlx, no extra packages) also runs
mlx-lm's own offline tests from that release's sdist, patched, then stock where they did not pass
patched, and fails on any test that passes stock and fails patched (``tools/upstream_tests.py``).

nox or tox-uv would give the venvs but not the grouping: neither runs sessions in parallel, and
on 2 cores two sessions at a time are what fits the budget.

    python tools/run_matrix.py                  # every row
    python tools/run_matrix.py -k 0.32.2        # rows whose name contains 0.32.2
    python tools/run_matrix.py --reuse -- -x tests/test_activation.py   # extra pytest args
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / ".matrix"
# package -> what its engine and server import beyond mlx-lm's and mlx-vlm's dependencies
WITHOUT_DEPENDENCIES = {"vllm-mlx": ["jsonschema"]}
# seconds each row's tests took in the last full runs: the order groups are scheduled in
DURATIONS = REPO / "tools" / "matrix_durations.json"
KERNEL_CACHES = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx-lm-patches" / "mlx-tmp"


def find_python(version: str) -> str:
    """An interpreter for ``X.Y``: pyenv's installs first, then PATH. Never a download."""
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")]
    for root in filter(None, roots):
        for candidate in sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True):
            if os.access(candidate, os.X_OK):
                return candidate
    for name in (f"python{version}",):
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() == version:
                return path
    raise SystemExit(f"run_matrix: no Python {version} found (pyenv versions or python{version} on PATH)")


def build_wheel() -> Path:
    dist = WORK / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    subprocess.run(["uv", "build", "--wheel", "-q", "-o", str(dist), str(REPO)], check=True)
    (wheel,) = dist.glob("*.whl")
    return wheel


def counts(text: str, plain: bool = False):
    """passed/failed(+errors) from pytest's closing line (``plain``: from a line that is just
    ``N passed, N failed``, as tools/upstream_tests.py prints)."""
    pattern = r"^\d+ passed, \d+ failed$" if plain else r"\d+ (passed|failed|error)"
    last = [line for line in text.splitlines() if re.search(pattern, line)]
    if not last:
        return 0, 0
    line = last[-1]
    get = lambda word: sum(int(n) for n in re.findall(rf"(\d+) {word}", line))  # noqa: E731
    return get("passed"), get("failed") + get("errors?") + get("xpassed")


def _env() -> dict:
    """Sessions write bytecode as they import (``PYTHONDONTWRITEBYTECODE`` dropped): compiling
    a whole venv at install (``--compile-bytecode``, mostly transformers, never imported) cost
    ~12 s of CPU per row, taken from the tests running beside the install; without bytecode
    at all every fresh interpreter of a test would compile what it imports again."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLX_LM_PATCHES") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env.update(UV_PYTHON_DOWNLOADS="never", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _step(out, argv, env, **kw) -> int:
    out.write(f"$ {' '.join(map(str, argv))}\n")
    out.flush()
    return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, **kw).returncode


def prepare(row, wheel: Path, reuse: bool) -> tuple:
    """The row's venv with everything installed: ``(return code, seconds)``. Mostly downloads
    and file copies, so it runs ahead, beside the tests of another row (see ``Prefetch``)."""
    venv = WORK / "venvs" / row["name"]
    log = WORK / "logs" / f"{row['name']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started, env = time.monotonic(), _env()
    with open(log, "w") as out:
        python = find_python(row["python"])
        rc = 0
        if not (reuse and (venv / "bin" / "python").exists()):
            shutil.rmtree(venv, ignore_errors=True)
            rc = _step(out, ["uv", "venv", "-q", "-p", python, str(venv)], env)
        install = ["uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python")]
        bare = [(name, version) for name, version in row["packages"] if name in WITHOUT_DEPENDENCIES]
        if rc == 0:
            rc = _step(out, [*install, "--reinstall-package", "mlx-lm-patches", f"{wheel}[cpu,test]",
                             f"mlx-lm=={row['mlx_lm']}", f"mlx=={row['mlx']}", f"mlx-cpu=={row['mlx']}",
                             *(f"{name}=={version}" for name, version in row["packages"] if (name, version) not in bare),
                             *(dep for name, _ in bare for dep in WITHOUT_DEPENDENCIES[name])], env)
        if rc == 0 and bare:
            rc = _step(out, [*install, "--no-deps", *(f"{name}=={version}" for name, version in bare)], env)
    return rc, time.monotonic() - started


class Prefetch:
    """Prepares rows' venvs in the background, at most one row ahead of each worker: while a
    worker tests a row, the next row it will take is installed."""

    def __init__(self, wheel: Path, reuse: bool):
        self.wheel, self.reuse = wheel, reuse
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.lock = threading.Lock()
        self.futures = {}

    def get(self, row):
        with self.lock:
            if row["name"] not in self.futures:
                self.futures[row["name"]] = self.pool.submit(prepare, row, self.wheel, self.reuse)
            future = self.futures[row["name"]]
        return future.result()

    def ahead(self, rows, index):
        """A worker has started ``rows[index]``: prepare the row it takes next."""
        with self.lock:
            if index + 1 < len(rows) and rows[index + 1]["name"] not in self.futures:
                row = rows[index + 1]
                self.futures[row["name"]] = self.pool.submit(prepare, row, self.wheel, self.reuse)


def session_tmp(row) -> Path:
    """A fresh private ``TMPDIR`` for the session, seeded with the shared kernel cache of its mlx
    version (a copy: the session never writes the shared one)."""
    tmp = WORK / "tmp" / row["name"]
    shutil.rmtree(tmp, ignore_errors=True)
    shared = KERNEL_CACHES / row["mlx"] / "mlx"
    if shared.is_dir():
        shutil.copytree(shared, tmp / "mlx")
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def keep_kernels(tmp: Path, mlx_version: str) -> int:
    """Add the kernels a passing session compiled to its mlx version's shared cache; each file is
    written under a short name in the cache's ``.incoming`` folder (kernel names come close to
    the 255-byte limit) and renamed into place, so a session seeding meanwhile copies whole files
    only. A file that cannot be added is left out (the cache only saves time). The number of
    files added."""
    compiled, shared = tmp / "mlx", KERNEL_CACHES / mlx_version / "mlx"
    incoming = KERNEL_CACHES / mlx_version / ".incoming"
    added = 0
    for path in compiled.rglob("*") if compiled.is_dir() else ():
        target = shared / path.relative_to(compiled)
        if not path.is_file() or target.exists():
            continue
        partial = incoming / f"{os.getpid()}-{threading.get_ident()}-{added}"
        try:
            incoming.mkdir(parents=True, exist_ok=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, partial)
            os.replace(partial, target)
            added += 1
        except OSError as error:
            print(f"run_matrix: kernel {path.name} not kept: {error}", file=sys.stderr, flush=True)
            partial.unlink(missing_ok=True)
    return added


def session(row, prefetch: Prefetch, rows, index, pytest_args) -> dict:
    name = row["name"]
    venv = WORK / "venvs" / name
    log = WORK / "logs" / f"{name}.log"
    env = _env()
    waited = time.monotonic()
    rc, install_seconds = prefetch.get(row)
    started = time.monotonic()
    prefetch.ahead(rows, index)
    tested = False
    tmp = session_tmp(row)
    with open(log, "a") as out:
        if rc == 0:
            test_env = dict(env, MLX_LM_PATCHES_STRICT="1", MLX_LM_PATCHES_EXPECT_INSTALLED="1", TMPDIR=str(tmp),
                            VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
            selection = ["-m", marks] if (marks := marker_expression(row)) else []
            if row["suite"] == "core" and not row["packages"] and not pytest_args:
                selection += row_selection().core_row_files(row["python_only"])
            if row["packages"] and not row["python_only"] and not pytest_args:
                selection += row_selection().package_row_files([name for name, _ in row["packages"]])
            if row["judges_only_packages"] and not pytest_args:
                selection.append("--judge-only-packages=" + ",".join(name for name, _ in row["packages"]))
            tested = True
            rc = _step(out, [str(venv / "bin" / "pytest"), "-q", "-p", "no:cacheprovider", "-rfE", "--durations=40", *selection, *pytest_args],
                       test_env, cwd=str(REPO))
    ours = counts(log.read_text())
    upstream = (0, 0)
    if tested and row["upstream_tests"] and not pytest_args:
        with open(log, "a") as out:
            out.write(f"$ python tools/upstream_tests.py --python {venv / 'bin' / 'python'}\n")
            out.flush()
            done = subprocess.run([sys.executable, str(REPO / "tools" / "upstream_tests.py"), "--python",
                                   str(venv / "bin" / "python")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=dict(env, TMPDIR=str(tmp)))
            out.write(done.stdout)
        upstream = counts(done.stdout, plain=True)
        rc = rc or done.returncode
    if rc == 0:
        keep_kernels(tmp, row["mlx"])
    shutil.rmtree(tmp, ignore_errors=True)
    passed, failed = ours[0] + upstream[0], ours[1] + upstream[1]
    if rc != 0 and failed == 0:
        failed = 1  # install failure or a crash before pytest's summary
    return dict(name=name, rc=rc, passed=passed, failed=failed, seconds=time.monotonic() - started,
                install=install_seconds, waited=started - waited, log=log)


def marker_expression(row) -> str:
    """The row's ``-m`` selection: a ``core`` row (``suite: core`` in the matrix) runs the tests
    marked ``core`` (and, on its Python's ``python_only`` row, those); ``python_only`` tests run
    on their rows only, ``release_only`` tests not on an mlx twin."""
    terms = []
    if row["suite"] == "core":
        terms.append("(core or python_only)" if row["python_only"] else "core")
    if not row["python_only"]:
        terms.append("not python_only")
    if row["mlx_twin"]:
        terms.append("not release_only")
    return " and ".join(terms)


def load_rows() -> list:
    """The rows of ``tested_versions``, read and validated by the package's own matrix reader
    (``mlx_lm_patches.engine.matrix``, imported from this checkout), as the dicts the sessions
    and the schedule annotate."""
    sys.path.insert(0, str(REPO))
    from mlx_lm_patches.engine import matrix

    return [dict(name=t.name, mlx_lm=t.mlx_lm, mlx=t.mlx, python=t.python, suite=t.suite, packages=list(t.packages))
            for t in matrix.load(str(REPO / "compat_matrix.yaml")).tested_versions]


def row_selection():
    """tests/row_selection.py: which tests a row runs, declared once (plain data)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("row_selection", REPO / "tests" / "row_selection.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def release(version: str) -> tuple:
    """``"0.30.10"`` -> ``(0, 30, 10)``: tested versions are plain releases."""
    return tuple(int(part) for part in version.split("."))


def mark_python_only_rows(rows) -> None:
    """One row per Python version runs the ``python_only`` tests: its newest mlx-lm (then
    fewest extra packages, then newest mlx)."""
    best = {}
    for row in rows:
        rank = (release(row["mlx_lm"]), -len(row["packages"]), release(row["mlx"]))
        if row["python"] not in best or rank > best[row["python"]][0]:
            best[row["python"]] = (rank, row)
    for row in rows:
        row["python_only"] = best[row["python"]][1] is row


def mark_upstream_rows(rows) -> None:
    """One row per mlx-lm release runs its upstream tests: the one with the oldest mlx (the
    release-time pin) and no extra packages."""
    best = {}
    for row in rows:
        if row["packages"]:
            continue
        if row["mlx_lm"] not in best or release(row["mlx"]) < release(best[row["mlx_lm"]]["mlx"]):
            best[row["mlx_lm"]] = row
    for row in rows:
        row["upstream_tests"] = best.get(row["mlx_lm"]) is row


def mark_package_judging(rows) -> None:
    """``judges_only_packages``: a row with further packages whose mlx-lm and mlx are also a row
    without them. It judges (``check``, the matrix cells, the probes' traces) only the patches
    of its packages: the other patches' cells are the same versions' cells, judged on that row."""
    plain = {(row["mlx_lm"], row["mlx"]) for row in rows if not row["packages"]}
    for row in rows:
        row["judges_only_packages"] = bool(row["packages"]) and (row["mlx_lm"], row["mlx"]) in plain


def mark_mlx_twins(rows) -> None:
    """``mlx_twin``: a row without further packages whose mlx-lm release has its own full row
    (the one that runs the upstream tests, with the release-time mlx): it only adds a newer mlx,
    and leaves the entry points (``release_only``) to that row. Where the release's own row is a
    ``core`` one, the full row with the newer mlx runs them."""
    own = {row["mlx_lm"] for row in rows if row["upstream_tests"] and row["suite"] == "full"}
    for row in rows:
        row["mlx_twin"] = not row["packages"] and not row["upstream_tests"] and row["mlx_lm"] in own


def load_durations() -> dict:
    """``{row name: seconds}`` of the last full runs (``DURATIONS``, committed); {} if absent."""
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def save_durations(results) -> None:
    """Record the test seconds of rows that ran in full and passed (commit the file when the
    order it gives changes)."""
    known = load_durations()
    known.update({r["name"]: round(r["seconds"]) for r in results if r["rc"] == 0})
    DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


def schedule(rows, durations, jobs) -> list:
    """The rows each worker runs, in order: longest first (by the seconds they took last time; a
    row never timed counts as the median row), a free worker taking the longest row left, except
    one whose mlx version another worker is still running cold (its shared kernel cache not yet
    filled) while a row of another version is left. Planned ahead (by those seconds) so that
    each worker's next row can be installed while it tests the current one."""
    typical = sorted(durations.values())[len(durations) // 2] if durations else 1.0
    left = sorted(rows, key=lambda row: durations.get(row["name"], typical), reverse=True)
    jobs = max(1, min(jobs, len(rows)))
    plans, free_at, running = [[] for _ in range(jobs)], [0.0] * jobs, [(None, 0.0)] * jobs
    warm = set()  # mlx versions one of whose rows has ended (by then its kernels are shared)
    while left:
        worker = free_at.index(min(free_at))
        now = free_at[worker]
        warm |= {mlx for mlx, ends in running if mlx is not None and ends <= now}
        cold_elsewhere = {mlx for other, (mlx, ends) in enumerate(running)
                          if other != worker and ends > now and mlx not in warm}
        row = next((r for r in left if r["mlx"] not in cold_elsewhere), left[0])
        left.remove(row)
        seconds = durations.get(row["name"], typical)
        plans[worker].append(row)
        running[worker] = (row["mlx"], now + seconds)
        free_at[worker] = now + seconds
    return [plan for plan in plans if plan]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", help="only rows whose name contains this")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MATRIX_JOBS", "2")))
    parser.add_argument("--reuse", action="store_true", help="reuse existing session venvs")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args()

    rows = load_rows()
    mark_python_only_rows(rows)
    mark_upstream_rows(rows)
    mark_mlx_twins(rows)
    mark_package_judging(rows)
    if args.select:
        rows = [row for row in rows if args.select in row["name"]]
    if not rows:
        raise SystemExit(f"run_matrix: no row matches {args.select!r}")
    wheel = build_wheel()
    print(f"matrix: {len(rows)} sessions, {args.jobs} at a time, wheel {wheel.name}", flush=True)
    results = []
    started = time.monotonic()

    workers = schedule(rows, load_durations(), args.jobs)
    prefetch = Prefetch(wheel, args.reuse)

    def run_worker(assigned):
        out = []
        for index, row in enumerate(assigned):
            r = session(row, prefetch, assigned, index, args.pytest_args)
            mark = "ok  " if r["rc"] == 0 else "FAIL"
            print(f"[{mark}] {r['name']}: {r['passed']} passed, {r['failed']} failed "
                  f"({r['seconds']:.0f}s after {r['waited']:.0f}s waiting for its install of {r['install']:.0f}s, "
                  f"at {time.monotonic() - started:.0f}s, log {r['log'].relative_to(REPO)})", flush=True)
            out.append(r)
        return out

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        for future in [pool.submit(run_worker, assigned) for assigned in workers]:
            results.extend(future.result())
    if not args.pytest_args:
        save_durations(results)
    bad = [r for r in results if r["rc"] != 0]
    for r in bad:
        print(f"\n===== {r['name']} (tail of {r['log'].relative_to(REPO)})")
        print("\n".join(r["log"].read_text().splitlines()[-60:]))
    passed = sum(r["passed"] for r in results)
    failed = sum(r["failed"] for r in results)
    print(f"\nmatrix: {len(results)} sessions in {time.monotonic() - started:.0f}s")
    print(f"matrix: {passed} passed, {failed} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

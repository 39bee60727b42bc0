"""Run the test suite once per row of ``tested_versions`` in compat_matrix.yaml.

Each session: a fresh uv venv on that row's Python (found under pyenv or on PATH; never
downloaded), the package installed *non-editable* from a wheel built once (so the real ``.pth``
is exercised), ``mlx-lm==X`` with its release-time ``mlx[cpu]==Y`` plus the row's ``packages``
(e.g. ``mlx-vlm==0.4.0``), then pytest with ``MLX_LM_PATCHES_STRICT=1``. Sessions run in
parallel (``--jobs``); logs go to ``.matrix/``.
The last line is the plain total, ``matrix: N passed, N failed``.

    python tools/run_matrix.py                  # every row
    python tools/run_matrix.py -k 0.32.2        # rows whose name contains 0.32.2
    python tools/run_matrix.py --reuse -- -x tests/test_activation.py   # extra pytest args
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / ".matrix"


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


def counts(text: str):
    """passed/failed(+errors) from pytest's closing line."""
    last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not last:
        return 0, 0
    line = last[-1]
    get = lambda word: sum(int(n) for n in re.findall(rf"(\d+) {word}", line))  # noqa: E731
    return get("passed"), get("failed") + get("errors?") + get("xpassed")


def session(row, wheel: Path, reuse: bool, pytest_args) -> dict:
    name = row["name"]
    venv = WORK / "venvs" / name
    log = WORK / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_PATCHES") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(UV_PYTHON_DOWNLOADS="never", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.monotonic()
    with open(log, "w") as out:
        def step(argv, **kw):
            out.write(f"$ {' '.join(map(str, argv))}\n")
            out.flush()
            return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=kw.pop("env", env), **kw).returncode

        python = find_python(row["python"])
        rc = 0
        if not (reuse and (venv / "bin" / "python").exists()):
            shutil.rmtree(venv, ignore_errors=True)
            rc = step(["uv", "venv", "-q", "-p", python, str(venv)])
        if rc == 0:
            rc = step(["uv", "pip", "install", "-q", "--compile-bytecode", "--python", str(venv / "bin" / "python"), "--reinstall-package", "mlx-lm-patches",
                       f"{wheel}[cpu,test]", f"mlx-lm=={row['mlx_lm']}", f"mlx=={row['mlx']}", f"mlx-cpu=={row['mlx']}",
                       *(f"{name}=={version}" for name, version in row["packages"])])
        if rc == 0:
            # mlx's CPU backend caches compiled kernels under $TMPDIR/mlx/<version>; sessions
            # sharing an mlx version corrupt each other's cache when run in parallel.
            tmp = WORK / "tmp" / name
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            test_env = dict(env, MLX_LM_PATCHES_STRICT="1", MLX_LM_PATCHES_EXPECT_INSTALLED="1", TMPDIR=str(tmp),
                            VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
            rc = step([str(venv / "bin" / "pytest"), "-q", "-p", "no:cacheprovider", "-rfE", *pytest_args],
                      cwd=str(REPO), env=test_env)
    text = log.read_text()
    passed, failed = counts(text)
    if rc != 0 and failed == 0:
        failed = 1  # install failure or a crash before pytest's summary
    return dict(name=name, rc=rc, passed=passed, failed=failed, seconds=time.monotonic() - started, log=log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", help="only rows whose name contains this")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MATRIX_JOBS", "2")))
    parser.add_argument("--reuse", action="store_true", help="reuse existing session venvs")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args()

    data = yaml.safe_load((REPO / "compat_matrix.yaml").read_text())
    rows = []
    for row in data["tested_versions"]:
        packages = sorted((str(k), str(v)) for k, v in (row.get("packages") or {}).items())
        row = {k: str(v) for k, v in row.items() if k != "packages"}
        row["packages"] = packages  # further distributions this row installs: [(name, version)]
        row["name"] = (f"mlx-lm-{row['mlx_lm']}_mlx-{row['mlx']}_py{row['python']}"
                       + "".join(f"_{name}-{version}" for name, version in packages))
        if not args.select or args.select in row["name"]:
            rows.append(row)
    if not rows:
        raise SystemExit(f"run_matrix: no row matches {args.select!r}")
    wheel = build_wheel()
    print(f"matrix: {len(rows)} sessions, {args.jobs} at a time, wheel {wheel.name}", flush=True)
    results = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(session, row, wheel, args.reuse, args.pytest_args) for row in rows]
        for future in futures:
            r = future.result()
            results.append(r)
            mark = "ok  " if r["rc"] == 0 else "FAIL"
            print(f"[{mark}] {r['name']}: {r['passed']} passed, {r['failed']} failed "
                  f"({r['seconds']:.0f}s, log {r['log'].relative_to(REPO)})", flush=True)
    bad = [r for r in results if r["rc"] != 0]
    for r in bad:
        print(f"\n===== {r['name']} (tail of {r['log'].relative_to(REPO)})")
        print("\n".join(r["log"].read_text().splitlines()[-60:]))
    passed = sum(r["passed"] for r in results)
    failed = sum(r["failed"] for r in results)
    print(f"\nmatrix: {passed} passed, {failed} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Run mlx-lm's own offline tests with and without mlx-lm-patches; fail on any test lost.

    python tools/upstream_tests.py --python VENV/bin/python [--cache DIR] [--all | --files F ...]

``VENV/bin/python`` is a venv holding one mlx-lm release and this package (installed, so its
``.pth`` activates it at ``import mlx_lm``), plus pytest. The tool

1. asks that interpreter which mlx-lm it has (``X``);
2. gets the sdist of ``mlx-lm==X`` - from ``--cache`` (default
   ``~/.cache/mlx-lm-patches/sdists``), else from PyPI (the file its JSON API lists, sha256
   checked; ``pip download --no-deps --no-binary :all:`` where that API cannot be reached) into
   it, so reruns are offline;
3. copies the sdist's ``tests/`` into a temporary directory (never the sdist root: its
   ``mlx_lm/`` source would shadow the installed one) and runs the offline test files there
   with the venv's pytest: patched (the default), then stock (``MLX_LM_PATCHES=0``) on the tests
   that did not pass patched (a test that passes patched cannot be lost; ``--full-stock`` runs
   every file stock too), both with ``HF_HUB_OFFLINE=1``, after checking that the package is on,
   respectively off, in each;
4. reports every test that passes stock and not patched.

Files run: test_models, test_prompt_cache and test_generate (``DEFAULT_FILES``; offline apart
from the classes noted below). ``--all`` adds the other files that build their models in memory
or on disk (``EXTRA_FILES``: test_sample_utils, test_losses, test_tuner_utils,
test_tuner_trainer, test_finetune, test_chat, test_tool_parsing, test_gated_delta, test_kernels,
test_awq, test_gptq, test_deepseek_v41, test_muse_spark, test_muse_spark_inputs - those the sdist
has). Never run: test_server, test_tokenizers, test_datsets, test_gguf, test_utils, test_evaluate
(most of their tests load models, tokenizers or data sets from the hub, or need lm-eval). Every test
class of test_generate and test_prompt_cache (0.28.4 - 0.32.2) loads
``mlx-community/Qwen1.5-0.5B-Chat-4bit`` in ``setUpClass``: offline all their tests error in both
runs (0 passed, ~45 s a run), so the two files are run only when that model is in the local HF
cache (then in both runs, from the cache); otherwise the tool says it skipped them. A file that fails to import (a missing optional dependency)
is skipped by both runs alike (``--continue-on-collection-errors``). ``--files`` runs the named
files of the sdist's tests/ instead.

Time (2 shared cores, load 5-7): test_models alone 25-30 s a run; with test_generate and
test_prompt_cache (hub model absent) 50-170 s a run - 104 s (0.28.4) to 285 s (0.32.2) per
release for both runs; ``--all`` adds about 30 s a run - hence not the default.

Output: every test that passes stock and fails patched (``LOST <id>``), then a plain
``N passed, F failed`` (N = passed patched, F = lost) and the closing line
``upstream mlx-lm X: M passed patched, K lost (stock run on the J that did not)``; with
``--full-stock``, ``N passed stock, M passed patched, K lost``, and the tests that pass only
patched listed as ``GAINED`` (informational). Exit 0 if nothing is lost (also when the sdist ships no
tests: said so), 1 if a test is lost, 2 on a usage or setup error (no pytest, no mlx-lm, the
package not active in the patched run, the sdist cannot be had).
"""

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET

DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "mlx-lm-patches" / "sdists"
DEFAULT_FILES = ("test_models.py", "test_prompt_cache.py", "test_generate.py")
HUB_MODEL = "mlx-community/Qwen1.5-0.5B-Chat-4bit"
HUB_MODEL_FILES = ("test_prompt_cache.py", "test_generate.py")  # every class loads HUB_MODEL
EXTRA_FILES = (
    "test_sample_utils.py", "test_losses.py", "test_tuner_utils.py", "test_tuner_trainer.py",
    "test_finetune.py", "test_chat.py", "test_tool_parsing.py", "test_gated_delta.py",
    "test_kernels.py", "test_awq.py", "test_gptq.py", "test_deepseek_v41.py",
    "test_muse_spark.py", "test_muse_spark_inputs.py",
)

_PROBE = r"""
import json, os, sys
import mlx_lm
from importlib.metadata import version
patches = sys.modules.get("mlx_lm_patches")
applied = None
if patches is not None:
    applied = sum(1 for s in patches.status() if s.state == "applied")
import pytest
try:
    from huggingface_hub import snapshot_download
    snapshot_download("mlx-community/Qwen1.5-0.5B-Chat-4bit", local_files_only=True)
    hub_model = True
except Exception:
    hub_model = False
print(json.dumps({"mlx_lm": version("mlx-lm"), "active": patches is not None, "applied": applied,
                  "hub_model": hub_model}))
"""


class SetupError(Exception):
    pass


def _env(patched: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLX_LM_PATCHES")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    if not patched:
        env["MLX_LM_PATCHES"] = "0"
    return env


def probe(python: str, patched: bool, cwd: str) -> dict:
    run = subprocess.run([python, "-c", _PROBE], env=_env(patched), cwd=cwd,
                         capture_output=True, text=True)
    if run.returncode:
        raise SetupError(f"{python} cannot import mlx_lm and pytest:\n{run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def sdist(version: str, cache: pathlib.Path) -> pathlib.Path:
    """The cached sdist of mlx-lm ``version`` (downloaded once)."""
    cache.mkdir(parents=True, exist_ok=True)
    names = [f"mlx_lm-{version}.tar.gz", f"mlx-lm-{version}.tar.gz"]
    for name in names:
        if (cache / name).exists():
            return cache / name
    try:
        return _from_pypi(version, cache)
    except (OSError, ValueError, KeyError) as error:  # no route to PyPI's JSON API: pip's index
        errors = [f"https://pypi.org/pypi/mlx-lm/{version}/json: {error}"]
    command = ["download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
               "-q", f"mlx-lm=={version}", "-d", str(cache)]
    pips = [[sys.executable, "-m", "pip"]] + [
        [found] + rest for name, rest in (("pip", []), ("python3", ["-m", "pip"])) if (found := shutil.which(name))]
    for pip in pips:
        run = subprocess.run(pip + command, capture_output=True, text=True)
        for name in names:
            if (cache / name).exists():
                return cache / name
        errors.append(f"{' '.join(pip)}: {(run.stderr or run.stdout).strip()[-800:]}")
    raise SetupError(f"could not download the sdist of mlx-lm {version}:\n" + "\n".join(errors))


def _from_pypi(version: str, cache: pathlib.Path) -> pathlib.Path:
    """The sdist fetched as PyPI lists it (JSON API), checked against its sha256. ``pip
    download --no-binary`` gets the same file but first builds its metadata in an isolated
    build environment: ~30 s a release on a fresh machine, against ~1 s here."""
    with urllib.request.urlopen(f"https://pypi.org/pypi/mlx-lm/{version}/json", timeout=60) as answer:
        files = [f for f in json.load(answer)["urls"] if f["packagetype"] == "sdist"]
    if not files:
        raise ValueError(f"PyPI lists no sdist of mlx-lm {version}")
    listed = files[0]
    with urllib.request.urlopen(listed["url"], timeout=120) as answer:
        data = answer.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != listed["digests"]["sha256"]:
        raise ValueError(f"{listed['filename']}: sha256 {digest}, PyPI lists {listed['digests']['sha256']}")
    target = cache / listed["filename"]
    partial = target.with_name(target.name + f".{os.getpid()}.part")
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


def extract_tests(archive: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """Copy the sdist's ``tests/`` to ``into/tests`` (nothing else), beside an empty
    ``into/pytest.ini``; return it. The empty configuration makes ``into`` pytest's rootdir:
    pytest looks upward from the tests for one, and would otherwise take an enclosing project's
    (this repository's, where CI's TMPDIR lies inside the clone) - other options, and test ids
    that no longer name the files they ran in (the stock rerun then ran whole files)."""
    (into / "pytest.ini").write_text("[pytest]\n")
    target = into / "tests"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if len(pathlib.PurePosixPath(m.name).parts) > 2
                   and pathlib.PurePosixPath(m.name).parts[1] == "tests" and (m.isfile() or m.isdir())]
        for member in members:
            relative = pathlib.PurePosixPath(*pathlib.PurePosixPath(member.name).parts[2:])
            if ".." in relative.parts:
                continue
            path = target / relative
            if member.isdir():
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tar.extractfile(member).read())
    return target


def run_pytest(python: str, files, cwd: pathlib.Path, patched: bool, report: pathlib.Path):
    """Run the files; return (passed ids, all outcomes {id: outcome}, seconds, tail of output)."""
    start = time.monotonic()
    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
         "-o", "addopts=", "--junitxml", str(report), *files],
        env=_env(patched), cwd=cwd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if not report.exists():
        raise SetupError(f"pytest wrote no report (exit {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    outcomes = {}  # a teardown error adds a second entry for a test: the worst one counts
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for case in ET.parse(report).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test_id = f"{classname}::{name}" if classname else name
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        if rank[outcome] >= rank[outcomes.get(test_id, "passed")]:
            outcomes[test_id] = outcome
    passed = {t for t, o in outcomes.items() if o == "passed"}
    tail = "\n".join((run.stdout or "").strip().splitlines()[-1:])
    return passed, outcomes, seconds, tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the venv's python (mlx-lm + this package + pytest)")
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE, help="sdist cache directory")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--all", action="store_true", help="also run EXTRA_FILES (slower)")
    choice.add_argument("--files", nargs="+", help="files of the sdist's tests/ to run instead")
    parser.add_argument("--full-stock", action="store_true",
                        help="run every file stock too (default: only the tests that did not pass patched)")
    args = parser.parse_args(argv)

    try:
        with tempfile.TemporaryDirectory(prefix="mlx-lm-upstream-") as tmp:
            tmp = pathlib.Path(tmp)
            stock_info = probe(args.python, patched=False, cwd=str(tmp))
            patched_info = probe(args.python, patched=True, cwd=str(tmp))
            version = stock_info["mlx_lm"]
            if stock_info["active"]:
                raise SetupError("MLX_LM_PATCHES=0 did not turn the package off")
            if not patched_info["active"]:
                raise SetupError(f"mlx-lm-patches is not active in {args.python} (not installed there?)")
            archive = sdist(version, args.cache)
            tests = extract_tests(archive, tmp)
            available = sorted(p.name for p in tests.glob("test_*.py")) if tests.is_dir() else []
            if not available:
                print(f"upstream mlx-lm {version}: the sdist ships no tests; nothing to compare")
                print("0 passed, 0 failed")
                return 0
            wanted = args.files or (DEFAULT_FILES + EXTRA_FILES if args.all else DEFAULT_FILES)
            if not args.files and not stock_info["hub_model"]:
                # every class of these loads the hub model in setUpClass: offline all error (~45 s a run)
                print(f"upstream mlx-lm {version}: {', '.join(HUB_MODEL_FILES)} skipped: "
                      f"{HUB_MODEL} is not in the local HF cache (all their tests need it)")
                wanted = [name for name in wanted if name not in HUB_MODEL_FILES]
            files = [f"tests/{name}" for name in wanted if name in available]
            missing = [name for name in (args.files or ()) if name not in available]
            if missing:
                raise SetupError(f"not in the sdist's tests/: {', '.join(missing)}")
            print(f"upstream mlx-lm {version}: {len(files)} files ({', '.join(f[6:] for f in files)}); "
                  f"{patched_info['applied']} patches applied in the patched run", flush=True)

            patched, patched_all, t_patched, tail_patched = run_pytest(
                args.python, files, tmp, patched=True, report=tmp / "patched.xml")
            print(f"  patched ({t_patched:.0f} s): {tail_patched}", flush=True)
            others = sorted(t for t, outcome in patched_all.items() if outcome != "passed")
            stock_files = files if args.full_stock else _node_ids(others, files)
            stock, stock_all, t_stock, tail_stock = set(), {}, 0.0, "not run: every test passed patched"
            if stock_files:
                stock, stock_all, t_stock, tail_stock = run_pytest(
                    args.python, stock_files, tmp, patched=False, report=tmp / "stock.xml")
            print(f"  stock   ({t_stock:.0f} s, {'every file' if args.full_stock else f'{len(others)} tests'}): "
                  f"{tail_stock}", flush=True)
    except SetupError as exc:
        print(f"upstream_tests: {exc}", file=sys.stderr)
        return 2

    lost = sorted(stock - patched)
    for test_id in lost:
        print(f"LOST {test_id} (passed stock, {patched_all.get(test_id, 'not run')} patched)")
    if args.full_stock:
        for test_id in sorted(patched - stock):
            print(f"GAINED {test_id} (passed patched, {stock_all.get(test_id, 'not run')} stock)")
    print(f"{t_stock + t_patched:.0f} s for both runs")
    print(f"{len(patched)} passed, {len(lost)} failed")
    if args.full_stock:
        print(f"upstream mlx-lm {version}: {len(stock)} passed stock, {len(patched)} passed patched, "
              f"{len(lost)} lost")
    else:
        print(f"upstream mlx-lm {version}: {len(patched)} passed patched, {len(lost)} lost "
              f"(stock run on the {len(others)} that did not: {len(stock)} passed there)")
    return 1 if lost else 0


def _node_ids(test_ids, files):
    """pytest node ids (``tests/test_x.py::Class::test``) for junit ids (``tests.test_x.Class::test``);
    a whole file where an id names none of its tests (e.g. the file failed to import)."""
    out = []
    for test_id in test_ids:
        classname, _, name = test_id.rpartition("::")
        match = next((f for f in files if classname == f[:-3].replace("/", ".")
                      or classname.startswith(f[:-3].replace("/", ".") + ".")), None)
        if match is None:
            match = next((f for f in files if f in test_id or f[:-3].replace("/", ".") in test_id), None)
            if match and match not in out:
                out.append(match)
            continue
        rest = classname[len(match) - 3:].lstrip(".")
        node = "::".join([match] + ([*rest.split(".")] if rest else []) + [name])
        if node not in out:
            out.append(node)
    return out


if __name__ == "__main__":
    sys.exit(main())

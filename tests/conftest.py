"""Shared fixtures: the installed versions, the matrix, and fresh-interpreter runners.

The suite runs against the *installed* package (tools/run_matrix.py installs the wheel
non-editable into one venv per tested mlx-lm release), so the real ``.pth`` is exercised.
"""

import contextlib
import functools
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# No hub access, ever: every model in the suite is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def clean_env(**overrides):
    """The current environment without our variables, plus ``overrides`` (None removes)."""
    from mlx_lm_patches.engine import env as ours

    environ = {k: v for k, v in os.environ.items() if k not in ours.ALL_VARIABLES}
    environ.pop("PYTHONPATH", None)
    environ["HF_HUB_OFFLINE"] = "1"
    for key, value in overrides.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return environ


def run_python(code="", *args, env=None, timeout=300, python=None, cwd=None):
    """Run ``python -c code`` (or ``python *args``) in a fresh interpreter of this venv."""
    argv = [python or sys.executable]
    argv += ["-c", textwrap.dedent(code)] if code else []
    argv += list(args)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**(env or {})), cwd=cwd or "/")
    return Ran(proc.returncode, proc.stdout, proc.stderr)


FORKED = """
import json, os, sys, traceback
# What every child would import first anyway, loaded once here: mlx-lm's tokenizer_utils imports
# it, and it is most of a fresh interpreter's start (its import-structure scan). Not mlx_lm: the
# children must start before anything activates the package.
from transformers import AutoTokenizer  # noqa: F401
assert not [m for m in sys.modules if m.partition(".")[0] in ("mlx_lm", "mlx_lm_patches", "mlx")], (
    "the preload imported mlx, mlx-lm or the package: the children would not start fresh")
results = {}
for name, code in json.loads(sys.argv[1]).items():
    out, err = os.path.join(sys.argv[2], name + ".out"), os.path.join(sys.argv[2], name + ".err")
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        status = 0
        try:
            exec(compile(code, "<" + name + ">", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    results[name] = os.waitstatus_to_exitcode(status)
print(json.dumps(results))
"""


def run_forked(programs, env=None, timeout=600):
    """Run each of ``programs`` (``{name: code}``) as if in a fresh interpreter of this venv,
    one after another, for CI time: one interpreter (with ``env``, as :func:`run_python`) loads
    ``transformers`` - about 0.7 s of every start here, which each program would pay again - and
    forks a child per program, before anything imported mlx, mlx-lm or this package (the .pth
    has armed activation as at any start: each child activates, or not, on its own first import
    of mlx_lm). ``{name: Ran}``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="forked-") as folder:
        ran = run_python(FORKED, json.dumps(programs), folder, env=env, timeout=timeout)
        assert ran.returncode == 0, ran.stderr[-3000:]
        codes = json.loads(ran.stdout.strip().splitlines()[-1])
        read = lambda name, ext: pathlib.Path(folder, f"{name}.{ext}").read_text(errors="replace")  # noqa: E731
        return {name: Ran(codes[name], read(name, "out"), read(name, "err")) for name in programs}


def judged_ids(config) -> list:
    """The patches this session judges (matrix order): all, or with ``--judge-only-packages``
    those whose ``package`` is one of the named distributions."""
    from mlx_lm_patches.engine import matrix

    only = config.getoption("--judge-only-packages")
    packages = set(only.split(",")) if only else None
    return [spec.id for spec in matrix.load().patches if packages is None or spec.package in packages]


@pytest.fixture(scope="session")
def check_report(request):
    """``python -m mlx_lm_patches check --json`` (the main job) in a fresh interpreter, once per
    session: each patch judged alone, its scenario run on stock mlx-lm and with the patch. The
    matrix cells (tests/test_matrix_cells.py) and the CLI test (tests/test_cli.py) read it, so
    every scenario runs twice per row, not four times. Adds ``returncode`` and ``stderr``. With
    ``--judge-only-packages``, the patches of those packages only."""
    only = request.config.getoption("--judge-only-packages")
    ids = judged_ids(request.config) if only else []
    ran = run_python(None, "-m", "mlx_lm_patches", "check", "--json", *ids, timeout=1200)
    try:
        report = json.loads(ran.stdout)
    except ValueError:
        raise AssertionError(f"check --json printed no JSON (exit {ran.returncode}):\n"
                             f"{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}") from None
    report.update(returncode=ran.returncode, stderr=ran.stderr)
    return report


@pytest.fixture(scope="session")
def the_matrix():
    from mlx_lm_patches.engine import matrix

    return matrix.load()


@pytest.fixture(scope="session")
def mlx_lm_version():
    from mlx_lm_patches.engine import versions

    return versions.mlx_lm().parsed


def affected(patch_id):
    """Whether the installed mlx-lm (or the distribution the patch names as its ``package``) has
    the bug ``patch_id`` fixes: for a release, what compat_matrix.yaml says (never where that
    distribution is missing or a ``requires`` is unmet); for an install that is not a release
    (git, local path, dev version), what the probe finds, as the engine decides there."""
    from mlx_lm_patches.engine import matrix
    from mlx_lm_patches.engine import versions

    verdict = matrix.load().get(patch_id).version_verdict(versions.installed)
    if verdict is not None:
        return verdict
    return _probe_states()[patch_id] == "applied"


@functools.lru_cache(maxsize=None)
def _probe_states():
    """Each patch's state after ``apply()`` in a fresh interpreter (every anchor imported, so
    the probes decide): used only where the installed mlx-lm is not a release."""
    ran = run_python("import json, mlx_lm_patches; "
                     "print(json.dumps({r.id: r.state for r in mlx_lm_patches.apply()}))")
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout.strip().splitlines()[-1])


def xfail_if_affected(patch_id, reason=""):
    """Strict xfail where the matrix says affected: an upstream fix makes the test XPASS,
    which fails the run and forces the range in compat_matrix.yaml to be narrowed."""
    from mlx_lm_patches.engine import matrix

    package = matrix.load().get(patch_id).package
    return pytest.mark.xfail(
        affected(patch_id), strict=True,
        reason=reason or f"compat_matrix.yaml: {patch_id} affects this {package} (stock is broken)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used a running ``mlx_lm.server`` (``support.server.Server``) shows the
    end of the server's log in its report."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from support.server import Server

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, Server):
            report.sections.append((f"mlx_lm.server log ({name}, tail)", value.log_tail(80)))


def pytest_configure(config):
    """Every patch applied once, before any test module is imported (modules bind patched
    objects such as ``MambaCache`` or ``make_prompt_cache`` at import); with
    ``MLX_LM_PATCHES_STRICT=1`` a patch that fails stops the session here, loudly. Tests that
    need stock mlx-lm revert what they show (:func:`reverted`) or run a fresh interpreter."""
    import mlx_lm_patches

    mlx_lm_patches.apply()


def pytest_collection_modifyitems(config, items):
    from row_selection import CORE, PYTHON_ONLY

    for item in items:
        where = f"{item.path.name}::{item.originalname}"
        if item.path.name in PYTHON_ONLY or where in PYTHON_ONLY:
            item.add_marker(pytest.mark.python_only)
        if item.path.name in CORE:
            item.add_marker(pytest.mark.core)
    if config.getoption("--judge-only-packages"):
        judged = set(judged_ids(config))
        other = [item for item in items
                 if "pid" in getattr(getattr(item, "callspec", None), "params", {}) and item.callspec.params["pid"] not in judged]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if item not in other]


def pytest_addoption(parser):
    parser.addoption("--full-sweeps", action="store_true",
                     help="run every family of a family sweep on this row (see tests/support/sweeps.py)")
    parser.addoption("--judge-only-packages", metavar="NAMES", default="",
                     help="judge (check, matrix cells, probe traces) only the patches of these distributions, "
                          "comma-separated: a package row whose mlx-lm and mlx have a row of their own "
                          "(tools/run_matrix.py), where the other patches are judged")


@pytest.fixture(autouse=True)
def _family_sweep(request):
    """A test marked ``family_sweep(families)`` and parametrized by ``model_type`` (or ``family``)
    runs a family in full only where its model source changed since an earlier row of the
    matrix with the same mlx, or where it represents its cache layout (tests/support/sweeps.py)."""
    marker = request.node.get_closest_marker("family_sweep")
    callspec = getattr(request.node, "callspec", None)
    if marker is None or callspec is None:
        return
    family = callspec.params.get("model_type", callspec.params.get("family"))
    families = tuple(marker.args[0])
    if family in families:
        from support import sweeps

        reason = sweeps.skip_reason(family, families, full=request.config.getoption("--full-sweeps"),
                                    core=request.node.get_closest_marker("core") is not None)
        if reason:
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def _kv_quantization_forgotten():
    """Generating with ``kv_bits`` marks the process as quantizing its KV caches (as a server
    with ``--kv-bits`` is: prefix restores on long prompts are declined from then on); forget it
    before and after each test, so no test depends on which ran before it."""
    def forget():  # only where an engine runs: the fixture itself starts nothing
        core = sys.modules.get("mlx_lm_patches.engine.core")
        memo = core.memo("prompt-cache-prefix-reuse") if core is not None else None
        if memo is not None:
            from mlx_lm_patches.mechanisms.prefix_reuse.settings import QUANTIZED_FROM

            memo.pop(QUANTIZED_FROM, None)

    forget()
    yield
    forget()


@pytest.fixture(autouse=True)
def _drafting_memory_forgotten():
    """Adaptive drafting starts a sequence from what the last one with the same model and draft
    left (mechanisms/adaptive.py, kept in the patch's memo): forget it around each test, so
    every test's first sequence starts as a process's first does, whichever test ran before."""
    def forget():  # only where the patch was loaded: the fixture itself imports nothing
        patch = sys.modules.get("mlx_lm_patches.patches.adaptive_drafting")
        if patch is not None:
            patch.forget_sequences()

    forget()
    yield
    forget()


@contextlib.contextmanager
def reverted(*ids):
    """The given patches (every patch if none is given) reverted for a block (stock mlx-lm for
    what they fix), applied again after it."""
    import mlx_lm_patches

    mlx_lm_patches.revert(list(ids) or None)
    try:
        yield
    finally:
        mlx_lm_patches.apply(list(ids) or None)

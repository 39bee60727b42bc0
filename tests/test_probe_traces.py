"""Probes leave no trace in the user's process (engine/contract.py): every probe whose anchor
imports here runs on stock mlx-lm (the bug path, the most work) in one fresh interpreter, and

* the user's seeded random stream draws the same after it as without it;
* it writes no file (``TMPDIR`` and the working directory are empty directories, and stay so;
  mlx's own compiled-kernel cache, ``$TMPDIR/mlx``, is mlx's: linked to the session's, left out);
* it leaves process-wide settings as they were: the environment, ``tempfile``'s cached
  directory, ``sys.path``, mlx's default device and stream, running threads;
* it decides the same when the package's sources cannot be read (an install with bytecode
  only): ``inspect`` finds no source.

Probes of mlx-vlm / vllm-mlx patches run where those packages are installed (the package rows of
tools/run_matrix.py run this file). Then the issue's own reproduction, through automatic
activation: ``mx.random.seed(1234)``, import every ``mlx_lm.models`` module, draw - the same with
the package on and off.
"""

import json
import pathlib
import tempfile

import pytest

from conftest import run_python
from mlx_lm_patches.engine import matrix

pytestmark = pytest.mark.subprocess

IDS = matrix.load().ids()

PROBE_EVERY_PATCH = """
import importlib, inspect, json, os, sys, tempfile, threading
import mlx.core as mx
import mlx_lm  # noqa: F401  - what a user has imported when the probes run
from mlx_lm_patches.engine import matrix

def files():
    out = []
    for root in (os.environ["TMPDIR"], os.getcwd()):
        for folder, dirs, names in os.walk(root):
            if folder == os.environ["TMPDIR"]:
                dirs[:] = [d for d in dirs if d != "mlx"]  # mlx's kernel cache
            out += [os.path.join(folder, n) for n in names + dirs]
    return sorted(out)

def settings():
    return {"environ": dict(os.environ), "tempfile.tempdir": tempfile.tempdir,
            "sys.path": list(sys.path), "device": str(mx.default_device()),
            "stream": str(mx.default_stream(mx.default_device())),
            "threads": sorted(t.name for t in threading.enumerate())}

def draw():
    return mx.random.uniform(shape=(4,)).tolist()

def no_source(*args, **kwargs):
    raise OSError("could not get source code")

report = {}
for spec in matrix.load().patches:
    try:
        importlib.import_module(spec.anchor)
    except ImportError as exc:
        report[spec.id] = {"skip": f"{spec.anchor} not importable: {exc}"}
        continue
    module = importlib.import_module(spec.module_in(matrix.PATCH_PACKAGE))
    mx.random.seed(1234)
    expected = draw()
    before, written = settings(), files()
    mx.random.seed(1234)
    try:
        decided, raised = module.probe(), None
    except Exception as exc:
        decided, raised = None, f"{type(exc).__name__}: {exc}"
    row = {"decided": repr(decided), "raised": raised, "present": bool(decided),
           "draw": draw() == expected, "files": [f for f in files() if f not in written],
           "settings": {k: [v, settings()[k]] for k, v in before.items() if settings()[k] != v}}
    findsource, inspect.findsource = inspect.findsource, no_source
    try:
        without = module.probe()
        row["without sources"] = repr(without)
        row["present without sources"] = bool(without)
    except Exception as exc:
        row["without sources"] = repr(exc)
        row["present without sources"] = None
    finally:
        inspect.findsource = findsource
    report[spec.id] = row
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    tmp, cwd = tmp_path_factory.mktemp("probe-tmp"), tmp_path_factory.mktemp("probe-cwd")
    # mlx's CPU kernel cache ($TMPDIR/mlx) stays the session's: a cold one costs a minute of
    # compiling on mlx 0.29-0.31 (tools/run_matrix.py), and it is mlx's, not the probes'
    kernels = pathlib.Path(tempfile.gettempdir()) / "mlx"
    kernels.mkdir(exist_ok=True)
    (tmp / "mlx").symlink_to(kernels, target_is_directory=True)
    ran = run_python(PROBE_EVERY_PATCH, env={"MLX_LM_PATCHES": "0", "TMPDIR": str(tmp)},
                     cwd=str(cwd), timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pid", IDS)
def test_probe_leaves_no_trace(pid, probed):
    row = probed[pid]
    if "skip" in row:
        pytest.skip(row["skip"])
    assert row["raised"] is None, f"{pid}: the probe raised {row['raised']}"
    assert row["draw"], f"{pid}: the probe moved mlx's random stream ({row['decided']})"
    assert row["files"] == [], f"{pid}: the probe left files: {row['files']}"
    assert row["settings"] == {}, f"{pid}: the probe changed {row['settings']}"
    assert row["present without sources"] == row["present"], (
        f"{pid}: decided {row['decided']} with sources, {row['without sources']} without")


def test_seeded_stream_is_the_same_with_the_package_on_and_off():
    """The issue's reproduction: automatic activation (every probe of mlx-lm's patches whose
    anchor a model import pulls in) between a seed and a draw changes nothing."""
    code = """
        import importlib, pkgutil, json
        import mlx.core as mx
        mx.random.seed(1234)
        import mlx_lm.models
        for info in pkgutil.iter_modules(mlx_lm.models.__path__):
            try:
                importlib.import_module(f"mlx_lm.models.{info.name}")
            except (Exception, SystemExit):  # e.g. olmo exits without ai2-olmo
                pass
        from mlx_lm_patches.engine import core
        applied = [r.id for r in core.status() if r.state == "applied"]
        print(json.dumps([mx.random.uniform(shape=(4,)).tolist(), applied]))
    """
    draws = {}
    for enabled in ("0", "1"):
        ran = run_python(code, env={"MLX_LM_PATCHES": enabled})
        assert ran.returncode == 0, ran.stderr[-3000:]
        draws[enabled] = json.loads(ran.stdout.strip().splitlines()[-1])
    assert draws["0"][1] == [] and draws["1"][1], draws  # the probes did run with the package on
    assert draws["1"][0] == draws["0"][0], draws


def test_random_state_kept_and_seeded_put_the_key_back():
    """On this mlx (whose ``mx.random.state`` is read-only from 0.32): after draws inside
    either block the stream continues where it was."""
    import mlx.core as mx

    from mlx_lm_patches.engine.traceless import random_state_kept, seeded

    mx.random.seed(99)
    mx.random.uniform(shape=(2,))  # a key that is not a fresh seed's
    reference_key = mx.random.state[0].tolist()
    expected = mx.random.uniform(shape=(3,)).tolist()
    for block in (random_state_kept(), seeded(5)):
        mx.random.seed((reference_key[0] << 32) | reference_key[1])
        with block:
            inside = mx.random.uniform(shape=(3,)).tolist()
        assert mx.random.uniform(shape=(3,)).tolist() == expected
    assert inside == (mx.random.seed(5) or mx.random.uniform(shape=(3,)).tolist())

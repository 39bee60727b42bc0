"""Every order of import / apply / revert / re-apply, each in a fresh interpreter (forked from one
that loaded transformers only, for CI time: ``conftest.run_forked``), on the real
mlx-lm: no double wrapping, revert restores the original objects (identity), re-apply works,
and the patched behaviour is there exactly when a patch is applied."""

import json

import pytest

from conftest import REPO, run_forked, run_python

pytestmark = [pytest.mark.subprocess, pytest.mark.release_only]

STEPS = {
    "import": "import mlx_lm, mlx_lm.generate, mlx_lm.models.cache",
    "apply": "mlx_lm_patches.apply()",
    "revert": "mlx_lm_patches.revert()",
}

ORDERS = [
    ("import", "apply", "revert", "apply"),
    ("apply", "import", "revert", "import", "apply"),
    ("revert", "apply", "apply", "revert", "revert", "apply"),
    ("apply", "revert", "import", "apply", "revert"),
    ("import", "revert", "apply", "apply"),
]

PROGRAM = """
import sys
import mlx_lm_patches, child
import mlx_lm.models.cache  # the original objects, captured before any patch
original = child.snapshot()
applied = False
for step in {steps!r}:
    exec({commands!r}[step])
    if step == "apply":
        applied = True
    if step == "revert":
        applied = False
        child.assert_restored(original)
    child.assert_not_double_wrapped()
    states = child.states()
    want = "applied" if applied else {{"revert": "reverted"}}.get(step)
    for pid, state in states.items():
        if state.startswith("skipped") or state == "disabled":
            continue
        if want and applied:
            assert state == "applied", (step, pid, state)
        if step == "revert":
            assert state in ("reverted", "inactive"), (step, pid, state)
    from mlx_lm_patches.patches import mamba_cache_compat as m
    if states["mamba-cache-compat"] == "applied":
        assert m.probe() is None, "patched mlx-lm must pass the probe"
print("ok")
"""


def _program(order, auto):
    code = PROGRAM.format(steps=order, commands=STEPS)
    if auto == "auto-on":
        # with automatic activation the import in the prologue already applied: start by reverting
        code = code.replace("original = child.snapshot()",
                            "mlx_lm_patches.revert()\noriginal = child.snapshot()")
    return code


@pytest.fixture(scope="module")
def orders_run(request):
    """Every order of one activation mode, each in a fresh interpreter (forked from one that
    loaded transformers only: ``conftest.run_forked``). ``(mode, {order name: Ran})``."""
    env = {"PYTHONPATH": str(REPO / "tests")}
    if request.param == "auto-off":
        env["MLX_LM_PATCHES"] = "0"
    programs = {"-".join(order): _program(order, request.param) for order in ORDERS}
    return request.param, run_forked(programs, env=env)


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
@pytest.mark.parametrize("orders_run", ["auto-on", "auto-off"], indirect=True)
def test_order(order, orders_run):
    _, ran = orders_run
    ran = ran["-".join(order)]
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() == "ok"


# -- patches sharing a target: subsets and interleavings -------------------------------------

def _release(text):
    from packaging.version import Version

    return Version(text)


def _shared_pairs(versions):
    """{(a, b): [targets]} for patches that share a target and can both be active on one of
    ``versions`` (their affected ranges both contain it), a before b in matrix order."""
    from mlx_lm_patches.engine import matrix

    the_matrix = matrix.load()
    pairs = {}
    specs = the_matrix.patches
    for i, a in enumerate(specs):
        for b in specs[i + 1:]:
            shared = [t for t in a.targets if t in b.targets]
            if shared and any(a.affects(v) and b.affects(v) for v in versions):
                pairs[(a.id, b.id)] = shared
    return pairs


def test_every_shared_target_has_a_declared_order():
    from mlx_lm_patches.engine import matrix

    the_matrix = matrix.load()
    tested = [_release(t.mlx_lm) for t in the_matrix.tested_versions]
    pairs = _shared_pairs(tested)
    assert len({t for targets in pairs.values() for t in targets}) >= 8
    missing = [f"{a} / {b} on {targets}" for (a, b), targets in pairs.items()
               if not the_matrix.ordered(a, b)]
    assert not missing, "declare `after:` for patches sharing a target: " + "; ".join(missing)


def _installed_pairs():
    from importlib.metadata import version

    return sorted(_shared_pairs([_release(version("mlx-lm"))]))


INTERLEAVE = """
import json, traceback
import mlx_lm_patches, child
import mlx_lm, mlx_lm.generate, mlx_lm.models.cache
from mlx_lm_patches.engine import core
original = child.snapshot()

def interleave(a, b, scenario):
    mlx_lm_patches.apply()
    states = child.states()
    if states[a] != "applied" or states[b] != "applied":
        mlx_lm_patches.revert()
        return "skip: " + states[a] + " " + states[b]
    child.assert_layers_ok()
    for step, ids in (("revert", [a]), ("apply", [a]), ("revert", [b]), ("apply", [b])):
        getattr(mlx_lm_patches, step)(ids)
        child.assert_layers_ok()
        child.assert_not_double_wrapped()
        now = child.states()
        want = "reverted" if step == "revert" else "applied"
        assert now[ids[0]] == want, (step, ids, now[ids[0]])
        other = b if ids[0] == a else a
        assert now[other] == "applied", (step, ids, other, now[other])
    outcome = core.get().patch_module(scenario).scenario()
    assert outcome is None or outcome.ok, outcome
    mlx_lm_patches.revert()
    child.assert_restored(original)
    child.assert_layers_ok()
    assert not [r for r in mlx_lm_patches.status() if r.state == "reverted" and "replaced" in r.detail]
    return "ok"

results = dict()
for a, b, scenario in {pairs!r}:
    try:
        results[a + "+" + b] = interleave(a, b, scenario)
    except BaseException:
        results[a + "+" + b] = traceback.format_exc()[-3000:]
        break  # a failed pair may leave patches half applied: the pairs after it are not judged
print(json.dumps(results))
"""


# Patches whose scenario needs more than one rank (tests/test_distributed.py proves them): the
# other patch's scenario runs for their pairs.
NEEDS_RANKS = ("distributed-request-agreement", "distributed-generation-death")


def _scenario_of(pair):
    a, b = pair
    return a if b in ("recurrent-rollback", *NEEDS_RANKS) else b  # one scenario is enough: both are on


@pytest.fixture(scope="module")
def interleavings():
    """Every installed pair interleaved in one fresh interpreter, one after another: each pair
    starts from, and must return to, the original objects (``assert_restored``), so the pairs
    are as independent as in interpreters of their own. ``{"a+b": "ok" | "skip: ..." | error}``."""
    pairs = [(a, b, _scenario_of((a, b))) for a, b in _installed_pairs()]
    ran = run_python(INTERLEAVE.format(pairs=pairs), env={"PYTHONPATH": str(REPO / "tests"), "MLX_LM_PATCHES": "0"},
                     timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pair", _installed_pairs(), ids=lambda p: "+".join(p))
def test_shared_target_interleaving(pair, interleavings):
    key = "+".join(pair)
    assert key in interleavings, f"not judged: an earlier pair failed ({interleavings})"
    result = interleavings[key]
    assert result == "ok" or result.startswith("skip: "), result

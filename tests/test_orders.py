"""Every order of import / apply / revert / re-apply, each in a fresh interpreter, on the real
mlx-lm: no double wrapping, revert restores the original objects (identity), re-apply works,
and the patched behaviour is there exactly when a patch is applied."""

import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.subprocess

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


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
@pytest.mark.parametrize("auto", ["auto-on", "auto-off"])
def test_order(order, auto):
    code = PROGRAM.format(steps=order, commands=STEPS)
    env = {"PYTHONPATH": str(REPO / "tests")}
    if auto == "auto-off":
        env["MLX_LM_PATCHES"] = "0"
    else:
        # with automatic activation the import in the prologue already applied: start by reverting
        code = code.replace("original = child.snapshot()",
                            "mlx_lm_patches.revert()\noriginal = child.snapshot()")
    ran = run_python(code, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() == "ok"

"""The matrix is tested, not claimed: per patch, on the installed mlx-lm release,

* with patches off (fresh interpreter, MLX_LM_PATCHES=0) the patch's scenario fails where
  compat_matrix.yaml says the release is affected - a strict xfail, so an upstream fix XPASSes
  and forces the range to be narrowed - and passes where it says unaffected;
* with patches on, the engine's state agrees with the matrix and the scenario is exact.
"""

import pytest

import mlx_lm_patches
from conftest import affected, run_python, xfail_if_affected
from mlx_lm_patches.engine import matrix

IDS = matrix.load().ids()


@pytest.fixture(scope="module")
def patched():
    return {row.id: row for row in mlx_lm_patches.apply()}


@pytest.fixture(scope="module")
def stock_outcomes():
    """Every patch's scenario run on stock mlx-lm (MLX_LM_PATCHES=0), in one fresh interpreter:
    ``{id: (ok, summary)}``. A scenario that raises is reported as a failure of that scenario."""
    import json

    ran = run_python(f"""
        import importlib, json
        from mlx_lm_patches.engine import matrix
        out = {{}}
        for pid in {IDS!r}:
            try:
                outcome = importlib.import_module(matrix.load().get(pid).module_name).scenario()
                out[pid] = (outcome.ok, outcome.summary)
            except Exception as exc:
                out[pid] = (False, f"scenario raised {{type(exc).__name__}}: {{exc}}")
        print(json.dumps(out))
    """, env={"MLX_LM_PATCHES": "0"}, timeout=1800)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", [pytest.param(i, marks=xfail_if_affected(i)) for i in IDS])
def test_stock_mlx_lm_passes_the_scenario_unless_affected(pid, stock_outcomes):
    ok, summary = stock_outcomes[pid]
    if ok is None:
        pytest.skip(f"not applicable on this mlx-lm: {summary.strip()}")
    assert ok is True, f"stock mlx-lm fails {pid}: {summary.strip()}"


@pytest.mark.parametrize("pid", IDS)
def test_engine_state_agrees_with_the_matrix(pid, patched):
    row = patched[pid]
    if affected(pid):
        assert row.state == "applied", f"{pid}: {row.state} ({row.detail})"
    else:
        assert row.state == "skipped:version", f"{pid}: {row.state} ({row.detail})"


@pytest.mark.parametrize("pid", IDS)
def test_patched_scenario_is_exact(pid, patched):
    import importlib

    outcome = importlib.import_module(matrix.load().get(pid).module_name).scenario()
    if outcome.ok is None:
        pytest.skip(f"not applicable on this mlx-lm: {outcome.summary}")
    assert outcome.ok, outcome.summary

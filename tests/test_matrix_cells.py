"""The matrix is tested, not claimed: per patch, on the installed mlx-lm release,

* on stock mlx-lm the patch's scenario fails where compat_matrix.yaml says the release is
  affected - a strict xfail, so an upstream fix XPASSes and forces the range to be narrowed -
  and passes where it says unaffected;
* with the patch on, the scenario is exact, and the engine's state agrees with the matrix.

The scenarios run once each way, in ``check`` (the ``check_report`` fixture: one fresh
interpreter, every patch judged alone - stock is every patch reverted but what the patch
``needs``, patched is the patch and what it needs); the engine's state is read here, with every
patch applied as a user gets them.
"""

import pytest

import mlx_lm_patches
from conftest import affected, xfail_if_affected
from mlx_lm_patches.engine import matrix
from mlx_lm_patches.engine import versions

IDS = matrix.load().ids()


@pytest.fixture(scope="module")
def patched():
    return {row.id: row for row in mlx_lm_patches.apply()}


@pytest.fixture(scope="module")
def judged(check_report):
    """``{id: check's result}``."""
    return {row["id"]: row for row in check_report["results"]}


def _outcome(judged, pid, which):
    """A scenario run of ``check`` (``stock`` or ``patched``); skips where the scenario cannot
    drive the installed packages, fails where check did not run it."""
    row = judged[pid]
    outcome = row[which]
    if outcome is None and which == "patched" and row["stock"] and row["stock"]["ok"] is None:
        outcome = row["stock"]  # not applicable on stock: check ends there
    assert outcome is not None, f"{pid}: check ran no {which} scenario ({row['state']}: {row['verdict']})"
    if outcome["ok"] is None:
        pytest.skip(f"not applicable on this mlx-lm: {outcome['summary'].strip()}")
    return outcome


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", [pytest.param(i, marks=xfail_if_affected(i)) for i in IDS])
def test_stock_mlx_lm_passes_the_scenario_unless_affected(pid, judged):
    outcome = _outcome(judged, pid, "stock")
    assert outcome["ok"] is True, f"stock mlx-lm fails {pid}: {outcome['summary'].strip()}"


@pytest.mark.parametrize("pid", IDS)
def test_engine_state_agrees_with_the_matrix(pid, patched, judged):
    row = patched[pid]
    if affected(pid):
        assert row.state == "applied", f"{pid}: {row.state} ({row.detail})"
    elif matrix.load().get(pid).version_verdict(versions.installed) is None:
        assert row.state == "skipped:probe", f"{pid}: {row.state} ({row.detail})"  # probe only
    else:
        assert row.state == "skipped:version", f"{pid}: {row.state} ({row.detail})"
    assert judged[pid]["state"] == row.state, f"{pid}: check judged it {judged[pid]['state']}"


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", IDS)
def test_patched_scenario_is_exact(pid, judged):
    """The scenario with the patch on where it applies; where it does not (the release is not
    affected), stock mlx-lm is what a user gets for it, and must be exact."""
    which = "patched" if judged[pid]["state"] == "applied" else "stock"
    outcome = _outcome(judged, pid, which)
    assert outcome["ok"] is True, f"{pid} ({which}): {outcome['summary'].strip()}"


@pytest.mark.parametrize("pid", [i for i in IDS if matrix.load().get(i).before])
def test_a_release_older_than_the_range_is_told_what_it_gets(pid, patched):
    """Where the installed release is older than what the fix builds on, status says what it gets
    instead (the matrix's ``before``)."""
    spec, row = matrix.load().get(pid), patched[pid]
    installed = versions.installed(spec.package).parsed
    if installed is None or not spec.older_than_affected(installed):
        pytest.skip(f"{spec.package} {installed} is not older than {spec.affected}")
    assert row.state == "skipped:version" and row.detail.endswith(spec.before), row.detail

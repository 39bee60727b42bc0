"""``python -m mlx_lm_patches check``: demonstrate every applicable fix live on the installed mlx-lm.

Every patch is judged alone. First every patch is applied as it would be for a user (so the
engine decides which apply), then all of them are reverted. Then, per patch:

* applied -> its scenario runs on stock mlx-lm (everything reverted: must fail, or the bug is not
  shown), then with only that patch and the patches it declares it ``needs`` in
  compat_matrix.yaml (must be exact), which are reverted again afterwards;
* skipped by the version gate or the probe -> its scenario runs on stock mlx-lm (everything
  reverted but what it ``needs``: must be correct, else the skip hides a gap);
* a scenario that cannot drive the installed packages (e.g. an mlx-vlm whose API differs)
  returns "not applicable" and is reported as such, never as a failure.

A patch the engine applies beside the others but whose probe finds no bug when it is alone
(its evidence came from another patch's change) is judged as skipped.

At the end every patch that was applied before is applied again. Each patch ends in one of
:data:`OUTCOMES`: ``fixed`` (stock fails, patched is exact), ``not needed`` (skipped, stock is
correct), ``not applicable`` (its scenario did not run here), ``disabled``, or ``gap`` (a fix
that does not hold, a skipped patch whose bug stock mlx-lm still shows, or a patch that failed).
The report counts them apart, streamed one patch at a time (``on_result``); the exit code is 0
iff there is no gap.
"""

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from mlx_lm_patches.engine import core as engine
from mlx_lm_patches.engine.core import State
from mlx_lm_patches.engine.contract import Outcome


FIXED, NOT_NEEDED, NOT_APPLICABLE, DISABLED, GAP = "fixed", "not needed", "not applicable", "disabled", "gap"
OUTCOMES = (FIXED, NOT_NEEDED, NOT_APPLICABLE, DISABLED, GAP)


@dataclass
class CheckResult:
    id: str
    state: str
    holds: bool
    verdict: str
    without: Optional[Outcome]
    with_patch: Optional[Outcome]
    seconds: float
    outcome: str = GAP  # one of OUTCOMES


def _run(module) -> Outcome:
    try:
        return module.scenario()
    except Exception as exc:  # a scenario that crashes is a failed scenario
        return Outcome.failure("scenario raised", exc)


def _only(eng: engine.Engine, ids) -> List[str]:
    """Apply exactly ``ids`` (each decided by the engine as usual), everything else reverted."""
    ids = [i for i in ids if i in eng.records]
    eng.revert([i for i, r in eng.records.items() if r.state in (State.APPLIED, State.PENDING) and i not in ids])
    if ids:
        eng.request(ids, raise_errors=False)
    return ids


def _stock(eng: engine.Engine) -> None:
    eng.revert([i for i, r in eng.records.items() if r.state in (State.APPLIED, State.PENDING)])


def check_patch(eng: engine.Engine, pid: str, state: Optional[State] = None,
                detail: str = "") -> CheckResult:
    """Judge ``pid`` alone. ``state``/``detail``: what the engine decided for it as a user would
    get it (default: its current record); the caller restores the applied patches afterwards."""
    start = time.perf_counter()
    rec = eng.records[pid]
    module = eng.patch_module(pid)
    if state is None:
        state, detail = rec.state, rec.detail
    needs = [i for i in eng.matrix.needed_by(pid) if i != pid]
    without = with_patch = None

    def result(outcome, verdict, shown_state=None):
        return CheckResult(pid, (shown_state or state).value, outcome != GAP, verdict, without,
                           with_patch, time.perf_counter() - start, outcome)

    if state is State.APPLIED:
        _stock(eng)
        without = _run(module)
        if without.ok is None:
            return result(NOT_APPLICABLE, f"not applicable here: {without.summary}")
        _only(eng, [pid] + needs)
        now = eng.records[pid].state
        try:
            with_patch = _run(module) if now is State.APPLIED else None
        finally:
            _stock(eng)
        if with_patch is None and now is State.SKIPPED_PROBE:
            # alone, its probe finds no bug: judged as a skipped patch (stock must be correct)
            state, without = now, None
        elif with_patch is None:
            return result(GAP, f"BROKEN: patch did not apply alone ({now.value}: "
                               f"{eng.records[pid].detail})", now)
        elif with_patch.ok is None:
            return result(NOT_APPLICABLE, f"not applicable here: {with_patch.summary}")
        elif with_patch.ok and not without.ok:
            return result(FIXED, "fixed: stock mlx-lm fails, patched mlx-lm is exact")
        elif with_patch.ok and without.ok:
            return result(GAP, "NOT SHOWN: stock mlx-lm passed the scenario too (probe or "
                               "scenario is wrong)")
        else:
            return result(GAP, "BROKEN: the fix does not hold")
    if state in (State.SKIPPED_VERSION, State.SKIPPED_PROBE):
        _only(eng, needs)
        try:
            without = _run(module)
        finally:
            _stock(eng)
        if without.ok is None:
            return result(NOT_APPLICABLE, f"not applicable here: {without.summary}")
        if without.ok:
            return result(NOT_NEEDED, "not needed: stock mlx-lm is correct")
        return result(GAP, "GAP: skipped, yet stock mlx-lm fails the scenario")
    if state is State.DISABLED:
        return result(DISABLED, "not checked: disabled")
    return result(GAP, f"BROKEN: patch is {state.value}: {detail}")


def run_check(ids=None, on_result: Optional[Callable[[CheckResult], None]] = None) -> List[CheckResult]:
    """Judge ``ids`` (default: every patch), in matrix order; ``on_result`` is called with each
    result as soon as it is known."""
    eng = engine.get()
    chosen = list(eng.records) if ids is None else eng.resolve_ids(ids, "check")
    # every patch is decided as it would be for a user; only the chosen ones are demonstrated
    eng.request(None, raise_errors=False, import_anchors=True)
    decided = {pid: (r.state, r.detail) for pid, r in eng.records.items()}
    applied = [pid for pid, (state, _) in decided.items() if state is State.APPLIED]
    global restored
    results = []
    try:
        for pid in chosen:
            results.append(check_patch(eng, pid, *decided[pid]))
            if on_result is not None:
                on_result(results[-1])
        return results
    finally:
        _stock(eng)
        eng.request(applied, raise_errors=False)  # state restored: applied as before
        restored = (applied, [pid for pid in applied if eng.records[pid].state is State.APPLIED])


restored = ([], [])  # after run_check: (applied before, applied again)


def _word(outcome: Outcome) -> str:
    return {True: "ok", False: "fails", None: "n/a"}[outcome.ok]


def _outcome_dict(outcome: Optional[Outcome]):
    if outcome is None:
        return None
    return {"ok": outcome.ok, "summary": outcome.summary, "details": list(outcome.details)}


def counts(results: List[CheckResult]) -> Dict[str, int]:
    """How many patches ended in each of :data:`OUTCOMES`."""
    return {name: sum(r.outcome == name for r in results) for name in OUTCOMES}


def summary(results: List[CheckResult]) -> str:
    """``check: 20 fixed, 3 not needed (stock correct), 20 not applicable, 1 disabled, 0 gaps``."""
    n = counts(results)
    gaps = n[GAP]
    return (f"check: {n[FIXED]} fixed, {n[NOT_NEEDED]} not needed (stock correct), "
            f"{n[NOT_APPLICABLE]} not applicable, {n[DISABLED]} disabled, "
            f"{gaps} gap{'' if gaps == 1 else 's'}")


def report_dict(results: List[CheckResult]) -> dict:
    """The report as data (``check --json``): per patch its state, its ``outcome`` (one of
    :data:`OUTCOMES`), whether it holds (no gap), the verdict, and each scenario run (``stock``:
    everything reverted but what the patch needs, ``patched``: the patch and what it needs;
    ``null`` where not run), ``ok`` being true, false or null (not applicable here); ``counts``
    per outcome, ``held`` (patches without a gap) of ``total``."""
    eng = engine.get()
    before, again = restored
    return {
        "mlx_lm": eng.mlx_lm.describe(),
        "mlx": eng.mlx.describe(),
        "results": [{"id": r.id, "state": r.state, "outcome": r.outcome, "holds": r.holds,
                     "verdict": r.verdict, "seconds": round(r.seconds, 3),
                     "stock": _outcome_dict(r.without), "patched": _outcome_dict(r.with_patch)}
                    for r in results],
        "counts": counts(results),
        "held": sum(r.holds for r in results),
        "total": len(results),
        "applied_before": list(before),
        "applied_again": list(again),
    }


def header() -> str:
    eng = engine.get()
    return f"mlx-lm-patches check on mlx-lm {eng.mlx_lm.describe()}, mlx {eng.mlx.describe()}"


def format_result(r: CheckResult) -> List[str]:
    """The lines of one patch: its verdict, then the scenario runs behind it."""
    mark = "ok  " if r.holds else "FAIL"
    lines = [f"[{mark}] {r.id} ({r.state}, {r.seconds:.1f}s): {r.verdict}"]
    if r.without is not None:
        label = "stock mlx-lm" if r.with_patch is not None else "stock mlx-lm (no patch needed)"
        lines.append(f"       {label}: {_word(r.without)} - {r.without.summary}")
        lines.extend(f"         {d}" for d in r.without.details)
    if r.with_patch is not None:
        lines.append(f"       with patch: {_word(r.with_patch)} - {r.with_patch.summary}")
        lines.extend(f"         {d}" for d in r.with_patch.details)
    return lines


def format_footer(results: List[CheckResult]) -> str:
    before, again = restored
    lost = [pid for pid in before if pid not in again]
    return "\n".join(["", summary(results),
                      f"applied again after check: {len(again)}/{len(before)}"
                      + (f" (not: {', '.join(lost)})" if lost else "")])


def format_report(results: List[CheckResult]) -> str:
    lines = [header(), ""]
    for r in results:
        lines += format_result(r)
    return "\n".join(lines) + "\n" + format_footer(results)

"""``python -m mlx_lm_patches check``: demonstrate every applicable fix live on the installed mlx-lm.

For each patch the engine applied, run its scenario with every patch on (must be exact), revert
them all and run it again (shows the failure or the wrong output stock mlx-lm gives), then
re-apply. For a
patch skipped because the installed release or the probe says the bug is absent, run the
scenario on stock mlx-lm (must be correct). The report says, per patch, whether the fix holds.
"""

import time
from dataclasses import dataclass
from typing import List, Optional

from mlx_lm_patches.engine import core as engine
from mlx_lm_patches.engine.core import State
from mlx_lm_patches.engine.contract import Outcome


@dataclass
class CheckResult:
    id: str
    state: str
    holds: bool
    verdict: str
    without: Optional[Outcome]
    with_patch: Optional[Outcome]
    seconds: float


def _run(module) -> Outcome:
    try:
        return module.scenario()
    except Exception as exc:  # a scenario that crashes is a failed scenario
        return Outcome.failure("scenario raised", exc)


def check_patch(eng: engine.Engine, pid: str) -> CheckResult:
    start = time.perf_counter()
    rec = eng.records[pid]
    module = eng.patch_module(pid)
    state = rec.state
    without = with_patch = None
    if state is State.APPLIED:
        with_patch = _run(module)
        if with_patch.ok is None:
            return CheckResult(pid, state.value, True, f"not applicable here: {with_patch.summary}",
                               None, with_patch, time.perf_counter() - start)
        # "stock" means no patch at all: patches can overlap (per-row prefill also sidesteps
        # the 0.31.3 mask bug), so reverting only this one could hide the failure
        applied = [i for i, r in eng.records.items() if r.state is State.APPLIED]
        eng.revert(applied)
        try:
            without = _run(module)
        finally:
            eng.request(applied, raise_errors=False)
        holds = with_patch.ok and not without.ok and eng.records[pid].state is State.APPLIED
        if holds:
            verdict = "fixed: stock mlx-lm fails, patched mlx-lm is exact"
        elif with_patch.ok and without.ok:
            verdict = "NOT SHOWN: stock mlx-lm passed the scenario too (probe or scenario is wrong)"
        else:
            verdict = "BROKEN: the fix does not hold"
    elif state in (State.SKIPPED_VERSION, State.SKIPPED_PROBE):
        without = _run(module)
        holds = without.ok is not False
        if without.ok is None:
            verdict = f"not applicable here: {without.summary}"
        else:
            verdict = ("not needed: stock mlx-lm is correct" if holds
                       else "GAP: skipped, yet stock mlx-lm fails the scenario")
    elif state is State.DISABLED:
        holds, verdict = True, "not checked: disabled"
    else:
        holds, verdict = False, f"BROKEN: patch is {state.value}: {rec.detail}"
    return CheckResult(pid, eng.records[pid].state.value, holds, verdict, without, with_patch,
                       time.perf_counter() - start)


def run_check(ids=None) -> List[CheckResult]:
    eng = engine.get()
    chosen = list(eng.records) if ids is None else eng.resolve_ids(ids, "check")
    # every patch applies, as it would for a user; only the chosen ones are demonstrated
    eng.request(None, raise_errors=False, import_anchors=True)
    return [check_patch(eng, pid) for pid in chosen]


def _word(outcome: Outcome) -> str:
    return {True: "ok", False: "fails", None: "n/a"}[outcome.ok]


def format_report(results: List[CheckResult]) -> str:
    eng = engine.get()
    lines = [
        f"mlx-lm-patches check on mlx-lm {eng.mlx_lm.describe()}, mlx {eng.mlx.describe()}",
        "",
    ]
    for r in results:
        mark = "ok  " if r.holds else "FAIL"
        lines.append(f"[{mark}] {r.id} ({r.state}, {r.seconds:.1f}s): {r.verdict}")
        if r.without is not None:
            label = "stock mlx-lm" if r.with_patch is not None else "stock mlx-lm (no patch needed)"
            lines.append(f"       {label}: {_word(r.without)} - {r.without.summary}")
            lines.extend(f"         {d}" for d in r.without.details)
        if r.with_patch is not None:
            lines.append(f"       with patch: {_word(r.with_patch)} - {r.with_patch.summary}")
            lines.extend(f"         {d}" for d in r.with_patch.details)
    held = sum(r.holds for r in results)
    lines += ["", f"{held}/{len(results)} fixes hold"]
    return "\n".join(lines)

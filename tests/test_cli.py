"""The command line: status (text and JSON), check (the main job), table."""

import re

import pytest

from conftest import affected, run_python

pytestmark = pytest.mark.subprocess


@pytest.mark.release_only
def test_status_json_lists_every_patch_with_its_state(the_matrix):
    ran = run_python(None, "-m", "mlx_lm_patches", "status", "--json")
    assert ran.returncode == 0, ran.stderr
    info = ran.json()
    assert info["activation"] == "pth"
    assert info["mlx_lm"] and info["mlx"]
    from mlx_lm_patches.engine import versions

    release = versions.mlx_lm().is_release
    assert info["gate"]["rule"] == ("range" if release else "probe")
    assert info["gate"]["text"].startswith("version range + probe" if release else "probe only (mlx-lm ")
    assert isinstance(info["warnings"], list)
    rows = {row["id"]: row for row in info["patches"]}
    assert set(rows) == set(the_matrix.ids())
    # What `import mlx_lm` imports with the patches on (some probes read a model module).
    imported = set(run_python("import sys, mlx_lm; print(' '.join(sys.modules))").stdout.split())
    for pid, row in rows.items():
        anchor = the_matrix.get(pid).anchor
        # A patch anchored on a module that `import mlx_lm` does not import (e.g.
        # mlx_lm.models.gpt_bigcode) waits for it: "pending" until a model of that family loads.
        waiting = anchor not in imported
        if the_matrix.get(pid).version_verdict(versions.installed) is False:
            expected = "skipped:version"  # a release outside the range (or a package missing)
        elif waiting:  # in range, or probe only (not a release): its probe waits for the anchor
            expected = "pending"
        else:
            expected = "applied" if affected(pid) else "skipped:probe"
        assert row["state"] == expected, row
        assert row["summary"] and row["affected"] and row["targets"] and row["upstream"]


def test_status_text_and_disabled_activation():
    ran = run_python(None, "-m", "mlx_lm_patches", "status", env={"MLX_LM_PATCHES": "0"})
    assert ran.returncode == 0, ran.stderr
    assert "activation: none (MLX_LM_PATCHES=0)" in ran.stdout
    assert "mamba-cache-compat" in ran.stdout and "inactive" in ran.stdout


@pytest.mark.release_only
def test_status_text_is_a_summary_line_then_rows_within_100_columns(the_matrix):
    ran = run_python(None, "-m", "mlx_lm_patches", "status")
    verbose = run_python(None, "-m", "mlx_lm_patches", "status", "--verbose")
    assert ran.returncode == 0 and verbose.returncode == 0, ran.stderr + verbose.stderr
    for out in (ran.stdout, verbose.stdout):
        assert max(map(len, out.splitlines())) <= 100, max(out.splitlines(), key=len)
    first = ran.stdout.splitlines()[0]
    counted = dict((state, int(n)) for n, state in re.findall(r"(\d+) ([a-z:]+)", first.partition(": ")[2]))
    assert first.startswith("mlx-lm-patches ") and sum(counted.values()) == len(the_matrix.ids()), first
    rows = [line.split()[:2] for line in ran.stdout.splitlines() if line.split()[:1] and line.split()[0] in the_matrix.ids()]
    assert len(rows) == len(the_matrix.ids())
    assert {state: sum(1 for _, s in rows if s == state) for state in counted} == counted
    for spec in the_matrix.patches:  # what each fixes: in --verbose only
        assert spec.summary.split()[0] in verbose.stdout


def test_status_exits_non_zero_when_a_patch_failed():
    if not affected("mamba-cache-compat"):
        pytest.skip("patch not in range here")
    ran = run_python("""
        import sys
        import mlx_lm_patches.patches.mamba_cache_compat as patch
        def boom():
            raise RuntimeError("injected")
        patch.probe = boom
        from mlx_lm_patches.__main__ import main
        sys.exit(main(["status"]))
    """)
    assert ran.returncode == 1
    assert "failed" in ran.stdout and "injected" in ran.stdout


def test_check_demonstrates_every_fix(request, check_report):
    """Each patch judged alone: stock = everything reverted, patched = the patch plus what it
    ``needs``; skipped patches on stock mlx-lm; a scenario that cannot drive the installed API
    says "not applicable"; afterwards every patch applied before is applied again."""
    from conftest import judged_ids

    assert check_report["returncode"] == 0, check_report["stderr"][-3000:]
    judged = {row["id"]: row for row in check_report["results"]}
    assert list(judged) == judged_ids(request.config)
    for pid, row in judged.items():
        assert row["holds"], row
        if row["verdict"].startswith("not applicable here"):
            assert row["outcome"] == "not applicable", row
            continue
        if affected(pid):
            assert row["verdict"] == "fixed: stock mlx-lm fails, patched mlx-lm is exact", row
            assert row["stock"]["ok"] is False and row["patched"]["ok"] is True, row
            assert row["outcome"] == "fixed", row
        else:
            assert row["verdict"] == "not needed: stock mlx-lm is correct", row
            assert row["stock"]["ok"] is True and row["patched"] is None, row
            assert row["outcome"] == "not needed", row
    assert check_report["held"] == check_report["total"] == len(judged)
    # the counts are of what ran: a patch whose scenario could not run is not counted as fixed
    counts = check_report["counts"]
    assert counts == {name: sum(r["outcome"] == name for r in judged.values())
                      for name in ("fixed", "not needed", "not applicable", "disabled", "gap")}
    assert counts["gap"] == 0 and counts["disabled"] == 0, counts
    assert check_report["applied_again"] == check_report["applied_before"]


def _check_streamed(*args):
    """``check`` in a fresh interpreter: ``(exit code, [(seconds since start, stdout line)],
    stderr)``, each line timed as it arrives."""
    import subprocess
    import sys
    import time

    from conftest import clean_env

    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm_patches", "check", *args], cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    stderr = proc.stderr.read()
    return proc.wait(timeout=600), lines, stderr


@pytest.mark.release_only
def test_check_text_report(the_matrix):
    """What a user reads: one line per patch judged as soon as it is judged (streamed, not at
    the end), its scenario runs under it, then the counts; nothing but the report on stdout."""
    pids = ["mamba-cache-compat", "recurrent-rollback"]  # the second one takes seconds
    code, timed, stderr = _check_streamed(*pids)
    lines = [line for _, line in timed]
    assert code == 0, "\n".join(lines) + stderr
    assert lines[0].startswith("mlx-lm-patches check on mlx-lm "), lines[0]
    verdicts = [(at, line) for at, line in timed if line.startswith("[")]
    assert [line.split()[2] for _, line in verdicts] == pids, lines
    pid, verdict = pids[0], verdicts[0][1]
    assert re.match(rf"^\[ok  \] {pid} \((applied|skipped:version|skipped:probe), \d+\.\ds\): ", verdict), verdict
    want = "fixed: stock mlx-lm fails, patched mlx-lm is exact" if affected(pid) else "not needed: stock mlx-lm is correct"
    assert verdict.endswith(want), verdict
    assert any(l.startswith("       stock mlx-lm") for l in lines), lines
    # the first patch's lines arrived before the second patch's scenario ran
    second = float(re.search(r"\((?:[a-z:]+), (\d+\.\d)s\)", verdicts[1][1]).group(1))
    assert verdicts[0][0] < timed[-1][0] - second + 0.5, (timed, second)
    outcomes = {"fixed": 0, "not needed (stock correct)": 0, "not applicable": 0, "disabled": 0}
    for _, line in verdicts:
        outcome = ("not applicable" if "not applicable here" in line else
                   "fixed" if "fixed:" in line else "not needed (stock correct)")
        outcomes[outcome] += 1
    assert ("check: " + ", ".join(f"{n} {name}" for name, n in outcomes.items()) + ", 0 gaps") in lines, lines
    assert re.search(r"^applied again after check: (\d+)/\1$", "\n".join(lines), re.M), lines


def test_check_unknown_id_is_a_clear_error():
    ran = run_python(None, "-m", "mlx_lm_patches", "check", "no-such-patch")
    assert ran.returncode == 2
    assert "check: unknown patch id(s) 'no-such-patch'" in ran.stderr


def test_table_matches_matrix(the_matrix):
    ran = run_python(None, "-m", "mlx_lm_patches", "table")
    assert ran.returncode == 0
    for spec in the_matrix.patches:
        assert f"`{spec.id}`" in ran.stdout

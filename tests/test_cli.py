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
        ruled_out = "skipped:version" if the_matrix.get(pid).version_verdict(versions.installed) is not None else "skipped:probe"
        expected = ("pending" if waiting else "applied") if affected(pid) else ruled_out
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


def test_check_demonstrates_every_fix(the_matrix, check_report):
    """Each patch judged alone: stock = everything reverted, patched = the patch plus what it
    ``needs``; skipped patches on stock mlx-lm; a scenario that cannot drive the installed API
    says "not applicable"; afterwards every patch applied before is applied again."""
    assert check_report["returncode"] == 0, check_report["stderr"][-3000:]
    judged = {row["id"]: row for row in check_report["results"]}
    assert list(judged) == list(the_matrix.ids())
    for pid, row in judged.items():
        assert row["holds"], row
        if row["verdict"].startswith("not applicable here"):
            continue
        if affected(pid):
            assert row["verdict"] == "fixed: stock mlx-lm fails, patched mlx-lm is exact", row
            assert row["stock"]["ok"] is False and row["patched"]["ok"] is True, row
        else:
            assert row["verdict"] == "not needed: stock mlx-lm is correct", row
            assert row["stock"]["ok"] is True and row["patched"] is None, row
    assert check_report["held"] == check_report["total"] == len(judged)
    assert check_report["applied_again"] == check_report["applied_before"]


@pytest.mark.release_only
def test_check_text_report(the_matrix):
    """What a user reads: one line per patch judged, its scenario runs under it, the totals;
    nothing but the report on stdout."""
    pid = "mamba-cache-compat"
    ran = run_python(None, "-m", "mlx_lm_patches", "check", pid, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("mlx-lm-patches check on mlx-lm "), lines[0]
    verdict = next(l for l in lines if l.startswith("["))
    assert re.match(rf"^\[ok  \] {pid} \((applied|skipped:version|skipped:probe), \d+\.\ds\): ", verdict), verdict
    want = "fixed: stock mlx-lm fails, patched mlx-lm is exact" if affected(pid) else "not needed: stock mlx-lm is correct"
    assert verdict.endswith(want), verdict
    assert any(l.startswith("       stock mlx-lm") for l in lines), ran.stdout
    assert "1/1 fixes hold" in lines
    assert re.search(r"^applied again after check: (\d+)/\1$", ran.stdout, re.M), ran.stdout


def test_check_unknown_id_is_a_clear_error():
    ran = run_python(None, "-m", "mlx_lm_patches", "check", "no-such-patch")
    assert ran.returncode == 2
    assert "check: unknown patch id(s) 'no-such-patch'" in ran.stderr


def test_table_matches_matrix(the_matrix):
    ran = run_python(None, "-m", "mlx_lm_patches", "table")
    assert ran.returncode == 0
    for spec in the_matrix.patches:
        assert f"`{spec.id}`" in ran.stdout

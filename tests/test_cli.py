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


@pytest.mark.release_only
def test_check_demonstrates_every_fix(the_matrix):
    """Each patch judged alone: stock = everything reverted, patched = the patch plus what it
    ``needs``; skipped patches on stock mlx-lm; a scenario that cannot drive the installed API
    says "not applicable"; afterwards every patch applied before is applied again."""
    ran = run_python(None, "-m", "mlx_lm_patches", "check", timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for pid in the_matrix.ids():
        line = next(l for l in ran.stdout.splitlines() if l.startswith("[") and f"] {pid} (" in l)
        assert line.startswith("[ok  ]"), line
        if "not applicable here" in line:
            continue
        if affected(pid):
            assert "fixed: stock mlx-lm fails, patched mlx-lm is exact" in line
        else:
            assert "not needed: stock mlx-lm is correct" in line
    assert re.search(r"^(\d+)/\1 fixes hold$", ran.stdout, re.M), ran.stdout
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

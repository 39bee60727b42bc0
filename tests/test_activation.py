"""Automatic activation in fresh interpreters: the installed .pth, sitecustomize, `run`, the
environment variables, late activation, fault containment and interpreter start cost."""

import os
import re
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, affected, run_python

pytestmark = pytest.mark.subprocess

TESTS = str(REPO / "tests")
SITE = sysconfig.get_paths()["purelib"]


def test_package_is_installed_with_its_pth():
    if os.environ.get("MLX_LM_PATCHES_EXPECT_INSTALLED") != "1":
        pytest.skip("not running from tools/run_matrix.py")
    import mlx_lm_patches

    assert Path(mlx_lm_patches.__file__).resolve().is_relative_to(Path(SITE).resolve())
    assert (Path(SITE) / "mlx_lm_patches.pth").is_file()
    assert (Path(SITE) / "mlx_lm_patches.start").read_text().strip() == "_mlx_lm_patches_boot:start"


def test_interpreter_start_is_cheap_and_lazy():
    ran = run_python("""
        import sys
        heavy = [m for m in ("wrapt", "yaml", "packaging", "importlib.metadata", "mlx_lm",
                             "mlx_lm_patches.engine.core", "mlx_lm_patches.engine.matrix") if m in sys.modules]
        heavy += [m for m in sys.modules if m.startswith("mlx_lm_patches")]
        print(heavy, "_mlx_lm_patches_boot" in sys.modules)
    """)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["[]", "True"], ran.stdout
    assert ran.stderr == ""


def _our_import_microseconds(stderr):
    total = 0
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+)\s+\|\s+\d+\s+\|\s+(\s*)(\S+)", line)
        if m and m.group(3).split(".")[0] in ("mlx_lm_patches", "_mlx_lm_patches_boot", "wrapt"):
            total += int(m.group(1))
    return total


def test_importtime_under_one_millisecond():
    best = min(_our_import_microseconds(run_python("pass", env={"PYTHONPROFILEIMPORTTIME": "1"}).stderr)
               for _ in range(5))
    ran = run_python("pass", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert "wrapt" not in ran.stderr
    assert "_mlx_lm_patches_boot" in ran.stderr, "the .pth did not run"
    assert best < 1000, f"our modules cost {best} us at interpreter start"


def test_automatic_activation_without_apply_and_nothing_on_stdout():
    ran = run_python("""
        import mlx_lm
        import _mlx_lm_patches_boot as boot
        import child
        print(boot.armed_by(), child.states(), file=__import__("sys").stderr)
    """, env={"PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == ""
    assert "pth" in ran.stderr
    if affected("mamba-cache-compat"):
        assert "'mamba-cache-compat': 'applied'" in ran.stderr


def test_activation_triggers_are_mlx_lm_and_every_patched_package(the_matrix):
    """The bootstrap cannot read the matrix at interpreter start (that would cost more than the
    1 ms budget), so it lists the packages whose first import activates the engine; they must be
    mlx-lm and every distribution a patch names, or that distribution's fixes would wait for an
    import of mlx_lm that may never come (mlx-vlm 0.7 does not import it)."""
    import _mlx_lm_patches_boot as boot

    named = {spec.package.replace("-", "_") for spec in the_matrix.patches}
    assert set(boot.TRIGGERS) == {"mlx_lm"} | named


def test_first_import_of_a_patched_package_activates_without_mlx_lm():
    """A process whose first import among them is ``mlx_vlm`` activates the engine at that
    lookup (whether mlx-vlm is installed or not: the lookup is what the finder sees), without
    importing mlx_lm itself: where mlx_lm was not imported, mlx-lm's patches stay pending."""
    ran = run_python("""
        import sys
        try:
            import mlx_vlm
        except ImportError:
            pass
        import mlx_lm_patches
        states = {r.id: r.state for r in mlx_lm_patches.status()}
        print("mlx_lm" in sys.modules, states["mamba-cache-compat"])
    """, env={"MLX_LM_PATCHES_DEBUG": "1"})
    assert ran.returncode == 0, ran.stderr
    assert "automatic activation via pth" in ran.stderr, ran.stderr[-2000:]
    imported_mlx_lm, state = ran.stdout.split()
    if imported_mlx_lm == "False":  # mlx-vlm 0.7 does not import mlx_lm (older ones do)
        assert state == "pending", state


def test_pth_runs_twice_but_applies_once():
    ran = run_python(f"""
        import site, sys
        site.addsitedir({SITE!r})      # re-runs every .pth line in site-packages, ours included
        exec(open({SITE!r} + "/mlx_lm_patches.pth").read())  # and once more by hand
        finders = [f for f in sys.meta_path if type(f).__name__ == "_MlxLmImportFinder"]
        import mlx_lm.models.cache
        import child
        print(len(finders), child.assert_not_double_wrapped())
    """, env={"PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    n_finders, n_ours = ran.stdout.split()
    assert n_finders == "1"
    if affected("mamba-cache-compat"):
        assert int(n_ours) >= 1


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_env_off_leaves_mlx_lm_untouched(value):
    ran = run_python("""
        import sys, mlx_lm.models.cache
        import child
        print("_mlx_lm_patches_boot" in sys.modules, "wrapt" in sys.modules, child.assert_not_double_wrapped())
    """, env={"MLX_LM_PATCHES": value, "PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["False", "False", "0"]


def test_env_malformed_enabled_says_so_once_and_import_works():
    ran = run_python("import mlx_lm.models.cache", env={"MLX_LM_PATCHES": "maybe"})
    assert ran.returncode == 0
    assert ran.stderr.count("MLX_LM_PATCHES='maybe' is not understood") == 1, ran.stderr
    assert ran.stdout == ""


def test_env_malformed_settings_are_one_line_each_and_the_defaults_used():
    """Automatic activation: a typo in any variable is one line on stderr naming it and the
    accepted values; the program runs with the default, also where a patch reads it later."""
    malformed = ["MLX_LM_PATCHES_STRICT", "MLX_LM_PATCHES_DEBUG", "MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS",
                 "MLX_LM_PATCHES_PREFIX_CHECKPOINTS", "MLX_LM_PATCHES_DISABLE"]
    ran = run_python("""
        import sys, mlx_lm.models.cache, child
        from mlx_lm_patches.mechanisms.journal import max_snapshots
        from mlx_lm_patches.mechanisms.prefix_reuse.settings import max_checkpoints
        print(max_snapshots(), max_checkpoints(), max_snapshots(), file=sys.stderr)
        print(sorted(set(child.states().values())), file=sys.stderr)
    """, env={**{name: "maybe!" for name in malformed}, "PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == ""
    lines = ran.stderr.splitlines()
    for name in malformed:
        said = [line for line in lines if f"{name}='maybe!'" in line]
        assert len(said) == 1 and "accepted values:" in said[0] and "using the default" in said[0], lines
    assert "32 8 32" in lines
    assert "disabled" not in lines[-1] and "failed" not in lines[-1]  # the DISABLE typo disabled nothing


def test_explicit_apply_raises_on_a_malformed_setting():
    ran = run_python("""
        import mlx_lm_patches
        mlx_lm_patches.apply()
    """, env={"MLX_LM_PATCHES_STRICT": "maybe", "MLX_LM_PATCHES": "0"})
    assert ran.returncode != 0
    assert "EnvError: MLX_LM_PATCHES_STRICT='maybe' is not understood; accepted values:" in ran.stderr


def test_explicit_apply_only_before_import_applies_only_those():
    """apply(only=...) called first takes the place of automatic activation."""
    ran = run_python("""
        import mlx_lm_patches, child
        mlx_lm_patches.apply(only=["mamba-cache-compat"])
        import mlx_lm, mlx_lm.generate
        print(sorted(i for i, s in child.states().items() if s != "inactive"))
    """, env={"PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["['mamba-cache-compat']"]


def test_env_disable_unknown_id_warns_and_others_apply():
    ran = run_python("""
        import mlx_lm.models.cache, child, sys
        print(child.states(), file=sys.stderr)
    """, env={"MLX_LM_PATCHES_DISABLE": "no-such-patch", "PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    assert "MLX_LM_PATCHES_DISABLE names unknown patch id(s) 'no-such-patch'" in ran.stderr
    if affected("mamba-cache-compat"):
        assert "'mamba-cache-compat': 'applied'" in ran.stderr


def test_env_disable_malformed_and_explicit_apply_raises():
    ran = run_python("""
        import mlx_lm_patches
        mlx_lm_patches.apply()
    """, env={"MLX_LM_PATCHES_DISABLE": "*,mamba-cache-compat", "MLX_LM_PATCHES": "0"})
    assert ran.returncode != 0
    assert "MLX_LM_PATCHES_DISABLE='*,mamba-cache-compat' mixes '*'" in ran.stderr


def test_env_disable_star_disables_everything():
    ran = run_python("""
        import mlx_lm.models.cache, child, sys
        print(sorted(set(child.states().values())))
    """, env={"MLX_LM_PATCHES_DISABLE": "*", "PYTHONPATH": TESTS})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "['disabled']"


def test_debug_logs_decisions_to_stderr():
    ran = run_python("import mlx_lm.models.cache", env={"MLX_LM_PATCHES_DEBUG": "1"})
    assert ran.returncode == 0
    assert "automatic activation via pth" in ran.stderr
    assert "mamba-cache-compat ->" in ran.stderr
    assert ran.stdout == ""


FAULT = """
    import mlx_lm_patches.patches.mamba_cache_compat as patch
    def boom(*args):
        raise RuntimeError("injected fault")
    patch.{which} = boom
    import mlx_lm
    from mlx_lm.models import cache
    import mlx_lm_patches
    print(mlx_lm_patches.status()[0].state)
"""


@pytest.mark.parametrize("which", ["probe", "apply"])
def test_injected_fault_leaves_import_working(which):
    if not affected("mamba-cache-compat"):
        pytest.skip("patch not in range here")
    ran = run_python(FAULT.format(which=which))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "failed"
    assert "mamba-cache-compat" in ran.stderr and "injected fault" in ran.stderr


@pytest.mark.parametrize("which", ["probe", "apply"])
def test_injected_fault_strict_fails_the_import(which):
    if not affected("mamba-cache-compat"):
        pytest.skip("patch not in range here")
    ran = run_python(FAULT.format(which=which), env={"MLX_LM_PATCHES_STRICT": "1"})
    assert ran.returncode != 0
    assert "PatchError" in ran.stderr and "injected fault" in ran.stderr


def test_injected_fault_explicit_apply_raises():
    if not affected("mamba-cache-compat"):
        pytest.skip("patch not in range here")
    ran = run_python(FAULT.format(which="probe").replace("import mlx_lm\n", "mlx_lm_patches.apply()\n")
                     .replace("    import mlx_lm_patches.patches", "    import mlx_lm_patches\n    import mlx_lm_patches.patches"),
                     env={"MLX_LM_PATCHES": "0"})
    assert ran.returncode != 0
    assert "PatchError: patch 'mamba-cache-compat' failed: probe raised RuntimeError: injected fault" in ran.stderr


def test_late_activation_applies_and_warns():
    ran = run_python("""
        import mlx_lm
        import mlx_lm_patches, sys
        rows = mlx_lm_patches.apply()
        print({r.id: r.state for r in rows}, file=sys.stderr)
    """, env={"MLX_LM_PATCHES": "0"})
    assert ran.returncode == 0, ran.stderr
    assert "apply() after mlx_lm was imported" in ran.stderr
    if affected("mamba-cache-compat"):
        assert "'mamba-cache-compat': 'applied'" in ran.stderr


def _bare_venv(tmp_path):
    """A venv that sees mlx-lm and our package through PYTHONPATH only: no .pth is processed."""
    import subprocess

    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


PROBE_CHILD = """
    import json, os, subprocess, sys
    import mlx_lm.models.cache as cache
    from mlx_lm_patches.__main__ import armed_by
    out = {"armed_by": armed_by(), "user_site": getattr(__import__("builtins"), "_user_sitecustomize_ran", False)}
    if len(sys.argv) > 1:
        child = subprocess.run([sys.executable, "-c", "import mlx_lm; from mlx_lm_patches.__main__ import armed_by; print(armed_by())"],
                               capture_output=True, text=True)
        out["child_armed_by"] = child.stdout.strip()
    print(json.dumps(out))
"""


def test_sitecustomize_launcher_activates_and_chains_user_sitecustomize(tmp_path):
    python = _bare_venv(tmp_path)
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import builtins\nbuiltins._user_sitecustomize_ran = True\n")
    script = tmp_path / "probe_child.py"
    script.write_text(__import__("textwrap").dedent(PROBE_CHILD))
    pythonpath = os.pathsep.join([str(user), SITE])
    launcher = str(Path(sys.executable).parent / "mlx-lm-patches-run")

    control = run_python(None, str(script), python=python, env={"PYTHONPATH": pythonpath})
    assert control.returncode == 0, control.stderr
    assert control.json() == {"armed_by": None, "user_site": True}

    launched = run_python(None, launcher, python, str(script), "children", python=sys.executable,
                          env={"PYTHONPATH": pythonpath})
    assert launched.returncode == 0, launched.stderr
    assert launched.json() == {"armed_by": "sitecustomize", "user_site": True, "child_armed_by": "None"}

    inherited = run_python(None, launcher, python, str(script), "children", python=sys.executable,
                           env={"PYTHONPATH": pythonpath, "MLX_LM_PATCHES_CHILDREN": "1"})
    assert inherited.json()["child_armed_by"] == "sitecustomize"


def test_launcher_reports_missing_command():
    launcher = str(Path(sys.executable).parent / "mlx-lm-patches-run")
    ran = run_python(None, launcher, "no-such-command-xyz", python=sys.executable)
    assert ran.returncode == 127 and "cannot run 'no-such-command-xyz'" in ran.stderr
    ran = run_python(None, launcher, python=sys.executable)
    assert ran.returncode == 2 and "usage" in ran.stderr


def test_run_module_in_process_applies_first(tmp_path):
    (tmp_path / "usermod.py").write_text(
        "import sys\nfrom mlx_lm_patches import status\n"
        "print(sys.argv[1:], {r.id: r.state for r in status()})\n"
    )
    ran = run_python(None, "-m", "mlx_lm_patches", "run", "-m", "usermod", "--flag", "x",
                     env={"MLX_LM_PATCHES": "0", "PYTHONPATH": str(tmp_path)})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("['--flag', 'x']")
    if affected("mamba-cache-compat"):
        assert "'mamba-cache-compat': 'applied'" in ran.stdout
    script = run_python(None, "-m", "mlx_lm_patches", "run", str(tmp_path / "usermod.py"), "y",
                        env={"MLX_LM_PATCHES": "0"})
    assert script.returncode == 0 and script.stdout.startswith("['y']"), script.stderr

"""A git install of mlx-lm ``main`` is decided by the probes alone, whatever its version says.

mlx-lm's ``main`` carries the next release's number before that release's fixes land. Here a
temporary venv holds the installed release's own mlx-lm files, labelled as the next release and
recorded the way pip and uv record a VCS install (``direct_url.json`` with ``vcs_info``), and a
copy of mlx-lm-patches whose matrix says one patch's bug ends with the installed release
(``affected: ==<release>``, as a range reads once a fix is merged for the next release). The
label lies outside that range, the probe still finds the bug in the files: the patch must be
applied, and ``status`` must name the rule. The same files labelled as a plain release of that
number are gated by the range (skipped:version), for contrast.

No network: the venv is made with ``venv --without-pip`` and reaches this venv's packages
(mlx, transformers, ...) through a ``.pth`` line.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_python

pytestmark = [pytest.mark.subprocess, pytest.mark.release_only]

PATCH = "mamba-cache-compat"  # its probe finds the bug in every release's files


def _next_release(version):
    from packaging.version import Version

    v = Version(version)
    return f"{v.major}.{v.minor}.{v.micro + 1}"


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python*/site-packages"))


def _label(site: Path, label: str, direct_url) -> None:
    """Record the copied mlx-lm as installed at ``label`` (with pip's ``direct_url.json``)."""
    from importlib import metadata

    for old in site.glob("mlx_lm-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"mlx_lm-{label}.dist-info"
    info.mkdir()
    release = metadata.distribution("mlx-lm")
    text = re.sub(r"(?m)^Version: .*$", f"Version: {label}", release.read_text("METADATA"))
    (info / "METADATA").write_text(text)
    (info / "INSTALLER").write_text("uv\n")
    (info / "RECORD").write_text("")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv holding the installed release's mlx-lm files and a copy of mlx-lm-patches whose
    shipped matrix closes PATCH's range at that release; labelled by each test."""
    from importlib import metadata

    import mlx_lm
    import mlx_lm_patches

    venv = tmp_path_factory.mktemp("git-install") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    made = subprocess.run([base, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"cannot build a temporary venv with {base}: {made.stderr.strip()[-300:]}")
    site = _site_packages(venv)
    here = Path(mlx_lm.__file__).resolve().parent.parent  # this venv's site-packages
    for name in ("_mlx_lm_patches_boot.py", "mlx_lm_patches.pth"):
        if not (here / name).exists():
            pytest.skip(f"{name} not in {here}: mlx-lm-patches not installed with its activation")
        shutil.copy(here / name, site / name)
    shutil.copytree(Path(mlx_lm.__file__).resolve().parent, site / "mlx_lm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    package = Path(mlx_lm_patches.__file__).resolve().parent
    shutil.copytree(package, site / "mlx_lm_patches", ignore=shutil.ignore_patterns("__pycache__"))
    from mlx_lm_patches.engine import matrix

    release = metadata.version("mlx-lm")
    source = matrix.default_path().read_text(encoding="utf-8")
    entry = source.index(f"  - id: {PATCH}\n")
    head, rest = source[:entry], source[entry:]
    rest = re.sub(r'affected: "[^"]*"', f'affected: "=={release}"', rest, count=1)
    rest = re.sub(r"fixed_in: \S+", f'fixed_in: "{_next_release(release)}"', rest, count=1)
    (site / "mlx_lm_patches" / "compat_matrix.yaml").write_text(head + rest, encoding="utf-8")
    # everything else (mlx, transformers, wrapt, ...) from this venv, after the copies
    (site / "zz_this_venv.pth").write_text(f"{here}\n")
    return venv


def _status(venv: Path):
    ran = run_python(None, "-m", "mlx_lm_patches", "status", "--json",
                     python=str(venv / "bin" / "python"), timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran.json()


def test_a_git_install_labelled_as_the_next_release_is_gated_by_the_probe(venv):
    from importlib import metadata

    release = metadata.version("mlx-lm")
    label = _next_release(release)
    git = {"url": "https://github.com/ml-explore/mlx-lm.git",
           "vcs_info": {"vcs": "git", "commit_id": "0123456789abcdef0123456789abcdef01234567",
                        "requested_revision": "main"}}
    _label(_site_packages(venv), label, git)
    info = _status(venv)
    assert info["mlx_lm"] == f"{label} (git https://github.com/ml-explore/mlx-lm.git@0123456789ab)"
    assert info["gate"]["rule"] == "probe"
    assert info["gate"]["text"].startswith("probe only (mlx-lm installed from git https://github.com/ml-explore/mlx-lm.git@0123456789ab")
    assert any("not a published release" in w for w in info["warnings"])
    rows = {row["id"]: row for row in info["patches"]}
    assert rows[PATCH]["affected"] == f"=={release}"  # the label lies outside
    assert rows[PATCH]["state"] == "applied", rows[PATCH]
    # no patch is ruled out by a range here; only a missing distribution or requirement can
    for row in rows.values():
        if row["state"] == "skipped:version":
            assert "not installed" in row["detail"] or "which the bug needs" in row["detail"], row

    text = run_python(None, "-m", "mlx_lm_patches", "status",
                      python=str(venv / "bin" / "python"), timeout=120)
    assert "gate: probe only (mlx-lm installed from git" in text.stdout, text.stdout


def test_the_same_files_labelled_as_a_release_are_gated_by_the_range(venv):
    from importlib import metadata

    label = _next_release(metadata.version("mlx-lm"))
    _label(_site_packages(venv), label, None)
    info = _status(venv)
    assert info["gate"] == {"rule": "range", "text": "version range + probe"}
    rows = {row["id"]: row for row in info["patches"]}
    assert rows[PATCH]["state"] == "skipped:version", rows[PATCH]
    from packaging.version import Version

    from mlx_lm_patches.engine import matrix

    newer = Version(label) > matrix.load().newest_tested()
    assert any("newer than the newest tested release" in w for w in info["warnings"]) == newer
    assert not any("not a published release" in w for w in info["warnings"])

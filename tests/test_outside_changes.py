"""What a patch changes beyond its targets goes through the patcher: status (``changes()`` and
the row's detail) lists it while applied, and ``revert()`` leaves nothing of ours behind - the
``python -m mlx_lm.X`` hook on runpy, the class swap of the MTP hidden-state capture on models
loaded before the revert, the MTP interface on them, and the last loaded model and tokenizer
``--draft-model mtp`` remembers. Each case runs in a fresh interpreter."""

import pytest

from conftest import REPO, run_python

pytestmark = [pytest.mark.subprocess, pytest.mark.release_only]

ENV = {"PYTHONPATH": str(REPO / "tests"), "MLX_LM_PATCHES": "0"}


def _ok(code):
    ran = run_python(code, env=ENV)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip().splitlines()[-1] == "ok", ran.stdout


def test_console_hook_is_listed_and_reverted():
    _ok("""
        import runpy
        import _mlx_lm_patches_boot as boot
        import mlx_lm_patches
        from mlx_lm_patches.engine import core

        stock = runpy._run_module_as_main
        boot._run_as_console_script("mlx_lm.generate")
        assert runpy._run_module_as_main is not stock
        assert "runpy._run_module_as_main" in " ".join(core.changes()["activation"])
        mlx_lm_patches.revert(["mtp-heads-kept"])  # reverting some patches leaves it
        assert runpy._run_module_as_main is not stock
        mlx_lm_patches.revert()
        assert runpy._run_module_as_main is stock
        assert "activation" not in core.changes()
        print("ok")
    """)


def test_console_hook_removes_itself_when_used():
    _ok("""
        import runpy, sys
        import _mlx_lm_patches_boot as boot

        stock = runpy._run_module_as_main
        boot._run_as_console_script("mlx_lm.nothing_such")
        try:
            runpy._run_module_as_main("mlx_lm_patches_no_such_module")
        except BaseException:
            pass  # runpy's own error for a missing module
        assert runpy._run_module_as_main is stock
        print("ok")
    """)


MTP = """
import tempfile, weakref
import mlx_lm_patches
from mlx_lm_patches.engine import core
from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
from mlx_lm_patches.mechanisms.mtp.decoding import CAPTURE, INTERFACE

mlx_lm_patches.apply(["mtp-heads-kept", "mtp-draft-selection"])
import sys
import mlx_lm.generate
from mlx_lm.models import qwen3_next
gen = sys.modules["mlx_lm.generate"]

states = {{r.id: r for r in mlx_lm_patches.status()}}
assert states["mtp-heads-kept"].state == "applied", states["mtp-heads-kept"].detail
tmp = tempfile.mkdtemp()
folder = str(write_mtp_checkpoint(tmp, "qwen3_next", form="hf", dtype="float32").folder)
model, tokenizer = gen.load(folder)
norm = model.model.norm
model_class, norm_class = type(model).__mro__[0], type(norm)
draft, draft_tokenizer = gen.load("mtp")  # installs the capture: classes swapped
assert draft_tokenizer is tokenizer
assert type(model) is not qwen3_next.Model and type(model).__name__ == "Model"
assert type(model.model.norm) is not norm_class

changes = core.changes()
assert any("MTP interface" in c for c in changes["mtp-heads-kept"]), changes
assert any("tokenizer" in c for c in changes["mtp-draft-selection"]), changes
rows = {{r.id: r for r in mlx_lm_patches.status()}}
assert "MTP interface" in rows["mtp-heads-kept"].detail, rows["mtp-heads-kept"].detail
assert "tokenizer" in rows["mtp-draft-selection"].detail, rows["mtp-draft-selection"].detail

mlx_lm_patches.revert({revert!r})
assert type(model) is qwen3_next.Model, type(model).__mro__
assert type(model.model.norm) is norm_class
assert CAPTURE not in vars(model) and CAPTURE not in vars(model.model.norm)
assert not [name for name in INTERFACE if name in vars(model)]
assert core.changes() == {{}}, core.changes()
for pid in ("mtp-heads-kept", "mtp-draft-selection"):
    row = {{r.id: r for r in mlx_lm_patches.status()}}[pid]
    assert row.state == "reverted" and "also changed" not in row.detail, row.detail

# the remembered model and tokenizer did not outlive the revert
mlx_lm_patches.apply(["mtp-heads-kept", "mtp-draft-selection"])
try:
    gen.load("mtp")
except ValueError as exc:
    assert "load the main model first" in str(exc), exc
else:
    raise AssertionError("load('mtp') found a model remembered from before the revert")
# and a model loaded now gets the interface and works as a draft again
model2, _ = gen.load(folder)
draft2, _ = gen.load("mtp")
mlx_lm_patches.revert()
assert type(model2) is qwen3_next.Model
print("ok")
"""


@pytest.mark.parametrize("revert", [None, ["mtp-heads-kept", "mtp-draft-selection"]],
                         ids=["revert-all", "revert-both"])
def test_mtp_changes_are_listed_and_reverted(revert):
    _ok(MTP.format(revert=revert))

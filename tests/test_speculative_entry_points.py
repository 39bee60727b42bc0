"""Speculative decoding of a hybrid model where users run it: ``stream_generate(...,
draft_model=...)`` and ``mlx_lm.generate --draft-model``, on model folders written to disk
(safetensors, config.json, a locally built tokenizer), against the same entry point without a
draft. With a hybrid draft that disagrees with the main model, a dense draft, and the main model
as its own draft (every draft token accepted)."""

import pytest

from mlx_lm_patches.selftest.model_folder import write_model_folder
from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model, tiny_config



@pytest.fixture(autouse=True)
def _fixed_draft_length(monkeypatch):
    """Some checks here need rounds that draft (tokens from the draft) at a fixed
    ``num_draft_tokens``; with adaptive drafting a draft that does not pay (a tiny model's)
    is rightly left out: off here (its schedules are tested in test_adaptive_drafting.py)."""
    from mlx_lm_patches.engine import env

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "0")

pytestmark = pytest.mark.release_only

MAIN = "qwen3_next"
PROMPT = "the quick brown fox jumps over"
# The self-draft is the main model itself: every draft token is accepted.
DRAFTS = {"hybrid-draft": (MAIN, 7), "dense-draft": (DENSE_MODEL_TYPE, 2), "self-draft": (MAIN, 1)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    out = {"main": write_model_folder(root / "main", build_tiny_model(MAIN, seed=1), tiny_config(MAIN))}
    for name, (model_type, seed) in DRAFTS.items():
        out[name] = write_model_folder(root / name, build_tiny_model(model_type, seed=seed), tiny_config(model_type))
    return out


def _stream(model, tokenizer, **kwargs):
    from mlx_lm.generate import stream_generate

    return [(r.token, r.logprobs, getattr(r, "from_draft", False))
            for r in stream_generate(model, tokenizer, PROMPT, max_tokens=14, **kwargs)]


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_stream_generate_with_a_draft_model(folders, draft):
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(folders["main"]))
    draft_model, _ = load(str(folders[draft]))
    reference = _stream(model, tokenizer)
    got = _stream(model, tokenizer, draft_model=draft_model, num_draft_tokens=3)
    assert [t for t, _, _ in got] == [t for t, _, _ in reference]
    worst = max(mx.abs(a - b).max().item() for (_, a, _), (_, b, _) in zip(reference, got))
    assert worst <= 1e-4
    if draft == "self-draft":
        assert sum(from_draft for _, _, from_draft in got) >= len(got) // 2


def _cli(*args, form="console-script", env=None, whole=False):
    """The ``mlx_lm.generate`` console script of this venv (the documented command), or
    ``python -m mlx_lm.generate`` (deprecated upstream, still common). Its stdout, or with
    ``whole`` the whole run (stdout and stderr)."""
    import os
    import subprocess
    import sys

    from conftest import Ran, clean_env

    if form == "console-script":
        command = [os.path.join(os.path.dirname(sys.executable), "mlx_lm.generate")]
    elif form == "run -m":  # the package's own runner, with automatic activation off
        command = [sys.executable, "-m", "mlx_lm_patches", "run", "-m", "mlx_lm.generate"]
        env = {"MLX_LM_PATCHES": "0", **(env or {})}
    elif form == "mlx-lm-patches-run":  # the launcher (its sitecustomize arms the activation)
        bin_dir = os.path.dirname(sys.executable)
        command = [os.path.join(bin_dir, "mlx-lm-patches-run"), os.path.join(bin_dir, "mlx_lm.generate")]
    else:
        command = [sys.executable, "-m", "mlx_lm.generate"]
    proc = subprocess.run([*command, "--prompt", PROMPT, "--max-tokens", "14", "--verbose", "False", *args],
                          capture_output=True, text=True, timeout=300, env=clean_env(**(env or {})), cwd="/")
    ran = Ran(proc.returncode, proc.stdout, proc.stderr)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran if whole else ran.stdout


@pytest.fixture(scope="module")
def cli_reference(folders):
    """What ``mlx_lm.generate`` prints without a draft model (the same for every draft and form)."""
    reference = _cli("--model", str(folders["main"]))
    assert reference.strip(), "the reference run printed nothing"
    return reference


@pytest.mark.subprocess
@pytest.mark.parametrize("form", ["console-script", "python -m"])
@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_generate_cli_with_draft_model(folders, cli_reference, draft, form):
    got = _cli("--model", str(folders["main"]), "--draft-model", str(folders[draft]),
               "--num-draft-tokens", "3", form=form)
    assert got == cli_reference


@pytest.mark.subprocess
@pytest.mark.parametrize("form", ["run -m", "mlx-lm-patches-run"])
def test_package_runners_with_draft_model(folders, cli_reference, form):
    """``python -m mlx_lm_patches run -m mlx_lm.generate`` runs the patched module's ``main()``
    (``runpy`` would run a second, unpatched copy: "requires a trimmable prompt cache"); so does
    the launcher ``mlx-lm-patches-run mlx_lm.generate``."""
    got = _cli("--model", str(folders["main"]), "--draft-model", str(folders["hybrid-draft"]),
               "--num-draft-tokens", "3", form=form)
    assert got == cli_reference


@pytest.mark.subprocess
def test_python_dash_m_stock_shows_its_deprecation_notice():
    """``python -m mlx_lm.generate`` would run a second, unpatched copy of generate.py as
    ``__main__``; with the package active it runs the imported (patched) module's ``main()``, so
    its output equals the console script's (``test_generate_cli_with_draft_model[*-python -m]``:
    no deprecation notice either). With ``MLX_LM_PATCHES=0`` the stock behaviour is untouched:
    the notice shows."""
    import subprocess
    import sys

    from conftest import clean_env

    stock = subprocess.run([sys.executable, "-m", "mlx_lm.generate", "--help"], capture_output=True,
                           text=True, env=clean_env(MLX_LM_PATCHES="0"), cwd="/")
    assert "deprecated" in stock.stdout


CAPPED = "num_draft_tokens=3 capped to 1"


@pytest.mark.subprocess
@pytest.mark.parametrize("main", ["hybrid", "dense"])
def test_generate_cli_draft_model_over_the_rollback_budget(folders, cli_reference, tmp_path, main):
    """``MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS=3``, three draft tokens, a hybrid draft (issue 37;
    more in test_speculative_budget.py): stdout is what the command prints without a draft; a
    hybrid main model's cap (to 1) is said once on stderr, a dense main model's run says nothing
    (its draft re-synchronises)."""
    if main == "hybrid":
        folder, reference = folders["main"], cli_reference
    else:
        folder = write_model_folder(tmp_path / "dense", build_tiny_model(DENSE_MODEL_TYPE, seed=1),
                                    tiny_config(DENSE_MODEL_TYPE))
        reference = _cli("--model", str(folder))
    got = _cli("--model", str(folder), "--draft-model", str(folders["hybrid-draft"]), "--num-draft-tokens", "3",
               env={"MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS": "3"}, whole=True)
    assert got.stdout == reference
    ours = [line for line in got.stderr.splitlines() if "mlx-lm-patches" in line]
    assert got.stderr.count(CAPPED) == len(ours) == (1 if main == "hybrid" else 0), got.stderr

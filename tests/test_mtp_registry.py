"""The registry of MTP families (``mechanisms/mtp/families/``, one module per family) is the one
list of them: the matrix's targets of ``mtp-heads-kept``, the test kit's tiny checkpoints
(``MTP_MODEL_TYPES``) and docs/mtp.md agree with it, and every hook a family defines is declared,
with its default, on ``MtpFamily``."""

import inspect
import pathlib
import re

import pytest

from mlx_lm_patches.engine import matrix
from mlx_lm_patches.mechanisms.mtp import families
from mlx_lm_patches.mechanisms.mtp.families.base import MtpFamily

pytestmark = pytest.mark.python_only

REPO = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = ("build", "convert", "fusion", "head_norm", "embed", "final_norm", "logits", "vocab_size")


def _expected_targets():
    """``mtp-heads-kept``'s targets as the registry has them: ``(targets, optional ones)``."""
    required = {"mlx_lm.utils:load_model"}
    optional = set()
    for model_type in families.model_types():
        sanitize = f"mlx_lm.models.{model_type}:Model.sanitize"
        (optional if model_type in families.subclassed_types() else required).add(sanitize)
    optional |= {f"mlx_lm.models.{model_type}:Model.shard" for model_type in families.sharded_types()}
    return required | optional, optional


def test_matrix_targets_are_the_registry_s():
    """A family added to the registry is declared in the matrix (its ``sanitize``, and its
    ``shard`` where the head is sharded with the model), and the matrix lists no other."""
    spec = matrix.load().get("mtp-heads-kept")
    targets, optional = _expected_targets()
    assert set(spec.targets) == targets, (sorted(targets - set(spec.targets)), sorted(set(spec.targets) - targets))
    assert set(spec.optional_targets) == optional


def test_the_test_kit_writes_a_checkpoint_of_every_family():
    from mlx_lm_patches.selftest.mtp_checkpoints import MTP_MODEL_TYPES

    assert len(set(MTP_MODEL_TYPES)) == len(MTP_MODEL_TYPES)
    assert set(MTP_MODEL_TYPES) == set(families.model_types())


def test_docs_name_every_family():
    """docs/mtp.md describes each family's head (its model type named in the text)."""
    text = (REPO / "docs" / "mtp.md").read_text()
    missing = [t for t in families.model_types() if not re.search(rf"\b{t}\b", text)]
    assert missing == []


@pytest.mark.parametrize("model_type", families.model_types())
def test_each_family_declares_its_hooks_on_the_base(model_type):
    """A family defines the required hooks and no public method or constant the base does not
    declare (an optional hook is declared once, with its default, on ``MtpFamily``; callers never
    look one up with ``getattr``)."""
    family = families.FAMILIES[model_type]
    cls = type(family)
    assert model_type in cls.MODEL_TYPES
    for hook in REQUIRED:
        assert getattr(cls, hook) is not getattr(MtpFamily, hook), f"{cls.__name__} lacks {hook}"
    declared = {name for name in dir(MtpFamily) if not name.startswith("_")}
    defined = {name for klass in cls.__mro__[:cls.__mro__.index(MtpFamily)] for name in vars(klass)
               if not name.startswith("_")}
    assert defined - declared == set()
    for name in defined & declared:
        assert inspect.isfunction(getattr(MtpFamily, name)) == inspect.isfunction(getattr(cls, name)), name


def test_the_registry_refuses_a_model_type_twice():
    from mlx_lm_patches.mechanisms.mtp.families.base import register

    class Again(MtpFamily):
        MODEL_TYPES = ("not_a_model_type", families.model_types()[0])

    before = dict(families.FAMILIES)
    with pytest.raises(TypeError, match="registered twice"):
        register(Again)
    assert families.FAMILIES == before

"""What differs between model families' MTP heads: one module per family, each a subclass of
``base.MtpFamily`` registered for the mlx-lm model types it serves; every module of this
package not starting with ``_`` (but ``base``) is one, imported here.

A head is built from the family's own mlx-lm blocks, so each release's numerics are the
release's own. Per family a module says how (``build``), how checkpoint tensors map to the
head's parameters (``convert``), and where the main model keeps what the head shares: the token
embedding, the final norm (whose input and output are the pre-/post-norm hidden states the head
reads) and the output projection. The forward itself is the same for every family
(``decoding.mtp_forward``): ``proj(concat[enorm(embed(x_{t+1})), hnorm(h_t)])``, the head's
layers (attention layers with their own KV cache), the head's final norm, the shared output.
"""

import importlib
import pkgutil
from typing import Optional, Tuple

from mlx_lm_patches.mechanisms.mtp.families.base import (REGISTRY, SLIDING_WINDOW, HeadUnsupported, MtpFamily,
                                                         declared_layers)

__all__ = ["FAMILIES", "NOT_KEPT", "NOT_READ", "SLIDING_WINDOW", "HeadUnsupported", "MtpFamily", "declared_layers",
           "family_name", "family_of", "model_types", "sharded_types", "subclassed_types"]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_") and _module != "base":
        importlib.import_module(f"{__name__}.{_module}")

FAMILIES = REGISTRY  # model type -> its family

# Why the heads of families mlx-lm drops MTP layers for are not kept (what ``mtp_status`` says).
NOT_KEPT = {
    "kimi_k3": ("its released checkpoints ship no MTP layer (num_nextn_predict_layers 0, no such tensors in the "
                "weight index; vLLM's kimi_k3 MTP model is written for a head no checkpoint has published), so "
                "there is nothing to check a port against"),
    "kimi_linear": ("its checkpoints ship no MTP layer (no MTP setting in its config, no Kimi-Linear MTP model "
                    "in vLLM or SGLang, the published weight index lists the decoder layers only)"),
    "deepseek_v41": ("its mtp.* tensors are a block drafter (DeepSeek's DSpark: several tokens per pass from "
                     "chosen layers' hidden states), not a next-token MTP layer this package's decoding runs"),
}
NOT_READ = "the layout of its MTP layers has not been read yet"


def model_types() -> Tuple[str, ...]:
    """Every model type whose MTP head is kept, sorted."""
    return tuple(sorted(REGISTRY))


def sharded_types() -> Tuple[str, ...]:
    """The model types whose ``Model.shard`` splits the head's layers too, sorted."""
    return tuple(sorted(t for family in set(REGISTRY.values()) for t in family.SHARDS))


def subclassed_types() -> Tuple[str, ...]:
    """The model types whose ``Model`` subclasses another kept family's, sorted."""
    return tuple(sorted(t for family in set(REGISTRY.values()) for t in family.SUBCLASSES))


def family_name(model):
    """The name ``model``'s family is kept under: its ``model_type``, or for a checkpoint whose
    ``model_type`` names another module (Ling 3.0's ``bailing_hybrid``, loaded by mlx-lm's
    ``bailing_moe_v3``) the module its class comes from."""
    model_type = getattr(model, "model_type", None)
    if model_type in REGISTRY:
        return model_type
    for cls in type(model).__mro__:  # (a subclass swapped in keeps its base's module)
        package, _, module = cls.__module__.rpartition(".")
        if package == "mlx_lm.models" and module in REGISTRY:
            return module
    return model_type


def family_of(model) -> Optional[MtpFamily]:
    """The family of ``model``, or ``None`` if its MTP heads are not kept."""
    return REGISTRY.get(family_name(model))

"""What a patch module provides, and what its scenario returns.

A patch is a module ``mlx_lm_patches.patches.<id with underscores>`` named by its entry in
``compat_matrix.yaml``. Its docstring says the bug, the fix and when it can be retired, a few
lines each (paragraphs headed ``Bug``, ``Fix`` and ``Retire``, each heading on a line of its own;
``Metal`` where the fix takes another path on Apple GPUs). Versions, upstream links and the
fixed-in release live in the matrix only: the docstring has no ``Affected`` or ``Upstream``
paragraph and no links. It defines:

* ``probe()`` – cheap; runs once the anchor module is imported, inside the user's process.
  Returns a truthy value (a string: the evidence) when the bug is present, falsy when it is
  absent; a target that no longer exists means "not needed" (falsy), never an exception.
  A probe leaves no trace:

  - mlx's global random state is untouched: tiny models are built inside
    :func:`~mlx_lm_patches.engine.traceless.seeded` (or draw with explicit ``key=``), and the
    engine saves and restores the key around every probe and ``apply`` besides;
  - no file is left behind and no process-wide setting changes (environment variables,
    ``tempfile``'s cached directory, default device or stream, ``sys.path``, threads left
    running); a probe that must hand a library a folder uses
    :func:`~mlx_lm_patches.engine.traceless.scratch_folder`;
  - it decides the same whether or not sources are installed: code is read from code objects
    (:mod:`~mlx_lm_patches.engine.bytecode`), never with ``inspect.getsource``.

  tests/test_probe_traces.py runs every probe whose anchor imports and checks all three.
* ``apply(p)`` – installs the fix through the :class:`~mlx_lm_patches.engine.patching.Patcher`
  ``p``; the engine reverts it through the same record.
* ``scenario()`` – what a user does, on a tiny model: returns an :class:`Outcome`, ``ok`` when
  mlx-lm behaves correctly. ``check`` runs it without and with the patch; the tests run it per
  mlx-lm release.
"""

import sys
from dataclasses import dataclass, field
from typing import List, Optional

REQUIRED = ("probe", "apply", "scenario")


class NotNeeded:
    """What a probe returns when the fix is not needed and it can say why (falsy). The engine
    shows the reason in ``status``."""

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self):
        return False

    def __repr__(self):
        return f"NotNeeded({self.reason!r})"


def missing(*targets: str) -> Optional[NotNeeded]:
    """``NotNeeded`` naming the first ``module:Qual.name`` of ``targets`` that this mlx-lm lacks
    (its module not imported, or an attribute on the way absent), else ``None``. For probes that
    reach for objects beyond their declared targets (the engine checks those). Both answers are
    falsy: test with ``is not None``."""
    for target in targets:
        module_name, _, qualname = target.partition(":")
        owner = sys.modules.get(module_name)
        for name in qualname.split(".") if owner is not None else ():
            owner = getattr(owner, name, None)
            if owner is None:
                break
        if owner is None:
            return NotNeeded(f"{target} missing in this mlx-lm: not needed")
    return None
DOCSTRING_SECTIONS = ("Bug", "Fix", "Retire")
MATRIX_ONLY_SECTIONS = ("Affected", "Upstream")  # in compat_matrix.yaml, not in docstrings


@dataclass
class Outcome:
    """What a scenario showed: ``ok`` True (correct), False (wrong or crashed), or None (not
    applicable on this mlx-lm, e.g. a feature another bug blocks; ``summary`` says why)."""

    ok: Optional[bool]
    summary: str
    details: List[str] = field(default_factory=list)

    @classmethod
    def not_applicable(cls, why: str):
        return cls(None, why)

    @classmethod
    def failure(cls, summary: str, exc: Optional[BaseException] = None, details=()):
        if exc is None:
            text = summary
        else:
            lines = str(exc).strip().splitlines() or [""]
            more = f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else ""
            text = f"{summary}: {type(exc).__name__}: {lines[0]}{more}"
        return cls(False, text, list(details))

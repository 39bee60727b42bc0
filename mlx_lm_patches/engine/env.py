"""Every environment variable the package reads, and how each is parsed.

Standard library only: the bootstrap imports this module at interpreter start.
A malformed value raises :class:`EnvError`, whose message names the variable, the value and
the accepted values. Automatic activation logs that message and goes on; explicit calls raise it.
"""

import os

ENABLED = "MLX_LM_PATCHES"
"""Automatic activation on import of ``mlx_lm``: ``1`` (default) or ``0`` (also true/false,
yes/no, on/off). ``0`` leaves the import untouched; explicit ``apply()`` still works."""

DISABLE = "MLX_LM_PATCHES_DISABLE"
"""Patch ids never to apply, separated by commas or spaces, or ``*`` for all of them."""

STRICT = "MLX_LM_PATCHES_STRICT"
"""``1``: a patch that fails to probe or apply raises, even during automatic activation, so the
user's ``import mlx_lm`` fails loudly. Meant for CI. Default ``0``."""

DEBUG = "MLX_LM_PATCHES_DEBUG"
"""``1``: log every decision (version gate, probe, apply, revert) to stderr. Default ``0``."""

CHILDREN = "MLX_LM_PATCHES_CHILDREN"
"""For ``mlx-lm-patches-run``: ``1`` keeps the sitecustomize activation in child processes.
Default ``0``: only the launched command is activated."""

ROLLBACK_SNAPSHOTS = "MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS"
"""Most recurrent states kept per cache list for exact rollback (speculative decoding): a
positive integer, default 32. A hybrid (or sliding-window) main model drafts at most ``value - 2``
tokens per round: a larger ``num_draft_tokens`` is capped before the first token, with one
warning. A draft model's rollback never refuses: past the bound it re-runs from an older state."""

PREFIX_CHECKPOINTS = "MLX_LM_PATCHES_PREFIX_CHECKPOINTS"
"""Most recurrent states kept per sequence for exact prefix reuse of hybrid models
(``LRUPromptCache``, ``mlx_lm.server``): a non-negative integer, default 8; ``0`` turns keeping
them off. Every forward of one sequence into a prompt cache keeps them at its end, whoever calls
the model; extra cuts at
powers of two and one-row ``BatchGenerator`` prefill happen once an ``LRUPromptCache`` exists in
the process, or always when the variable is set."""

ALL_VARIABLES = (ENABLED, DISABLE, STRICT, DEBUG, CHILDREN, ROLLBACK_SNAPSHOTS, PREFIX_CHECKPOINTS)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """An environment variable of ours holds a value we do not accept."""


def flag(name, default=False, environ=None):
    """Read a boolean variable; empty or unset means ``default``."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(
        f"{name}={raw!r} is not understood; accepted values: "
        f"{', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)"
    )


def id_list(name, environ=None):
    """Read a list of patch ids: ``None`` if unset, the string ``"*"`` for all, else a tuple.

    Only the syntax is checked here; unknown ids are reported by the engine, which knows them.
    """
    raw = (os.environ if environ is None else environ).get(name, "")
    items = [item for item in raw.replace(",", " ").split() if item]
    if not items:
        return None
    if "*" in items:
        if len(items) > 1:
            raise EnvError(
                f"{name}={raw!r} mixes '*' with patch ids; use '*' alone or a list of ids"
            )
        return "*"
    bad = [item for item in items if not _is_id(item)]
    if bad:
        raise EnvError(
            f"{name}={raw!r}: {', '.join(map(repr, bad))} is not a patch id; accepted values: "
            "'*' or patch ids such as 'mamba-cache-compat', separated by commas or spaces "
            "(`python -m mlx_lm_patches status` lists them)"
        )
    return tuple(dict.fromkeys(items))


def _is_id(text):
    return text[:1].isalpha() and all(ch.isalnum() or ch in "-_" for ch in text)


def positive_int(name, default, environ=None):
    """Read a positive integer; empty or unset means ``default``."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip()
    if not value:
        return default
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise EnvError(f"{name}={raw!r} is not understood; accepted values: a positive integer")


def non_negative_int(name, default, environ=None):
    """Read a non-negative integer; empty or unset means ``default``."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip()
    if not value:
        return default
    if value.isdigit():
        return int(value)
    raise EnvError(f"{name}={raw!r} is not understood; accepted values: a non-negative integer (0 turns it off)")

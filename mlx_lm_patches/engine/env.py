"""Every environment variable the package reads, and how each is parsed: one table
(:data:`VARIABLES`), one way to read a value.

Standard library only: the bootstrap imports this module at interpreter start.

* :func:`read` returns a variable's value or raises :class:`EnvError`, whose message names the
  variable, the value and the accepted values (explicit calls: ``apply()``, the CLI).
* :func:`setting` never raises: a malformed value is reported once per process, as one line on
  stderr (through the ``mlx_lm_patches`` logger), and the default is used. This is what the
  patches read while the user's program runs, so a typo never crashes a command.
* :func:`given` says whether a variable holds a value the user chose (a malformed one counts
  as unset);
* :func:`problems` lists every malformed variable; automatic activation reports them once,
  explicit ``apply()`` raises the first.

``MLX_LM_PATCHES`` itself is read by the bootstrap: a malformed value keeps automatic activation
off (the variable exists to opt out; stock mlx-lm is what nothing-asked-for looks like).
"""

import os

ENABLED = "MLX_LM_PATCHES"
DISABLE = "MLX_LM_PATCHES_DISABLE"
STRICT = "MLX_LM_PATCHES_STRICT"
DEBUG = "MLX_LM_PATCHES_DEBUG"
CHILDREN = "MLX_LM_PATCHES_CHILDREN"
ROLLBACK_SNAPSHOTS = "MLX_LM_PATCHES_ROLLBACK_SNAPSHOTS"
PREFIX_CHECKPOINTS = "MLX_LM_PATCHES_PREFIX_CHECKPOINTS"
ADAPTIVE_DRAFTING = "MLX_LM_PATCHES_ADAPTIVE_DRAFTING"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_FLAG_VALUES = f"{', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)"


class EnvError(ValueError):
    """An environment variable of ours holds a value we do not accept."""


class _Malformed(Exception):
    """Raised by a parser; :func:`read` words the message."""

    def __init__(self, why: str = ""):  # appended to "NAME='value'"
        super().__init__(why)
        self.why = why


def _parse_flag(value: str) -> bool:
    value = value.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _Malformed()


def _is_id(text):
    return text[:1].isalpha() and all(ch.isalnum() or ch in "-_" for ch in text)


def _parse_ids(value: str):
    items = [item for item in value.replace(",", " ").split() if item]
    if "*" in items:
        if len(items) > 1:
            raise _Malformed(" mixes '*' with patch ids; use '*' alone or a list of ids")
        return "*"
    bad = [item for item in items if not _is_id(item)]
    if bad:
        raise _Malformed(f": {', '.join(map(repr, bad))} is not a patch id")
    return tuple(dict.fromkeys(items))


def _parse_positive(value: str) -> int:
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise _Malformed()


def _parse_non_negative(value: str) -> int:
    if value.isdigit():
        return int(value)
    raise _Malformed()


class Variable:
    """One variable: ``parse`` turns the stripped, non-empty value into the setting (or raises
    ``_Malformed``); ``default`` is what unset, empty or (in :func:`setting`) malformed means;
    ``accepted`` words the accepted values for messages."""

    __slots__ = ("name", "parse", "default", "accepted", "doc")

    def __init__(self, name, parse, default, accepted, doc):
        self.name, self.parse, self.default, self.accepted, self.doc = name, parse, default, accepted, doc


VARIABLES = {v.name: v for v in (
    Variable(ENABLED, _parse_flag, True, _FLAG_VALUES,
             "Automatic activation on import of ``mlx_lm``. ``0`` leaves the import untouched; "
             "explicit ``apply()`` still works."),
    Variable(DISABLE, _parse_ids, None,
             "'*' or patch ids such as 'mamba-cache-compat', separated by commas or spaces "
             "(`python -m mlx_lm_patches status` lists them)",
             "Patch ids never to apply, or ``*`` for all of them."),
    Variable(STRICT, _parse_flag, False, _FLAG_VALUES,
             "A patch that fails to probe or apply raises, even during automatic activation "
             "(meant for CI)."),
    Variable(DEBUG, _parse_flag, False, _FLAG_VALUES,
             "Log every decision (version gate, probe, apply, revert) to stderr."),
    Variable(CHILDREN, _parse_flag, False, _FLAG_VALUES,
             "``mlx-lm-patches-run``: keep the activation in child processes of the command."),
    Variable(ROLLBACK_SNAPSHOTS, _parse_positive, 32, "a positive integer",
             "Most recurrent states kept per cache list for exact rollback (speculative "
             "decoding). A hybrid (or sliding-window) main model drafts at most ``value - 2`` "
             "tokens per round: a larger ``num_draft_tokens`` is capped before the first token, "
             "with one warning. A draft model's rollback never refuses: past the bound it re-runs "
             "from an older state."),
    Variable(PREFIX_CHECKPOINTS, _parse_non_negative, 8,
             "a non-negative integer (0 turns it off)",
             "Most recurrent states kept per sequence for exact prefix reuse of hybrid models."),
    Variable(ADAPTIVE_DRAFTING, _parse_flag, True, _FLAG_VALUES,
             "Speculative decoding chooses the draft tokens of each round (0 to "
             "``num_draft_tokens``) from the acceptance and the costs it measures (patch "
             "``adaptive-drafting``). ``0``: every round drafts ``num_draft_tokens``, as in stock "
             "mlx-lm."),
)}
ALL_VARIABLES = tuple(VARIABLES)

_reported = set()  # (name, raw value) already reported by setting()/report()


def _spec(name: str, parse=None, default=None):
    known = VARIABLES.get(name)
    if parse is None:
        if known is None:
            raise KeyError(f"{name} is not one of the package's variables: {', '.join(VARIABLES)}")
        return known
    accepted = known.accepted if known is not None else {
        _parse_flag: _FLAG_VALUES, _parse_positive: "a positive integer",
        _parse_non_negative: "a non-negative integer"}.get(parse, "")
    return Variable(name, parse, default, accepted, "")


def _read(spec: Variable, environ):
    raw = (os.environ if environ is None else environ).get(spec.name, "")
    value = raw.strip()
    if not value:
        return spec.default
    try:
        return spec.parse(value)
    except _Malformed as exc:
        why = exc.why or " is not understood"
        raise EnvError(f"{spec.name}={raw!r}{why}; accepted values: {spec.accepted}") from None


def read(name: str, environ=None):
    """The value of one of :data:`VARIABLES` (its default when unset or empty); a malformed
    value raises :class:`EnvError`."""
    return _read(_spec(name), environ)


def setting(name: str, environ=None):
    """Like :func:`read`, but a malformed value is reported once (one line on stderr) and the
    default is used: never raises."""
    spec = _spec(name)
    try:
        return _read(spec, environ)
    except EnvError as exc:
        _report(spec, exc, environ)
        return spec.default


def given(name: str, environ=None) -> bool:
    """Whether the user set one of :data:`VARIABLES` to a value of their own: a well-formed,
    non-empty one. A malformed value is reported (as :func:`setting` does) and counts as unset:
    the default is used, and what an explicit setting turns on stays off."""
    spec = _spec(name)
    try:
        _read(spec, environ)
    except EnvError as exc:
        _report(spec, exc, environ)
        return False
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def _report(spec: Variable, exc: EnvError, environ) -> None:
    key = (spec.name, (os.environ if environ is None else environ).get(spec.name, ""))
    if key not in _reported:
        _reported.add(key)
        import logging

        logging.getLogger("mlx_lm_patches").warning("mlx-lm-patches: %s; using the default (%s)", exc, _shown(spec.default))


def _shown(default) -> str:
    if isinstance(default, bool):
        return "1" if default else "0"
    return "none" if default is None else str(default)


def problems(environ=None, names=None):
    """Every malformed variable (of ``names``, default all but ``MLX_LM_PATCHES``, which the
    bootstrap reads)."""
    out = []
    for name in names or [n for n in VARIABLES if n != ENABLED]:
        try:
            read(name, environ)
        except EnvError as exc:
            out.append(exc)
    return out


def report(environ=None) -> None:
    """Report every malformed variable once (automatic activation): one line each."""
    for name in VARIABLES:
        if name != ENABLED:
            setting(name, environ)


# Parsers by name, for variables outside the table (and the tests): the same rules.
def flag(name, default=False, environ=None) -> bool:
    """Read a boolean variable; empty or unset means ``default``."""
    return _read(_spec(name, _parse_flag, default), environ)


def id_list(name, environ=None):
    """A list of patch ids: ``None`` if unset, ``"*"`` for all, else a tuple. Only the syntax is
    checked; unknown ids are reported by the engine, which knows them."""
    return _read(_spec(name, _parse_ids, None), environ)


def positive_int(name, default, environ=None) -> int:
    return _read(_spec(name, _parse_positive, default), environ)


def non_negative_int(name, default, environ=None) -> int:
    return _read(_spec(name, _parse_non_negative, default), environ)

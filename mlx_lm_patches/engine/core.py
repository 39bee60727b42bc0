"""The engine: decides, per patch, whether to apply it, applies it, reverts it, reports on it.

Per patch, in this order: disabled by the environment or the caller -> ``disabled``; installed
mlx-lm (or the distribution the patch names as its ``package``, e.g. mlx-vlm) missing, a
``requires`` distribution outside its range, or a *release* outside the affected range ->
``skipped:version``; otherwise a post-import hook waits for the patch's anchor module
(``pending``); when it is imported, a declared target whose owner is missing from an imported
module -> ``skipped:probe`` ("target X missing in this mlx-lm: not needed"); otherwise the patch
module's ``probe()`` looks for the bug: absent -> ``skipped:probe``, present -> ``apply(patcher)``
-> ``applied`` (or ``failed``; a probe that raises is a real bug). Probes and ``apply`` run with
mlx's random key saved and restored (:mod:`~mlx_lm_patches.engine.traceless`): whatever a probe
builds, the user's seeded stream draws the same as without the package. ``revert`` restores the
original objects -> ``reverted``.

The gate (:meth:`Engine.gate_rule`): for a published release the affected range rules patches
out and the probe confirms; for anything else (a git, local-directory or editable install, or a
dev/pre-release/local version) the version label cannot be trusted - mlx-lm's ``main`` carries
the next release's number before that release's fixes land - so the range is not consulted and
the probe alone decides.

Failures are contained. Automatic activation logs them and lets ``import mlx_lm`` succeed
(unless ``MLX_LM_PATCHES_STRICT=1``); explicit :func:`apply` raises :class:`PatchError`.
All state changes happen under one re-entrant lock; imports happen outside it.
"""

import difflib
import importlib
import logging
import sys
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, Iterable, List, Optional

from mlx_lm_patches.engine import env
from mlx_lm_patches.engine import matrix
from mlx_lm_patches.engine import versions
from mlx_lm_patches.engine.contract import NotNeeded
from mlx_lm_patches.engine.patching import Patcher, Switch, owner_of, split_target
from mlx_lm_patches.engine.traceless import random_state_kept

log = logging.getLogger("mlx_lm_patches")


class State(str, Enum):
    INACTIVE = "inactive"  # nothing asked for this patch in this process yet
    PENDING = "pending"  # waiting for its anchor module to be imported
    APPLIED = "applied"
    SKIPPED_VERSION = "skipped:version"
    SKIPPED_PROBE = "skipped:probe"
    DISABLED = "disabled"
    FAILED = "failed"
    REVERTED = "reverted"


class PatchError(RuntimeError):
    """Explicit apply()/revert() could not do what was asked; the message says which patch."""


@dataclass
class PatchStatus:
    id: str
    summary: str
    affected: str
    fixed_in: Optional[str]
    state: str
    detail: str
    targets: List[str]
    upstream: List[str]
    metal: Optional[str] = None  # where the fix takes a different path on Apple GPUs
    package: str = matrix.MLX_LM  # the distribution ``affected`` is about

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Record:
    spec: matrix.PatchSpec
    state: State = State.INACTIVE
    detail: str = ""
    patcher: Optional[Patcher] = None
    raise_errors: bool = False
    error: Optional[BaseException] = field(default=None, repr=False)
    applied_seq: int = 0  # order of application: revert undoes the latest first
    switch: Switch = field(default_factory=Switch, repr=False)  # read by every wrapper we installed
    # the patch's ``p.memo``, one dict for every application (cleared by revert): a wrapper
    # installed by an earlier application and still bound elsewhere (``from .generate import
    # generate_step`` in a module imported meanwhile) runs again when the switch is back on,
    # and must see the state the new wrappers see
    memo: dict = field(default_factory=dict, repr=False)

    @property
    def active(self) -> bool:
        """Whether this patch's wrappers run (off: a soft revert, alias copies included)."""
        return bool(self.switch)

    @active.setter
    def active(self, on: bool) -> None:
        self.switch.turn(on)


class Engine:
    def __init__(self, the_matrix: matrix.Matrix, patch_package: str = matrix.PATCH_PACKAGE,
                 installed: Optional[versions.InstalledDist] = None,
                 packages: Optional[Dict[str, versions.InstalledDist]] = None):
        self.matrix = the_matrix
        self.patch_package = patch_package
        self.lock = threading.RLock()
        self.records: Dict[str, _Record] = {s.id: _Record(s) for s in the_matrix.patches}
        self.activation: Optional[str] = None
        self._seq = 0
        self.mlx_lm = installed or versions.mlx_lm()
        self.mlx = versions.mlx()
        self._packages: Dict[str, versions.InstalledDist] = dict(packages or {})

    def installed(self, package: str) -> versions.InstalledDist:
        """The installed version of ``package`` (read once, from distribution metadata)."""
        if package == matrix.MLX_LM:
            return self.mlx_lm
        with self.lock:
            if package not in self._packages:
                self._packages[package] = versions.installed(package)
            return self._packages[package]

    # -- the gate -----------------------------------------------------------------------------
    def gate_rule(self, package: str = matrix.MLX_LM) -> str:
        """``"range"``: ``package`` is a published release, so the affected ranges rule patches
        out and the probes confirm; ``"probe"``: it is not (git/local/editable install, dev or
        pre-release or local version) - its label may name a release whose fixes it lacks or
        holds - so each patch's probe alone decides; ``"missing"``: not installed."""
        dist = self.installed(package)
        if dist.version is None:
            return "missing"
        return "range" if dist.is_release else "probe"

    def gate_text(self, package: str = matrix.MLX_LM) -> str:
        """``status``'s gate line, e.g. ``version range + probe``."""
        rule = self.gate_rule(package)
        if rule == "range":
            return "version range + probe"
        dist = self.installed(package)
        if rule == "missing":
            return f"none ({package} not installed)"
        where = dist.origin
        if where.startswith("git ") or " http" in where or where.split(" ")[0] in ("hg", "svn", "bzr"):
            how = f"installed from {where}"
        elif where.startswith("local "):
            how = f"installed from the local directory {where[len('local '):]}"
        elif where.startswith("editable "):
            how = f"installed editable from {where[len('editable '):]}"
        else:
            how = f"version {dist.version} is a {where}"
        return f"probe only ({package} {how}: its version label need not match a release)"

    def warnings(self) -> List[str]:
        """Why the matrix may not vouch for the installed mlx-lm."""
        out = []
        dist = self.mlx_lm
        if dist.version is None:
            return out
        newest = self.matrix.newest_tested()
        if not dist.is_release:
            out.append(f"mlx-lm {dist.describe()} is not a published release: the version "
                       "ranges are not consulted, each patch's probe decides alone")
        if newest is not None and dist.parsed is not None and dist.parsed > newest:
            out.append(f"mlx-lm {dist.version} is newer than the newest tested release "
                       f"({newest}); patches are decided by their probes, run "
                       "`python -m mlx_lm_patches check` to see the fixes hold")
        return out

    def other_packages(self) -> List[versions.InstalledDist]:
        """The distributions besides mlx-lm that patches are about, as installed."""
        names = dict.fromkeys(s.package for s in self.matrix.patches if s.package != matrix.MLX_LM)
        return [self.installed(name) for name in names]

    def patch_module(self, pid: str):
        return importlib.import_module(self.records[pid].spec.module_in(self.patch_package))

    # -- selection --------------------------------------------------------------------------
    def resolve_ids(self, ids: Optional[Iterable[str]], what: str) -> List[str]:
        if ids is None:
            return list(self.records)
        if isinstance(ids, str):
            ids = [i for i in ids.replace(",", " ").split() if i]
        ids = list(ids)
        unknown = [i for i in ids if i not in self.records]
        if unknown:
            raise ValueError(
                f"{what}: unknown patch id(s) {self._name_unknown(unknown)}; "
                f"known: {', '.join(self.records)}"
            )
        return ids

    def _name_unknown(self, unknown) -> str:
        """``'recurrent_rollback' (did you mean 'recurrent-rollback'?), 'x'``."""
        named = []
        for pid in unknown:
            close = difflib.get_close_matches(pid.replace("_", "-").lower(), list(self.records), n=1)
            named.append(f"{pid!r} (did you mean {close[0]!r}?)" if close else repr(pid))
        return ", ".join(named)

    def _env_disabled(self, raise_errors: bool) -> set:
        listed = env.read(env.DISABLE) if raise_errors else env.setting(env.DISABLE)
        if listed is None:
            return set()
        if listed == "*":
            return set(self.records)
        unknown = [i for i in listed if i not in self.records]
        if unknown:
            message = (
                f"{env.DISABLE} names unknown patch id(s) {self._name_unknown(unknown)}; "
                f"known: {', '.join(self.records)}"
            )
            if raise_errors:
                raise env.EnvError(message)
            log.warning("mlx-lm-patches: %s; the unknown id(s) are ignored, every other patch "
                        "applies as usual", message)
        return {i for i in listed if i in self.records}

    # -- apply ------------------------------------------------------------------------------
    def request(self, ids=None, exclude=None, raise_errors=True, import_anchors=True):
        """Ask for patches; returns the status rows of the patches asked for."""
        chosen = self.resolve_ids(ids, "only")
        excluded = set(self.resolve_ids(exclude, "exclude")) if exclude else set()
        disabled = self._env_disabled(raise_errors) | excluded
        to_import = []
        with self.lock:
            for pid in chosen:
                rec = self.records[pid]
                if rec.state in (State.APPLIED, State.PENDING):
                    if rec.state is State.PENDING:  # e.g. armed by automatic activation
                        to_import.append(rec.spec.anchor)
                    continue  # idempotent
                rec.raise_errors = raise_errors
                rec.error = None
                if pid in disabled:
                    why = "excluded by the caller" if pid in excluded else f"{env.DISABLE}"
                    self._set(rec, State.DISABLED, f"disabled ({why})")
                    continue
                package = rec.spec.package
                dist = self.installed(package)
                version = dist.parsed
                if dist.version is None or (version is None and dist.is_release):
                    self._set(rec, State.SKIPPED_VERSION, f"{package} {dist.describe()}")
                    continue
                if dist.is_release and not rec.spec.affects(version):
                    note = f"; fixed in {rec.spec.fixed_in}" if rec.spec.fixed_in else ""
                    if rec.spec.before and rec.spec.older_than_affected(version):
                        note += f": {rec.spec.before}"
                    self._set(
                        rec,
                        State.SKIPPED_VERSION,
                        f"{package} {dist.describe()} is outside {rec.spec.affected}{note}",
                    )
                    continue
                unmet = rec.spec.unmet_requirement(self.installed)
                if unmet:
                    self._set(rec, State.SKIPPED_VERSION, unmet)
                    continue
                self._set(rec, State.PENDING, f"waiting for import of {rec.spec.anchor}")
                self._hook(rec.spec.anchor, lambda module, rec=rec: self._decide(rec))
                to_import.append(rec.spec.anchor)
        if import_anchors:
            for name in dict.fromkeys(to_import):
                try:
                    importlib.import_module(name)
                except ImportError as exc:
                    log.debug("mlx-lm-patches: %s not importable yet: %s", name, exc)
        rows = [self.row(pid) for pid in chosen]
        if raise_errors:
            failed = [self.records[pid] for pid in chosen if self.records[pid].state is State.FAILED]
            if failed:
                raise PatchError(
                    "; ".join(f"patch {r.spec.id!r} failed: {r.detail}" for r in failed)
                ) from failed[0].error
        return rows

    def _hook(self, module_name: str, callback) -> None:
        import wrapt

        def hook(module):
            try:
                callback(module)
            except Exception:
                if _strict():
                    raise
                log.exception("mlx-lm-patches: post-import hook for %s failed", module_name)

        wrapt.register_post_import_hook(hook, module_name)

    def _decide(self, rec: _Record) -> None:
        with self.lock:
            if rec.state is not State.PENDING:
                return  # reverted or decided meanwhile
            spec = rec.spec
            gone = missing_target(spec)
            if gone:
                self._set(rec, State.SKIPPED_PROBE, f"target {gone} missing in this mlx-lm: not needed")
                return
            try:
                patch_module = self.patch_module(spec.id)
                with random_state_kept():  # a probe leaves the user's random stream alone
                    evidence = patch_module.probe()
            except Exception as exc:
                self._fail(rec, f"probe raised {type(exc).__name__}: {exc}", exc)
                return
            if not evidence:
                why = (evidence.reason if isinstance(evidence, NotNeeded)
                       else "bug not present in this mlx-lm")
                self._set(rec, State.SKIPPED_PROBE, f"probe: {why}")
                return
            patcher = Patcher(spec.id, spec.targets, rec.switch,
                              outer=self.matrix.later_than(spec.id), memo=rec.memo)
            rec.patcher = patcher
            rec.active = True
            try:
                with random_state_kept():
                    patch_module.apply(patcher)
            except Exception as exc:
                rec.active = False
                patcher.revert()
                rec.patcher = None
                self._fail(rec, f"apply raised {type(exc).__name__}: {exc}", exc)
                return
            detail = evidence if isinstance(evidence, str) else "bug confirmed by probe"
            self._seq += 1
            rec.applied_seq = self._seq
            self._set(rec, State.APPLIED, detail)
            for module_name, thunk, target in patcher.deferred:
                self._hook(
                    module_name,
                    lambda module, rec=rec, p=patcher, t=thunk, tg=target: self._deferred(rec, p, t, tg),
                )

    def _deferred(self, rec, patcher, thunk, target) -> None:
        with self.lock:
            if rec.patcher is not patcher or not rec.active:
                return
            try:
                thunk()
                patcher.deferred = [d for d in patcher.deferred if d[1] is not thunk]
            except Exception as exc:
                self._fail(rec, f"patching {target} raised {type(exc).__name__}: {exc}", exc)
                rec.active = False
                patcher.revert()

    def _fail(self, rec, detail, exc) -> None:
        self._set(rec, State.FAILED, detail)
        rec.error = exc
        if _strict() and not rec.raise_errors:
            raise PatchError(f"patch {rec.spec.id!r} failed: {detail}") from exc
        if not rec.raise_errors:
            log.error("mlx-lm-patches: patch %r failed (mlx-lm left unpatched for it): %s",
                      rec.spec.id, detail)

    def _set(self, rec, state, detail) -> None:
        rec.state, rec.detail = state, detail
        log.debug("mlx-lm-patches: %s -> %s (%s)", rec.spec.id, state.value, detail)

    # -- revert -----------------------------------------------------------------------------
    def revert(self, ids=None) -> List[PatchStatus]:
        """Take the given (default: all) patches out. Each target keeps the layers of the patches
        still applied, in their declared order; with ``ids=None`` the activation's own change
        (the ``python -m mlx_lm.X`` hook on runpy, if not yet used) goes too."""
        chosen = self.resolve_ids(ids, "revert")
        with self.lock:
            # patches may stack on the same attribute: undo the latest first
            for pid in sorted(chosen, key=lambda i: -self.records[i].applied_seq):
                rec = self.records[pid]
                if rec.state not in (State.APPLIED, State.PENDING):
                    continue
                rec.active = False  # soft-disables wrappers that others may have copied
                notes = rec.patcher.revert() if rec.patcher else []
                rec.patcher = None
                self._set(rec, State.REVERTED, "; ".join(notes) or "original objects restored")
            if ids is None:
                boot = sys.modules.get("_mlx_lm_patches_boot")
                if boot is not None and hasattr(boot, "unhook"):
                    boot.unhook()
        return [self.row(pid) for pid in chosen]

    def changes(self) -> Dict[str, List[str]]:
        """What is changed now beyond the targets' attributes, by patch id (and ``activation``
        for the bootstrap's own hook): each entry is undone by :meth:`revert`."""
        out: Dict[str, List[str]] = {}
        boot = sys.modules.get("_mlx_lm_patches_boot")
        hook = boot.console_hook() if boot is not None and hasattr(boot, "console_hook") else None
        if hook is not None:
            out["activation"] = [f"runpy._run_module_as_main hooked: python -m {hook.module} "
                                 "runs the patched module's main()"]
        with self.lock:
            for pid, rec in self.records.items():
                if rec.state is State.APPLIED and rec.patcher is not None:
                    held = rec.patcher.outside()
                    if held:
                        out[pid] = held
        return out

    # -- status -----------------------------------------------------------------------------
    def row(self, pid: str) -> PatchStatus:
        rec = self.records[pid]
        with self.lock:
            state, detail = rec.state.value, rec.detail
            if rec.state is State.APPLIED and rec.patcher is not None:
                moved = rec.patcher.in_place()
                if moved:
                    detail += f"; replaced by someone else since: {', '.join(moved)}"
                held = rec.patcher.outside()
                if held:
                    detail += f"; also changed: {', '.join(held)}"
                waiting = [d[2] for d in rec.patcher.deferred]
                if waiting:
                    detail += f"; waiting for import: {', '.join(waiting)}"
        spec = rec.spec
        return PatchStatus(
            id=spec.id,
            summary=spec.summary,
            affected=str(spec.affected) + "".join(f" with {n} {v}" for n, v in spec.requires),
            fixed_in=str(spec.fixed_in) if spec.fixed_in else None,
            state=state,
            detail=detail,
            targets=list(spec.targets),
            upstream=list(spec.upstream),
            metal=spec.metal_note,
            package=spec.package,
        )

    def rows(self) -> List[PatchStatus]:
        return [self.row(pid) for pid in self.records]


def missing_target(spec: matrix.PatchSpec) -> Optional[str]:
    """The owner (``module:Qual``) of the first declared target (not marked optional) that is
    absent although its module is imported, else ``None``. The
    attribute itself may be missing: patches add attributes too. Targets in modules not
    imported yet are not judged (they are patched when imported)."""
    for target in spec.targets:
        if target in spec.optional_targets:
            continue
        module_name, qualname = split_target(target)
        if module_name not in sys.modules:
            continue
        if "." not in qualname:
            continue  # a module attribute: the module is its owner, and it is there
        try:
            owner_of(target)
        except (KeyError, AttributeError, TypeError):
            return f"{module_name}:{qualname.rsplit('.', 1)[0]}"
    return None


def _strict() -> bool:
    return env.setting(env.STRICT)


_engine: Optional[Engine] = None
_engine_lock = threading.Lock()


def get() -> Engine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _configure_logging()
            _engine = Engine(matrix.load())
        return _engine


def _configure_logging() -> None:
    if env.setting(env.DEBUG) and not any(getattr(h, "_mlx_lm_patches", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._mlx_lm_patches = True
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)


def auto_activate(source: str, late: bool) -> None:
    """Called by the bootstrap when ``mlx_lm`` is first looked up (or at once if already imported)."""
    eng = get()
    with eng.lock:
        if eng.activation == "explicit":
            log.debug("mlx-lm-patches: automatic activation via %s skipped: apply() was called "
                      "first and decides what applies", source)
            return
        if eng.activation is None:
            eng.activation = source
    env.report()
    if late:
        log.warning(
            "mlx-lm-patches: mlx_lm was imported before activation (%s); patches apply now, "
            "but copies that modules already took with `from x import y` of replaced (not "
            "wrapped) objects stay unpatched", source,
        )
    log.debug("mlx-lm-patches: automatic activation via %s, mlx-lm %s, mlx %s",
              source, eng.mlx_lm.describe(), eng.mlx.describe())
    eng.request(None, raise_errors=False, import_anchors=late)


def apply(only=None, exclude=None) -> List[PatchStatus]:
    """Apply every patch whose version range includes the installed mlx-lm and whose probe
    confirms the bug (``only``/``exclude``: patch ids). Idempotent. Imports the modules the
    patches anchor on (so mlx-lm gets imported). Raises :class:`PatchError` if a patch fails,
    ``ValueError`` for unknown ids or malformed environment variables.

    Called before ``mlx_lm`` is imported, it takes the place of automatic activation: what it
    names is all that applies (``only=["x"]``: just ``x``). Called after, it adds to what
    automatic activation applied (``revert(ids)`` takes patches out)."""
    problems = env.problems()
    if problems:
        raise env.EnvError("; ".join(map(str, problems)))
    eng = get()
    late = "mlx_lm" in sys.modules
    with eng.lock:
        if eng.activation is None:
            eng.activation = "explicit"
            if late:
                log.warning(
                    "mlx-lm-patches: apply() after mlx_lm was imported: copies that modules "
                    "already took with `from x import y` of replaced (not wrapped) objects "
                    "stay unpatched; import mlx_lm_patches and apply() first, or rely on the "
                    "automatic activation"
                )
    return eng.request(only, exclude=exclude, raise_errors=True, import_anchors=True)


def revert(ids=None) -> List[PatchStatus]:
    """Restore the original objects of the given (default: all) patches."""
    return get().revert(ids)


def status() -> List[PatchStatus]:
    return get().rows()


def changes() -> Dict[str, List[str]]:
    """What the patches (and the bootstrap) changed beyond their targets; ``revert()`` undoes it."""
    return get().changes()


def memo(patch_id: str) -> Optional[dict]:
    """The memo of patch ``patch_id`` (what it keeps between calls), or None where no engine
    runs or the patch was never applied; starts nothing."""
    record = _engine.records.get(patch_id) if _engine is not None else None
    return record.patcher.memo if record is not None and record.patcher is not None else None

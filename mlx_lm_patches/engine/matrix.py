"""``compat_matrix.yaml``: the single source of truth for which patch applies to which mlx-lm.

The file ships inside the wheel (``mlx_lm_patches/compat_matrix.yaml``); in a source checkout
it is the one at the repository root. It is read and validated without importing mlx-lm.
"""

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import FrozenSet, Optional, Tuple

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

_ID = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DISTRIBUTION = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")

MLX_LM = "mlx-lm"


PATCH_PACKAGE = "mlx_lm_patches.patches"


class MatrixError(ValueError):
    """compat_matrix.yaml is malformed."""


@dataclass(frozen=True)
class PatchSpec:
    id: str
    summary: str
    affected: SpecifierSet
    fixed_in: Optional[Version]
    upstream: Tuple[str, ...]
    targets: Tuple[str, ...]
    probe: str
    metal_note: Optional[str] = None
    before: Optional[str] = None  # what a release older than ``affected`` gets instead (status says it there)
    package: str = MLX_LM  # the distribution whose version ``affected`` is about
    # further distributions the bug needs, e.g. (("mlx", SpecifierSet(">=0.32.0")),)
    requires: Tuple[Tuple[str, SpecifierSet], ...] = ()
    # targets marked ``?`` in the file: present in some releases only (an alternative to another
    # target), so their absence does not rule the patch out
    optional_targets: Tuple[str, ...] = ()
    needs: Tuple[str, ...] = ()  # patch ids whose fixes this patch's scenario cannot pass without
    # patch ids this one is layered over on the targets they share (its wrappers stay outside theirs)
    after: Tuple[str, ...] = ()

    @property
    def module_name(self) -> str:
        return self.module_in(PATCH_PACKAGE)

    def module_in(self, package: str) -> str:
        return f"{package}.{self.id.replace('-', '_')}"

    @property
    def anchor(self) -> str:
        """The module whose import decides this patch (the first target's module)."""
        return self.targets[0].split(":")[0]

    def older_than_affected(self, version: Version) -> bool:
        """Whether ``version`` lies below what ``affected`` admits (fails one of its lower bounds)."""
        return any((s.operator in (">=", ">") and not s.contains(version, prereleases=True))
                   or (s.operator == "==" and "*" not in s.version and version < Version(s.version))
                   for s in self.affected)

    def affects(self, version: Version) -> bool:
        return self.affected.contains(version, prereleases=True)

    def version_verdict(self, installed) -> Optional[bool]:
        """What the versions alone say (``installed(name)`` gives an installed distribution):
        ``False`` when they rule the bug out (``package`` missing or, for a release, outside
        ``affected``; a ``requires`` distribution outside its range), ``True`` when a release
        lies inside ``affected``, ``None`` when ``package`` is not a published release (a git,
        local or editable install, or a dev/pre-release/local version), whose label cannot be
        trusted: the probe alone decides. The engine's gate, for tests to share."""
        dist = installed(self.package)
        if dist.version is None or self.unmet_requirement(installed):
            return False
        if not dist.is_release:
            return None
        return dist.parsed is not None and self.affects(dist.parsed)

    def unmet_requirement(self, installed) -> Optional[str]:
        """Why a further distribution the bug needs rules it out (``installed(name)`` gives an
        installed distribution), or ``None`` when every requirement holds."""
        for name, specifier in self.requires:
            dist = installed(name)
            if dist.parsed is None or not specifier.contains(dist.parsed, prereleases=True):
                return f"{name} {dist.describe()} is outside {specifier}, which the bug needs"
        return None


# A row of tested_versions runs the whole suite ("full") or the tests marked ``core`` (the matrix
# cells and what changes with every release; pyproject.toml's markers): tools/run_matrix.py.
SUITES = ("full", "core")


@dataclass(frozen=True)
class TestedVersion:
    mlx_lm: str
    mlx: str
    python: str
    packages: Tuple[Tuple[str, str], ...] = ()  # further distributions installed: (name, version)
    suite: str = "full"  # which tests the row runs: "full", or "core" (tests marked core; SUITES)

    @property
    def name(self) -> str:
        extra = "".join(f"_{name}-{version}" for name, version in self.packages)
        return f"mlx-lm-{self.mlx_lm}_mlx-{self.mlx}_py{self.python}{extra}"


@dataclass(frozen=True)
class Matrix:
    supported: SpecifierSet
    tested_versions: Tuple[TestedVersion, ...]
    patches: Tuple[PatchSpec, ...]
    path: Path = field(compare=False)

    def get(self, patch_id: str) -> PatchSpec:
        for spec in self.patches:
            if spec.id == patch_id:
                return spec
        raise KeyError(
            f"unknown patch id {patch_id!r}; known: {', '.join(self.ids()) or '(none)'}"
        )

    def ids(self) -> Tuple[str, ...]:
        return tuple(spec.id for spec in self.patches)

    def needed_by(self, patch_id: str) -> Tuple[str, ...]:
        """``patch_id`` and every patch it needs, transitively (``needs``), in matrix order."""
        wanted, todo = {patch_id}, [patch_id]
        while todo:
            for other in self.get(todo.pop()).needs:
                if other not in wanted:
                    wanted.add(other)
                    todo.append(other)
        return tuple(i for i in self.ids() if i in wanted)

    def later_than(self, patch_id: str) -> FrozenSet[str]:
        """The patches declared ``after`` ``patch_id``, transitively: on a shared target their
        layers stay outside its layer."""
        later, grew = set(), True
        while grew:
            grew = False
            for spec in self.patches:
                if spec.id not in later and (patch_id in spec.after or later & set(spec.after)):
                    later.add(spec.id)
                    grew = True
        return frozenset(later)

    def ordered(self, first: str, second: str) -> bool:
        """Whether the matrix declares an order between two patches (either way)."""
        return second in self.later_than(first) or first in self.later_than(second)

    def newest_tested(self) -> Optional[Version]:
        """The newest mlx-lm release in ``tested_versions``."""
        tested = [Version(t.mlx_lm) for t in self.tested_versions]
        return max(tested) if tested else None


def default_path() -> Path:
    here = Path(__file__).resolve().parent.parent  # the package folder
    shipped = here / "compat_matrix.yaml"
    if shipped.is_file():
        return shipped
    source_tree = here.parent / "compat_matrix.yaml"
    if source_tree.is_file():
        return source_tree
    raise MatrixError(f"compat_matrix.yaml not found beside {here} nor in {here.parent}")


@functools.lru_cache(maxsize=None)
def load(path: Optional[str] = None) -> Matrix:
    import yaml

    p = Path(path) if path else default_path()
    try:
        # libyaml's loader where PyYAML has it: 12x faster, and the matrix is read at `import mlx_lm`
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise MatrixError(f"{p}: not valid YAML: {exc}") from None
    return parse(data, p)


def parse(data, path: Path) -> Matrix:
    where = str(path)
    if not isinstance(data, dict) or data.get("schema") != 1:
        raise MatrixError(f"{where}: expected a mapping with 'schema: 1'")
    supported = _specifier(data.get("supported", ""), f"{where}: supported")
    tested = tuple(_tested(row, f"{where}: tested_versions[{i}]")
                   for i, row in enumerate(data.get("tested_versions") or ()))
    patches = tuple(_patch(row, f"{where}: patches[{i}]")
                    for i, row in enumerate(data.get("patches") or ()))
    ids = [p.id for p in patches]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise MatrixError(f"{where}: duplicate patch ids {duplicates}")
    for spec in patches:
        unknown = [n for n in spec.needs if n not in ids]
        if unknown:
            raise MatrixError(f"{where}: patch {spec.id}: needs names unknown patch id(s) "
                              f"{unknown}; known: {', '.join(ids)}")
        if spec.id in spec.needs:
            raise MatrixError(f"{where}: patch {spec.id}: needs names the patch itself")
        unknown = [n for n in spec.after if n not in ids]
        if unknown:
            raise MatrixError(f"{where}: patch {spec.id}: after names unknown patch id(s) "
                              f"{unknown}; known: {', '.join(ids)}")
    _check_after_acyclic(patches, where)
    return Matrix(supported, tested, patches, path)


def _check_after_acyclic(patches, where) -> None:
    after = {spec.id: spec.after for spec in patches}
    state: dict = {}  # id -> "visiting" | "done"

    def visit(pid, path):
        if state.get(pid) == "done":
            return
        if state.get(pid) == "visiting":
            cycle = path[path.index(pid):] + [pid]
            raise MatrixError(f"{where}: 'after' declares a cycle: {' -> '.join(cycle)}")
        state[pid] = "visiting"
        for other in after[pid]:
            visit(other, path + [pid])
        state[pid] = "done"

    for pid in after:
        visit(pid, [])


def _specifier(text, where) -> SpecifierSet:
    try:
        return SpecifierSet(str(text))
    except InvalidSpecifier:
        raise MatrixError(f"{where}: {text!r} is not a PEP 440 specifier") from None


def _tested(row, where) -> TestedVersion:
    if not isinstance(row, dict) or not {"mlx_lm", "mlx", "python"} <= set(row) <= {"mlx_lm", "mlx", "python", "packages", "suite"}:
        raise MatrixError(f"{where}: expected keys mlx_lm, mlx, python (and optionally packages, suite); got {row!r}")
    suite = str(row.get("suite", "full"))
    if suite not in SUITES:
        raise MatrixError(f"{where}: suite={suite!r} is not one of {', '.join(SUITES)}")
    for key in ("mlx_lm", "mlx"):
        try:
            Version(str(row[key]))
        except InvalidVersion:
            raise MatrixError(f"{where}: {key}={row[key]!r} is not a version") from None
    packages = row.get("packages") or {}
    if not isinstance(packages, dict):
        raise MatrixError(f"{where}: packages must map distribution names to versions; got {packages!r}")
    for name, version in packages.items():
        if not _DISTRIBUTION.match(str(name)) or str(name) in (MLX_LM, "mlx"):
            raise MatrixError(f"{where}: packages: {name!r} is not a further distribution name")
        try:
            Version(str(version))
        except InvalidVersion:
            raise MatrixError(f"{where}: packages: {name}={version!r} is not a version") from None
    return TestedVersion(str(row["mlx_lm"]), str(row["mlx"]), str(row["python"]),
                         tuple(sorted((str(n), str(v)) for n, v in packages.items())), suite)


_PATCH_KEYS = {"id", "summary", "affected", "fixed_in", "upstream", "targets", "probe"}
_OPTIONAL_KEYS = {"metal_note", "before", "package", "requires", "needs", "after"}


def _patch(row, where) -> PatchSpec:
    if not isinstance(row, dict):
        raise MatrixError(f"{where}: expected a mapping")
    missing = _PATCH_KEYS - set(row)
    unknown = set(row) - _PATCH_KEYS - _OPTIONAL_KEYS
    if missing or unknown:
        raise MatrixError(
            f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}"
        )
    pid = str(row["id"])
    where = f"{where} ({pid})"
    if not _ID.match(pid):
        raise MatrixError(f"{where}: id must be kebab-case (a-z, 0-9, '-')")
    package = str(row.get("package", MLX_LM))
    if not _DISTRIBUTION.match(package):
        raise MatrixError(f"{where}: package {package!r} is not a distribution name")
    marked = tuple(row["targets"] or ())
    targets = tuple(t[:-1] if isinstance(t, str) and t.endswith("?") else t for t in marked)
    optional = tuple(t[:-1] for t in marked if isinstance(t, str) and t.endswith("?"))
    bad = [t for t in targets if not isinstance(t, str) or not _TARGET.match(t)]
    if not targets or bad:
        raise MatrixError(f"{where}: targets must be non-empty 'module:qualname' strings; bad: {bad}")
    if "package" in row:  # a patch of another distribution touches only that distribution
        top = package.replace("-", "_")
        outside = [t for t in targets if t.split(":")[0] != top and not t.startswith(top + ".")]
        if outside:
            raise MatrixError(f"{where}: targets must lie in {package}'s modules ({top}.*); outside: {outside}")
    fixed_in = row["fixed_in"]
    if fixed_in is not None:
        try:
            fixed_in = Version(str(fixed_in))
        except InvalidVersion:
            raise MatrixError(f"{where}: fixed_in={fixed_in!r} is not a version") from None
    requires = row.get("requires") or {}
    if not isinstance(requires, dict) or not all(_DISTRIBUTION.match(str(n)) for n in requires):
        raise MatrixError(f"{where}: requires must map distribution names to version specifiers; got {requires!r}")
    requires = tuple((str(n), _specifier(v, f"{where}: requires {n}")) for n, v in requires.items())
    needs = row.get("needs") or ()
    if not isinstance(needs, (list, tuple)) or not all(isinstance(n, str) and _ID.match(n) for n in needs):
        raise MatrixError(f"{where}: needs must be a list of patch ids; got {needs!r}")
    after = row.get("after") or ()
    if not isinstance(after, (list, tuple)) or not all(isinstance(n, str) and _ID.match(n) for n in after):
        raise MatrixError(f"{where}: after must be a list of patch ids; got {after!r}")
    if pid in after:
        raise MatrixError(f"{where}: after names the patch itself")
    affected = _specifier(row["affected"], f"{where}: affected")
    if fixed_in is not None and affected.contains(fixed_in, prereleases=True):
        raise MatrixError(f"{where}: fixed_in {fixed_in} lies inside affected {affected}")
    return PatchSpec(
        id=pid,
        summary=str(row["summary"]),
        affected=affected,
        fixed_in=fixed_in,
        upstream=tuple(str(u) for u in row["upstream"] or ()),
        targets=targets,
        probe=str(row["probe"]),
        metal_note=row.get("metal_note"),
        before=str(row["before"]) if row.get("before") else None,
        package=package,
        requires=requires,
        optional_targets=optional,
        needs=tuple(dict.fromkeys(needs)),
        after=tuple(dict.fromkeys(after)),
    )

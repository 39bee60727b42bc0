"""Engine unit tests on a small fake package (no mlx-lm involved).

Each test gets a freshly named fake library and patch package in a temporary directory, so
post-import hooks, ``sys.modules`` and wrapt's hook registry never leak between tests.
"""

import itertools
import sys
import textwrap
import threading

import pytest

from mlx_lm_patches.engine import core as engine_mod
from mlx_lm_patches.engine import matrix
from mlx_lm_patches.engine import versions
from mlx_lm_patches.engine.core import Engine, PatchError, State
from mlx_lm_patches.engine.patching import installed_by

_counter = itertools.count()

LIB = {
    "__init__.py": "",
    "core.py": """
        class Cache:
            def __init__(self, size):
                self.size = size

            def trim(self, n):
                return 0

        def greet(name):
            return "hello " + name

        def tally():
            return "tally"
    """,
    "user.py": """
        from {lib}.core import greet, Cache  # private copies, like mlx-lm's modules take
    """,
    "extra.py": """
        def thing():
            return "original"

        class Box:
            def get(self):
                return "original"

        class Base:
            def get(self):
                return "base"

        class Inheriting(Base):
            pass

        class Overriding(Base):
            def get(self):
                return "own"

        def _elsewhere():
            return "original"

        def __getattr__(name):  # forwards a name it does not define (as mlx-vlm 0.6's generate does)
            if name == "forwarded":
                return _elsewhere
            raise AttributeError(name)
    """,
}

PATCHES = {
    "__init__.py": "",
    "trim_fix.py": """
        import sys

        def probe():
            return "trim returns 0" if sys.modules["{lib}.core"].Cache(1).trim(1) == 0 else None

        def apply(p):
            p.wrap("{lib}.core:Cache.trim", lambda wrapped, instance, args, kwargs: args[0])

        def scenario():
            return None
    """,
    "greet_fix.py": """
        def probe():
            return True

        def apply(p):
            p.wrap("{lib}.core:greet", lambda wrapped, instance, args, kwargs: wrapped(*args).upper())
    """,
    "added_attr.py": """
        def probe():
            return True

        def apply(p):
            p.set("{lib}.core:NEW", 42)
            p.set("{lib}.core:Cache.extra", lambda self: "extra")
    """,
    "absent_bug.py": """
        def probe():
            return False

        def apply(p):
            raise AssertionError("must not be called")
    """,
    "old_only.py": """
        def probe():
            raise AssertionError("must not be probed")

        def apply(p):
            raise AssertionError("must not be called")
    """,
    "broken_probe.py": """
        def probe():
            raise RuntimeError("probe exploded")

        def apply(p):
            pass
    """,
    "broken_apply.py": """
        def probe():
            return True

        def apply(p):
            p.set("{lib}.core:PARTIAL", 1)
            raise RuntimeError("apply exploded")
    """,
    "undeclared.py": """
        def probe():
            return True

        def apply(p):
            p.set("{lib}.extra:thing", None)
    """,
    "closed_range.py": """
        def probe():
            return "bug seen by the probe"

        def apply(p):
            p.set("{lib}.core:CLOSED", "fixed")
    """,
    "gone_target.py": """
        import sys

        def probe():
            return sys.modules["{lib}.core"].Removed  # raises AttributeError: the class is gone

        def apply(p):
            raise AssertionError("must not be called")
    """,
    "alternative_targets.py": """
        import sys

        def probe():
            return True

        def apply(p):
            core = sys.modules["{lib}.core"]
            if hasattr(core, "Later"):
                p.wrap("{lib}.core:Later.method", lambda wrapped, instance, args, kwargs: 1)
            else:
                p.wrap("{lib}.core:Cache.trim", lambda wrapped, instance, args, kwargs: 1)
    """,
    "not_needed_reason.py": """
        from mlx_lm_patches.engine.contract import missing

        def probe():
            return missing("{lib}.core:Cache.no_such_helper")

        def apply(p):
            raise AssertionError("must not be called")
    """,
    "leans_on_other.py": """
        import sys

        from mlx_lm_patches.engine.contract import Outcome

        def probe():  # sees the "bug" only where added-attr's change is in place
            return "NEW is there" if hasattr(sys.modules["{lib}.core"], "NEW") else None

        def apply(p):
            p.set("{lib}.core:LEANS", 1)

        def scenario():
            return Outcome(True, "stock is correct")
    """,
    "stock_fails.py": """
        from mlx_lm_patches.engine.contract import Outcome

        def probe():
            return None

        def apply(p):
            raise AssertionError("must not be called")

        def scenario():
            return Outcome(False, "stock is wrong")
    """,
    "side_state.py": """
        from functools import partial

        COUNTED = "calls of tally counted"

        def probe():
            return True

        def _count(memo, wrapped, instance, args, kwargs):
            memo[COUNTED] = memo.get(COUNTED, 0) + 1
            return f"{{wrapped()}} {{memo[COUNTED]}}"

        def apply(p):
            p.wrap("{lib}.core:tally", partial(_count, p.memo))
    """,
    "deferred.py": """
        def probe():
            return True

        def apply(p):
            p.wrap("{lib}.extra:thing", lambda wrapped, instance, args, kwargs: "patched")
            p.wrap_if_present("{lib}.extra:Box.get", lambda wrapped, instance, args, kwargs: "patched")
            p.wrap_if_present("{lib}.extra:Gone.get", lambda wrapped, instance, args, kwargs: "patched")
            p.wrap_if_present("{lib}.extra:forwarded", lambda wrapped, instance, args, kwargs: "patched")
            around = lambda wrapped, instance, args, kwargs: "wrapped " + wrapped(*args, **kwargs)
            p.wrap_if_present("{lib}.extra:Base.get", around)
            p.wrap_if_present("{lib}.extra:Inheriting.get", around, own=True)
            p.wrap_if_present("{lib}.extra:Overriding.get", around, own=True)
    """,
}

MATRIX = """
schema: 1
supported: ">=1.0"
tested_versions: []
patches:
  - {{id: trim-fix, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache.trim"], probe: p, before: "older releases trim another way"}}
  - {{id: greet-fix, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:greet"], probe: p}}
  - {{id: added-attr, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:NEW", "{lib}.core:Cache.extra"], probe: p}}
  - {{id: absent-bug, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache"], probe: p}}
  - {{id: old-only, summary: s, affected: "<1.0", fixed_in: "1.0", upstream: [], targets: ["{lib}.core:Cache"], probe: p}}
  - {{id: broken-probe, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache"], probe: p}}
  - {{id: broken-apply, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:PARTIAL"], probe: p}}
  - {{id: undeclared, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache"], probe: p}}
  - {{id: closed-range, summary: s, affected: "==0.9", fixed_in: "1.0", upstream: [], targets: ["{lib}.core:CLOSED"], probe: p}}
  - {{id: gone-target, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Removed.__call__"], probe: p}}
  - {{id: alternative-targets, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Later.method?", "{lib}.core:Cache.trim?"], probe: p}}
  - {{id: not-needed-reason, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache"], probe: p}}
  - {{id: leans-on-other, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:LEANS"], probe: p}}
  - {{id: stock-fails, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache"], probe: p}}
  - {{id: side-state, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:tally"], probe: p}}
  - {{id: deferred, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{lib}.core:Cache", "{lib}.extra:thing", "{lib}.extra:Box.get?", "{lib}.extra:Gone.get?", "{lib}.extra:forwarded?", "{lib}.extra:Base.get?", "{lib}.extra:Inheriting.get?", "{lib}.extra:Overriding.get?"], probe: p}}
"""

OK_IDS = ["trim-fix", "greet-fix", "added-attr"]


class Fake:
    def __init__(self, tmp_path, monkeypatch, version="1.2", origin="release"):
        n = next(_counter)
        self.lib, self.pkg = f"fakelib{n}", f"fakepatches{n}"
        for package, files in ((self.lib, LIB), (self.pkg, PATCHES)):
            (tmp_path / package).mkdir()
            for name, text in files.items():
                (tmp_path / package / name).write_text(textwrap.dedent(text.format(lib=self.lib)))
        path = tmp_path / "compat_matrix.yaml"
        path.write_text(MATRIX.format(lib=self.lib))
        monkeypatch.syspath_prepend(str(tmp_path))
        for var in ("MLX_LM_PATCHES_DISABLE", "MLX_LM_PATCHES_STRICT"):
            monkeypatch.delenv(var, raising=False)
        self.engine = Engine(matrix.load(str(path)), patch_package=self.pkg,
                             installed=versions.InstalledDist("fakelib", version, origin))

    def module(self, name):
        __import__(f"{self.lib}.{name}")
        return sys.modules[f"{self.lib}.{name}"]

    def state(self, pid):
        return self.engine.records[pid].state


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return Fake(tmp_path, monkeypatch)


def test_pending_until_anchor_import_then_applied_before_copies_are_taken(fake):
    fake.engine.request(OK_IDS, import_anchors=False)
    assert all(fake.state(i) is State.PENDING for i in OK_IDS)
    user = fake.module("user")  # imports core; hooks fire before user copies greet
    assert all(fake.state(i) is State.APPLIED for i in OK_IDS)
    assert user.greet("x") == "HELLO X"
    assert user.Cache(1).trim(3) == 3
    assert fake.module("core").NEW == 42 and user.Cache(1).extra() == "extra"


def test_explicit_request_imports_anchors_and_is_idempotent(fake):
    fake.engine.request(OK_IDS)
    core = sys.modules[f"{fake.lib}.core"]
    wrapper = vars(core.Cache)["trim"]
    fake.engine.request(OK_IDS)
    fake.engine.request(["trim-fix"])
    assert vars(core.Cache)["trim"] is wrapper
    assert vars(core.Cache)["trim"].__wrapped__.__name__ == "trim"
    assert not hasattr(vars(core.Cache)["trim"].__wrapped__, "__wrapped__"), "double wrapped"
    assert installed_by(wrapper) == "trim-fix"


def test_revert_restores_identity_and_soft_disables_copies(fake):
    core = fake.module("core")
    original_trim, original_greet = vars(core.Cache)["trim"], core.greet
    fake.engine.request(OK_IDS)
    user = fake.module("user")  # takes a copy of the wrapped greet
    assert user.greet("a") == "HELLO A"
    fake.engine.revert()
    assert vars(core.Cache)["trim"] is original_trim
    assert core.greet is original_greet
    assert not hasattr(core, "NEW") and "extra" not in vars(core.Cache)
    assert user.greet("a") == "hello a", "copy of a reverted wrapper must act as the original"
    assert all(fake.state(i) is State.REVERTED for i in OK_IDS)
    fake.engine.request(OK_IDS)  # re-apply
    assert core.greet("b") == "HELLO B" and user.greet("b") == "HELLO B"
    assert vars(core.Cache)["trim"].__wrapped__ is original_trim


def test_side_state_lives_in_the_memo_listed_by_status_and_forgotten_by_revert(fake):
    """What a patch keeps between calls (``p.memo``, not a module global): status lists it while
    applied, revert forgets it, and the patch applied again starts as in a fresh process."""
    fake.engine.request(["side-state"])
    core = fake.module("core")
    assert [core.tally(), core.tally()] == ["tally 1", "tally 2"]
    assert fake.engine.changes() == {"side-state": ["holds calls of tally counted"]}
    assert "also changed: holds calls of tally counted" in fake.engine.row("side-state").detail
    fake.engine.revert(["side-state"])
    assert core.tally() == "tally"
    assert fake.engine.changes() == {}
    fake.engine.request(["side-state"])
    assert core.tally() == "tally 1", "state kept before the revert outlived it"


def test_revert_leaves_objects_others_installed_on_top(fake):
    fake.engine.request(["greet-fix"])
    core = sys.modules[f"{fake.lib}.core"]
    theirs = lambda name: "theirs"  # noqa: E731
    core.greet = theirs
    rows = fake.engine.revert(["greet-fix"])
    assert core.greet is theirs
    assert "replaced by someone else" in rows[0].detail


def test_version_gate_and_probe(fake):
    fake.engine.request(["old-only", "absent-bug"])
    assert fake.state("old-only") is State.SKIPPED_VERSION
    assert "outside <1.0" in fake.engine.row("old-only").detail
    assert "fixed in 1.0" in fake.engine.row("old-only").detail
    assert fake.state("absent-bug") is State.SKIPPED_PROBE


def test_a_release_older_than_the_range_says_what_it_gets(tmp_path, monkeypatch):
    """A patch's ``before`` (what releases older than its range get instead) is what status says
    there, after the version gate's reason; not above a range, nor for a patch without one."""
    from packaging.version import Version

    older = Fake(tmp_path, monkeypatch, version="0.8")
    older.engine.request(["trim-fix", "greet-fix"])
    assert older.engine.row("trim-fix").detail.endswith(" 0.8 is outside >=1.0: older releases trim another way")
    assert older.engine.row("greet-fix").detail.endswith(" 0.8 is outside >=1.0")
    specs = {pid: rec.spec for pid, rec in older.engine.records.items()}
    assert specs["trim-fix"].older_than_affected(Version("0.8"))
    assert not specs["old-only"].older_than_affected(Version("1.2"))  # above "<1.0"
    assert specs["closed-range"].older_than_affected(Version("0.8"))  # below "==0.9"
    assert not specs["closed-range"].older_than_affected(Version("1.2"))


def test_prerelease_is_inside_the_range(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, version="0.9.dev0")
    fake.engine.request(["old-only"], raise_errors=False)
    assert fake.state("old-only") is State.FAILED  # probed (and its probe asserts): gate let it through


def test_explicit_apply_raises_on_failures_and_leaves_nothing_behind(fake):
    with pytest.raises(PatchError, match="broken-probe.*probe exploded"):
        fake.engine.request(["broken-probe"])
    with pytest.raises(PatchError, match="apply exploded"):
        fake.engine.request(["broken-apply"])
    assert not hasattr(sys.modules[f"{fake.lib}.core"], "PARTIAL"), "partial apply not rolled back"
    with pytest.raises(PatchError, match="not under its targets"):
        fake.engine.request(["undeclared"])
    assert fake.state("broken-apply") is State.FAILED


def test_automatic_mode_contains_failures(fake, caplog):
    fake.engine.request(["broken-probe", "trim-fix"], raise_errors=False, import_anchors=False)
    fake.module("core")  # the import must succeed
    assert fake.state("broken-probe") is State.FAILED
    assert fake.state("trim-fix") is State.APPLIED
    assert "broken-probe" in caplog.text


def test_strict_mode_raises_in_automatic_mode(fake, monkeypatch):
    monkeypatch.setenv("MLX_LM_PATCHES_STRICT", "1")
    fake.engine.request(["broken-probe"], raise_errors=False, import_anchors=False)
    with pytest.raises(PatchError, match="probe exploded"):
        fake.module("core")


def test_disable_env_and_exclude(fake, monkeypatch):
    monkeypatch.setenv("MLX_LM_PATCHES_DISABLE", "greet-fix")
    fake.engine.request(OK_IDS, exclude=["added-attr"])
    assert fake.state("greet-fix") is State.DISABLED
    assert fake.state("added-attr") is State.DISABLED
    assert fake.state("trim-fix") is State.APPLIED


def test_disable_all(fake, monkeypatch):
    monkeypatch.setenv("MLX_LM_PATCHES_DISABLE", "*")
    fake.engine.request(OK_IDS)
    assert all(fake.state(i) is State.DISABLED for i in OK_IDS)


def test_unknown_ids_are_errors(fake, monkeypatch, caplog):
    with pytest.raises(ValueError, match="unknown patch id.*'nope'"):
        fake.engine.request(["nope"])
    with pytest.raises(ValueError, match="exclude: unknown patch id"):
        fake.engine.request(OK_IDS, exclude=["nope"])
    monkeypatch.setenv("MLX_LM_PATCHES_DISABLE", "nope")
    with pytest.raises(ValueError, match="MLX_LM_PATCHES_DISABLE names unknown patch id.*'nope'"):
        fake.engine.request(OK_IDS)
    fake.engine.request(OK_IDS, raise_errors=False)  # automatic mode: warn and go on
    assert "MLX_LM_PATCHES_DISABLE names unknown" in caplog.text


def test_deferred_targets_apply_when_their_module_is_imported(fake):
    fake.engine.request(["deferred"])
    assert fake.state("deferred") is State.APPLIED
    assert "waiting for import" in fake.engine.row("deferred").detail
    extra = fake.module("extra")
    assert extra.thing() == "patched"
    assert extra.Box().get() == "patched"  # an optional target that is there is wrapped
    assert not hasattr(extra, "Gone")  # one that is not is left alone, without an error
    assert extra.forwarded() == "original" and "forwarded" not in vars(extra)  # forwarded: not there
    # own=True: an inherited method goes through its base's wrapper once; an override is wrapped
    assert (extra.Base().get(), extra.Inheriting().get(), extra.Overriding().get()) == (
        "wrapped base", "wrapped base", "wrapped own")
    assert "get" not in vars(extra.Inheriting)
    assert fake.state("deferred") is State.APPLIED
    assert "waiting" not in fake.engine.row("deferred").detail
    fake.engine.revert(["deferred"])
    assert extra.thing() == "original"
    assert extra.Box().get() == "original"
    assert (extra.Base().get(), extra.Inheriting().get(), extra.Overriding().get()) == ("base", "base", "own")


def test_revert_while_pending_cancels(fake):
    fake.engine.request(["trim-fix"], import_anchors=False)
    fake.engine.revert(["trim-fix"])
    core = fake.module("core")
    assert fake.state("trim-fix") is State.REVERTED
    assert core.Cache(1).trim(2) == 0


def test_status_reads_live_objects(fake):
    fake.engine.request(["trim-fix"])
    core = sys.modules[f"{fake.lib}.core"]
    core.Cache.trim = lambda self, n: -1
    assert "replaced by someone else since" in fake.engine.row("trim-fix").detail


def test_concurrent_requests_apply_once(fake):
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        fake.engine.request(OK_IDS)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    core = sys.modules[f"{fake.lib}.core"]
    assert core.greet("z") == "HELLO Z"
    assert len(fake.engine.records["greet-fix"].patcher.ops) == 1


def test_public_api_is_lazy_and_complete():
    import mlx_lm_patches

    for name in mlx_lm_patches.__all__:
        assert getattr(mlx_lm_patches, name) is not None
    assert mlx_lm_patches.apply is engine_mod.apply
    with pytest.raises(AttributeError):
        mlx_lm_patches.nope


def test_revert_all_undoes_stacked_patches_latest_first(tmp_path, monkeypatch):
    """Two patches on one attribute (the second wraps what the first added): reverting both
    restores the original, whatever order the ids are given in."""
    fake = Fake(tmp_path, monkeypatch)
    patches = tmp_path / fake.pkg
    (patches / "stack_base.py").write_text(textwrap.dedent(f"""
        def probe():
            return True

        def apply(p):
            p.set("{fake.lib}.core:Cache.added", lambda self: "base")
    """))
    (patches / "stack_top.py").write_text(textwrap.dedent(f"""
        def probe():
            return True

        def apply(p):
            p.wrap("{fake.lib}.core:Cache.added", lambda wrapped, instance, args, kwargs: "top")
    """))
    path = tmp_path / "stacked.yaml"
    path.write_text(textwrap.dedent(f"""
        schema: 1
        supported: ">=1.0"
        tested_versions: []
        patches:
          - {{id: stack-base, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{fake.lib}.core:Cache.added"], probe: p}}
          - {{id: stack-top, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["{fake.lib}.core:Cache.added"], probe: p}}
    """))
    eng = Engine(matrix.load(str(path)), patch_package=fake.pkg,
                 installed=versions.InstalledDist("fakelib", "1.2"))
    eng.request()
    core = sys.modules[f"{fake.lib}.core"]
    assert core.Cache(1).added() == "top"
    # Wrapped by another patch of ours is still in place (status does not cry "replaced").
    assert all("replaced" not in eng.row(pid).detail for pid in ("stack-base", "stack-top"))
    eng.revert(["stack-base", "stack-top"])
    assert "added" not in vars(core.Cache)


def test_a_patch_of_another_distribution_is_gated_on_that_distribution(tmp_path, monkeypatch):
    """``package: <dist>`` entries: the version gate reads that distribution (missing ->
    skipped:version, outside the range -> skipped:version), the anchor is in its modules, and
    status says which distribution the range is about. mlx-lm's version plays no part."""
    fake = Fake(tmp_path, monkeypatch)
    other = f"fakevlm{next(_counter)}"
    (tmp_path / other).mkdir()
    (tmp_path / other / "__init__.py").write_text("")
    (tmp_path / other / "lang.py").write_text("def offset_user(o):\n    return 'stock'\n")
    (tmp_path / fake.pkg / "vlm_fix.py").write_text(textwrap.dedent(f"""
        def probe():
            return "bug seen"

        def apply(p):
            p.wrap("{other}.lang:offset_user", lambda wrapped, instance, args, kwargs: "fixed")
    """))
    path = tmp_path / "vlm.yaml"
    path.write_text(textwrap.dedent(f"""
        schema: 1
        supported: ">=1.0"
        tested_versions:
          - {{mlx_lm: "1.2", mlx: "1.0", python: "3.12", packages: {{{other}: "0.4.0"}}}}
        patches:
          - {{id: vlm-fix, package: {other}, summary: s, affected: "<=0.4.0", fixed_in: null, upstream: [], targets: ["{other}.lang:offset_user"], probe: p}}
    """))
    the_matrix = matrix.load(str(path))
    assert the_matrix.tested_versions[0].name == f"mlx-lm-1.2_mlx-1.0_py3.12_{other}-0.4.0"

    def engine_with(version):
        dist = versions.InstalledDist(other, version, "release" if version else "missing")
        return Engine(the_matrix, patch_package=fake.pkg, installed=versions.InstalledDist("fakelib", "0.1"),
                      packages={other: dist})

    missing = engine_with(None)
    missing.request(["vlm-fix"])
    assert missing.records["vlm-fix"].state is State.SKIPPED_VERSION
    assert missing.row("vlm-fix").detail == f"{other} not installed"
    newer = engine_with("0.5.0")
    newer.request(["vlm-fix"])
    assert newer.records["vlm-fix"].state is State.SKIPPED_VERSION
    assert f"{other} 0.5.0 is outside <=0.4.0" in newer.row("vlm-fix").detail
    eng = engine_with("0.4.0")  # mlx-lm ("fakelib" 0.1) is outside every mlx-lm range: irrelevant
    eng.request(["vlm-fix"], import_anchors=False)
    assert eng.records["vlm-fix"].state is State.PENDING
    assert f"waiting for import of {other}.lang" in eng.row("vlm-fix").detail
    __import__(f"{other}.lang")
    assert eng.records["vlm-fix"].state is State.APPLIED
    assert sys.modules[f"{other}.lang"].offset_user(1) == "fixed"
    row = eng.row("vlm-fix")
    assert (row.package, row.affected) == (other, "<=0.4.0")
    assert [d.describe() for d in eng.other_packages()] == ["0.4.0"]
    eng.revert(["vlm-fix"])
    assert sys.modules[f"{other}.lang"].offset_user(1) == "stock"


def test_explicit_request_imports_the_anchors_of_pending_patches(fake):
    """Automatic activation leaves patches pending on their anchors; a later explicit request
    imports those anchors, so the patches are decided (as ``apply()`` promises)."""
    fake.engine.request(["trim-fix"], raise_errors=False, import_anchors=False)
    assert fake.state("trim-fix") is State.PENDING
    fake.engine.request(["trim-fix"])
    assert fake.state("trim-fix") is State.APPLIED


def test_a_bug_that_needs_another_distribution_is_gated_on_it_too(tmp_path, monkeypatch):
    """``requires: {dist: spec}``: the bug needs that distribution in that range as well (e.g. an
    mlx-lm release only breaks with a newer mlx). Missing or outside -> skipped:version saying
    why; inside -> decided as usual; status shows the requirement beside the range."""
    fake = Fake(tmp_path, monkeypatch)
    other = f"fakemlx{next(_counter)}"
    (tmp_path / fake.pkg / "needs_other.py").write_text(textwrap.dedent(f"""
        def probe():
            return "bug seen"

        def apply(p):
            p.wrap("{fake.lib}.extra:thing", lambda wrapped, instance, args, kwargs: "fixed")
    """))
    path = tmp_path / "requires.yaml"
    path.write_text(textwrap.dedent(f"""
        schema: 1
        supported: ">=0.1"
        tested_versions:
          - {{mlx_lm: "0.1", mlx: "1.0", python: "3.12"}}
        patches:
          - {{id: needs-other, summary: s, affected: "<1.0", requires: {{{other}: ">=2.0"}}, fixed_in: null, upstream: [], targets: ["{fake.lib}.extra:thing"], probe: p}}
    """))
    the_matrix = matrix.load(str(path))
    assert [(n, str(s)) for n, s in the_matrix.get("needs-other").requires] == [(other, ">=2.0")]

    def engine_with(version):
        dist = versions.InstalledDist(other, version, "release" if version else "missing")
        return Engine(the_matrix, patch_package=fake.pkg, installed=versions.InstalledDist(fake.lib, "0.1"),
                      packages={other: dist})

    for version, detail in ((None, f"{other} not installed is outside >=2.0, which the bug needs"),
                            ("1.5", f"{other} 1.5 is outside >=2.0")):
        eng = engine_with(version)
        eng.request(["needs-other"], import_anchors=False)
        assert eng.records["needs-other"].state is State.SKIPPED_VERSION
        assert detail in eng.row("needs-other").detail
    eng = engine_with("2.1")
    eng.request(["needs-other"])
    assert eng.records["needs-other"].state is State.APPLIED
    assert sys.modules[f"{fake.lib}.extra"].thing() == "fixed"
    assert eng.row("needs-other").affected == f"<1.0 with {other} >=2.0"
    eng.revert(["needs-other"])
    assert sys.modules[f"{fake.lib}.extra"].thing() == "original"


# -- the gate: releases by range + probe, anything else by the probe alone ---------------------


def _dist_info(site, name, version, direct_url=None):
    """A minimal installed distribution in ``site`` (as pip/uv leave it), optionally with the
    ``direct_url.json`` they write for VCS and local-directory installs."""
    import json

    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_installed_tells_releases_from_git_local_and_dev_installs(tmp_path, monkeypatch):
    site = tmp_path / "site"
    n = next(_counter)
    _dist_info(site, f"rel{n}", "0.32.2")
    _dist_info(site, f"git{n}", "0.32.3", {"url": "https://github.com/ml-explore/mlx-lm.git",
                                          "vcs_info": {"vcs": "git", "commit_id": "0123456789abcdef0123"}})
    _dist_info(site, f"dir{n}", "0.32.3", {"url": "file:///src/mlx-lm", "dir_info": {"editable": True}})
    _dist_info(site, f"dev{n}", "0.32.3.dev0")
    _dist_info(site, f"loc{n}", "0.32.3+g0123")
    monkeypatch.syspath_prepend(str(site))
    release = versions.installed(f"rel{n}")
    assert release.is_release and release.describe() == "0.32.2"
    git = versions.installed(f"git{n}")
    assert not git.is_release
    assert git.origin == "git https://github.com/ml-explore/mlx-lm.git@0123456789ab"
    editable = versions.installed(f"dir{n}")
    assert not editable.is_release and editable.origin == "editable file:///src/mlx-lm"
    for name in (f"dev{n}", f"loc{n}"):
        assert not versions.installed(name).is_release, name
    assert not versions.installed(f"nope{n}").is_release


def test_a_release_outside_the_range_is_skipped_without_probing(fake):
    fake.engine.request(["closed-range"])
    assert fake.state("closed-range") is State.SKIPPED_VERSION
    assert fake.engine.gate_rule() == "range"
    assert fake.engine.gate_text() == "version range + probe"
    spec = fake.engine.matrix.get("closed-range")
    assert spec.version_verdict(lambda name: fake.engine.mlx_lm) is False
    assert fake.engine.matrix.get("trim-fix").version_verdict(lambda name: fake.engine.mlx_lm) is True


@pytest.mark.parametrize("version, origin, says", [
    ("1.2", "git https://github.com/ml-explore/mlx-lm.git@0123456789ab",
     "probe only (mlx-lm installed from git https://github.com/ml-explore/mlx-lm.git@0123456789ab"),
    ("1.2", "editable file:///src/mlx-lm", "probe only (mlx-lm installed editable from file:///src/mlx-lm"),
    ("1.2.dev0", "development version", "probe only (mlx-lm version 1.2.dev0 is a development version"),
])
def test_a_non_release_is_decided_by_its_probe_alone(tmp_path, monkeypatch, version, origin, says):
    """main carries the next release's number early: a closed range (==0.9) that excludes the
    label must not hide a bug the probe finds; ranges that include it do not apply a patch whose
    probe finds nothing; requires/package rules stay."""
    fake = Fake(tmp_path, monkeypatch, version=version, origin=origin)
    fake.engine.request(["closed-range", "absent-bug", "trim-fix"])
    assert fake.state("closed-range") is State.APPLIED
    assert fake.module("core").CLOSED == "fixed"
    assert fake.state("absent-bug") is State.SKIPPED_PROBE
    assert fake.state("trim-fix") is State.APPLIED
    assert fake.engine.gate_rule() == "probe"
    assert fake.engine.gate_text().startswith(says)
    assert any("not a published release" in w for w in fake.engine.warnings())
    assert fake.engine.matrix.get("closed-range").version_verdict(lambda name: fake.engine.mlx_lm) is None


def test_status_warns_when_mlx_lm_is_newer_than_the_newest_tested_release(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch)
    path = tmp_path / "tested.yaml"
    path.write_text(MATRIX.format(lib=fake.lib).replace("tested_versions: []", textwrap.dedent("""
        tested_versions:
          - {mlx_lm: "1.0", mlx: "1.0", python: "3.12"}
          - {mlx_lm: "1.1", mlx: "1.0", python: "3.12"}
    """).strip()))
    the_matrix = matrix.load(str(path))
    assert str(the_matrix.newest_tested()) == "1.1"
    newer = Engine(the_matrix, patch_package=fake.pkg, installed=versions.InstalledDist(fake.lib, "1.2"))
    assert [w for w in newer.warnings() if "newer than the newest tested release (1.1)" in w]
    tested = Engine(the_matrix, patch_package=fake.pkg, installed=versions.InstalledDist(fake.lib, "1.1"))
    assert tested.warnings() == []


# -- a target that is gone: not needed, never a failure -----------------------------------------


def test_a_missing_target_is_not_needed_and_never_probed(fake):
    fake.engine.request(["gone-target"])  # explicit: would raise on a failure
    assert fake.state("gone-target") is State.SKIPPED_PROBE
    assert fake.engine.row("gone-target").detail == (
        f"target {fake.lib}.core:Removed missing in this mlx-lm: not needed")


def test_a_missing_target_does_not_raise_under_strict(fake, monkeypatch):
    monkeypatch.setenv("MLX_LM_PATCHES_STRICT", "1")
    fake.engine.request(["gone-target", "broken-probe"], raise_errors=False, import_anchors=False)
    with pytest.raises(PatchError, match="probe exploded"):  # a probe that raises is still a bug
        fake.module("core")
    assert fake.state("gone-target") is State.SKIPPED_PROBE
    assert fake.state("broken-probe") is State.FAILED


def test_alternative_targets_marked_optional_do_not_rule_the_patch_out(fake):
    spec = fake.engine.matrix.get("alternative-targets")
    assert spec.targets == (f"{fake.lib}.core:Later.method", f"{fake.lib}.core:Cache.trim")
    assert spec.optional_targets == spec.targets
    fake.engine.request(["alternative-targets"])
    assert fake.state("alternative-targets") is State.APPLIED
    assert fake.module("core").Cache(1).trim(5) == 1


def test_a_probe_can_say_why_the_fix_is_not_needed(fake):
    fake.engine.request(["not-needed-reason"])
    assert fake.state("not-needed-reason") is State.SKIPPED_PROBE
    assert fake.engine.row("not-needed-reason").detail == (
        f"probe: {fake.lib}.core:Cache.no_such_helper missing in this mlx-lm: not needed")


# -- needs: what a patch's scenario cannot pass without ----------------------------------------


def test_needs_is_validated_and_transitive(tmp_path):
    def parse(extra):
        text = textwrap.dedent(f"""
            schema: 1
            supported: ">=1.0"
            patches:
              - {{id: a, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["m:x"], probe: p{extra.get("a", "")}}}
              - {{id: b, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["m:y"], probe: p{extra.get("b", "")}}}
              - {{id: c, summary: s, affected: ">=1.0", fixed_in: null, upstream: [], targets: ["m:z"], probe: p}}
        """)
        import yaml

        return matrix.parse(yaml.safe_load(text), tmp_path / "m.yaml")

    the_matrix = parse({"a": ", needs: [b]", "b": ", needs: [c]"})
    assert the_matrix.get("a").needs == ("b",)
    assert the_matrix.needed_by("a") == ("a", "b", "c")
    assert the_matrix.needed_by("c") == ("c",)
    with pytest.raises(matrix.MatrixError, match=r"patch a: needs names unknown patch id\(s\) \['nope'\]"):
        parse({"a": ", needs: [nope]"})
    with pytest.raises(matrix.MatrixError, match="needs must be a list of patch ids"):
        parse({"a": ", needs: b"})
    with pytest.raises(matrix.MatrixError, match="needs names the patch itself"):
        parse({"a": ", needs: [a]"})


def test_check_judges_a_patch_applied_only_beside_others_as_skipped(fake):
    """A patch whose probe finds the bug only through another patch's change (mlx-lm main:
    mamba-cache-extract-class beside mamba-cache-compat's restored MambaCache) is judged by
    ``check`` as a skipped one: stock correct -> "not needed", not "did not apply alone"; a
    skipped patch whose stock scenario fails is a gap; the outcomes are counted apart."""
    from mlx_lm_patches.engine import check

    fake.engine.request(["added-attr", "leans-on-other", "stock-fails"])
    assert fake.state("leans-on-other") is State.APPLIED  # as a user gets it, beside added-attr
    assert fake.state("stock-fails") is State.SKIPPED_PROBE
    results = [check.check_patch(fake.engine, pid) for pid in ("leans-on-other", "stock-fails")]
    leaning, failing = results
    assert (leaning.state, leaning.outcome, leaning.holds) == ("skipped:probe", check.NOT_NEEDED, True), leaning
    assert leaning.verdict == "not needed: stock mlx-lm is correct" and leaning.with_patch is None
    assert (failing.outcome, failing.holds) == (check.GAP, False), failing
    assert failing.verdict.startswith("GAP: skipped, yet stock mlx-lm fails")
    assert check.counts(results) == {"fixed": 0, "not needed": 1, "not applicable": 0, "disabled": 0, "gap": 1}
    assert check.summary(results) == ("check: 0 fixed, 1 not needed (stock correct), 0 not applicable, "
                                      "0 disabled, 1 gap")


def test_check_counts_a_disabled_patch_as_disabled_never_as_fixed(fake, monkeypatch):
    """``MLX_LM_PATCHES_DISABLE=x``: check does not run x's scenario and counts it apart."""
    from mlx_lm_patches.engine import check

    monkeypatch.setenv("MLX_LM_PATCHES_DISABLE", "greet-fix")
    fake.engine.request(OK_IDS)
    assert fake.state("greet-fix") is State.DISABLED
    result = check.check_patch(fake.engine, "greet-fix")
    assert (result.outcome, result.holds, result.verdict) == (check.DISABLED, True, "not checked: disabled")
    assert check.counts([result]) == {"fixed": 0, "not needed": 0, "not applicable": 0, "disabled": 1, "gap": 0}
    assert check.summary([result]) == ("check: 0 fixed, 0 not needed (stock correct), 0 not applicable, "
                                       "1 disabled, 0 gaps")

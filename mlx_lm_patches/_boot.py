"""The bootstrap armed at interpreter start by our ``.pth`` / ``.start`` file or sitecustomize.

Standard library only and nearly free: it puts a one-shot finder on ``sys.meta_path`` and
returns. Nothing heavy (wrapt, packaging, yaml, importlib.metadata, the engine) is imported
until something imports ``mlx_lm``; the finder then hands over to the engine, which registers
post-import hooks on the modules that define each patch target *before* ``mlx_lm`` runs its
``__init__`` (so ``from x import y`` copies inside mlx-lm see patched objects) and lets the
import proceed. If ``mlx_lm`` is already imported when we are armed, the engine applies late
and warns.

``arm()`` is idempotent: in a virtualenv the ``.pth`` line runs twice per start.
"""

import sys

_armed_by = None  # "pth", "start", "sitecustomize" once armed
_finder = None


def armed_by():
    """How automatic activation was armed in this process, or ``None``."""
    return _armed_by


def _enabled():
    from mlx_lm_patches import env

    try:
        return env.flag(env.ENABLED, default=True)
    except env.EnvError as exc:
        # Never break the interpreter: say what is wrong and stay off.
        sys.stderr.write(f"mlx-lm-patches: automatic activation is off: {exc}\n")
        return False


class _MlxLmImportFinder:
    """One-shot meta path finder: activates the engine the first time ``mlx_lm`` is looked up.

    It never finds anything itself; it stays on ``sys.meta_path`` as a no-op afterwards,
    because removing a finder while the import system iterates ``sys.meta_path`` would make
    it skip the next finder.
    """

    def __init__(self, source):
        self.source = source
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if self.done or (fullname != "mlx_lm" and not fullname.startswith("mlx_lm.")):
            return None
        self.done = True
        _activate(self.source, late=False)
        return None


def _activate(source, late):
    try:
        from mlx_lm_patches import engine

        engine.auto_activate(source, late=late)
    except Exception as exc:  # never break the user's import
        from mlx_lm_patches import env

        try:
            strict = env.flag(env.STRICT)
        except env.EnvError:
            strict = False
        if strict:
            raise
        sys.stderr.write(f"mlx-lm-patches: automatic activation failed: {exc!r}\n")


def arm(source="pth"):
    """Arm automatic activation (idempotent; never raises)."""
    global _armed_by, _finder
    try:
        if _armed_by is not None or not _enabled():
            return
        _armed_by = source
        if "mlx_lm" in sys.modules:
            _activate(source, late=True)
            return
        _finder = _MlxLmImportFinder(source)
        sys.meta_path.insert(0, _finder)
    except Exception as exc:
        sys.stderr.write(f"mlx-lm-patches: could not arm automatic activation: {exc!r}\n")


def start():
    """Entry point of the PEP 829 ``mlx_lm_patches.start`` file (Python 3.15+)."""
    arm("start")


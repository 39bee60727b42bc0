"""mlx-lm-patches bootstrap, armed at interpreter start by ``mlx_lm_patches.pth`` (or the PEP 829
``mlx_lm_patches.start`` file, or the launcher's sitecustomize).

Installed as a *top-level* module so that arming costs one small import: standard library only
(``sys``, plus ``os`` which site already imported), and not even our package is imported until
something imports ``mlx_lm``. It puts a one-shot finder on ``sys.meta_path``; when ``mlx_lm`` is
first looked up, the finder hands over to ``mlx_lm_patches.engine``, which registers post-import
hooks on the modules that define each patch target *before* ``mlx_lm`` runs its ``__init__`` (so
``from x import y`` copies inside mlx-lm see patched objects), then lets the import proceed. If
``mlx_lm`` is already imported when we are armed, the engine applies late and warns.

``arm()`` is idempotent (in a virtualenv the ``.pth`` line runs twice per start) and never
raises.
"""

import os
import sys

_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")

_armed_by = None  # "pth", "start", "sitecustomize" once armed


def armed_by():
    """How automatic activation was armed in this process, or ``None``."""
    return _armed_by


def _enabled():
    value = os.environ.get("MLX_LM_PATCHES", "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    try:  # malformed: let env.py word the message, and stay off
        from mlx_lm_patches import env

        env.flag(env.ENABLED)
        message = f"MLX_LM_PATCHES={value!r} is not understood"
    except Exception as exc:
        message = str(exc)
    sys.stderr.write(f"mlx-lm-patches: automatic activation is off: {message}\n")
    return False


class _MlxLmImportFinder:
    """Activates the engine the first time ``mlx_lm`` is looked up; never finds anything itself.

    It stays on ``sys.meta_path`` as a no-op afterwards: removing a finder while the import
    system iterates ``sys.meta_path`` would make it skip the next finder.
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


def _strict():
    return os.environ.get("MLX_LM_PATCHES_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _activate(source, late):
    try:
        from mlx_lm_patches import engine

        engine.auto_activate(source, late=late)
    except Exception as exc:  # never break the user's import, unless asked to
        if _strict():
            raise
        sys.stderr.write(f"mlx-lm-patches: automatic activation failed: {exc!r}\n")


def arm(source="pth"):
    """Arm automatic activation (idempotent; never raises)."""
    global _armed_by
    try:
        if _armed_by is not None or not _enabled():
            return
        _armed_by = source
        if "mlx_lm" in sys.modules:
            _activate(source, late=True)
        else:
            sys.meta_path.insert(0, _MlxLmImportFinder(source))
    except Exception as exc:
        sys.stderr.write(f"mlx-lm-patches: could not arm automatic activation: {exc!r}\n")


def start():
    """Entry point of the PEP 829 ``mlx_lm_patches.start`` file (Python 3.15+)."""
    arm("start")

"""mlx-lm-patches bootstrap, armed at interpreter start by ``mlx_lm_patches.pth`` (or the PEP 829
``mlx_lm_patches.start`` file, or the launcher's sitecustomize).

Installed as a *top-level* module so that arming costs one small import: standard library only
(``sys``, plus ``os`` which site already imported), and not even our package is imported until
something imports ``mlx_lm`` (or ``mlx_vlm`` or ``vllm_mlx``: ``TRIGGERS``). It puts a one-shot
finder on ``sys.meta_path``; when one of them is first looked up, the finder hands over to
``mlx_lm_patches.engine.core``, which registers post-import hooks on the modules that define each
patch target *before* that package runs its ``__init__`` (so ``from x import y`` copies inside it
see patched objects), then lets the import proceed. mlx-vlm 0.7 no longer imports mlx-lm, and
vllm-mlx may import a module a patch targets before it imports mlx-lm: waiting for ``mlx_lm``
would patch them too late or never. If ``mlx_lm`` is already imported when we are armed, the
engine applies late and warns.

``arm()`` is idempotent (in a virtualenv the ``.pth`` line runs twice per start) and never
raises.
"""

import os
import sys

# The values of MLX_LM_PATCHES decided here without importing anything (the common cases at every
# interpreter start): env.py's flag words, which a test keeps equal. Anything else is parsed
# and worded by env.py.
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")

_armed_by = None  # "pth", "start", "sitecustomize" once armed
# The top-level packages whose first import activates the engine: mlx-lm and every distribution
# a patch in compat_matrix.yaml names as its ``package`` (a test keeps the two in step).
TRIGGERS = ("mlx_lm", "mlx_vlm", "vllm_mlx")


def armed_by():
    """How automatic activation was armed in this process, or ``None``."""
    return _armed_by


_refused = None  # the malformed MLX_LM_PATCHES value already reported in this process


def _enabled():
    global _refused
    raw = os.environ.get("MLX_LM_PATCHES", "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF or raw == _refused:  # reported once per process, not per .pth line
        return False
    _refused = raw
    try:  # malformed: let env.py word the message, and stay off
        from mlx_lm_patches.engine import env

        env.flag(env.ENABLED)
        message = f"MLX_LM_PATCHES={value!r} is not understood"
    except Exception as exc:
        message = str(exc)
    sys.stderr.write(f"mlx-lm-patches: automatic activation is off: {message}\n")
    return False


class _MlxLmImportFinder:
    """Activates the engine the first time one of ``TRIGGERS`` is looked up; never finds
    anything itself.

    It stays on ``sys.meta_path`` as a no-op afterwards: removing a finder while the import
    system iterates ``sys.meta_path`` would make it skip the next finder.
    """

    def __init__(self, source):
        self.source = source
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if self.done or fullname.partition(".")[0] not in TRIGGERS:
            return None
        self.done = True
        _activate(self.source, late=False)
        return None


def _strict():
    try:
        from mlx_lm_patches.engine import env

        return env.setting(env.STRICT)
    except Exception:
        return False


def _activate(source, late):
    try:
        from mlx_lm_patches.engine import core as engine

        engine.auto_activate(source, late=late)
    except Exception as exc:  # never break the user's import, unless asked to
        if _strict():
            raise
        sys.stderr.write(f"mlx-lm-patches: automatic activation failed: {exc!r}\n")


def _dash_m_module():
    """``mlx_lm.X`` when this interpreter was started as ``python -m mlx_lm.X``, else ``None``."""
    argv = getattr(sys, "orig_argv", None) or []
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            name = argv[i + 1]
            break
        if arg.startswith("-m") and len(arg) > 2:
            name = arg[2:]
            break
        if not arg.startswith("-"):
            return None  # a script or -c: not -m
    else:
        return None
    return name if name.startswith("mlx_lm.") and name.count(".") == 1 else None


_TAG = "__mlx_lm_patches_id__"
_HOOK = "activation: python -m"


def _run_as_console_script(name):
    """``python -m mlx_lm.generate`` (deprecated upstream) executes a *second* copy of
    generate.py as ``__main__``, beside the ``mlx_lm.generate`` that ``import mlx_lm`` loads and
    that the patches fix; the copy would run unpatched. Run it the way mlx-lm's console script
    ``mlx_lm.generate`` does instead: ``main()`` of the imported module.

    The hook on ``runpy._run_module_as_main`` is one-shot: the interpreter calls it once, before
    any user code, and it puts the stock function back first. Until then ``console_hook()``
    reports it (the engine lists it in ``changes()``) and ``unhook()`` (the engine's
    ``revert()``) removes it."""
    import runpy

    stock = runpy._run_module_as_main

    def _run_module_as_main(mod_name, alter_argv=True):
        unhook()
        if mod_name != name:
            return stock(mod_name, alter_argv)
        from mlx_lm_patches.engine.launcher import console_main

        main = console_main(mod_name)
        if main is None:
            return stock(mod_name, alter_argv)
        if alter_argv:
            sys.argv[0] = sys.modules[mod_name].__file__
        sys.exit(main())

    setattr(_run_module_as_main, _TAG, _HOOK)
    _run_module_as_main.stock = stock
    _run_module_as_main.module = name
    runpy._run_module_as_main = _run_module_as_main


def console_hook():
    """The ``python -m mlx_lm.X`` hook when it is still on ``runpy``, else ``None``."""
    runpy = sys.modules.get("runpy")
    hook = getattr(runpy, "_run_module_as_main", None) if runpy is not None else None
    return hook if getattr(hook, _TAG, None) == _HOOK else None


def unhook():
    """Put the stock ``runpy._run_module_as_main`` back (if the hook is ours and still there)."""
    hook = console_hook()
    if hook is not None:
        sys.modules["runpy"]._run_module_as_main = hook.stock
        return True
    return False


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
            name = _dash_m_module()
            if name is not None:
                _run_as_console_script(name)
    except Exception as exc:
        sys.stderr.write(f"mlx-lm-patches: could not arm automatic activation: {exc!r}\n")


def start():
    """Entry point of the PEP 829 ``mlx_lm_patches.start`` file (Python 3.15+)."""
    arm("start")

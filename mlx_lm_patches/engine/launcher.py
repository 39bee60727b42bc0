"""``mlx-lm-patches-run COMMAND [ARGS...]``: run a command with automatic activation.

For environments where the package is not installed into the interpreter's site-packages
(system Pythons, containers, ``PYTHONPATH``-managed deployments), in the spirit of
``opentelemetry-instrument`` and ``ddtrace-run``: put a directory holding our
``sitecustomize.py`` first on ``PYTHONPATH`` (plus the directory this package is imported
from, so the child can import it) and ``exec`` the command. Child processes of the command
are not activated unless ``MLX_LM_PATCHES_CHILDREN=1``.
"""

import os
import sys
from pathlib import Path

USAGE = "usage: mlx-lm-patches-run COMMAND [ARGS...]   e.g. mlx-lm-patches-run mlx_lm.server --model PATH"


def environment(base=None) -> dict:
    environ = dict(os.environ if base is None else base)
    package = Path(__file__).resolve().parent.parent
    package_parent = str(package.parent)
    site_dir = str(package / "_sitecustomize")
    parts = [site_dir, package_parent] + [
        p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (site_dir, package_parent)
    ]
    environ["PYTHONPATH"] = os.pathsep.join(parts)
    return environ


def console_main(name):
    """The ``main`` of mlx-lm's command module ``name`` (``mlx_lm.generate``, ``mlx_lm.server``,
    ...) imported the usual way, or ``None`` for any other module.

    ``python -m mlx_lm.generate`` (and ``runpy``) would execute a *second* copy of the module as
    ``__main__``, beside the ``mlx_lm.generate`` that the patches fix: the copy runs unpatched.
    mlx-lm's console scripts call ``main()`` of the imported module; so do we."""
    if not (name.startswith("mlx_lm.") and name.count(".") == 1):
        return None
    import importlib

    main = getattr(importlib.import_module(name), "main", None)
    return main if callable(main) else None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write(USAGE + "\n")
        return 0 if argv else 2
    try:
        os.execvpe(argv[0], argv, environment())
    except OSError as exc:
        sys.stderr.write(f"mlx-lm-patches-run: cannot run {argv[0]!r}: {exc.strerror}\n")
        return 127


if __name__ == "__main__":
    sys.exit(main())

"""sitecustomize used by ``mlx-lm-patches-run`` (not installed into site-packages).

The launcher puts this directory first on ``PYTHONPATH``. At interpreter start we arm the same
bootstrap as the ``.pth`` file, remove this directory from ``PYTHONPATH`` in the environment (so
child processes are not activated unless ``MLX_LM_PATCHES_CHILDREN=1``), then import the user's
own ``sitecustomize``, if there is one further along ``sys.path``. Never raises.
"""


def _run():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        try:  # the launcher put the package's folder on PYTHONPATH
            from mlx_lm_patches.engine import env

            children = env.setting(env.CHILDREN)
        except ImportError:
            children = False
        if not children:
            parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and os.path.abspath(p) != here]
            if parts:
                os.environ["PYTHONPATH"] = os.pathsep.join(parts)
            else:
                os.environ.pop("PYTHONPATH", None)
        try:
            import _mlx_lm_patches_boot as boot
        except ImportError:  # a source checkout: the wheel installs it top-level
            import importlib.util

            path = os.path.join(os.path.dirname(here), "_activation", "_mlx_lm_patches_boot.py")
            spec = importlib.util.spec_from_file_location("_mlx_lm_patches_boot", path)
            boot = importlib.util.module_from_spec(spec)
            sys.modules["_mlx_lm_patches_boot"] = boot
            spec.loader.exec_module(boot)
        boot.arm("sitecustomize")
    except Exception as exc:
        sys.stderr.write(f"mlx-lm-patches: sitecustomize activation failed: {exc!r}\n")

    # Chain to the user's own sitecustomize, if any.
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        import importlib

        try:
            importlib.import_module("sitecustomize")
        except ImportError as exc:
            if exc.name != "sitecustomize":
                raise
            if ours is not None:
                sys.modules["sitecustomize"] = ours
    except Exception as exc:
        sys.stderr.write(f"mlx-lm-patches: the user's sitecustomize failed: {exc!r}\n")
    finally:
        sys.path[:] = saved


_run()
del _run

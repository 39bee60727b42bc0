"""mlx-lm-patches: exact hybrid-model support for the installed mlx-lm, only where it is broken.

    import mlx_lm_patches
    mlx_lm_patches.apply()      # or rely on automatic activation (installed .pth)
    mlx_lm_patches.status()
    mlx_lm_patches.revert()

This module stays tiny: the interpreter-start bootstrap imports it, so everything else is
loaded lazily on first use of the public API.
"""

__version__ = "0.1.0"

__all__ = ["apply", "revert", "status", "PatchError", "PatchStatus", "State", "__version__"]


def __getattr__(name):
    if name in ("apply", "revert", "status", "PatchError", "PatchStatus", "State"):
        from mlx_lm_patches.engine import core as engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mlx_lm_patches' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

"""One module per patch, named after its id in compat_matrix.yaml (``-`` becomes ``_``).

What each module provides (``probe``, ``apply``, ``scenario``, and its docstring) is the patch
contract, written down in :mod:`mlx_lm_patches.engine.contract`.
"""

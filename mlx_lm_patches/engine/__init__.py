"""The engine: reads the matrix, decides per patch, applies and reverts, reports.

* ``env`` – every environment variable, parsed in one place;
* ``versions`` – installed versions from distribution metadata (mlx-lm is not imported);
* ``matrix`` – ``compat_matrix.yaml``: patch entries and tested versions;
* ``patching`` – the revertible operations a patch may perform (``Patcher``);
* ``contract`` – what a patch module provides, and the ``Outcome`` its scenario returns;
* ``core`` – the ``Engine``: decisions, post-import hooks, per-patch state, ``apply``/``revert``;
* ``check`` – the live demonstration (``python -m mlx_lm_patches check``);
* ``launcher`` – ``mlx-lm-patches-run``.

Importing this package imports nothing else: the interpreter-start bootstrap reaches ``env``
through it.
"""

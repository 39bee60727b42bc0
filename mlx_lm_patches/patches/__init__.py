"""One module per patch, named after its id in compat_matrix.yaml (``-`` becomes ``_``).

Each module has a docstring (the bug, the affected versions, upstream links, when the patch
can be retired) and defines:

* ``probe()`` – cheap and side-effect free; runs once the anchor module is imported. Returns a
  truthy value (a string: the evidence) when the bug is present, falsy when it is absent.
* ``apply(p)`` – installs the fix through the :class:`mlx_lm_patches.patching.Patcher` ``p``;
  the engine reverts it through the same record.
* ``scenario()`` – what a user does, on a tiny model: returns a
  :class:`mlx_lm_patches.scenarios.Outcome`; ``ok`` when mlx-lm behaves correctly. The ``check``
  command runs it without and with the patch; the tests run it per mlx-lm release.
"""

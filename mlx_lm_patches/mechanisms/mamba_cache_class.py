"""The ``MambaCache`` class that ``mamba-cache-compat`` puts back where mlx-lm removed it (0.30.6+):
its mark, so other patches tell it from a class mlx-lm defines itself."""

RESTORED = "_mlx_lm_patches_restored"


def mark_restored(cls) -> None:
    setattr(cls, RESTORED, True)


def restored(cls) -> bool:
    """``cls`` is the ``MambaCache`` mamba-cache-compat put back (not one mlx-lm defines)."""
    return bool(vars(cls).get(RESTORED))

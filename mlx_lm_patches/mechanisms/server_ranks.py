"""The ranks of a distributed ``mlx_lm.server``: their group, and the mark on an error they agreed on.

``distributed-request-agreement`` marks an error every rank raised together for one request
(:data:`AGREED`); ``distributed-generation-death`` ends a rank on an error that lacks the mark.
"""

AGREED = "_mlx_lm_patches_agreed"  # attribute set on an error every rank raised together for the same request


def group():
    """The distributed group of this process if it has more than one rank, else ``None``."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        return None
    found = mx.distributed.init()
    return found if found.size() > 1 else None


def agreed(error) -> bool:
    """Whether every rank raised ``error`` together (it carries the mark)."""
    return bool(getattr(error, AGREED, False))


def mark_agreed(error) -> None:
    setattr(error, AGREED, True)

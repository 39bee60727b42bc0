"""When prefix checkpoints are kept: the per-sequence bound and whether prompt-cache stores exist."""


_lru_seen = False  # an LRUPromptCache was created in this process


def max_checkpoints(environ=None) -> int:
    """``MLX_LM_PATCHES_PREFIX_CHECKPOINTS``: most kept states per sequence (0 turns it off)."""
    from mlx_lm_patches.engine.env import PREFIX_CHECKPOINTS, setting

    return setting(PREFIX_CHECKPOINTS, environ)


def note_prompt_cache_created() -> None:
    global _lru_seen
    _lru_seen = True


def keeping() -> bool:
    """Whether a prefill into a prompt cache the caller holds keeps states at the ends of its
    passes (no extra cuts, so the passes are mlx-lm's own): unless
    ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``. Such a cache may be stored in a prompt-cache store
    later; it carries at most that many states."""
    return max_checkpoints() > 0


def capturing() -> bool:
    """Whether prefills also cut passes at powers of two, and ``BatchGenerator`` prefills hybrid
    rows one at a time to keep states: once an ``LRUPromptCache`` exists in the process (as in
    ``mlx_lm.server``), or whenever ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS`` is set explicitly;
    never with ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``."""
    import os

    from mlx_lm_patches.engine.env import PREFIX_CHECKPOINTS

    if max_checkpoints() == 0:
        return False
    return _lru_seen or bool(os.environ.get(PREFIX_CHECKPOINTS, "").strip())

"""When prefix checkpoints are kept: the per-sequence bound and whether prompt-cache stores exist."""


_lru_seen = False  # an LRUPromptCache was created in this process
_quantized_from = None  # smallest quantized_kv_start of a generation asked to quantize its KV caches


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


def note_kv_quantization(kv_bits, quantized_kv_start) -> None:
    """A generation in this process quantizes its KV caches (``kv_bits``) from
    ``quantized_kv_start`` tokens on (``mlx_lm.server --kv-bits``: every request)."""
    global _quantized_from
    if kv_bits is None or not isinstance(quantized_kv_start, int):
        return
    if _quantized_from is None or quantized_kv_start < _quantized_from:
        _quantized_from = quantized_kv_start


def quantized_prefill(length: int) -> bool:
    """Whether a prefill of ``length`` tokens may quantize its KV caches on the way (after a
    prefill chunk that reaches ``quantized_kv_start``): where it does depends on where the
    chunks end, so a prefill resumed from a restored state does not equal a cold one."""
    return _quantized_from is not None and length >= _quantized_from

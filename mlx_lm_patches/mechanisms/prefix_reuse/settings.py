"""When prefix checkpoints are kept: the per-sequence bound and whether prompt-cache stores exist.

What the process has seen (a prompt-cache store created, KV quantization asked for) is kept in
the ``memo`` of the patch that notes it (``prompt-cache-prefix-reuse``): status lists it and
``revert()`` forgets it, so a patch applied again starts as in a fresh process.
"""

STORE_SEEN = "an LRUPromptCache seen (prefills cut at powers of two)"
QUANTIZED_FROM = "the smallest quantized_kv_start asked for (restores that would quantize declined)"


def max_checkpoints(environ=None) -> int:
    """``MLX_LM_PATCHES_PREFIX_CHECKPOINTS``: most kept states per sequence (0 turns it off)."""
    from mlx_lm_patches.engine.env import PREFIX_CHECKPOINTS, setting

    return setting(PREFIX_CHECKPOINTS, environ)


def note_prompt_cache_created(memo: dict) -> None:
    memo[STORE_SEEN] = True


def keeping() -> bool:
    """Whether a prefill into a prompt cache the caller holds keeps states at the ends of its
    passes (no extra cuts, so the passes are mlx-lm's own): unless
    ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``. Such a cache may be stored in a prompt-cache store
    later; it carries at most that many states."""
    return max_checkpoints() > 0


def capturing(memo: dict) -> bool:
    """Whether prefills also cut passes at powers of two, and ``BatchGenerator`` prefills hybrid
    rows one at a time to keep states: once an ``LRUPromptCache`` exists in the process (as in
    ``mlx_lm.server``; noted in ``memo``), or whenever ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS`` is
    set explicitly (a malformed value is the default, not a setting); never with
    ``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``."""
    from mlx_lm_patches.engine.env import PREFIX_CHECKPOINTS, given

    if max_checkpoints() == 0:
        return False
    return bool(memo.get(STORE_SEEN)) or given(PREFIX_CHECKPOINTS)


def note_kv_quantization(memo: dict, kv_bits, quantized_kv_start) -> None:
    """A generation in this process quantizes its KV caches (``kv_bits``) from
    ``quantized_kv_start`` tokens on (``mlx_lm.server --kv-bits``: every request)."""
    if kv_bits is None or not isinstance(quantized_kv_start, int):
        return
    known = memo.get(QUANTIZED_FROM)
    if known is None or quantized_kv_start < known:
        memo[QUANTIZED_FROM] = quantized_kv_start


def quantized_prefill(memo: dict, length: int) -> bool:
    """Whether a prefill of ``length`` tokens may quantize its KV caches on the way (after a
    prefill chunk that reaches ``quantized_kv_start``): where it does depends on where the
    chunks end, so a prefill resumed from a restored state does not equal a cold one."""
    start = memo.get(QUANTIZED_FROM)
    return start is not None and length >= start

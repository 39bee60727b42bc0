"""Exact prefix reuse for hybrid models: recurrent states kept at positions of the prefill.

An attention cache (``KVCache``) holding tokens ``0..n`` can be cut back to any shorter prefix.
A recurrent cache (``ArraysCache``) holds one state, the one after *all* its tokens: the state
after a shorter prefix is gone unless it was kept. So a cached prompt that a new request
diverges from is useless to a hybrid model unless the recurrent states at some earlier positions
were kept when it was computed. This module keeps them, and uses them only where they are exact.

Checkpoints
    Around the forward of every model with recurrent layers (:func:`recorded_forward`), a pass
    of one sequence into a cache list whose history is known keeps the recurrent states at its
    end by reference (mlx arrays are immutable and models replace their cache slots), whoever
    calls the model. Within :func:`cutting` (the prefill of ``generate_step`` and of
    ``BatchGenerator`` rows while a prompt-cache store exists) passes are also cut at powers of
    two (32, 64, 128, ...; at most one extra cut per doubling of the prompt). With prefill
    chunks of ``s`` tokens, a kept state lies at or before any position ``d`` at ``d - s`` or
    later, and with the cuts at least at ``d/2``; :func:`thin` keeps that property when it
    bounds the count (``MLX_LM_PATCHES_PREFIX_CHECKPOINTS``, default 8 per sequence).

Trails
    Each recurrent cache carries, per batch row, a :class:`Trail`: the first tokens the row has
    seen (a prefix of its content: tokens are only ever appended), the kept states of this layer
    at positions within them, and - while it is known - the exact slot objects after the last
    observed pass (so "this cache holds exactly these tokens" can be checked by identity: any
    forward pass replaces the slots). Trails ride along when mlx-lm merges, extends, filters,
    extracts or deep-copies caches, so they follow the rows through ``BatchGenerator``.

Use
    A kept state is used only for a token sequence that starts with the tokens it was computed
    from (checked token by token), together with attention caches cut back to exactly the same
    position; otherwise it is not used. Nothing is ever reset or approximated: a cache that
    cannot be restored exactly is simply not reused (the request is prefilled from an earlier
    exact state, or cold).
"""

from mlx_lm_patches.mechanisms.prefix_reuse.carry import (
    carry_extend, carry_extract, carry_filter, carry_merge, copy_row_trails)
from mlx_lm_patches.mechanisms.prefix_reuse.cuts import CHAIN_FLOOR, FIRST_CUT, cut_points, thin
from mlx_lm_patches.mechanisms.prefix_reuse.forward import arm, cutting, recorded_forward
from mlx_lm_patches.mechanisms.prefix_reuse.restore import (
    best_restore, common_prefix, holds_quantized_kv, mark_exact, restored_copy, settle)
from mlx_lm_patches.mechanisms.prefix_reuse.settings import (
    capturing, keeping, max_checkpoints, note_kv_quantization, note_prompt_cache_created, quantized_prefill)
from mlx_lm_patches.mechanisms.prefix_reuse.trails import (
    TokenLog, TokenStore, Trail, batch_size, checkpoints, exact_history, is_empty, known_log, retained_nbytes,
    row_trails, set_trails, trails)

__all__ = [
    "CHAIN_FLOOR", "FIRST_CUT", "TokenLog", "TokenStore", "Trail", "arm", "batch_size", "best_restore",
    "capturing", "carry_extend", "carry_extract", "carry_filter", "carry_merge", "checkpoints", "common_prefix",
    "copy_row_trails", "cut_points", "cutting", "exact_history", "holds_quantized_kv", "is_empty", "keeping",
    "known_log", "mark_exact", "max_checkpoints", "note_kv_quantization", "note_prompt_cache_created",
    "quantized_prefill", "recorded_forward", "restored_copy", "retained_nbytes", "row_trails", "set_trails",
    "settle", "thin", "trails",
]

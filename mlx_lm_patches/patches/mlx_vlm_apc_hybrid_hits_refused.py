"""mlx-vlm 0.5.0 - 0.6.3's automatic prefix cache with hybrid models: no hits (every prompt prefilled cold).

Bug
    mlx-vlm 0.5.0 - 0.6.3's ``BatchGenerator`` with an ``APCManager`` restores whole-prefix snapshots of
    Qwen3.5 hybrids (its "exact" mode), but a request prefilled on top of a restored snapshot
    can be answered wrong even alone: measured on 0.5.0, 0.6.0, 0.6.1 and 0.6.3, a request
    reusing a snapshot stored from a batched prefill (0.6.0, 0.6.1) or from the middle of a
    prompt (0.5.0, 0.6.3) differs from the same request without the cache; and on 0.5.0
    requests admitted together beside a hit raise in its mixed prefill (a broadcast error).

Fix
    ``BatchGenerator._build_mixed_prompt_batch`` returns ``None`` in the "exact" mode, whatever
    it is given: every request takes mlx-vlm's cold path (exact; no reuse for hybrid models).
    Shares its wrapper with ``mlx-vlm-apc-hybrid-batches-cold``.

Retire
    When mlx-vlm < 0.6.4 is no longer supported.

Metal
    Only the admission path differs; the prefill is mlx-vlm's own.
"""

from mlx_lm_patches.mechanisms.vlm_apc_admission import cold_admissions


def apply(p):
    p.wrap("mlx_vlm.generate:BatchGenerator._build_mixed_prompt_batch", cold_admissions(1))


def probe():
    """Evidence: a tiny Qwen3.5 whose requests beside cache hits (sent together, or alone on a
    snapshot stored from a batch) are answered differently from each without the cache (or
    raise)."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import apc_mixed_prefill_evidence

    return apc_mixed_prefill_evidence("qwen3_5")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5 with mlx-vlm's prefix cache: every request answered
    as without the cache (with the fix there is no hit)."""
    from mlx_lm_patches.selftest.vlm.prefix_cache import apc_scenario

    return apc_scenario("qwen3_5", require_hit=False)

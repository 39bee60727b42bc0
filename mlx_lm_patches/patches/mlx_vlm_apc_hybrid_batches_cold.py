"""mlx-vlm's automatic prefix cache with hybrid models: requests admitted together are prefilled cold.

Bug
    With an ``APCManager`` (its server: ``APC_ENABLED=1``), mlx-vlm's ``BatchGenerator`` keeps
    whole-prefix snapshots for models with recurrent layers (its "exact" mode: Qwen3.5 /
    Qwen3.5-MoE). When several queued requests are admitted together and one of them hits the
    cache, ``_build_mixed_prompt_batch`` prefills them in one right-padded "mixed" batch on top
    of the restored states. For Qwen3.5 that batch is wrong: its language model prefills the
    rows one by one and replaces the cache entries by merged ones that no longer carry the
    batch's right-padding record (``finalize`` then leaves the padding inside the attention
    caches, and later chunks fold it into the recurrent states), and on 0.6.x the first token
    of a row whose prompt ended in an earlier chunk is read from the wrong column. Concurrent
    requests - the warm one and the cold ones beside it - are answered wrong (silently;
    0.5.0 crashes on a broadcast instead). One request at a time the cache is exact.

Fix
    ``BatchGenerator._build_mixed_prompt_batch``: in the "exact" mode, two or more sequences
    admitted together are not looked up; the call returns ``None``, so mlx-vlm takes its own
    cold path (one left-padded prefill of the rows, whose prefixes it still stores for later
    hits). A request admitted alone keeps its cache hit. Exact; the price is no reuse for
    requests that arrive together.

Retire
    When mlx-vlm's mixed prefill keeps the padding record of hybrid caches (and, on 0.6.x,
    the logits of rows that end in an earlier chunk).

Metal
    Only the admission path differs; the prefill is mlx-vlm's own.
"""

from mlx_lm_patches.mechanisms.vlm_apc_admission import cold_admissions


def apply(p):
    # (from 0.6 mlx_vlm.generate forwards BatchGenerator from mlx_vlm.generate.ar: the class is wrapped)
    p.wrap("mlx_vlm.generate:BatchGenerator._build_mixed_prompt_batch", cold_admissions(2))


def probe():
    """Evidence: a tiny Qwen3.5 whose requests sent together beside a cache hit are answered
    differently from each alone (or raise)."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import apc_mixed_prefill_evidence

    return apc_mixed_prefill_evidence("qwen3_5")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5 with mlx-vlm's prefix cache: a prompt, then two
    requests sharing or extending it sent together, then an extension alone, each answered as
    without the cache (the last one a hit)."""
    from mlx_lm_patches.selftest.vlm.prefix_cache import apc_scenario

    return apc_scenario("qwen3_5")  # (needs hits-refused: where that applies, no hit: n/a)

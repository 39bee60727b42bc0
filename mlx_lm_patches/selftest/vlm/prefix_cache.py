"""The scenario of the ``mlx-vlm-apc-hybrid-*`` patches: mlx-vlm's automatic prefix cache on a
tiny Qwen3.5 (:func:`~mlx_lm_patches.mechanisms.probing.vlm_problems.apc_mixed_prefill_problem`).
"""

import importlib.util

from mlx_lm_patches.mechanisms.probing.tiny_vlm import available
from mlx_lm_patches.mechanisms.probing.vlm_problems import apc_mixed_prefill_problem
from mlx_lm_patches.selftest.vlm.api import takes_rows


def apc_scenario(model_type: str = "qwen3_5", require_hit: bool = True):
    """The scenario of the ``mlx-vlm-apc-hybrid-*`` patches: :func:`apc_mixed_prefill_problem`
    exact; ``require_hit``: a run without a cache hit shows nothing (not applicable), else it
    passes (no reuse is exact)."""
    from mlx_lm_patches.engine.contract import Outcome

    if not available(model_type):
        return Outcome.not_applicable(f"mlx-vlm with {model_type} is not installed")
    if importlib.util.find_spec("mlx_vlm.apc") is None or not takes_rows():
        return Outcome.not_applicable("this mlx-vlm has no prefix cache for its BatchGenerator")
    try:
        problem = apc_mixed_prefill_problem(model_type)
    except Exception as exc:
        return Outcome.failure(f"mlx-vlm {model_type} with its prefix cache", exc)
    if problem == "no hit" and require_hit:
        return Outcome.not_applicable(f"this mlx-vlm's prefix cache does not hit a {model_type} prompt here")
    if problem not in (None, "no hit"):
        return Outcome.failure(problem)
    return Outcome(True, f"mlx-vlm {model_type} with its prefix cache: requests sent together beside a hit, and a "
                         "later request alone, answered as without the cache"
                         + (" (no hit)" if problem == "no hit" else " (a hit)"))

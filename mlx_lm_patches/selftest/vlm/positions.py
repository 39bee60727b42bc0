"""The scenario of the ``mlx-vlm-*-prefill-positions`` patches
(:mod:`mlx_lm_patches.mechanisms.vlm_positions`).
"""

import importlib

from mlx_lm_patches.mechanisms.probing.tiny_vlm import available
from mlx_lm_patches.mechanisms.probing.vlm_problems import prefill_positions_problem
from mlx_lm_patches.selftest.vlm.api import takes_rows
from mlx_lm_patches.selftest.vlm.batching import scenario_outcome


def prefill_positions_scenario(module_name: str, model_type: str):
    """The scenario of the ``*-prefill-positions`` patches: ``model_type``'s language model (the
    module ``module_name``) prefilling a padded batch on mlx-vlm's caches without positions, and
    prefilled with handed positions, decodes as each row alone; and (where driven) rows inserted
    one by one into mlx-vlm's ``BatchGenerator`` equal each prompt alone."""
    from mlx_lm_patches.engine.contract import Outcome

    language_module = importlib.import_module(module_name) if available(model_type) else None
    if language_module is None:
        return Outcome.not_applicable(f"mlx-vlm with {model_type} is not installed")
    if not takes_rows():
        return Outcome.not_applicable("mlx-vlm < 0.5: its batching code is the *-batch-positions patches'")
    problem = prefill_positions_problem(language_module, model_type)
    if problem:
        return Outcome.failure(problem)
    outcome = scenario_outcome(model_type, only=("mlx-vlm",))
    if outcome.ok is False:
        return outcome
    details = ["language model: a padded batch prefilled without positions, and a row prefilled with "
               "handed positions, decode as each row alone"]
    details += outcome.details if outcome.ok else [f"mlx-vlm BatchGenerator not driven: {outcome.summary}"]
    return Outcome(True, f"mlx-vlm {model_type}: batched prefills place each row at its own positions", details)

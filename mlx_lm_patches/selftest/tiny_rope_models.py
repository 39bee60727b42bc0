"""Tiny random-weight models whose rotary frequencies depend on the sequence length, and the
batched-generation check they need.

The rotary classes listed in :mod:`mlx_lm_patches.mechanisms.rope_rows` switch frequencies once
``offset + L`` passes a threshold (``max_position_embeddings``, or
``original_max_position_embeddings`` for longrope). A tiny model only shows whether batching
gives each row its own frequencies if the rows straddle that threshold, so every config here sets
it low:

* ``THRESHOLD_IN_DECODE`` (12): prompts of 5, 9 and 13 tokens prefill below it (cold or continued
  from a cache of 3-6 tokens, so :func:`mlx_lm_patches.selftest.scenarios.batching_situations` applies
  unchanged), and the rows cross it at different decode steps.
* ``THRESHOLD_IN_PREFILL`` (8, internlm 3): the longer prompts cross it during the prefill, so a
  row prefilled padded to another row's length would get that length's frequencies.
  :func:`batching_check` compares with the reference that has the same forward passes: cold
  single-sequence decoding, or single-sequence decoding continued from the same prompt cache (a
  key keeps the frequencies it was rotated with, so a prompt cut differently decodes differently
  even alone).

``KINDS`` maps each patched rotary class to the model types that use it.
"""

from typing import Any, Dict, List, Optional, Tuple

from mlx_lm_patches.selftest import tiny_models
from mlx_lm_patches.engine.traceless import seeded
from mlx_lm_patches.mechanisms.probing.random_weights import randomize_parameters

THRESHOLD_IN_DECODE = 12
THRESHOLD_IN_PREFILL = 8
# internlm2/3 add the number of heads (x.shape[1] of (B, heads, L, D)), not L, to the offset:
# 4 query heads and 2 key heads with a threshold of 3 put the queries past it from the start
# and the keys past it from offset 2 on.
INTERNLM_THRESHOLD_IN_PREFILL = 3

_SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False}
DYNAMIC = {"type": "dynamic", "factor": 2.0}


def _internlm2(threshold):
    return dict(_SMALL, model_type="internlm2", bias=False, max_position_embeddings=threshold)


def _internlm3(threshold):
    return dict(_SMALL, model_type="internlm3", head_dim=16, qkv_bias=False, bias=False,
                max_position_embeddings=threshold)


def _phi3_longrope(threshold):
    return dict(_SMALL, model_type="phi3", max_position_embeddings=64,
                original_max_position_embeddings=threshold,
                rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                              "long_factor": [2.0, 1.5, 3.0, 1.0, 4.0, 2.5, 1.2, 5.0]})


def _dynamic(model_type, threshold):
    config = tiny_models.tiny_config(model_type)
    config.update(rope_scaling=dict(DYNAMIC), max_position_embeddings=threshold)
    return config


# patch id -> the model types (with a config builder taking the threshold) that use its class
KINDS = {
    "internlm2-batch-rope": [("internlm2", _internlm2)],
    "internlm3-batch-rope": [("internlm3", _internlm3)],
    "su-scaled-rope-batch": [("phi3", _phi3_longrope)],
    "dynamic-ntk-rope-batch": [(t, lambda threshold, t=t: _dynamic(t, threshold))
                               for t in ("llama", "qwen3_next", "falcon_h1")],
}


def configs(pid: str, where: str = "decode") -> List[Tuple[str, Dict[str, Any]]]:
    """``[(model_type, config)]`` for the models that use the rotary class patch ``pid`` fixes,
    with the threshold crossed in the decode (``where="decode"``) or in the prefill."""
    out = []
    for model_type, make in KINDS[pid]:
        if where == "decode":
            threshold = THRESHOLD_IN_DECODE
        elif model_type.startswith("internlm"):
            threshold = INTERNLM_THRESHOLD_IN_PREFILL
        else:
            threshold = THRESHOLD_IN_PREFILL
        out.append((model_type, make(threshold)))
    return out


def build(model_type: str, config: Dict[str, Any], seed: int = 1):
    """A random-weight model of ``model_type`` from ``config`` (float32, eval mode). Raises if
    the installed mlx-lm lacks the family or rejects the config (e.g. rope type ``dynamic``
    before 0.32.0)."""
    import mlx.core as mx

    model_cls, args_cls = tiny_models._model_classes(config, model_type)
    with seeded(seed):  # the caller's random stream is left where it was
        model = model_cls(args_cls.from_dict(dict(config)))
    randomize_parameters(model, model_type, seed, mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def buildable(pid: str, where: str = "decode", seed: int = 1):
    """``[(model_type, model)]`` for the configs of ``pid`` that build on the installed mlx-lm,
    and ``[(model_type, why)]`` for those that do not."""
    built, skipped = [], []
    for model_type, config in configs(pid, where):
        try:
            built.append((model_type, build(model_type, config, seed)))
        except Exception as exc:  # family missing, or the rope type unknown in this release
            skipped.append((model_type, f"{type(exc).__name__}: {exc}"))
    return built, skipped


def batching_check(model, model_type) -> Optional[str]:
    """Three prompts (5, 9, 13 tokens) decoded together by mlx-lm's ``BatchGenerator``: all at
    once, one inserted while the others decode, and continued from prompt caches holding their
    first 3/6/4 tokens - each row against single-sequence greedy decoding through the same forward
    passes. ``None`` if every row is exact, else what differs."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, first_problem, greedy, split_prefilled

    prompts = [prompt_tokens(n, seed=n) for n in (5, 9, 13)]
    splits = (3, 6, 4)
    cold = [greedy(model, p) for p in prompts]
    caches, rest = split_prefilled(model, prompts, splits)
    alone_caches, _ = split_prefilled(model, prompts, splits)
    continued = [greedy(model, r, prompt_cache=c) for r, c in zip(rest, alone_caches)]
    situations = {
        "different lengths": (lambda: batched_greedy(model, prompts), cold),
        "inserted while decoding": (lambda: batched_greedy(model, prompts[:2], late_prompts=prompts[2:]), cold),
        "pre-filled prompt caches": (lambda: batched_greedy(model, rest, caches=caches), continued),
    }
    return first_problem(model_type, situations)


def scenario_outcome(pid: str, label: str):
    """The scenario of the rotary patch ``pid``: its tiny models (threshold crossed in the prefill
    by the longer prompts and in the decode by the shorter ones) batched, each row equal to
    single-sequence decoding (:func:`batching_check`)."""
    from mlx_lm_patches.engine.contract import Outcome

    built, skipped = buildable(pid, "prefill")
    if not built:
        return Outcome.not_applicable(f"{label}: no model builds here ({skipped[0][0]}: {skipped[0][1]})")
    details = []
    for model_type, model in built:
        try:
            problem = batching_check(model, model_type)
        except Exception as exc:
            return Outcome.failure(f"{model_type} batched", exc)
        if problem:
            return Outcome.failure(problem)
        details.append(f"{model_type}: 3 situations x 3 prompts exact")
    return Outcome(True, f"{label}: batched rows get their own rotary frequencies; exact", details)

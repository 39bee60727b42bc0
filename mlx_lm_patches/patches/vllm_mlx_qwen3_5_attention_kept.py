"""vllm-mlx's vision engine keeps mlx-vlm's own Qwen3.5 attention.

Bug
    Every ``MLLMBatchGenerator`` vllm-mlx builds (its engine for vision-language checkpoints:
    Qwen3.5 / Qwen3.6 served with an mlx-vlm model) first calls
    ``vllm_mlx.patches.qwen3_5_mllm.patch_qwen35_attention_for_batching``, which replaces
    ``mlx_vlm.models.qwen3_5.language.Qwen3_5Attention.__call__`` for the whole process with a
    copy written against another mlx-vlm. On mlx-vlm 0.7.x that copy looks up a
    ``_target_verify_left_padded_attention`` helper the module does not have, so when the model
    marks a decode step of a left-padded batch (``mask="left_padded_decode"``: rows of different
    lengths merged for decoding) it attends over every cached position, the padding of the
    shorter rows included. mlx-vlm's own attention takes that mask to attend to each row's real
    tokens only. Requests of different lengths sent at once are silently wrong from their
    second token; the same prompt alone is right.

Fix
    Where the probe shows that vllm-mlx's replacement computes something other than mlx-vlm's own
    attention, ``patch_qwen35_attention_for_batching`` becomes a function that leaves mlx-vlm's
    attention in place and reports success (``True``, as vllm-mlx's does once applied): mlx-vlm's
    attention already takes per-row offsets and padding. vllm-mlx's replacements for other
    families are untouched.

Retire
    When vllm-mlx stops replacing the attention, or its replacement handles the left-padded
    decode of the installed mlx-vlm: the probe then reports it not needed.

Metal
    mlx-vlm's own attention runs, so on Metal its ragged decode kernel is used, as without
    vllm-mlx; nothing is bypassed.
"""

import sys

MODULE = "vllm_mlx.patches.qwen3_5_mllm"


def _keep_mlx_vlm_attention(wrapped, instance, args, kwargs):
    return True


def apply(p):
    from mlx_lm_patches.mechanisms.probing.vllm_mlx import LANGUAGE

    language = sys.modules.get(LANGUAGE)
    if language is not None and "_batch_patched" in vars(language.Qwen3_5Attention):
        raise RuntimeError("vllm-mlx already replaced mlx-vlm's Qwen3_5Attention.__call__ in this process: "
                           "apply mlx_lm_patches before vllm-mlx builds its MLLMBatchGenerator")
    p.wrap(f"{MODULE}:patch_qwen35_attention_for_batching", _keep_mlx_vlm_attention)


def probe():
    """Evidence that vllm-mlx's attention replacement, tried on a throwaway subclass, decodes a
    left-padded batch differently from mlx-vlm's own ``Qwen3_5Attention``."""
    from mlx_lm_patches.mechanisms.probing.tiny_vlm import available
    from mlx_lm_patches.mechanisms.probing.vllm_mlx import attention_replacement_problem
    from mlx_lm_patches.engine.contract import NotNeeded

    if not available("qwen3_5"):
        return NotNeeded("mlx-vlm's qwen3_5 is not installed: vllm-mlx's replacement has nothing to replace")
    return attention_replacement_problem(sys.modules[MODULE])


def scenario():
    """vllm-mlx's ``MLLMBatchGenerator`` on a tiny random-weight mlx-vlm Qwen3.5: text requests
    of 3, 17 and 9 tokens sent at once equal each prompt alone through mlx-vlm's
    ``generate_step``."""
    from mlx_lm_patches.selftest import vllm_mlx_engine

    return vllm_mlx_engine.scenario_outcome()

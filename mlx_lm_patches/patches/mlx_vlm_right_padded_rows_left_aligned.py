"""mlx-vlm 0.6.15 - 0.6.17's ``batch_generate``: image prompts padded on the right are told they are padded on the left.

Bug
    From 0.6.15 ``batch_generate`` (``_generate_batch``) builds its ``BatchGenerator`` with
    ``existing_left_padding``: each row's padding *count* from the attention mask, taken to be
    on the left. Text prompts are tokenized with ``padding_side="left"``, but a batch with
    images is tokenized by the processor, and mlx-vlm's own Qwen-VL processor (Qwen3.5,
    Qwen3.5-MoE, Qwen3-VL, Qwen3-VL-MoE) does not take ``padding_side``: its tokenizer pads on
    its own side, the right for Qwen's tokenizers unless their config says otherwise. The
    generator then masks a shorter row's first tokens (its image among them) as padding and
    reads its padding as prompt: each shorter image prompt of a batch is answered wrong
    (silently; measured on 0.6.17 for all four model types, exact with a left-padding tokenizer).

Fix
    Inside ``_generate_batch`` only, the mask ``prepare_inputs`` returned is kept, and when
    exactly those rows reach ``BatchGenerator.insert`` each row padded on the right has its
    padding moved before its real tokens, with the same reordering of every sequence-aligned
    tensor (embeddings, M-RoPE ``position_ids``, ...): the rows are what the generator is told.
    Rows already padded on the left are passed as they are; a mask row that is not one
    contiguous span is refused with an error. See ``mlx_lm_patches/mechanisms/vlm_padding.py``.

Retire
    With mlx-vlm 0.6.x (0.7 no longer has ``existing_left_padding``).

Metal
    Python-side bookkeeping (list reordering and one ``take`` per tensor); no kernel differs.
"""

import inspect
import sys

from mlx_lm_patches.mechanisms import vlm_padding

MODULE = "mlx_vlm.generate.ar"


def apply(p):
    p.wrap(f"{MODULE}:BatchGenerator.insert", vlm_padding.inserting_left_aligned)
    p.wrap(f"{MODULE}:_generate_batch", vlm_padding.within_generate_batch)
    p.wrap(f"{MODULE}:prepare_inputs", vlm_padding.recording_mask)


def probe():
    """Evidence that ``_generate_batch`` tells its generator the mask's padding counts as left
    padding and inserts the processor's rows as they are (``input_ids.tolist()``), whatever side
    they are padded on."""
    module = sys.modules[MODULE]
    if "existing_left_padding" not in inspect.signature(module.BatchGenerator.__init__).parameters:
        return None
    from mlx_lm_patches.engine import bytecode

    try:  # read from the code object, not the source (an install may ship bytecode only)
        found = bytecode.tokens(module._generate_batch)
    except (AttributeError, TypeError):
        return None
    ending = lambda suffix: lambda t: isinstance(t, str) and t.endswith(suffix)  # noqa: E731
    if not any(isinstance(t, str) and "existing_left_padding" in t for t in found) \
            or not bytecode.contains(found, [ending("input_ids"), "tolist"]) \
            or not bytecode.contains(found, [ending("mask"), "sum"]):
        return None
    return ("mlx_vlm's _generate_batch tells its BatchGenerator each row's padding count as left "
            "padding and inserts the processor's rows unchanged, whichever side they are padded on")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5 with image placeholder tokens and mlx-vlm's own
    processor over a locally built tokenizer that pads on the right: ``batch_generate`` of
    three image prompts (two of one image shape, of different lengths) and a text prompt
    answers each as ``mlx_vlm.generate`` answers it alone with its image."""
    from mlx_lm_patches.selftest.vlm.batch_generate import batch_generate_images_scenario

    return batch_generate_images_scenario("qwen3_5", "told")

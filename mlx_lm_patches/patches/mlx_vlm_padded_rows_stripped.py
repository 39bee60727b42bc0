"""mlx-vlm 0.5.0 - 0.6.14's ``batch_generate``: the processor's padding is no longer fed as prompt tokens.

Bug
    ``batch_generate`` (``_generate_batch``) tokenizes its prompts into one left-padded batch
    (``prepare_inputs``: ``input_ids``, ``attention_mask``), computes the batch's embeddings
    under that mask and inserts ``input_ids.tolist()`` - the padded rows - into its
    ``BatchGenerator`` with each row's embeddings of the padded width. The generator is never
    told the padding: every shorter row is prefilled with its padding as text, at positions
    counted from the padding, and decodes something else than the prompt alone (silently
    wrong from its first token; the longest row is right). Text and image prompts alike.

Fix
    Inside ``_generate_batch`` only, the mask ``prepare_inputs`` returned is kept, and when
    exactly those rows reach ``BatchGenerator.insert`` each is cut to its real tokens, with the
    matching columns of every sequence-aligned tensor (embeddings, ``position_ids``, ...) and
    the ``rope_deltas`` its own positions imply - what mlx-vlm 0.7 does (plus
    ``mlx-vlm-unpadded-rope-deltas``). The generator then pads and masks the rows itself, as it
    does for rows inserted one by one. A mask that is not one contiguous span per row is
    refused with an error. See ``mlx_lm_patches/mechanisms/vlm_padding.py``.

Retire
    When mlx-vlm < 0.6.15 is no longer supported.

Metal
    Python-side bookkeeping (list slicing and array views); no kernel differs.
"""

import importlib
import inspect
import sys

from mlx_lm_patches.mechanisms import vlm_padding

# mlx-vlm 0.5.x: one module; 0.6.x: a package whose ``ar`` module holds the generator.
LAYOUTS = ("mlx_vlm.generate", "mlx_vlm.generate.ar")


def apply(p):
    p.wrap("mlx_vlm.generate:BatchGenerator.insert", vlm_padding.inserting_unpadded)
    for module in LAYOUTS:
        p.wrap_if_present(f"{module}:_generate_batch", vlm_padding.within_generate_batch)
        p.wrap_if_present(f"{module}:prepare_inputs", vlm_padding.recording_mask)


def _generation_module():
    generator = importlib.import_module("mlx_vlm.generate").BatchGenerator
    return sys.modules[generator.__module__]


def probe():
    """Evidence that ``_generate_batch`` inserts its padded rows as prompts: its generator's
    ``insert`` takes no attention mask, the generator cannot be told the padding
    (``existing_left_padding``), and ``_generate_batch`` inserts ``input_ids.tolist()``."""
    module = _generation_module()
    generate_batch = getattr(module, "_generate_batch", None)
    if generate_batch is None:
        return None
    if "attention_mask" in inspect.signature(module.BatchGenerator.insert).parameters:
        return None
    if "existing_left_padding" in inspect.signature(module.BatchGenerator.__init__).parameters:
        return None
    from mlx_lm_patches.engine import bytecode

    try:  # read from the code object, not the source (an install may ship bytecode only)
        found = bytecode.tokens(generate_batch)
    except (AttributeError, TypeError):
        return None
    if not bytecode.contains(found, [lambda t: isinstance(t, str) and t.endswith("input_ids"), "tolist"]):
        return None
    return ("mlx_vlm's _generate_batch inserts input_ids.tolist() (the left-padded rows) into a "
            "BatchGenerator that is neither given the attention mask nor told the padding")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5 and a processor from a locally built tokenizer:
    ``batch_generate`` of three text prompts of different lengths answers each as
    ``mlx_vlm.generate`` answers it alone."""
    from mlx_lm_patches.selftest.vlm.batch_generate import batch_generate_texts_scenario

    return batch_generate_texts_scenario("qwen3_5", "inserted")

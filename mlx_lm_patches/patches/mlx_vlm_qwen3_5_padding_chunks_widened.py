"""mlx-vlm 0.6.0 - 0.6.4's Qwen3.5: a batched prefill chunk that is only padding for a row no longer crashes.

Bug
    mlx-vlm's ``BatchGenerator`` prefills a batch of prompts left-padded to one width, in chunks
    of ``prefill_step_size`` columns (2048 by default; ``PromptProcessingBatch.prompt_step``).
    On 0.6.0 - 0.6.4 Qwen3.5's language model (``Qwen3_5Model``, also Qwen3.5-MoE's) runs a
    padded chunk row by row, each row from its first real token; a chunk that holds only
    padding for a row leaves that row nothing to run, and the model raises ("[reshape] Cannot
    infer the shape of an empty array"). So any batch whose longest prompt is longer than a
    shorter one by at least a chunk - a short chat beside a long document, through
    ``mlx_vlm.batch_generate`` or its server - fails (loud; stock and with our other fixes, which
    insert rows unpadded so the generator pads them itself).

Fix
    ``PromptProcessingBatch.prompt_step`` of a Qwen3.5 batch is wrapped: when the chunk it is
    about to run would be padding only for some row, that one chunk is widened to reach every
    row's first real token (the generator's own chunking otherwise; later chunks hold no
    padding). When no chunk can (a row whose only real token is the last column, which
    ``prompt_step`` holds back), chunking is turned off for the rest of that batch: the
    generator's final pass runs it whole, as for a batch shorter than a chunk. With the
    automatic prefix cache (``APC_ENABLED=1``) a chunk also ends at each prefix snapshot; a
    snapshot inside some row's padding is not taken (that prefix is prefilled again when next
    asked for). The model then never sees a padding-only row, and computes what it computes
    for any other chunking. The cost is the memory of one wider first chunk for such batches.

Affected
    mlx-vlm 0.6.0 (first with the row-by-row prefill) - 0.6.4; 0.6.5 skips padding-only rows in
    the model itself. Read in 0.6.0, 0.6.3, 0.6.4, 0.6.5. Measured with tiny Qwen3.5 and
    Qwen3.5-MoE, prompts of 5/9/13 tokens inserted one by one with ``prefill_step_size=3``:
    ValueError stock on 0.6.4, equal to each prompt alone with the fix. Engines that call the
    language model with such chunks themselves still meet the stock crash.

Upstream
    https://github.com/Blaizzy/mlx-vlm/blob/v0.6.4/mlx_vlm/models/qwen3_5/language.py
    (``Qwen3_5Model.__call__``, the row loop); the skip added in
    https://github.com/Blaizzy/mlx-vlm/blob/v0.6.5/mlx_vlm/models/qwen3_5/language.py
    (``pad == h.shape[1]``).

Retire
    When mlx-vlm < 0.6.5 is no longer supported.

Metal
    Chunk boundaries only (one first chunk wider than ``prefill_step_size``); the same model
    forward and kernels.
"""

import inspect
import re
import sys

MODULE = "mlx_vlm.generate.ar"
LANGUAGE = "mlx_vlm.models.qwen3_5.language"


def _runs_rows_one_by_one(model) -> bool:
    """``model`` (the language model the generator drives) is one whose inner model prefills a
    padded chunk row by row (Qwen3.5, Qwen3.5-MoE)."""
    language = sys.modules.get(LANGUAGE)
    inner = getattr(model, "model", None)
    return language is not None and isinstance(inner, language.Qwen3_5Model)


def _widened_prompt_step(wrapped, instance, args, kwargs):
    if not instance.needs_processing() or not _runs_rows_one_by_one(instance.model):
        return wrapped(*args, **kwargs)
    done = instance._processed_prompt_columns
    padding = max(max(pad - done, 0) for pad in instance._left_padding_per_row)
    if not padding:
        return wrapped(*args, **kwargs)
    _skip_snapshots_before(instance, done + padding)
    step = instance.prefill_step_size
    width = instance._inputs_embeds.shape[1]  # columns left; prompt_step runs at most width - 1
    if padding < min(step or width, width - 1) or not instance.needs_processing():
        return wrapped(*args, **kwargs)  # every row has a real token in this chunk (or none runs)
    if padding + 1 <= width - 1:
        instance.prefill_step_size = padding + 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            instance.prefill_step_size = step
    instance.prefill_step_size = None  # the rest in the generator's final pass
    return 0


def _skip_snapshots_before(batch, column) -> None:
    """The automatic prefix cache's snapshots at columns up to ``column`` (inside some row's
    padding) are not taken: ``prompt_step`` ends a chunk at each, which would leave that row
    only padding. Those prefixes are then not reused later (prefilled again: exact)."""
    for row, meta in enumerate(getattr(batch, "_apc_meta", None) or ()):
        if meta is None:
            continue
        at = batch._apc_checkpoint_column_for_meta(row, meta)
        if at is not None and at <= column:
            meta["checkpoint_done"] = True


def apply(p):
    p.wrap(f"{MODULE}:PromptProcessingBatch.prompt_step", _widened_prompt_step)


def probe():
    """Evidence that Qwen3.5's model prefills padded chunks row by row without skipping a row
    that is only padding, and that the generator chunks a batch as this fix expects."""
    import importlib

    try:
        language = importlib.import_module(LANGUAGE)
        source = inspect.getsource(language.Qwen3_5Model.__call__)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if "_extract_row_cache" not in source or re.search(r"pad\s*==\s*h\.shape\[1\]", source):
        return None
    batch = getattr(sys.modules.get(MODULE), "PromptProcessingBatch", None)
    init = getattr(batch, "__init__", None)
    try:
        names = inspect.getsource(init) if init is not None else ""
    except (OSError, TypeError):
        names = ""
    if "_left_padding_per_row" not in names or not all(
            hasattr(batch, name) for name in ("prompt_step", "needs_processing", "_apc_checkpoint_column_for_meta")):
        return None
    return ("mlx_vlm's Qwen3_5Model runs a padded prefill chunk row by row from each row's first "
            "real token, with no case for a row the chunk holds only padding of")


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5: prompts of 5, 9 and 13 tokens inserted one by one
    into mlx-vlm's ``BatchGenerator`` with ``prefill_step_size=3`` (the first chunks are padding
    only for the shorter rows) equal each prompt alone."""
    from mlx_lm_patches.demos import tiny_vlm_models as vlm

    return vlm.scenario_outcome("qwen3_5", only=("mlx-vlm",), prefill_step_size=3)

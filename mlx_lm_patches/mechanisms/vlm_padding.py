"""The processor's padding in the rows mlx-vlm's ``batch_generate`` hands its generator.

mlx-vlm's ``batch_generate`` (``_generate_batch``) tokenizes its prompts into one padded batch
(``prepare_inputs``: ``input_ids`` and ``attention_mask``), computes the embeddings of that
batch and inserts its rows into a ``BatchGenerator``. The generator pads rows itself; rows that
still carry the processor's padding are taken as prompts of the padded width. Three wrappers
let the generator take each row as it is alone:

* :func:`within_generate_batch` (``_generate_batch``) opens a scope for one call, in a context
  variable (each thread and task has its own);
* :func:`recording_mask` (``prepare_inputs`` as ``_generate_batch`` looks it up) keeps the
  batch's ``input_ids`` and ``attention_mask`` in that scope;
* :func:`inserting_unpadded` (``BatchGenerator.insert``) takes the recorded batch, once: when
  the rows inserted are exactly its ``input_ids``, each row is cut to its real tokens
  (:func:`strip_padding`) before the stock ``insert`` runs.

Where the generator is told each row's padding and takes it to be on the left (mlx-vlm
0.6.15 - 0.6.17: ``existing_left_padding``), :func:`inserting_left_aligned` instead moves each
row's padding to its left (:func:`left_align`): the processor pads on its tokenizer's side.

Outside ``_generate_batch``, or for rows that are not the recorded batch, nothing changes.
"""

import contextvars

_SCOPE = contextvars.ContextVar("mlx_lm_patches_vlm_padded_batch", default=None)

# Per-row prompt tensors laid out along the prompt (axis 1; M-RoPE ``position_ids`` (3, 1, L):
# axis 2), as mlx-vlm's generators treat them; ``inputs_embeds`` among them.
SEQUENCE_ALIGNED = frozenset({
    "inputs_embeds", "attention_mask", "decoder_inputs_embeds", "deepstack_visual_embeds",
    "visual_pos_masks", "per_layer_inputs", "full_text_row_masked_out_mask", "position_ids",
    "pos_hw", "mm_token_type_ids", "token_type_ids",
})


class _PaddedBatch:
    """What ``prepare_inputs`` gave inside one ``_generate_batch`` call."""

    input_ids = None
    mask = None


class PaddingNotContiguous(ValueError):
    """A row of the attention mask is not one contiguous span of real tokens."""


def within_generate_batch(wrapped, instance, args, kwargs):
    token = _SCOPE.set(_PaddedBatch())
    try:
        return wrapped(*args, **kwargs)
    finally:
        _SCOPE.reset(token)


def recording_mask(wrapped, instance, args, kwargs):
    inputs = wrapped(*args, **kwargs)
    batch = _SCOPE.get()
    if batch is not None and hasattr(inputs, "get"):
        batch.input_ids, batch.mask = inputs.get("input_ids"), inputs.get("attention_mask")
    return inputs


def _sequence_axis(key, value, width):
    """The axis of ``value`` (one row's ``key`` tensor) that runs along the padded prompt, or None."""
    if key not in SEQUENCE_ALIGNED or value.ndim < 2:
        return None
    if key == "position_ids" and value.ndim == 3 and value.shape[0] == 3:
        return 2 if value.shape[2] == width else None
    return 1 if value.shape[1] == width else None


def _span(row_mask, index):
    real = [i for i, value in enumerate(row_mask) if value]
    if not real:
        raise PaddingNotContiguous(f"attention_mask row {index} has no prompt token")
    start, stop = real[0], real[-1] + 1
    if len(real) != stop - start:
        raise PaddingNotContiguous(
            f"attention_mask row {index} is not one contiguous span of prompt tokens: its padding "
            "cannot be stripped exactly (mlx-lm-patches refuses rather than decode it at wrong positions)")
    return start, stop


def strip_padding(rows, mask, prompt_kwargs):
    """``(rows, prompt_kwargs)`` without the padding ``mask`` (B, width) marks: each row cut to its
    real tokens, every sequence-aligned tensor of its kwargs cut alike, and its ``rope_deltas``
    the one its remaining ``position_ids`` imply (what ``get_rope_index`` gives the row alone).
    Unpadded rows and their kwargs are passed as they are; the caller's dictionaries are not
    changed."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.vlm_positions import own_rope_deltas

    width = len(rows[0])
    stripped_rows, stripped_kwargs = [], []
    for index, (ids, row_mask) in enumerate(zip(rows, mask.tolist())):
        kwargs = prompt_kwargs[index] if prompt_kwargs is not None else None
        start, stop = _span(row_mask, index)
        if (start, stop) == (0, width):
            stripped_rows.append(list(ids))
            stripped_kwargs.append(kwargs)
            continue
        stripped_rows.append(list(ids[start:stop]))
        if kwargs is None:
            stripped_kwargs.append(None)
            continue
        cut = {}
        for key, value in kwargs.items():
            axis = _sequence_axis(key, value, width) if isinstance(value, mx.array) else None
            if axis is not None:
                index_ = [slice(None)] * value.ndim
                index_[axis] = slice(start, stop)
                value = value[tuple(index_)]
            cut[key] = value
        deltas, positions = cut.get("rope_deltas"), cut.get("position_ids")
        if isinstance(deltas, mx.array) and isinstance(positions, mx.array) \
                and positions.shape[-1] == stop - start:
            cut["rope_deltas"] = own_rope_deltas(positions, stop - start, deltas)
        stripped_kwargs.append(cut)
    return stripped_rows, (stripped_kwargs if prompt_kwargs is not None else None)


def left_align(rows, mask, prompt_kwargs):
    """``(rows, prompt_kwargs)`` with each row's padding (where ``mask`` (B, width) is 0) moved
    before its real tokens, every sequence-aligned tensor of its kwargs reordered alike: a row
    padded on the right becomes the left-padded row a generator told ``width - real length`` of
    left padding expects (its padding masked, its real tokens at the end). Rows already padded
    on the left, and their kwargs, are passed as they are; the caller's dictionaries are not
    changed."""
    import mlx.core as mx

    width = len(rows[0])
    aligned_rows, aligned_kwargs = [], []
    for index, (ids, row_mask) in enumerate(zip(rows, mask.tolist())):
        kwargs = prompt_kwargs[index] if prompt_kwargs is not None else None
        start, stop = _span(row_mask, index)
        if stop == width:
            aligned_rows.append(list(ids))
            aligned_kwargs.append(kwargs)
            continue
        order = list(range(start)) + list(range(stop, width)) + list(range(start, stop))
        aligned_rows.append([ids[i] for i in order])
        if kwargs is None:
            aligned_kwargs.append(None)
            continue
        moved = {}
        for key, value in kwargs.items():
            axis = _sequence_axis(key, value, width) if isinstance(value, mx.array) else None
            moved[key] = value if axis is None else mx.take(value, mx.array(order), axis=axis)
        aligned_kwargs.append(moved)
    return aligned_rows, (aligned_kwargs if prompt_kwargs is not None else None)


def _is_recorded_batch(prompts, batch) -> bool:
    mask, input_ids = batch.mask, batch.input_ids
    if mask is None or input_ids is None or getattr(mask, "ndim", 0) != 2:
        return False
    rows = [list(row) for row in prompts] if prompts is not None else None
    return rows is not None and tuple(mask.shape) == tuple(input_ids.shape) \
        and len(rows) == mask.shape[0] and rows == input_ids.tolist()


def _inserting(rearrange):
    """A wrapper of ``BatchGenerator.insert`` that hands the recorded batch's rows, once, through
    ``rearrange(rows, mask, prompt_kwargs)``."""

    def inserting(wrapped, instance, args, kwargs):
        from mlx_lm_patches.mechanisms.calls import bind_arguments

        batch = _SCOPE.get()
        if batch is None or batch.mask is None:
            return wrapped(*args, **kwargs)
        call = bind_arguments(wrapped, args, kwargs)
        prompts, prompt_kwargs = call.arguments.get("prompts"), call.arguments.get("prompt_kwargs")
        mask, recorded = batch.mask, _is_recorded_batch(prompts, batch)
        batch.mask = None  # taken once
        if recorded and (prompt_kwargs is None or len(prompt_kwargs) == len(prompts)):
            call.arguments["prompts"], call.arguments["prompt_kwargs"] = rearrange(
                [list(row) for row in prompts], mask, prompt_kwargs)
        return wrapped(*call.args, **call.kwargs)

    return inserting


inserting_unpadded = _inserting(strip_padding)
inserting_left_aligned = _inserting(left_align)

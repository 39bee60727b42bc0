"""mlx-vlm 0.6.15 - 0.6.17's ``batch_generate``: a row told of its left padding keeps a rotary offset of its own.

Bug
    From 0.6.15 ``batch_generate`` tokenizes the prompts into one left-padded batch, computes
    its embeddings with ``get_input_embeddings(input_ids, mask=attention_mask)`` and inserts the
    padded rows into its ``BatchGenerator`` built with ``existing_left_padding`` (each row's
    padding, from the mask), so the padding is masked in the caches and a row's cache offset
    counts its real tokens only. For a text batch, Qwen-VL style models (Qwen3.5 /
    Qwen3.5-MoE, Qwen3-VL, ...) compute each row's ``rope_deltas`` as ``max(position) + 1 -
    padded width``, i.e. minus the row's padding: right only if the offset counted the padding.
    Decode positions are ``offset + rope_deltas``, so from its second token a shorter row
    decodes ``k`` positions behind itself (silently wrong: the same prompt alone, or in a batch
    of equal lengths, decodes differently).

Fix
    When a ``BatchGenerator`` told ``existing_left_padding`` is given those rows, each padded
    row's ``rope_deltas`` becomes the one its real tokens imply, ``max(position over the real
    tokens) + 1 - real length`` (text rows: 0; image rows: the shift their image positions
    need), i.e. the next position after the row's last real token - what the row alone gets.
    The caller's dictionaries are not changed; rows without padding, or without
    ``position_ids``/``rope_deltas``, are passed as they are.

Retire
    With mlx-vlm 0.6.x (0.7 no longer has ``existing_left_padding``).

Metal
    Python-side bookkeeping of one small array per row; no kernel differs.
"""

import sys

MODULE = "mlx_vlm.generate.ar"


def _with_own_deltas(prompts, prompt_kwargs, padding):
    """Copies of ``prompt_kwargs`` whose padded rows carry their own ``rope_deltas``."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.vlm_positions import own_rope_deltas

    rows = []
    for ids, kwargs, pad in zip(prompts, prompt_kwargs, padding):
        deltas, positions = kwargs.get("rope_deltas"), kwargs.get("position_ids")
        pad = int(pad)
        if pad > 0 and isinstance(deltas, mx.array) and isinstance(positions, mx.array) \
                and positions.shape[-1] == len(ids) > pad:
            kwargs = dict(kwargs, rope_deltas=own_rope_deltas(positions[..., pad:], len(ids) - pad, deltas))
        rows.append(kwargs)
    return rows


def _insert_with_own_deltas(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    call = bind_arguments(wrapped, args, kwargs)
    padding = getattr(instance, "_existing_left_padding", None)
    prompts, prompt_kwargs = call.arguments.get("prompts"), call.arguments.get("prompt_kwargs")
    if padding is not None and prompt_kwargs is not None and len(padding) == len(prompts) == len(prompt_kwargs):
        call.arguments["prompt_kwargs"] = _with_own_deltas(prompts, prompt_kwargs, padding)
    return wrapped(*call.args, **call.kwargs)


def apply(p):
    p.wrap(f"{MODULE}:BatchGenerator.insert", _insert_with_own_deltas)


def probe():
    """Evidence that ``BatchGenerator.insert`` on a generator told ``existing_left_padding``
    keeps a padded row's ``rope_deltas`` of the padded width (two rows, one left-padded by 1,
    positions as ``get_rope_index`` gives them under the mask)."""
    from mlx_lm_patches.mechanisms.probing.vlm_problems import left_padding_deltas_problem

    return left_padding_deltas_problem(sys.modules[MODULE])


def scenario():
    """A tiny random-weight mlx-vlm Qwen3.5: prompts of 5, 9 and 13 tokens fed to mlx-vlm's
    ``BatchGenerator`` as ``batch_generate`` feeds them (one padded batch, embeddings under its
    mask, the generator told each row's padding) equal each prompt alone through mlx-vlm's
    ``generate_step``."""
    from mlx_lm_patches.selftest.vlm.batch_generate import batch_generate_scenario

    return batch_generate_scenario("qwen3_5", "told")

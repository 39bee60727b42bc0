"""What the vllm-mlx patches' probes look for, on a tiny mlx-vlm Qwen3.5
(:mod:`~mlx_lm_patches.mechanisms.probing.tiny_vlm`): each ``*_problem`` returns evidence of a
bug (a string naming it) or ``None``.

Importing this module imports neither vllm-mlx nor mlx-vlm.
"""

import importlib
from typing import Optional

from mlx_lm_patches.mechanisms.probing import tiny_vlm as vlm

LANGUAGE = "mlx_vlm.models.qwen3_5.language"


def attention_replacement_problem(vllm_patch_module) -> Optional[str]:
    """Evidence that vllm-mlx's ``patch_qwen35_attention_for_batching`` would change what mlx-vlm's
    ``Qwen3_5Attention`` computes for a left-padded batch: the replacement is applied to a
    throwaway subclass (mlx-vlm's class untouched), and one decode step of two rows, one with
    two tokens of left padding, is run through both on identical caches. ``None`` where the
    outputs agree (the replacement is harmless on this mlx-vlm)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    language = importlib.import_module(LANGUAGE)
    own = language.Qwen3_5Attention
    if "_batch_patched" in vars(own):
        return ("vllm-mlx already replaced mlx-vlm's Qwen3_5Attention.__call__ in this process "
                "(its generator was built before this patch was applied)")
    replaced = type(own.__name__, (own,), {"__module__": own.__module__})
    language.Qwen3_5Attention = replaced
    try:
        vllm_patch_module.patch_qwen35_attention_for_batching()
    finally:
        language.Qwen3_5Attention = own
    if "__call__" not in vars(replaced):
        return None  # this vllm-mlx no longer replaces the attention

    model = vlm.build("qwen3_5")
    attention = next(layer.self_attn for layer in model.language_model.model.layers
                     if hasattr(layer, "self_attn"))
    hidden = attention.q_proj.weight.shape[1]
    prompt_key, step_key = mx.random.split(mx.random.key(3))
    prompt = mx.random.normal((2, 3, hidden), key=prompt_key)
    step = mx.random.normal((2, 1, hidden), key=step_key)

    def decode(call):
        cache = BatchKVCache([2, 0])
        own.__call__(attention, prompt, mask=None, cache=cache)  # same prefill for both
        cache._qwen3_5_decode_left_padding = [2, 0]  # as mlx-vlm's model marks a padded decode
        return call(attention, step, mask="left_padded_decode", cache=cache)

    expected, got = decode(own.__call__), decode(replaced.__call__)
    gap = mx.abs(expected - got).max().item()
    if gap > 1e-5:
        return (f"vllm-mlx's replacement of mlx-vlm's Qwen3_5Attention.__call__ decodes a row with two "
                f"tokens of left padding differently from mlx-vlm's own attention (max |diff| {gap:.3g})")
    return None


def write_mtp_sidecar(folder, model_type: str = "qwen3_5", seed: int = 7):
    """vllm-mlx's ``model-mtp.safetensors`` for a tiny mlx-vlm folder
    (:func:`~mlx_lm_patches.mechanisms.probing.tiny_vlm.write_model_folder`): a Qwen3.5 MTP
    head (built by this package's head builder over mlx-lm's model of the same text config: the
    names vllm-mlx's ``inject_mtp_support`` loads) with random float32 weights under ``mtp.``,
    and ``text_config.mtp_num_hidden_layers = 1`` in ``config.json``."""
    import json
    import pathlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_lm_patches.mechanisms.probing.random_weights import random_like
    from mlx_lm_patches.mechanisms.mtp.heads import build

    folder = pathlib.Path(folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    family = importlib.import_module(f"mlx_lm.models.{model_type}")
    head = build(family.Model(family.ModelArgs.from_dict(config)), 1, config)
    weights = random_like(dict(tree_flatten(head.parameters())), seed=seed)
    mx.save_safetensors(str(folder / "model-mtp.safetensors"),
                        {f"mtp.{k}": v.astype(mx.float32) for k, v in weights.items()})
    return config


def mtp_forward_problem(inject_module) -> Optional[str]:
    """Evidence that vllm-mlx's ``inject_mtp_support`` (``inject_module``) makes a tiny mlx-vlm
    Qwen3.5's language model ignore the embeddings it is handed (how mlx-vlm passes image
    features): after the injection, a call given ``inputs_embeds`` other than the tokens' own
    embeddings returns other logits than mlx-vlm's own forward. ``None`` where they agree."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache

    from mlx_lm_patches.engine.traceless import random_state_kept, scratch_folder

    # inject_mtp_support reads the head from disk: a private folder, removed afterwards; the
    # head it builds (and the one written) draw their initial weights from mlx's stream
    with scratch_folder() as root, random_state_kept():
        folder, model = vlm.write_model_folder(f"{root}/model", "qwen3_5")
        config = write_mtp_sidecar(folder)
        language_model = model.language_model
        own = type(language_model)
        tokens = mx.array([[5, 6, 7, 8]])
        embeddings = language_model.model.embed_tokens(tokens) * 2.0
        language_model._position_ids = language_model._rope_deltas = None
        expected = own.__call__(language_model, tokens, inputs_embeds=embeddings,
                                cache=make_prompt_cache(language_model)).logits
        if not inject_module.inject_mtp_support(model, folder, config):
            return None  # (this vllm-mlx injects nothing here: nothing to fix)
        language_model._position_ids = language_model._rope_deltas = None
        out = language_model(tokens, inputs_embeds=embeddings, cache=make_prompt_cache(language_model))
        got = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
        gap = mx.abs(expected - got).max().item()
    if gap > 1e-5:
        return (f"vllm-mlx's inject_mtp_support swaps mlx-vlm's Qwen3.5 language model for a forward "
                f"that ignores the inputs_embeds it is given (max |logit diff| {gap:.3g})")
    return None

"""The MTP head computes what its documented contract says, checked against an independent
reference: the fusion written out by hand (``W @ concat[rmsnorm(embed(x_{t+1})) * w_e,
rmsnorm(h_t) * w_h]``), then the head's layers run by *mlx-lm's own model* of the family - a
one-step model whose layers are the head's blocks (same tensors), whose input embeddings are the
fused vectors, whose final norm is the head's and whose output projection is the main model's.
``model.mtp_forward`` must give that model's logits (within the log-probability tolerance), for
every family whose head is kept. Float32 checkpoints written to disk, patches on."""

import importlib.util

import pytest

from mlx_lm_patches.mechanisms.probing.decoded import LOGPROB_TOLERANCE, prompt_tokens
from mlx_lm_patches.selftest.mtp_checkpoints import MTP_MODEL_TYPES, write_mtp_checkpoint


FAMILIES = [f for f in MTP_MODEL_TYPES
            if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]
EXTRA_LAYER = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "mimo")  # the head: one more decoder layer


def _rms(x, weight, eps):
    import mlx.core as mx

    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _one_step_model(model, config, head, fused):
    """mlx-lm's own model of ``model``'s family holding the head's blocks as its layers, the
    fused vectors as its first embedding rows, the head's final norm, the main output layer."""
    import copy

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_lm_patches.selftest.tiny_models import _model_classes

    config = copy.deepcopy(config)
    text = config.get("text_config", config)
    tokens = fused.shape[1]
    if model.model_type == "nemotron_h":
        config["hybrid_override_pattern"] = "".join(layer.block_type for layer in head.layers)
        config["num_hidden_layers"] = len(head.layers)
        prefix, embed, norm, lm_head = "backbone.", "backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head"
        blocks = {f"layers.{i}.{k}": v for i, layer in enumerate(head.layers)
                  for k, v in tree_flatten(layer.parameters())
                  if k.startswith(("norm.", "mixer."))}
        final_norm = head.layers[-1].final_layernorm.weight
        main_head = model.lm_head
    elif model.model_type == "exaone_moe":
        # the head's (dense) layer first, of the kind the config names; a second, sliding layer
        # that adds nothing (zero output projections) keeps "a layer slides", so RoPE is as in
        # the backbone
        kind = (config.get("mtp_layer_types") or ["full_attention"])[0]
        config.update(num_hidden_layers=2, layer_types=[kind, "sliding_attention"], is_moe_layer=[False, False])
        prefix, embed, norm, lm_head = "model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head"
        layer = dict(tree_flatten(head.layers[0].parameters()))
        blocks = {f"layers.0.{k}": v for k, v in layer.items()}
        blocks.update({f"layers.1.{k}": (mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v)
                       for k, v in layer.items()})
        final_norm = head.norm.weight
        main_head = model.lm_head
    elif model.model_type == "step3p5":
        # one layer of the MTP layer's kind and rotary factor (index num_hidden_layers of the
        # per-layer lists), dense; the head's own norm and output head
        depth = config["num_hidden_layers"]
        config.update(num_hidden_layers=1, layer_types=[config["layer_types"][depth]],
                      partial_rotary_factors=[config["partial_rotary_factors"][depth]], moe_layers_enum=None)
        config.pop("num_nextn_predict_layers", None)
        prefix, embed, norm, lm_head = "model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head"
        blocks = {f"layers.0.{k}": v for k, v in tree_flatten(head.layers[0].parameters())}
        final_norm = head.shared_head.norm.weight
        main_head = head.shared_head.output
    elif model.model_type == "mimo_v2_flash":
        # the head's (dense, sliding) layer first; a second, full-attention layer that adds nothing
        # (zero output projections): the family's model needs one of each kind
        config.update(num_hidden_layers=2, hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 0])
        prefix, embed, norm, lm_head = "model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head"
        layer = dict(tree_flatten(head.layers[0].parameters()))
        blocks = {f"layers.0.{k}": v for k, v in layer.items()}
        second = dict(tree_flatten(model.model.layers[0].parameters()))  # the backbone's dense full-attention layer
        blocks.update({f"layers.1.{k}": (mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v)
                       for k, v in second.items()})
        final_norm = head.final_layernorm.weight
        main_head = model.lm_head
    elif model.model_type == "bailing_moe_v3":
        # one layer: gated latent attention (the last of a group) with the sparse MoE
        config.update(num_hidden_layers=1, first_k_dense_replace=0, layer_group_size=1)
        prefix, embed, norm, lm_head = "model.", "model.word_embeddings.weight", "model.norm.weight", "lm_head"
        blocks = {f"layers.0.{k}": v for k, v in tree_flatten(head.layers[0].parameters())}
        final_norm = head.final_layernorm.weight
        main_head = model.lm_head
    elif model.model_type in ("longcat_flash", "longcat_flash_ngram"):
        # (LongCat-Flash-Lite: the same blocks in LongCat-Flash's model, which takes embeddings as rows)
        config = dict({k: v for k, v in config.items() if k not in ("ngram_vocab_size_ratio", "emb_neighbor_num",
                                                                    "emb_split_num")},
                      model_type="longcat_flash", attention_method="MLA", attention_bias=config.get("attention_bias", False))
        # the family's own two-attention block: its first attention and MLP the head's, the second
        # half and the shortcut MoE adding nothing (zero output projections; identity experts
        # never routed to)
        config["num_layers"] = 1
        prefix, embed, norm, lm_head = "model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head"
        layer = head.layers[0]
        ones = mx.ones((model.args.hidden_size,))
        blocks = {}
        for k, v in tree_flatten(layer.self_attn.parameters()):
            blocks[f"layers.0.self_attn.0.{k}"] = v
            blocks[f"layers.0.self_attn.1.{k}"] = mx.zeros_like(v) if k.startswith("o_proj.") else v
        for k, v in tree_flatten(layer.mlp.parameters()):
            blocks[f"layers.0.mlps.0.{k}"] = v
            blocks[f"layers.0.mlps.1.{k}"] = mx.zeros_like(v) if k.startswith("down_proj.") else v
        blocks.update({"layers.0.input_layernorm.0.weight": layer.input_layernorm.weight,
                       "layers.0.post_attention_layernorm.0.weight": layer.post_attention_layernorm.weight,
                       "layers.0.input_layernorm.1.weight": ones, "layers.0.post_attention_layernorm.1.weight": ones})
        for k, v in tree_flatten(model.model.layers[0].mlp.parameters()):
            if k.startswith("switch_mlp.down_proj."):
                v = mx.zeros_like(v)
            elif k == "router.e_score_correction_bias":
                v = mx.concatenate([mx.zeros((model.args.n_routed_experts,)),
                                    mx.full((v.shape[0] - model.args.n_routed_experts,), -10.0)])
            blocks[f"layers.0.mlp.{k}"] = v
        final_norm = head.norm.weight
        main_head = model.lm_head
    elif model.model_type in EXTRA_LAYER:
        config["num_hidden_layers"], config["first_k_dense_replace"] = 1, 0  # the head's (MoE) layer
        prefix, embed, norm, lm_head = "model.", "model.embed_tokens.weight", "model.norm.weight", "lm_head"
        blocks = {f"layers.0.{k}": v for k, v in tree_flatten(head.layers[0].parameters())}
        final_norm = (head.final_layernorm if model.model_type == "mimo" else head.shared_head.norm).weight
        main_head = model.lm_head
    else:
        text["num_hidden_layers"], text["full_attention_interval"] = 1, 1  # one full-attention layer
        inner = "model." if model.model_type == "qwen3_next" else "language_model.model."
        prefix, embed, norm = inner, f"{inner}embed_tokens.weight", f"{inner}norm.weight"
        lm_head = "lm_head" if model.model_type == "qwen3_next" else "language_model.lm_head"
        blocks = {f"layers.0.{k}": v for k, v in tree_flatten(head.layers[0].parameters())}
        final_norm = head.norm.weight
        main_head = model.lm_head if model.model_type == "qwen3_next" else model.language_model.lm_head
    model_class, args_class = _model_classes(config, config.get("model_type", model.model_type))
    reference = model_class(args_class.from_dict(config))
    table = mx.zeros((text["vocab_size"], fused.shape[-1]))
    table[:tokens] = fused[0]
    weights = {f"{prefix}{k}": v for k, v in blocks.items()}
    weights.update({embed: table, norm: final_norm, f"{lm_head}.weight": main_head.weight})
    reference.load_weights(list(weights.items()), strict=True)
    reference.eval()
    return reference


def _head_inputs(model):
    """The main model's post-norm hidden states over a 14-token sequence (all but the last
    position) and the tokens that follow each: what the head is run on."""
    import mlx.core as mx

    sequence = prompt_tokens(14, seed=11)
    model.make_draft_model()  # installs the hidden-state capture
    model(mx.array(sequence)[None])
    return model.hidden_states()["post"][:, :-1], mx.array(sequence[1:])[None]


def _ernie_block(config, block):
    """mlx-lm's own ERNIE decoder layer at index ``num_hidden_layers`` (dense) with ``block``'s
    weights."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import ernie4_5_moe

    args = ernie4_5_moe.ModelArgs.from_dict(config)
    layer = ernie4_5_moe.Ernie4_5_DecoderLayer(args, args.num_hidden_layers)
    layer.load_weights(list(tree_flatten(block.parameters())), strict=True)
    return layer


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_mtp_forward_is_the_documented_head(tmp_path, family):
    import json

    import mlx.core as mx

    from mlx_lm import load

    written = write_mtp_checkpoint(tmp_path, family, dtype="float32")
    model = load(str(written.folder))[0]
    config = json.loads((written.folder / "config.json").read_text())
    hidden, next_ids = _head_inputs(model)
    logits, _ = model.mtp_forward(hidden, next_ids, model.make_mtp_cache())

    # The documented names, read directly (not through mechanisms/mtp/families/).
    if family == "nemotron_h":
        first = model.mtp.layers[0]
        embedding_norm, hidden_norm, projection = first.enorm, first.hnorm, first.eh_proj
        embedded = model.backbone.embeddings(next_ids)
    elif family == "mimo":  # input_proj(concat[hidden_layernorm(h), token_layernorm(e)])
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.token_layernorm, head.hidden_layernorm, head.input_proj
        embedded = model.model.embed_tokens(next_ids)
    elif family == "ernie4_5_moe":  # mtp_linear_proj(concat[mtp_emb_norm(e), mtp_hidden_norm(h)])
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.mtp_emb_norm, head.mtp_hidden_norm, head.mtp_linear_proj
        embedded = model.model.embed_tokens(next_ids)
    elif family in EXTRA_LAYER:
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.enorm, head.hnorm, head.eh_proj
        embedded = model.model.embed_tokens(next_ids)
    elif family in ("mimo_v2_flash", "step3p5"):  # eh_proj(concat[enorm(e), hnorm(h)])
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.enorm, head.hnorm, head.eh_proj
        embedded = model.model.embed_tokens(next_ids)
    elif family == "longcat_flash":  # eh_proj(concat[enorm.m(e), hnorm.m(h)])
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.enorm, head.hnorm, head.eh_proj
        embedded = model.model.embed_tokens(next_ids)
    elif family == "longcat_flash_ngram":  # the same, the model's n-gram embedding over x_1.. (x_0 not in it)
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.enorm, head.hnorm, head.eh_proj
        embedded = model.model.ngram_embeddings(next_ids)
    elif family == "bailing_moe_v3":  # eh_proj(concat[enorm(e), hnorm(h)]), the model's word embeddings
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.enorm, head.hnorm, head.eh_proj
        embedded = model.model.word_embeddings(next_ids)
    elif family == "exaone_moe":  # fc(concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.fc
        embedded = model.model.embed_tokens(next_ids)
    else:
        head = model.mtp
        embedding_norm, hidden_norm, projection = head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.fc
        text = model if family == "qwen3_next" else model.language_model
        embedded = text.model.embed_tokens(next_ids)
    halves = [_rms(embedded, embedding_norm.weight, embedding_norm.eps), _rms(hidden, hidden_norm.weight, hidden_norm.eps)]
    fused = mx.concatenate(halves[::-1] if family == "mimo" else halves, axis=-1) @ projection.weight.T
    if family == "ernie4_5_moe":  # then the dense block, and the output head with no norm between
        expected = model.lm_head(_ernie_block(config, model.mtp.layers[0])(fused, "causal", None))
    else:
        reference = _one_step_model(model, config, model.mtp, fused)
        expected = reference(mx.arange(fused.shape[1])[None])
    worst = mx.abs(logits - expected).max().item()
    assert worst < LOGPROB_TOLERANCE, worst


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_mtp_forward_in_pieces_equals_one_pass(tmp_path, family):
    """The head run over a sequence in pieces through one cache (as the draft runs it: a
    catch-up, single steps, a trim and a rerun) gives the logits of one pass over it: what a
    head carries between calls (its KV cache; LongCat-Flash-Lite's n-gram context of the
    draft's tokens) follows every piece and every trim."""
    import mlx.core as mx

    from mlx_lm import load

    written = write_mtp_checkpoint(tmp_path, family, dtype="float32")
    model = load(str(written.folder))[0]
    hidden, next_ids = _head_inputs(model)
    whole, _ = model.mtp_forward(hidden, next_ids, model.make_mtp_cache())
    cache = model.make_mtp_cache()
    pieces = [model.mtp_forward(hidden[:, a:b], next_ids[:, a:b], cache)[0] for a, b in ((0, 5), (5, 6), (6, 7), (7, 10))]
    for layer_cache in cache:  # the last three positions taken back, then run again
        layer_cache.trim(3)
    pieces = pieces[:-1] + [model.mtp_forward(hidden[:, 7:13], next_ids[:, 7:13], cache)[0]]
    worst = mx.abs(mx.concatenate(pieces, axis=1) - whole).max().item()
    assert worst < LOGPROB_TOLERANCE, worst


@pytest.mark.skipif("exaone_moe" not in FAMILIES, reason="this mlx-lm has no exaone_moe")
def test_a_sliding_window_mtp_layer_attends_to_its_window(tmp_path):
    """K-EXAONE with a sliding-window MTP layer (``mtp_layer_types``) and a window of 4 over 13
    positions: the head (a plain cache and a window mask) equals mlx-lm's own model of the
    family with that layer as its sliding layer 0 - in one pass, and one position at a time
    through the same cache (where only the mask keeps the older keys out)."""
    import json

    import mlx.core as mx

    from mlx_lm import load

    written = write_mtp_checkpoint(tmp_path, "exaone_moe", dtype="float32")
    config_path = written.folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update(mtp_layer_types=["sliding_attention"], sliding_window=4)
    config_path.write_text(json.dumps(config))
    model = load(str(written.folder))[0]
    assert model.mtp is not None, model.mtp_status
    hidden, next_ids = _head_inputs(model)
    at_once, _ = model.mtp_forward(hidden, next_ids, model.make_mtp_cache())
    cache = model.make_mtp_cache()
    one_by_one = mx.concatenate([model.mtp_forward(hidden[:, t:t + 1], next_ids[:, t:t + 1], cache)[0]
                                 for t in range(next_ids.shape[1])], axis=1)

    head = model.mtp
    embedded = model.model.embed_tokens(next_ids)
    halves = [_rms(embedded, head.pre_fc_norm_embedding.weight, head.pre_fc_norm_embedding.eps),
              _rms(hidden, head.pre_fc_norm_hidden.weight, head.pre_fc_norm_hidden.eps)]
    fused = mx.concatenate(halves, axis=-1) @ head.fc.weight.T
    expected = _one_step_model(model, config, head, fused)(mx.arange(fused.shape[1])[None])
    for got in (at_once, one_by_one):
        worst = mx.abs(got - expected).max().item()
        assert worst < LOGPROB_TOLERANCE, worst

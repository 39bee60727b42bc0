"""Tiny random-weight mlx-lm models for tests and for the ``check`` CLI.

Every hybrid (recurrent + attention, or purely recurrent) model family that
some supported mlx-lm release ships gets a small config here: hidden size 64,
two to four layers laid out so that both recurrent layers (an ``ArraysCache``
entry, or the older ``MambaCache`` subclass) and attention layers appear, a
256-token vocabulary, a few heads and, for MoE families, four experts.  A
plain ``llama`` model is the dense control.

Models are built in memory from the config through mlx-lm's own
``ModelArgs.from_dict`` / ``Model`` classes, then every floating-point
parameter is overwritten with a deterministic pseudo-random value derived
from ``(seed, parameter path)``
(:mod:`mlx_lm_patches.mechanisms.probing.random_weights`).  Parameters with a special role get values
that make the recurrence stable but far from trivial: ``A_log`` and
``dt_bias`` give per-step decays between roughly 0.05 and 0.95, RG-LRU and
RWKV-7 mixing coefficients sit inside their useful ranges, norm weights stay
near their neutral value.  The recurrent state therefore matters to the
output (so tests of cache rollback are meaningful) and greedy decoding does
not collapse to a single token.

Only the standard library and ``mlx`` are imported here; ``mlx_lm`` is
imported inside the functions that need it, so importing this module is
cheap and works whatever mlx-lm release is installed.

Notes on individual families (release-specific mlx-lm bugs that the tiny
models expose are listed in ``KNOWN_ISSUES``):

* ``qwen3_5`` / ``qwen3_5_moe`` / ``kimi_k3`` / ``lfm2-vl`` nest the text
  model's settings under ``text_config``, as their Hugging Face configs do.
* ``bailing_moe_v3`` checkpoints call themselves ``bailing_hybrid`` and are
  told apart by ``architectures``; the tiny config uses the module name as
  ``model_type`` (``_get_classes`` resolves it directly) and also carries the
  ``architectures`` entry, so either route reaches the right module.
* ``longcat_flash_ngram`` keeps only the last few token ids in its
  ``ArraysCache`` (n-gram embedding context): no recurrence, but the cache
  still has to be rolled back with the attention caches.
* ``prism_hadamard_qwen35`` (0.32.2+) also returns ``ArraysCache`` entries but
  is left out: it is ``qwen3_5`` with 2-bit Hadamard-packed weights and needs
  a packed-module manifest, so it cannot hold random float weights.  Its
  cache behaviour is exactly that of ``qwen3_5``.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from typing import Any, Callable, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_patches.engine.traceless import seeded
from mlx_lm_patches.mechanisms.probing.random_weights import randomize_parameters

__all__ = [
    "HYBRID_MODEL_TYPES",
    "DENSE_MODEL_TYPE",
    "tiny_config",
    "available_model_types",
    "build_tiny_model",
    "cache_kinds",
    "cache_leaf_kinds",
    "cache_layout",
    "KNOWN_ISSUES",
]

# Every model_type (== module name under ``mlx_lm.models``) whose
# ``make_cache`` returns at least one ArraysCache-family entry in at least one
# supported mlx-lm release (0.28.4 ... 0.32.2).
HYBRID_MODEL_TYPES: Tuple[str, ...] = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "nemotron_h",
    "falcon_h1",
    "granitemoehybrid",
    "jamba",
    "kimi_linear",
    "kimi_k3",
    "lfm2",
    "lfm2_moe",
    "lfm2-vl",
    "mamba",
    "mamba2",
    "plamo2",
    "bailing_moe_linear",
    "bailing_hybrid",
    "bailing_moe_v3",
    "olmo_hybrid",
    "recurrent_gemma",
    "rwkv7",
    "baichuan_m1",
    "gear",
    "longcat_flash_ngram",
)

DENSE_MODEL_TYPE = "llama"

# Genuine mlx-lm bugs seen with these tiny models.  They are not worked
# around here; tests should avoid (or expect) them.
KNOWN_ISSUES: Dict[str, str] = {
    "falcon_h1": (
        "mlx-lm <= 0.31.3: Model.__call__ without a cache builds "
        "[(None, None) * n_layers] (one entry) instead of "
        "[(None, None)] * n_layers, so zip() runs only layer 0. Calls with "
        "a prompt cache are correct; fixed in 0.32.0."
    ),
}

# Sizes shared by the configs below.
_VOCAB = 256
_HIDDEN = 64
_FFN = 128
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_MAX_POS = 4096

# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------


def _qwen3_next_text(model_type: str, moe: bool) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 4,
        # layers 0, 2 are gated-delta (linear) layers, 1, 3 full attention
        "full_attention_interval": 2,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": _MAX_POS,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }
    if moe:
        cfg.update(
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "shared_expert_intermediate_size": 64,
                "moe_intermediate_size": 32,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
            }
        )
    return cfg


def _cfg_qwen3_next() -> Dict[str, Any]:
    cfg = _qwen3_next_text("qwen3_next", moe=True)
    cfg.update(
        {
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "rope_scaling": None,
        }
    )
    return cfg


def _qwen3_5_text(moe: bool) -> Dict[str, Any]:
    text = _qwen3_next_text("qwen3_5_moe_text" if moe else "qwen3_5_text", moe=moe)
    text.pop("mlp_only_layers", None)
    text["rope_parameters"] = {
        "type": "default",
        "mrope_section": [1, 1, 0],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    }
    return text


def _cfg_qwen3_5() -> Dict[str, Any]:
    return {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": _qwen3_5_text(moe=False),
    }


def _cfg_qwen3_5_moe() -> Dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": _qwen3_5_text(moe=True),
    }


def _cfg_nemotron_h() -> Dict[str, Any]:
    return {
        "model_type": "nemotron_h",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "max_position_embeddings": _MAX_POS,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "rms_norm_eps": 1e-5,  # required before 0.30.4
        "residual_in_fp32": False,  # required before 0.30.4
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, 1000.0],  # required before 0.30.6
        # M = mamba2 mixer, * = attention, - = MLP.  MoE blocks ("E") only
        # exist from 0.30.4 on, so they are left out to keep one config.
        "hybrid_override_pattern": "M*M-",
        "num_hidden_layers": 4,
    }


def _cfg_falcon_h1() -> Dict[str, Any]:
    # Every falcon_h1 layer runs attention and a mamba2 mixer in parallel
    # (cache entries are CacheList(ArraysCache, KVCache)).
    return {
        "model_type": "falcon_h1",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "max_position_embeddings": _MAX_POS,
        "rope_theta": 10000.0,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 1,
        "mamba_chunk_size": 16,
        "mamba_rms_norm": True,
        "tie_word_embeddings": False,
        # keep the muP multipliers neutral so random weights stay well scaled
        "embedding_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 1.0,
        "key_multiplier": 1.0,
        "ssm_in_multiplier": 1.0,
        "ssm_out_multiplier": 1.0,
        "mlp_multipliers": [1.0, 1.0],
        "ssm_multipliers": [1.0, 1.0, 1.0, 1.0, 1.0],
    }


def _cfg_granitemoehybrid() -> Dict[str, Any]:
    return {
        "model_type": "granitemoehybrid",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "max_position_embeddings": _MAX_POS,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "position_embedding_type": "rope",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "mamba_expand": 1,
        "tie_word_embeddings": True,
    }


def _cfg_jamba() -> Dict[str, Any]:
    return {
        "model_type": "jamba",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 4,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        # attention at layers 1, 3; MoE MLP at layers 1, 3
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
        "mamba_proj_bias": False,
        "mamba_conv_bias": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": _MAX_POS,
        "tie_word_embeddings": False,
    }


def _kimi_text(model_type: str) -> Dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _HEADS,
        "intermediate_size": _FFN,
        "head_dim": _HEAD_DIM,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        # 1-based: layers 0, 2 are KDA (linear) layers, 1, 3 MLA attention
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "model_max_length": _MAX_POS,
        "max_position_embeddings": _MAX_POS,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "tie_word_embeddings": False,
    }


def _cfg_kimi_linear() -> Dict[str, Any]:
    return _kimi_text("kimi_linear")


def _cfg_kimi_k3() -> Dict[str, Any]:
    text = _kimi_text("kimi_linear")
    text["hidden_act"] = "situ"
    return {"model_type": "kimi_k3", "text_config": text}


def _lfm2_common(model_type: str) -> Dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "max_position_embeddings": _MAX_POS,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "rope_theta": 1000000.0,
        "full_attn_idxs": [1, 3],
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    }


def _cfg_lfm2() -> Dict[str, Any]:
    cfg = _lfm2_common("lfm2")
    cfg.update(
        {
            "block_dim": _HIDDEN,
            "block_ff_dim": _FFN,
            "intermediate_size": _FFN,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True,
            "tie_word_embeddings": True,
        }
    )
    return cfg


def _cfg_lfm2_moe() -> Dict[str, Any]:
    cfg = _lfm2_common("lfm2_moe")
    cfg.update(
        {
            "intermediate_size": _FFN,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "use_expert_bias": True,
            "num_dense_layers": 1,
            "routed_scaling_factor": 1.0,
            "tie_word_embeddings": True,
        }
    )
    return cfg


def _cfg_lfm2_vl() -> Dict[str, Any]:
    text = _cfg_lfm2()
    return {"model_type": "lfm2-vl", "text_config": text}


def _cfg_mamba() -> Dict[str, Any]:
    return {
        "model_type": "mamba",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "state_size": 16,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
        "tie_word_embeddings": True,
    }


def _cfg_mamba2() -> Dict[str, Any]:
    return {
        "model_type": "mamba2",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, 1000.0],
        "time_step_rank": 8,
        "max_position_embeddings": _MAX_POS,
    }


def _cfg_plamo2() -> Dict[str, Any]:
    # mamba_step=2: layers 0, 2 are mamba, 1, 3 attention
    return {
        "model_type": "plamo2",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "hidden_size_per_head": _HEAD_DIM,
        "max_position_embeddings": _MAX_POS,
        "attention_window_size": _MAX_POS,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_num_heads": 4,
        "mamba_step": 2,
        "mamba_chunk_size": 16,
        "mamba_enabled": True,
        "intermediate_size": _FFN,
    }


def _bailing_common(model_type: str) -> Dict[str, Any]:
    # layer_group_size=2: layers 0, 2 linear attention, 1, 3 global attention
    return {
        "model_type": model_type,
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "max_position_embeddings": _MAX_POS,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _HEADS,
        "head_dim": _HEAD_DIM,
        "num_hidden_layers": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "first_k_dense_replace": 1,
        "layer_group_size": 2,
        "group_norm_size": 4,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
    }


def _cfg_bailing_moe_linear() -> Dict[str, Any]:
    cfg = _bailing_common("bailing_moe_linear")
    cfg.update(
        {
            "use_qk_norm": True,
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "partial_rotary_factor": 0.5,
        }
    )
    return cfg


def _cfg_bailing_hybrid() -> Dict[str, Any]:
    cfg = _bailing_common("bailing_hybrid")
    cfg.update(
        {
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "use_qk_norm": True,
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
        }
    )
    return cfg


def _cfg_bailing_moe_v3() -> Dict[str, Any]:
    cfg = _bailing_common("bailing_moe_v3")
    cfg.pop("group_norm_size")
    cfg.update(
        {
            "architectures": ["BailingMoeV3ForCausalLM"],
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "short_conv_kernel_size": 4,
            "kda_lower_bound": -5.0,
            "kda_safe_gate": True,
            "no_kda_lora": True,
        }
    )
    return cfg


def _cfg_olmo_hybrid() -> Dict[str, Any]:
    return {
        "model_type": "olmo_hybrid",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 4,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": _MAX_POS,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "layer_types": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
    }


def _cfg_recurrent_gemma() -> Dict[str, Any]:
    return {
        "model_type": "recurrent_gemma",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 3,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": 1,
        "attention_bias": False,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_window_size": 2048,
        "embeddings_scale_by_sqrt_dim": True,
        "block_types": ["recurrent", "attention", "recurrent"],
    }


def _cfg_rwkv7() -> Dict[str, Any]:
    return {
        "model_type": "rwkv7",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "norm_eps": 1e-5,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "a_low_rank_dim": 8,
        "v_low_rank_dim": 8,
        "gate_low_rank_dim": 16,
        "decay_low_rank_dim": 8,
        "tie_word_embeddings": False,
    }


def _cfg_baichuan_m1() -> Dict[str, Any]:
    # Each layer is CacheList(ArraysCache (last k/v for the 2-tap conv),
    # KVCache or RotatingKVCache).
    return {
        "model_type": "baichuan_m1",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "num_swa_attention_heads": _HEADS,
        "num_swa_key_value_heads": _KV_HEADS,
        "rope_theta": 10000.0,
        "sliding_window": 2048,
        "sliding_window_layers": [1],
        "conv_window": 2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


def _cfg_gear() -> Dict[str, Any]:
    return {
        "model_type": "gear",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 4,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "layer_types": [
            "conv_mixer",
            "sliding_attention",
            "conv_mixer",
            "full_attention",
        ],
        "sliding_window": 2048,
        "conv_L_cache": 3,
        "max_position_embeddings": _MAX_POS,
        "tie_word_embeddings": True,
    }


def _cfg_longcat_flash() -> Dict[str, Any]:
    cfg = {k: v for k, v in _cfg_longcat_flash_ngram().items()
           if k not in ("ngram_vocab_size_ratio", "emb_neighbor_num", "emb_split_num")}
    return dict(cfg, model_type="longcat_flash", attention_method="MLA", attention_bias=False)


def _cfg_longcat_flash_ngram() -> Dict[str, Any]:
    return {
        "model_type": "longcat_flash_ngram",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "ffn_hidden_size": _FFN,
        "expert_ffn_hidden_size": 32,
        "moe_topk": 2,
        "n_routed_experts": 4,
        "zero_expert_num": 1,
        "zero_expert_type": "identity",
        "num_layers": 2,
        "max_position_embeddings": _MAX_POS,
        "num_attention_heads": _HEADS,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        # 2 x (3 - 1) = 4 n-gram embedders of width 16, 1024-ish rows each
        "ngram_vocab_size_ratio": 4,
        "emb_neighbor_num": 3,
        "emb_split_num": 2,
    }


def _cfg_llama() -> Dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": _MAX_POS,
        "tie_word_embeddings": False,
    }


# DeepSeek-V3-layout MoE models (attention only; their MTP heads are what they are built for):
# three layers, not DeepSeek-V3's 61, the first dense, the others MoE; multi-head latent
# attention for deepseek_v3, deepseek_v32 (with its indexer) and glm4_moe_lite, grouped-query
# attention for glm4_moe.
_DEEPSEEK_MOE = {
    "vocab_size": _VOCAB,
    "hidden_size": _HIDDEN,
    "intermediate_size": _FFN,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": _HEADS,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": _MAX_POS,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
_MLA = {
    "num_key_value_heads": _HEADS,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


def _cfg_deepseek_v3() -> Dict[str, Any]:
    return dict(_DEEPSEEK_MOE, **_MLA, model_type="deepseek_v3", rms_norm_eps=1e-6)


def _cfg_deepseek_v32() -> Dict[str, Any]:
    # DeepSeek-V3.2's sparse attention: a small indexer; index_topk as the release's default
    # (every prompt here is shorter, so the attention sees every position, as V3.2's does then)
    return dict(_DEEPSEEK_MOE, **_MLA, model_type="deepseek_v32", rms_norm_eps=1e-6,
                index_n_heads=2, index_head_dim=16, index_topk=2048)


def _cfg_glm_moe_dsa() -> Dict[str, Any]:
    # GLM-5 (glm_moe_dsa): DeepSeek-V3.2's model (latent attention with its indexer) under GLM's
    # config names (RoPE settings in rope_parameters)
    config = dict(_DEEPSEEK_MOE, **_MLA, model_type="glm_moe_dsa", rms_norm_eps=1e-5,
                  index_n_heads=2, index_head_dim=16, index_topk=2048,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    for key in ("rope_theta", "rope_scaling"):
        config.pop(key)
    return config


def _cfg_glm4_moe_lite() -> Dict[str, Any]:
    return dict(_DEEPSEEK_MOE, **_MLA, model_type="glm4_moe_lite", rms_norm_eps=1e-5,
                partial_rotary_factor=1.0)


def _cfg_glm4_moe() -> Dict[str, Any]:
    return dict(_DEEPSEEK_MOE, model_type="glm4_moe", num_key_value_heads=_KV_HEADS, head_dim=_HEAD_DIM,
                rms_norm_eps=1e-5, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)


def _cfg_ernie4_5_moe() -> Dict[str, Any]:
    # ERNIE 4.5 MoE: three layers, the first dense, the others MoE (4 experts, 2 per token, one
    # shared); its MTP block is dense (the layer after the last, past moe_layer_end_index)
    return {"model_type": "ernie4_5_moe", "vocab_size": _VOCAB, "hidden_size": _HIDDEN,
            "intermediate_size": _FFN, "num_hidden_layers": 3, "num_attention_heads": _HEADS,
            "num_key_value_heads": _KV_HEADS, "head_dim": _HEAD_DIM, "max_position_embeddings": _MAX_POS,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_bias": False, "tie_word_embeddings": False,
            "moe_num_experts": 4, "moe_k": 2, "moe_layer_start_index": 1, "moe_intermediate_size": 32,
            "moe_num_shared_experts": 1, "moe_layer_interval": 1}


def _cfg_exaone_moe() -> Dict[str, Any]:
    # K-EXAONE's layout: sliding-window layers with RoPE, a full-attention layer without; the
    # first layer dense, then MoE (4 experts, 2 per token, one shared). The window is wider than
    # any sequence here (a rotating cache that has wrapped cannot be rolled back); the MTP layer
    # is a full-attention one
    return {"model_type": "exaone_moe", "vocab_size": _VOCAB, "hidden_size": _HIDDEN,
            "intermediate_size": _FFN, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": _HEADS, "num_key_value_heads": _KV_HEADS, "head_dim": _HEAD_DIM,
            "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "rms_norm_eps": 1e-5,
            "max_position_embeddings": _MAX_POS, "sliding_window": 512,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "is_moe_layer": [False, True, True], "rope_theta": 1000000.0, "tie_word_embeddings": False,
            "mtp_layer_types": ["full_attention"]}


def _cfg_mimo_v2_flash() -> Dict[str, Any]:
    # MiMo-V2-Flash's layout: a full-attention layer, then sliding-window ones with attention
    # sinks (their own head counts and dims, partial RoPE with their own base), MoE after the
    # first layer, value heads narrower than query/key heads. The window is wider than any
    # sequence here unless a test narrows it
    return {"model_type": "mimo_v2_flash", "vocab_size": _VOCAB, "hidden_size": _HIDDEN,
            "intermediate_size": _FFN, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": _HEADS, "num_key_value_heads": _KV_HEADS, "head_dim": _HEAD_DIM,
            "v_head_dim": 8, "swa_num_attention_heads": _HEADS, "swa_num_key_value_heads": _KV_HEADS,
            "swa_head_dim": _HEAD_DIM, "swa_v_head_dim": 8, "hybrid_layer_pattern": [0, 1, 1],
            "moe_layer_freq": [0, 1, 1], "add_swa_attention_sink_bias": True,
            "add_full_attention_sink_bias": False, "sliding_window_size": 512, "num_experts_per_tok": 2,
            "n_routed_experts": 4, "n_shared_experts": None, "routed_scaling_factor": 1.0,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
            "topk_group": 1, "max_position_embeddings": _MAX_POS, "layernorm_epsilon": 1e-5,
            "rope_theta": 1000000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "attention_value_scale": 0.707, "tie_word_embeddings": False}


def _cfg_step3p5() -> Dict[str, Any]:
    # Step-3.5-Flash's layout: full and sliding layers (the sliding ones with their own head
    # counts and full RoPE, the full ones with partial RoPE), a head-wise attention gate, MoE
    # layers listed in moe_layers_enum with a shared expert; the per-layer lists also cover the
    # num_nextn_predict_layers MTP layers after the backbone's (sliding, dense), as the
    # checkpoints' do (transformers splits them off by that count)
    return {"model_type": "step3p5", "vocab_size": _VOCAB, "hidden_size": _HIDDEN, "num_hidden_layers": 3,
            "num_attention_heads": _HEADS, "num_attention_groups": _KV_HEADS, "head_dim": _HEAD_DIM,
            "intermediate_size": _FFN, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": _MAX_POS, "sliding_window": 512,
            "num_nextn_predict_layers": 2,
            "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention",
                            "sliding_attention"],
            "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0, 1.0],
            "attention_other_setting": {"num_attention_heads": _HEADS, "num_attention_groups": _KV_HEADS},
            "use_head_wise_attn_gate": True, "moe_num_experts": 4, "moe_top_k": 2,
            "moe_intermediate_size": 32, "share_expert_dim": 32, "moe_layers_enum": "1,2",
            "moe_router_scaling_factor": 1.0, "norm_expert_weight": True, "tie_word_embeddings": False}


def _cfg_qwen3() -> Dict[str, Any]:
    # A dense model without ``make_cache``: ``make_prompt_cache`` builds its caches itself
    # (``RotatingKVCache`` for ``max_kv_size``), unlike llama, whose ``make_cache`` ignores it.
    return dict(_cfg_llama(), model_type="qwen3")


def _cfg_mimo() -> Dict[str, Any]:
    return dict(_cfg_llama(), model_type="mimo", num_nextn_predict_layers=1)


_CONFIGS: Dict[str, Callable[[], Dict[str, Any]]] = {
    "qwen3_next": _cfg_qwen3_next,
    "qwen3_5": _cfg_qwen3_5,
    "qwen3_5_moe": _cfg_qwen3_5_moe,
    "nemotron_h": _cfg_nemotron_h,
    "falcon_h1": _cfg_falcon_h1,
    "granitemoehybrid": _cfg_granitemoehybrid,
    "jamba": _cfg_jamba,
    "kimi_linear": _cfg_kimi_linear,
    "kimi_k3": _cfg_kimi_k3,
    "lfm2": _cfg_lfm2,
    "lfm2_moe": _cfg_lfm2_moe,
    "lfm2-vl": _cfg_lfm2_vl,
    "mamba": _cfg_mamba,
    "mamba2": _cfg_mamba2,
    "plamo2": _cfg_plamo2,
    "bailing_moe_linear": _cfg_bailing_moe_linear,
    "bailing_hybrid": _cfg_bailing_hybrid,
    "bailing_moe_v3": _cfg_bailing_moe_v3,
    "olmo_hybrid": _cfg_olmo_hybrid,
    "recurrent_gemma": _cfg_recurrent_gemma,
    "rwkv7": _cfg_rwkv7,
    "baichuan_m1": _cfg_baichuan_m1,
    "gear": _cfg_gear,
    "longcat_flash_ngram": _cfg_longcat_flash_ngram,
    "llama": _cfg_llama,
    "qwen3": _cfg_qwen3,
    "deepseek_v3": _cfg_deepseek_v3,
    "deepseek_v32": _cfg_deepseek_v32,
    "glm4_moe": _cfg_glm4_moe,
    "glm4_moe_lite": _cfg_glm4_moe_lite,
    "glm_moe_dsa": _cfg_glm_moe_dsa,
    "mimo": _cfg_mimo,
    "ernie4_5_moe": _cfg_ernie4_5_moe,
    "exaone_moe": _cfg_exaone_moe,
    "mimo_v2_flash": _cfg_mimo_v2_flash,
    "step3p5": _cfg_step3p5,
    "longcat_flash": _cfg_longcat_flash,
}


def tiny_config(model_type: str) -> Dict[str, Any]:
    """Return a fresh HF-style config dict for a tiny ``model_type`` model.

    The dict carries ``model_type`` and ``vocab_size`` (at top level, and in
    ``text_config`` for the families that nest there) and is accepted by
    ``mlx_lm.models.<model_type>.ModelArgs.from_dict`` in every supported
    release that has the module.  Raises ``KeyError`` for unknown types.
    """
    try:
        factory = _CONFIGS[model_type]
    except KeyError:
        known = ", ".join(sorted(_CONFIGS))
        raise KeyError(
            f"no tiny config for model_type {model_type!r}; known types: {known}"
        ) from None
    cfg = factory()
    if "text_config" in cfg:
        cfg.setdefault("vocab_size", cfg["text_config"]["vocab_size"])
    return copy.deepcopy(cfg)


# ---------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------


def _module_exists(model_type: str) -> bool:
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None
    except (ImportError, ValueError):
        return False


def _model_classes(config: Dict[str, Any], model_type: str):
    """(Model, ModelArgs) for ``config``, via mlx-lm's own class lookup."""
    getter = None
    try:
        from mlx_lm import utils as _utils

        getter = getattr(_utils, "_get_classes", None) or getattr(
            _utils, "get_model_classes", None
        )
    except ImportError:  # pragma: no cover - mlx_lm always has utils
        getter = None
    if getter is not None:
        try:
            model_cls, args_cls = getter(config=config)
        except (ValueError, ImportError, KeyError, TypeError):
            model_cls = args_cls = None
        if model_cls is not None and model_cls.__module__ == (
            f"mlx_lm.models.{model_type}"
        ):
            return model_cls, args_cls
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model, module.ModelArgs


def build_tiny_model(model_type: str, seed: int = 0, dtype=mx.float32, overrides=None) -> nn.Module:
    """Build a tiny random-weight mlx-lm model of ``model_type``.

    The config comes from :func:`tiny_config`, updated with ``overrides`` (e.g. a narrower
    sliding window) if given.  All floating-point
    parameters are replaced by deterministic values derived from ``seed`` and
    each parameter's path, cast to ``dtype`` (float32 by default, so that
    prefill and step-by-step decoding agree closely) and evaluated.  The
    model is put in eval mode.  Raises ``KeyError`` for unknown types and
    ``ModuleNotFoundError`` if the installed mlx-lm lacks the family.
    """
    config = tiny_config(model_type)
    config.update(overrides or {})
    if not _module_exists(model_type):
        raise ModuleNotFoundError(
            f"mlx_lm.models.{model_type} is not in the installed mlx-lm",
            name=f"mlx_lm.models.{model_type}",
        )
    model_cls, args_cls = _model_classes(config, model_type)
    with seeded(seed):  # the caller's random stream is left where it was
        model = model_cls(args_cls.from_dict(config))
    randomize_parameters(model, model_type, seed, dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def available_model_types(hybrid_only: bool = True) -> List[str]:
    """Model types whose module exists in the installed mlx-lm and that build.

    With ``hybrid_only=False`` the dense control (``DENSE_MODEL_TYPE``) is
    appended.  Modules are imported (and models built) only when this is
    called; results are cached per process.
    """
    types = list(HYBRID_MODEL_TYPES)
    if not hybrid_only:
        types.append(DENSE_MODEL_TYPE)
    return [t for t in types if _buildable(t)]


_BUILDABLE: Dict[str, bool] = {}


_LAYOUTS: Dict[str, str] = {}


def _buildable(model_type: str) -> bool:
    if model_type not in _BUILDABLE:
        ok = _module_exists(model_type)
        if ok:
            try:
                model = build_tiny_model(model_type)
                _LAYOUTS[model_type] = "+".join(sorted(set(cache_leaf_kinds(model))))
            except Exception:  # a release whose module cannot build tiny
                ok = False
        _BUILDABLE[model_type] = ok
    return _BUILDABLE[model_type]


def cache_layout(model_type: str) -> str:
    """The set of cache classes a family's prompt cache holds, e.g. ``"ArraysCache+KVCache"``
    (``CacheList`` entries spelled with their contents); ``""`` if it does not build here."""
    return _LAYOUTS.get(model_type, "") if _buildable(model_type) else ""


def _make_cache(model: nn.Module) -> list:
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    from mlx_lm.models.cache import make_prompt_cache

    return list(make_prompt_cache(model))


def cache_kinds(model: nn.Module) -> List[str]:
    """Class names of the model's prompt-cache entries, in layer order.

    ``CacheList`` entries are reported as ``"CacheList"``; use
    :func:`cache_leaf_kinds` for the classes inside them.
    """
    return [type(c).__name__ for c in _make_cache(model)]


def cache_leaf_kinds(model: nn.Module) -> List[str]:
    """Like :func:`cache_kinds`, but with ``CacheList`` entries expanded
    into ``"CacheList(ArraysCache,KVCache)"``-style names."""
    out = []
    for c in _make_cache(model):
        inner = getattr(c, "caches", None)
        if type(c).__name__ == "CacheList" and inner is not None:
            names = ",".join(type(x).__name__ for x in inner)
            out.append(f"CacheList({names})")
        else:
            out.append(type(c).__name__)
    return out


def nearby_model(model_type: str, seed: int = 0, scale: float = 0.02) -> nn.Module:
    """``build_tiny_model(model_type, seed)`` with every matrix moved by deterministic noise of
    ``scale``: a draft that agrees with that model on most tokens, not all (how much falls as
    ``scale`` grows), so speculation accepts a different number of tokens on different rows."""
    from mlx.utils import tree_flatten, tree_unflatten

    model = build_tiny_model(model_type, seed=seed)
    moved = [(name, value + scale * mx.random.normal(value.shape, key=mx.random.key(1000 + i)).astype(value.dtype))
             if value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating) else (name, value)
             for i, (name, value) in enumerate(tree_flatten(model.parameters()))]
    model.update(tree_unflatten(moved))
    mx.eval(model.parameters())
    return model

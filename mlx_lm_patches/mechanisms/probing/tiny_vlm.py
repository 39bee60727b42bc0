"""Tiny random-weight mlx-vlm Qwen3.5 / Qwen3-VL models, built in memory or written as a folder.

Built from a config dict through mlx-vlm's own classes (``get_model_and_args``,
``ModelConfig.from_dict``, ``update_module_configs``, ``Model``) - no download, no weights file -
with every floating-point parameter replaced by a deterministic pseudo-random value
(:mod:`mlx_lm_patches.mechanisms.probing.random_weights`). Text model: hidden size 64,
vocabulary 256; Qwen3.5 (and Qwen3.5-MoE, 4 experts) has 4 layers (gated-delta, attention,
gated-delta, attention), Qwen3-VL (and Qwen3-VL-MoE, 4 experts) 2 attention layers. The vision
tower is one small block; text-only generation never runs it. The reference path of a prompt is
:func:`single`, mlx-vlm's ``generate_step`` of it alone.

Importing this module does not import mlx-vlm; :func:`available` says whether it is installed.
"""

import contextlib
import importlib.util
from typing import Any, Dict, Optional

from mlx_lm_patches.engine.traceless import seeded

MAX_TOKENS = 6


_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
           "out_hidden_size": 64, "patch_size": 4, "spatial_patch_size": 4,
           "num_position_embeddings": 16, "deepstack_visual_indexes": []}


def available(model_type: str = "qwen3_5") -> bool:
    """mlx-vlm is installed and has ``model_type``."""
    try:
        return importlib.util.find_spec(f"mlx_vlm.models.{model_type}") is not None
    except ModuleNotFoundError:
        return False


def text_config(model_type: str) -> Dict[str, Any]:
    common = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    if model_type == "qwen3_5_moe":
        return dict(text_config("qwen3_5"), model_type="qwen3_5_moe_text", num_experts=4,
                    num_experts_per_tok=2, shared_expert_intermediate_size=64, moe_intermediate_size=32)
    if model_type == "qwen3_5":
        return dict(common, model_type="qwen3_5_text", num_hidden_layers=4, full_attention_interval=2,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, attention_bias=False,
                    rope_parameters={"type": "default", "mrope_section": [1, 1, 0],
                                     "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if model_type == "qwen3_vl":
        return dict(common, model_type="qwen3_vl_text", num_hidden_layers=2,
                    rope_theta=10000.0, rope_scaling={"type": "default", "mrope_section": [4, 2, 2]})
    if model_type == "qwen3_vl_moe":
        return dict(text_config("qwen3_vl"), model_type="qwen3_vl_moe_text", num_experts=4,
                    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                    moe_intermediate_size=32, norm_topk_prob=True)
    raise KeyError(model_type)


# image placeholder tokens inside the tiny vocabulary (the real ones lie far above 256): its last
# four ids, where :func:`vision_processor`'s tokenizer puts them
IMAGE_TOKENS = {"vision_start_token_id": 252, "vision_end_token_id": 253, "image_token_id": 254,
                "video_token_id": 255}


VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def config(model_type: str, images: bool = False) -> Dict[str, Any]:
    return {"model_type": model_type, "vocab_size": 256, "text_config": text_config(model_type),
            "vision_config": dict(_VISION, model_type=model_type), **(IMAGE_TOKENS if images else {})}


def build(model_type: str, seed: int = 1, images: bool = False):
    """A tiny random-weight mlx-vlm model (``Model``: vision tower + ``language_model``);
    ``images``: its image placeholder tokens inside the vocabulary (:data:`IMAGE_TOKENS`)."""
    import mlx.core as mx
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    from mlx_lm_patches.mechanisms.probing.random_weights import randomize_parameters

    cfg = config(model_type, images)
    arch, _ = get_model_and_args(cfg)
    model_config = update_module_configs(arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision"])
    with seeded(seed):  # the caller's random stream is left where it was
        model = arch.Model(model_config)
    randomize_parameters(model, model_type, seed, mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


@contextlib.contextmanager
def _no_tqdm_monitor_left():
    """mlx-vlm's chunked prefill opens a (disabled) tqdm bar, and tqdm starts its monitor thread
    for the first bar of a process: a probe stops the one it started."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    before = getattr(tqdm, "monitor", None)
    try:
        yield
    finally:
        started = getattr(tqdm, "monitor", None)
        if before is None and started is not None:
            started.exit()
            tqdm.monitor = None


def single(model, prompt, max_tokens: int = MAX_TOKENS):
    """The reference: mlx-vlm's ``generate_step`` of ``prompt`` alone (text only)."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    tokens, logprobs = [], []
    with _no_tqdm_monitor_left():
        steps = generate_step(mx.array([prompt]), model, None, None, max_tokens=max_tokens)
        for token, logprob in steps:
            tokens.append(int(token))
            logprobs.append(logprob)
    mx.eval(logprobs)
    return Decoded(tokens, logprobs)


def generation_module():
    """The module that defines mlx-vlm's ``BatchGenerator`` (``mlx_vlm.generate`` up to 0.5,
    ``mlx_vlm.generate.ar`` from 0.6)."""
    import sys

    generator = importlib.import_module("mlx_vlm.generate").BatchGenerator
    return sys.modules[generator.__module__]


def embeddings(model, input_ids, **kwargs):
    return {k: v for k, v in model.get_input_embeddings(input_ids, None, **kwargs).to_dict().items()
            if v is not None}


# ChatML whose image parts render as Qwen-VL's placeholder (the processor expands it per image)
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# the image processor's settings for :data:`_VISION` (4-pixel patches, 2 x 2 merge): images are
# resized to multiples of 8 pixels, between 8 x 8 and 32 x 32
IMAGE_PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
                   "max_pixels": 1024, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def write_vision_processor_files(folder, model_type: str, padding_side: Optional[str] = None):
    """The files mlx-vlm's ``load_processor`` reads for ``model_type``'s own (torch-free) Qwen-VL
    processor, written into ``folder``: a tokenizer built locally with the image placeholder
    tokens at :data:`IMAGE_TOKENS`, :data:`VISION_CHAT_TEMPLATE`, ``preprocessor_config.json``
    (:data:`IMAGE_PROCESSOR`) and ``config.json`` (:func:`config` with images). The tokenizer
    pads on ``padding_side`` (unset: the tokenizer's default, the right, as Qwen's tokenizers)."""
    import json
    import pathlib

    from mlx_lm_patches.mechanisms.probing.tokenizer_files import build_tokenizer_files

    folder = pathlib.Path(folder)
    build_tokenizer_files(folder, 256, VISION_SPECIALS, VISION_CHAT_TEMPLATE)
    if padding_side is not None:
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        settings["padding_side"] = padding_side
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    (folder / "config.json").write_text(json.dumps(config(model_type, images=True), indent=2))
    return folder


def write_model_folder(folder, model_type: str, seed: int = 1):
    """A tiny mlx-vlm ``model_type`` with image tokens (:func:`build` ``images=True``) written as
    a model folder ``mlx_vlm.load`` (and servers built on it) reads: its weights in MLX layout
    (``model.safetensors``, loaded back unchanged) beside :func:`write_vision_processor_files`.
    Returns the folder and the in-memory model."""
    import pathlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_vision_processor_files(folder, model_type)
    model = build(model_type, seed=seed, images=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return folder, model


def two_layer_language_model(language_module, model_type: str):
    """``language_module.LanguageModel`` of the tiny ``model_type`` config with two layers,
    random init (seed 0)."""
    import mlx.core as mx

    package = language_module.__name__.rsplit(".", 1)[0]
    configs = importlib.import_module(f"{package}.config")
    model_config = configs.ModelConfig.from_dict(config(model_type))
    model_config.text_config = configs.TextConfig.from_dict(dict(text_config(model_type), num_hidden_layers=2))
    model_config.vision_config = configs.VisionConfig.from_dict(dict(_VISION, model_type=model_type))
    with seeded(0):
        lm = language_module.LanguageModel(model_config.text_config, model_config)
    mx.eval(lm.parameters())
    return lm

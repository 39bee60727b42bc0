"""Write a complete, loadable mlx-lm model folder from an in-memory model.

Tests and scenarios load models through mlx-lm's public entry points
(``mlx_lm.load``, ``mlx_lm.utils.load_model``, ``mlx_lm.server``, the
``mlx_lm generate`` CLI), which all want a folder on disk.  This module writes
such a folder from a tiny random-weight model without touching the network:

* ``config.json``: the model's config, plus ``model_type`` and an
  ``eos_token_id`` that matches the tokenizer written next to it;
* the weights in MLX format (``model.safetensors`` or
  ``model-0000i-of-0000N.safetensors``) and ``model.safetensors.index.json``,
  laid out the way ``mlx_lm.convert`` lays them out;
* a small real byte-level BPE tokenizer, trained with the ``tokenizers``
  library on a built-in English corpus (``tokenizer.json``,
  ``tokenizer_config.json`` with a ChatML chat template,
  ``special_tokens_map.json``):
  :mod:`mlx_lm_patches.mechanisms.probing.tokenizer_files`.

Weights are written already converted, so a model's ``sanitize`` sees MLX
layout on load.  The ``sanitize`` of every hybrid family (qwen3_next, qwen3_5,
nemotron_h, falcon_h1, mamba2, jamba, lfm2) detects that layout and leaves the
weights unchanged, with one exception noted where it matters:

* qwen3_5 in mlx-lm 0.30.7 to 0.31.x adds 1.0 to every RMSNorm weight when
  *any* ``mtp.*`` key is in the loaded weights, whatever their layout.  Putting
  ``mtp.*`` tensors into the main shards with ``extra_tensors`` therefore
  changes the norms of a qwen3_5 model loaded by those releases (0.32.0+ only
  shifts HF-layout checkpoints).  Keep MTP weights of qwen3_5 in a sidecar
  file (``extra_files``) to avoid it; this module does not work around it.
* qwen3_next's ``sanitize`` returns MLX-layout weights untouched, ``mtp.*``
  keys included, and nemotron_h keeps ``mtp.*`` keys before mlx-lm 0.31.2, so
  with strict loading such extra keys fail unless the model defines them.

Outside the hybrid list, baichuan_m1's ``sanitize`` (all supported releases)
divides every row of ``lm_head.weight`` by its L2 norm on each load, so its
loaded ``lm_head`` never equals the written one exactly (not even for rows
that already have unit norm, because of the 1e-7 added to the norm).

Loading the tokenizer also parses ``config.json``: transformers 5's
``AutoTokenizer`` builds the model's HF config class first, and some of those
classes validate it (e.g. Mamba2 wants ``hidden_size * expand == num_heads *
head_dim``), so a tiny config must be consistent for transformers too, not
only for mlx-lm.

Only the standard library is imported at module level; ``mlx`` is imported
inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Mapping

from mlx_lm_patches.mechanisms.probing.tokenizer_files import (EOS_TOKEN, SPECIAL_TOKENS, build_tokenizer_files,
                                                               write_json)

__all__ = ["write_model_folder"]


def _config_dict(config) -> dict:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    # A deep copy that is also checked to be JSON-serialisable.
    return json.loads(json.dumps(dict(config)))


def _infer_vocab_size(config: dict, weights: dict) -> int | None:
    for source in (config, config.get("text_config") or {}):
        if isinstance(source.get("vocab_size"), int):
            return source["vocab_size"]
    for key, value in weights.items():
        if key.endswith(("embed_tokens.weight", "embeddings.weight", "wte.weight")):
            if len(value.shape) == 2:
                return int(value.shape[0])
    return None


def _as_dtype(dtype):
    import mlx.core as mx

    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    name = str(dtype).rsplit(".", 1)[-1]
    value = getattr(mx, name, None)
    if not isinstance(value, mx.Dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _prepare_tensors(tensors: Mapping, dtype) -> dict:
    """Convert to mx.array and cast floating-point tensors to ``dtype``."""
    import mlx.core as mx

    out = {}
    for name, value in tensors.items():
        if not isinstance(value, mx.array):
            value = mx.array(value)
        if dtype is not None and mx.issubdtype(value.dtype, mx.floating):
            value = value.astype(dtype)
        out[str(name)] = value
    mx.eval(list(out.values()))
    return out


def _split_shards(weights: dict, shard_size: int | None) -> list[dict]:
    """Greedy split in insertion order; one tensor never spans two shards."""
    if shard_size is None:
        return [dict(weights)]
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    shards: list[dict] = []
    size = 0
    for name, value in weights.items():
        if not shards or (shards[-1] and size + value.nbytes > shard_size):
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards or [{}]


def _write_extra_file(folder: pathlib.Path, name: str, content, dtype) -> None:
    import mlx.core as mx

    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif isinstance(content, (bytes, bytearray)):
        path.write_bytes(bytes(content))
    elif name.endswith(".safetensors"):
        if not isinstance(content, Mapping):
            raise TypeError(f"extra file {name!r}: expected a dict of tensors")
        tensors = _prepare_tensors(content, dtype)
        mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})
    elif isinstance(content, (Mapping, list)):
        write_json(path, content)
    else:
        raise TypeError(
            f"extra file {name!r}: expected str, bytes, a dict of tensors "
            f"(for *.safetensors) or JSON data, got {type(content).__name__}"
        )


def write_model_folder(
    folder,
    model,
    config: dict,
    *,
    vocab_size: int | None = None,
    dtype=None,
    shard_size: int | None = None,
    extra_tensors: dict | None = None,
    extra_files: dict | None = None,
) -> pathlib.Path:
    """Write ``model`` as a model folder that ``mlx_lm.load`` can read offline.

    Args:
        folder: Destination directory (created if needed).  Stale
            ``model*.safetensors`` files and the index from an earlier write
            are removed first, since mlx-lm loads every ``model*.safetensors``.
        model: An mlx-lm model (``Model(ModelArgs.from_dict(config))``).
        config: The config dict the model was built from; written as
            ``config.json``.  ``model_type`` is taken from ``model.model_type``
            if missing, and ``eos_token_id`` is set to the tokenizer's eos id
            (replacing any value in ``config``).
        vocab_size: Tokenizer vocabulary size; by default the config's
            ``vocab_size`` (or ``text_config.vocab_size``), else the embedding
            rows.  Must not exceed the model's vocabulary.
        dtype: Optional ``mx.Dtype`` or name (``"bfloat16"``) that all
            floating-point tensors written (weights, ``extra_tensors`` and
            tensors in ``extra_files``) are cast to.  Integer tensors (e.g.
            quantized weights) are kept.
        shard_size: If given, split the weights into shards of at most this
            many bytes (a bigger tensor gets a shard of its own), named
            ``model-0000i-of-0000N.safetensors``.  Otherwise one
            ``model.safetensors``.  ``model.safetensors.index.json`` is written
            in both cases, as ``mlx_lm.convert`` does.
        extra_tensors: Name -> tensor, stored in the main shard(s) after the
            model's weights and listed in the index (e.g. ``mtp.*``).  Names
            must not clash with the model's.
        extra_files: File name -> content, written last (so they may replace a
            generated file).  ``*.safetensors`` names take a dict of tensors
            (saved in MLX format, not listed in the index, e.g. a sidecar
            ``mtp.safetensors``); ``str`` is written as text, ``bytes`` as is,
            and a dict or list for other names as JSON.

    Returns:
        The folder as a ``pathlib.Path``.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config_dict(config)
    if "model_type" not in config:
        model_type = getattr(model, "model_type", None)
        if model_type is None:
            model_type = getattr(getattr(model, "args", None), "model_type", None)
        if not model_type:
            raise ValueError("config has no 'model_type' and the model names none")
        config["model_type"] = model_type

    dtype = _as_dtype(dtype)
    weights = _prepare_tensors(dict(tree_flatten(model.parameters())), dtype)
    if extra_tensors:
        extra = _prepare_tensors(extra_tensors, dtype)
        clash = sorted(set(extra) & set(weights))
        if clash:
            raise ValueError(f"extra_tensors clash with model weights: {clash[:5]}")
        weights.update(extra)

    if vocab_size is None:
        vocab_size = _infer_vocab_size(config, weights)
        if vocab_size is None:
            raise ValueError("cannot infer vocab_size; pass it explicitly")
    else:
        model_vocab = _infer_vocab_size(config, weights)
        if model_vocab is not None and vocab_size > model_vocab:
            raise ValueError(
                f"tokenizer vocab_size {vocab_size} exceeds the model's "
                f"vocab_size {model_vocab}"
            )

    for stale in folder.glob("model*.safetensors"):
        stale.unlink()
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        index_path.unlink()

    shards = _split_shards(weights, shard_size)
    weight_map = {}
    for i, shard in enumerate(shards):
        if shard_size is None:
            name = "model.safetensors"
        else:
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
    write_json(
        index_path,
        {
            "metadata": {
                "total_size": sum(v.nbytes for v in weights.values()),
                "total_parameters": sum(v.size for v in weights.values()),
            },
            "weight_map": dict(sorted(weight_map.items())),
        },
    )

    build_tokenizer_files(folder, vocab_size)
    config["eos_token_id"] = SPECIAL_TOKENS.index(EOS_TOKEN)
    write_json(folder / "config.json", config)

    for name, content in (extra_files or {}).items():
        _write_extra_file(folder, str(name), content, dtype)
    return folder

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
* a small real byte-level BPE tokenizer, trained here with the ``tokenizers``
  library on a built-in English corpus (``tokenizer.json``,
  ``tokenizer_config.json`` with a ChatML chat template,
  ``special_tokens_map.json``).

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

Only the standard library is imported at module level; ``mlx`` and
``tokenizers`` are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer_files",
    "write_model_folder",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = EOS_TOKEN
BOS_TOKEN = None  # ChatML-style tokenizers (Qwen) have no BOS token.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Special tokens take the lowest ids, in this order: eos is always id 0.
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# The smallest vocabulary that still holds the specials, a space and a-z.
_MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 27
# From this size on, the whole 256-symbol byte alphabet fits with room for
# merges, so any text (not only ASCII) round-trips exactly.
_FULL_BYTE_ALPHABET_FROM = 512

# ChatML.  ``content`` may be a string or a list of OpenAI-style parts, of
# which the ``text`` parts are kept.  Messages of any role are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# A small built-in training corpus, plain ASCII English.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A small model can still "
    "learn a few simple words, but this one has random weights and will "
    "mostly say nothing useful at all.",
    "Hello! How can I help you today? I would like to know the weather in "
    "the city, and what time the train leaves for the coast.",
    "Once upon a time there was a little house on the side of a hill. In the "
    "house lived an old man, his daughter, and a very curious cat.",
    "Every morning the cat walked down to the river to watch the fish. The "
    "water was cold and clear, and the sun was warm on the stones.",
    "Language models read text as a sequence of tokens. Each token is a "
    "number, and the model predicts which number is most likely to come "
    "next.",
    "A recurrent layer keeps a fixed size state that is updated at every "
    "step, while an attention layer looks back at all of the previous keys "
    "and values in its cache.",
    "Hybrid models mix both kinds of layers. They are fast on long inputs "
    "because most layers only carry a small state from one step to the "
    "next.",
    "Please write a short poem about the sea. The sea is wide, the sea is "
    "deep; it sings the sailors all to sleep.",
    "What is the capital of France? The capital of France is Paris. What is "
    "two plus two? Two plus two is four.",
    "Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2024 "
    "appear in text too, as do dates like 12/05/2023 and times like 7:30.",
    "The system prompt tells the assistant how to behave. The user asks a "
    "question, and the assistant writes an answer that is helpful, honest "
    "and kind.",
    "She said, \"Thank you very much for your help.\" He answered: \"You are "
    "welcome; it was my pleasure.\"",
    "Good evening, everyone. Today we will talk about history, science, "
    "music, art, and the many ways that people share their stories with "
    "one another.",
    "It was a bright cold day in April, and the clocks were striking the "
    "hour as the students hurried home from school through the park.",
    "To make bread you need flour, water, salt and yeast. Mix them, let "
    "the dough rest for an hour, then bake it in a hot oven until golden.",
    "Why do birds sing in the morning? Some say they are calling to their "
    "friends, others think they simply enjoy the sound of their own voice.",
    "The meeting is on Monday at 10 am. Bring your notes, your questions, "
    "and a cup of coffee if you like. We should be done before noon.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Small steps, taken every day, often lead to large changes over time. "
    "Keep going, stay curious, and do not be afraid to ask for help.",
    "Rain fell softly on the roof while the children read their books by "
    "the fire. Outside, the wind moved through the tall dark trees.",
)


def _byte_symbols() -> list[str]:
    """The printable symbol that byte-level BPE uses for each byte value.

    Bytes that are visible Latin-1 characters stand for themselves; the other
    bytes (controls, space, ...) are given code points from 256 upwards, in
    byte order.  This is the mapping ``tokenizers``' ByteLevel pre-tokenizer
    and decoder use.
    """
    visible = set(range(ord("!"), ord("~") + 1))
    visible |= set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols = []
    extra = 0
    for byte in range(256):
        if byte in visible:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _alphabet(vocab_size: int) -> list[str]:
    """Initial BPE alphabet that fits a vocabulary of ``vocab_size``."""
    symbols = _byte_symbols()
    if vocab_size >= _FULL_BYTE_ALPHABET_FROM:
        return symbols
    # Below that, keep ASCII only (other characters are dropped on encoding),
    # most useful characters first, and as many as fit beside the specials.
    order = (
        " abcdefghijklmnopqrstuvwxyz"
        ".,'!?\nABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        "-:;\"()/#+=*_&%$@<>[]{}|\\^`~\t"
    )
    room = vocab_size - len(SPECIAL_TOKENS)
    return [symbols[ord(c)] for c in order[:room]]


def _train_tokenizer(vocab_size: int, extra_specials: tuple = ()):
    """Train the byte-level BPE tokenizer and pad it to ``vocab_size``, the
    ``extra_specials`` taking its last ids in their order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers import pre_tokenizers, processors, trainers

    if vocab_size - len(extra_specials) < _MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be at least {_MIN_VOCAB_SIZE + len(extra_specials)}, got {vocab_size}"
        )
    extra = list(extra_specials)
    vocab_size -= len(extra)
    alphabet = _alphabet(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True) for t in SPECIAL_TOKENS],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    tokenizer.train_from_iterator(list(_CORPUS), trainer=trainer)

    # The corpus has only so many merges; fill the rest of the vocabulary with
    # reserved special tokens so every id a model of this vocab_size can emit
    # decodes to something.
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)]
        )
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    if extra:
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in extra])
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i
    for i, token in enumerate(extra):
        assert tokenizer.token_to_id(token) == vocab_size + i
    return tokenizer


def _write_json(path: pathlib.Path, data: Any) -> None:
    path.write_text(
        json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def build_tokenizer_files(folder, vocab_size: int = 256, extra_specials: tuple = (),
                          chat_template: str | None = None) -> None:
    """Write a small real tokenizer into ``folder`` (no downloads).

    A byte-level BPE model is trained with the ``tokenizers`` library on a
    small built-in English corpus; its vocabulary has exactly ``vocab_size``
    entries (it is padded with ``<|reserved_i|>`` special tokens when the
    corpus runs out of merges), so it must not exceed the model's
    ``vocab_size``.  Ids 0, 1, 2 are ``<|endoftext|>`` (eos and pad),
    ``<|im_start|>`` and ``<|im_end|>``; there is no BOS token and nothing is
    added to encoded text.

    With ``vocab_size >= 512`` all 256 bytes are in the vocabulary and any text
    round-trips exactly.  Smaller vocabularies keep (a prefix of) printable
    ASCII plus newline and tab, and drop other characters when encoding.
    ``vocab_size`` must be at least 30.

    ``extra_specials`` (e.g. a vision model's image placeholder tokens) take
    the last ids of the vocabulary, in their order; ``chat_template`` replaces
    the ChatML one.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (class
    ``PreTrainedTokenizerFast``, a ChatML ``chat_template``) and
    ``special_tokens_map.json``.
    """
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(int(vocab_size), tuple(extra_specials))
    tokenizer.save(str(folder / "tokenizer.json"))

    added = {}
    for token in SPECIAL_TOKENS + tuple(extra_specials):
        added[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            "chat_template": chat_template or CHAT_TEMPLATE,
        },
    )
    _write_json(
        folder / "special_tokens_map.json",
        {
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )


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
        _write_json(path, content)
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
    _write_json(
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
    _write_json(folder / "config.json", config)

    for name, content in (extra_files or {}).items():
        _write_extra_file(folder, str(name), content, dtype)
    return folder

"""A small real tokenizer written into a folder, built locally (no download).

A byte-level BPE tokenizer trained here with the ``tokenizers`` library on a built-in English
corpus: ``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template,
``special_tokens_map.json``. Only the standard library is imported at module level;
``tokenizers`` is imported inside the functions that need it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer_files",
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


def write_json(path: pathlib.Path, data: Any) -> None:
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
    write_json(
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
    write_json(
        folder / "special_tokens_map.json",
        {
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )

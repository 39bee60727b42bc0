"""What a chat request *should* answer: the reference path, computed in-process.

Entry points (``mlx_lm.server``, ``mlx_lm.chat``, engines) batch, reuse prompt caches and
speculate; their greedy answers must equal single-sequence greedy decoding with a cold prefill of
the same prompt tokens. :func:`chat_reference` computes that with mlx-lm's own
``stream_generate`` (no prompt cache, no draft), so the text is detokenized the way the entry
points detokenize it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

__all__ = ["Reference", "chat_prompt", "chat_reference", "token_reference"]


@dataclass
class Reference:
    prompt: List[int]
    tokens: List[int]  # generated tokens, without a final eos
    text: str
    finish_reason: str  # "length" or "stop"
    logprobs: List[float] = field(default_factory=list)  # of each generated token (eos excluded)
    eos: Optional[int] = None  # the token that ended the answer when finish_reason is "stop"

    @property
    def fed(self) -> List[int]:
        """Every token a prompt cache holds after this turn: prompt, generated tokens and the
        final eos if there was one (decoding feeds each token before the next is drawn)."""
        return self.prompt + self.tokens + ([self.eos] if self.eos is not None else [])


def chat_prompt(tokenizer, messages, **template_kwargs) -> List[int]:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` as token ids,
    whatever the tokenizer returns (transformers 5 returns a ``BatchEncoding`` where mlx-lm
    before 0.30 does not ask for a list)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    if not isinstance(ids, list) and hasattr(ids, "keys") and "input_ids" in ids.keys():
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def token_reference(model, tokenizer, prompt: Sequence[int], max_tokens: int) -> Reference:
    """Greedy decoding of ``prompt`` (token ids), cold, single sequence."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    tokens, logprobs, text, finish = [], [], "", "length"
    eos = None
    for response in stream_generate(model, tokenizer, mx.array(list(prompt)), max_tokens=max_tokens):
        text += response.text
        if response.finish_reason == "stop":
            finish, eos = "stop", int(response.token)
            break
        tokens.append(int(response.token))
        logprobs.append(float(response.logprobs[response.token].item()))
    return Reference(list(prompt), tokens, text, finish, logprobs, eos)


def chat_reference(model, tokenizer, messages, max_tokens: int, **template_kwargs) -> Reference:
    """Greedy answer to ``messages`` (chat template, generation prompt), cold, single sequence."""
    return token_reference(model, tokenizer, chat_prompt(tokenizer, messages, **template_kwargs),
                           max_tokens)

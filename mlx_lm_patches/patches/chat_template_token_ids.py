"""``tokenizer.apply_chat_template(messages)`` gives token ids again under transformers 5.

Bug
    mlx-lm before 0.30.0 requires ``transformers>=4.39.3``, so installing it today brings
    transformers 5, whose ``apply_chat_template`` returns a ``BatchEncoding`` (``return_dict``
    now defaults to ``True``) where mlx-lm expects a list of token ids. ``TokenizerWrapper``
    forwards the call unchanged, and:

    * ``mlx_lm.chat`` crashes on the first message (``ValueError: Invalid type
      transformers.tokenization_utils_base.BatchEncoding received in array initialization``);
    * ``mlx_lm.server`` never answers a chat completion: the same error kills its generation
      thread, the HTTP side keeps accepting requests and every one of them waits forever;
    * Python code following mlx-lm's README (``prompt = tokenizer.apply_chat_template(messages,
      add_generation_prompt=True)``, then ``generate``/``stream_generate``) crashes the same way.

    ``mlx_lm.generate`` is unaffected (it renders the template as text, then encodes).

Fix
    Give ``TokenizerWrapper`` its own ``apply_chat_template`` that asks transformers for token
    ids (``return_dict=False``) whenever it tokenizes and the caller did not choose
    ``return_dict`` itself; everything else is forwarded unchanged. This is the behaviour mlx-lm
    adopted in 0.30.0.

Retire
    When the oldest supported mlx-lm is 0.30.0.

Metal
    Tokenization only.
"""

import inspect
import sys

from mlx_lm_patches.engine.contract import Outcome

TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"


def _apply_chat_template(self, conversation, *args, **kwargs):
    if kwargs.get("tokenize", True) and "return_dict" not in kwargs:
        kwargs["return_dict"] = False
    return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)


def probe():
    wrapper = sys.modules[TOKENIZER_UTILS].TokenizerWrapper
    if "apply_chat_template" in vars(wrapper):
        return None  # mlx-lm decides what the wrapper returns
    try:
        from transformers import PreTrainedTokenizerBase

        default = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters["return_dict"].default
    except (ImportError, KeyError, TypeError, ValueError):
        return None
    if default is not True:
        return None  # transformers 4: token ids by default
    return ("TokenizerWrapper forwards apply_chat_template to transformers, whose return_dict "
            "defaults to True: a BatchEncoding instead of token ids")


def apply(p):
    p.set(f"{TOKENIZER_UTILS}:TokenizerWrapper.apply_chat_template", _apply_chat_template)


def scenario():
    """What ``mlx_lm.chat`` does with a hybrid model folder: template the messages into token
    ids, then ``stream_generate``; the answer equals greedy decoding of the encoded template."""
    import tempfile

    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.model_folder import write_model_folder
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    messages = [{"role": "user", "content": "the quick brown fox"}]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model_folder(tmp, build_tiny_model("qwen3_next", seed=3), tiny_config("qwen3_next"))
        model, tokenizer = load(str(folder))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(text, add_special_tokens=False)
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        got = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=6)]
    except Exception as exc:
        return Outcome.failure("apply_chat_template, then stream_generate (what mlx_lm.chat does)", exc)
    if list(prompt) != expected:
        return Outcome.failure(f"apply_chat_template gave {type(prompt).__name__} {list(prompt)[:8]}..., "
                               f"not the template's token ids {expected[:8]}...")
    reference = greedy(model, expected, max_tokens=6).tokens
    if got[:len(reference)] != reference[:len(got)] or not got:
        return Outcome.failure(f"tokens differ: reference {reference}, got {got}")
    return Outcome(True, "apply_chat_template gives token ids; chat-style generation exact",
                   ["qwen3_next model folder: template ids equal the encoded template; greedy equal"])

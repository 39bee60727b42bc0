"""vllm-mlx's ``--enable-mtp`` on a Qwen3.5 vision-language checkpoint keeps mlx-vlm's own forward.

Bug
    With ``--enable-mtp``, vllm-mlx's vision engine loads a Qwen3.5 / Qwen3.6 checkpoint's MTP head
    from its ``model-mtp.safetensors`` with ``vllm_mlx.patches.qwen3_5_mtp.inject_mtp_support``,
    which swaps the class of mlx-vlm's language model for a subclass whose ``__call__`` is a
    forward of its own, written for mlx-lm's model: it embeds the token ids itself (the
    ``inputs_embeds`` mlx-vlm hands over - the image features - fall into ``**kwargs`` and are
    dropped), gives every token plain 1-D positions (no M-RoPE ``position_ids``, no
    ``rope_deltas``) and builds its own masks. Every request with an image is answered as if the
    image were not there (silently wrong from its first token, the drafts verified against that
    wrong forward); text requests are right.

Fix
    After vllm-mlx's injection, the swapped class's ``__call__`` runs mlx-vlm's own forward (the
    class it replaced) with the same arguments (vllm-mlx's ``input_embeddings`` passed on as
    ``inputs_embeds``); asked for ``return_hidden``, it returns mlx-vlm's output with the hidden
    state the head expects last in ``hidden_states`` (the final-norm output, or with
    ``mtp_hidden_state_mode: pre_norm`` the last layer's output, captured by mlx-vlm's own
    ``capture_layer_ids``). vllm-mlx's MTP head, drafting, verification and rollback are
    untouched. Models loaded by mlx-lm (vllm-mlx's text engine) are left alone.

Retire
    When vllm-mlx's injected forward hands mlx-vlm's language model its embeddings and
    positions: the probe then reports it not needed.

Metal
    mlx-vlm's own forward runs, as it does without ``--enable-mtp``; nothing is bypassed.
"""

import dataclasses
import functools
import sys

MODULE = "vllm_mlx.patches.qwen3_5_mtp"
HIDDEN_MODES = ("post_norm", "pre_norm")


def _hidden_mode(config) -> str:
    """The checkpoint's hidden-state contract, read as vllm-mlx reads it (post_norm unless the
    config says pre_norm)."""
    resolve = getattr(sys.modules[MODULE], "_resolve_qwen_mtp_hidden_state_mode", None)
    mode = resolve(config) if callable(resolve) and isinstance(config, dict) else "post_norm"
    return mode if mode in HIDDEN_MODES else "post_norm"


def _own_forward(own_call, mode: str, last_layer: int):
    """A ``__call__`` for vllm-mlx's swapped class that runs mlx-vlm's ``own_call``."""

    @functools.wraps(own_call)
    def __call__(self, inputs, cache=None, return_hidden: bool = False, input_embeddings=None, **kwargs):
        if input_embeddings is not None and kwargs.get("inputs_embeds") is None:
            kwargs["inputs_embeds"] = input_embeddings
        if return_hidden and mode == "pre_norm":
            kwargs["capture_layer_ids"] = [last_layer]
        out = own_call(self, inputs, cache=cache, return_hidden=return_hidden, **kwargs)
        hidden = getattr(out, "hidden_states", None) if return_hidden else None
        if hidden:
            chosen = hidden[0] if mode == "pre_norm" else hidden[-1]
            if dataclasses.is_dataclass(out):
                out = dataclasses.replace(out, hidden_states=[chosen])
            else:
                out.hidden_states = [chosen]
        return out

    return __call__


def _keeping_mlx_vlm_forward(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.calls import bind_arguments

    injected = wrapped(*args, **kwargs)
    if not injected:
        return injected
    call = bind_arguments(wrapped, args, kwargs).arguments
    model = call.get("model")
    text_model = getattr(model, "language_model", model)
    swapped = type(text_model)
    own = swapped.__mro__[1] if len(swapped.__mro__) > 1 else None
    if own is None or not own.__module__.startswith("mlx_vlm.") or "__call__" not in vars(swapped):
        return injected
    layers = len(text_model.model.layers)
    swapped.__call__ = _own_forward(own.__call__, _hidden_mode(call.get("config")), layers - 1)
    return injected


def apply(p):
    p.wrap(f"{MODULE}:inject_mtp_support", _keeping_mlx_vlm_forward)


def probe():
    """Evidence that, after vllm-mlx's ``inject_mtp_support`` on a tiny mlx-vlm Qwen3.5 (with a
    tiny ``model-mtp.safetensors``), its language model ignores the ``inputs_embeds`` it is
    handed: other logits than mlx-vlm's own forward."""
    from mlx_lm_patches.mechanisms.probing.tiny_vlm import available
    from mlx_lm_patches.mechanisms.probing.vllm_mlx import mtp_forward_problem
    from mlx_lm_patches.engine.contract import NotNeeded

    if not available("qwen3_5"):
        return NotNeeded("mlx-vlm's qwen3_5 is not installed: vllm-mlx's injection has nothing to swap")
    return mtp_forward_problem(sys.modules[MODULE])


def scenario():
    """vllm-mlx's engine with ``enable_mtp`` over a tiny mlx-vlm Qwen3.5 folder carrying its
    ``model-mtp.safetensors``: three image requests and a text request sent at once give each
    request's greedy tokens alone (mlx-vlm's ``generate_step``), the MTP head drafting."""
    import tempfile

    from mlx_lm_patches.selftest import vllm_mlx_engine
    from mlx_lm_patches.engine.contract import Outcome

    if not vllm_mlx_engine.available("qwen3_5"):
        return Outcome.not_applicable("vllm-mlx's vision engine or mlx-vlm's qwen3_5 is not installed")
    try:
        with tempfile.TemporaryDirectory() as root:
            problem, stats = vllm_mlx_engine.enable_mtp_problem(root)
    except Exception as exc:
        return Outcome.failure("vllm-mlx --enable-mtp on a tiny mlx-vlm Qwen3.5", exc)
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, "vllm-mlx --enable-mtp (mlx-vlm qwen3_5): image and text requests at once equal each alone",
                   [f"MTP drafts attempted: {stats.get('attempted')}, accepted: {stats.get('accepted')}"])

"""vllm-mlx's vision engine (``MLLMBatchGenerator``) on a tiny mlx-vlm Qwen3.5, and its checks.

vllm-mlx serves vision-language checkpoints with ``MLLMBatchGenerator``: each request is
prefilled alone through the mlx-vlm model, then the rows are merged into one left-padded batch
cache and decoded together. Text requests are given as token ids (``MLLMBatchRequest.input_ids``:
vllm-mlx then skips its processor), greedy, so no processor or tokenizer is needed.

The reference is the model's single-sequence path, mlx-vlm's ``generate_step`` of each prompt
alone (:func:`mlx_lm_patches.mechanisms.probing.tiny_vlm.single`): the same greedy tokens and
log-probabilities within :data:`mlx_lm_patches.mechanisms.probing.decoded.LOGPROB_TOLERANCE`.

Importing this module imports neither vllm-mlx nor mlx-vlm.
"""

import importlib
import importlib.util
from contextlib import contextmanager
from typing import List, Optional

from mlx_lm_patches.mechanisms.probing import tiny_vlm
from mlx_lm_patches.mechanisms.probing.vllm_mlx import LANGUAGE, write_mtp_sidecar
from mlx_lm_patches.selftest.vlm import batch_generate
from mlx_lm_patches.selftest.vlm.api import unsupported_api

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # the MoE model's attention is the same class
PROMPT_LENGTHS = (3, 17, 9)
MAX_TOKENS = 6


def available(model_type: str = "qwen3_5") -> bool:
    """vllm-mlx (with its vision engine) and mlx-vlm's ``model_type`` are installed."""
    try:
        return (importlib.util.find_spec("vllm_mlx.mllm_batch_generator") is not None
                and tiny_vlm.available(model_type))
    except ModuleNotFoundError:
        return False


@contextmanager
def attention_as_found():
    """mlx-vlm's ``Qwen3_5Attention`` restored on exit as it was on entry: vllm-mlx's generator
    replaces its ``__call__`` for the whole process, so a scenario run stock would otherwise
    leave the replacement behind for the next run."""
    cls = importlib.import_module(LANGUAGE).Qwen3_5Attention
    saved = {name: vars(cls)[name] for name in ("__call__", "_batch_patched") if name in vars(cls)}
    try:
        yield cls
    finally:
        for name in ("__call__", "_batch_patched"):
            if name in saved:
                setattr(cls, name, saved[name])
            elif name in vars(cls):
                delattr(cls, name)


def prompts() -> List[List[int]]:
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    return [prompt_tokens(n, seed=n) for n in PROMPT_LENGTHS]


def mllm_generator(model, processor, size: int, max_tokens: int):
    from vllm_mlx.mllm_batch_generator import MLLMBatchGenerator

    return MLLMBatchGenerator(model, processor=processor, max_tokens=max_tokens, stop_tokens=set(),
                              prefill_batch_size=size, completion_batch_size=size,
                              enable_vision_cache=False)


def decode_requests(generator, requests, max_tokens: int):
    """``requests`` inserted at once into ``generator`` and decoded to the end, greedy; one
    :class:`~mlx_lm_patches.mechanisms.probing.decoded.Decoded` per request, in order."""
    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    try:
        generator.insert(requests)
        decoded = {request.request_id: Decoded([], []) for request in requests}
        finished = set()
        for _ in range(len(requests) * (max_tokens + 2) + 8):  # bounded: each step yields a token per row
            for response in generator.next():
                if response.request_id in finished:
                    continue
                row = decoded[response.request_id]
                row.tokens.append(int(response.token))
                row.logprobs.append(response.logprobs.reshape(-1))
                if response.finish_reason is not None:
                    finished.add(response.request_id)
            if len(finished) == len(requests):
                break
        else:
            raise RuntimeError(f"MLLMBatchGenerator finished {len(finished)} of {len(requests)} requests")
        return [decoded[request.request_id] for request in requests]
    finally:
        close = getattr(generator, "close", None)
        if callable(close):
            close()


def mllm_batched(model, rows, max_tokens: int = MAX_TOKENS):
    """``rows`` (token ids) sent at once to vllm-mlx's ``MLLMBatchGenerator``, greedy; one
    :class:`~mlx_lm_patches.mechanisms.probing.decoded.Decoded` per row, in order."""
    import mlx.core as mx
    from vllm_mlx.mllm_batch_generator import MLLMBatchRequest

    requests = [MLLMBatchRequest(uid=-1, request_id=f"row{i}", prompt="", max_tokens=max_tokens,
                                 temperature=0.0, top_p=1.0, input_ids=mx.array([row]))
                for i, row in enumerate(rows)]
    return decode_requests(mllm_generator(model, None, len(rows), max_tokens), requests, max_tokens)


def image_data_url(image) -> str:
    """A PIL image as the ``data:image/png;base64,...`` URL an OpenAI client sends (PNG: lossless)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_requests() -> List[tuple]:
    """:data:`~mlx_lm_patches.selftest.vlm.batch_generate.IMAGE_PROMPTS` as ``(text, images)``:
    the first three with one of :func:`~mlx_lm_patches.selftest.vlm.batch_generate.test_images` each,
    the fourth text only."""
    images = batch_generate.test_images()
    return [(text, images[i:i + 1] or None) for i, text in enumerate(batch_generate.IMAGE_PROMPTS)]


def alone_with_images(model, processor, text, images, max_tokens: int = MAX_TOKENS):
    """``text`` (chat-formatted) with its ``images`` alone through mlx-vlm's ``generate_step``,
    greedy, from mlx-vlm's ``prepare_inputs``: the reference."""
    from mlx_vlm.generate import generate_step
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    formatted = apply_chat_template(processor, model.config, text, num_images=len(images or ()))
    inputs = prepare_inputs(processor, images=images, prompts=formatted)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    model.language_model._position_ids = model.language_model._rope_deltas = None
    steps = list(generate_step(inputs["input_ids"], model, inputs.get("pixel_values"),
                               inputs.get("attention_mask"), max_tokens=max_tokens, **extra))
    model.language_model._position_ids = model.language_model._rope_deltas = None
    return Decoded([int(t) for t, _ in steps], [lp.reshape(-1) for _, lp in steps])


def batched_problem(model, model_type: str) -> Optional[str]:
    """``None`` if every row of :func:`prompts` decoded together by vllm-mlx's vision engine
    equals the row alone (mlx-vlm's ``generate_step``), else what differs."""
    rows = prompts()
    reference = [tiny_vlm.single(model, row, MAX_TOKENS) for row in rows]
    with attention_as_found():
        got = mllm_batched(model, rows)
    for i, (ref, decoded) in enumerate(zip(reference, got)):
        problem = ref.compare(decoded)
        if problem:
            return f"vllm-mlx MLLMBatchGenerator, mlx-vlm {model_type}, prompt {i} ({len(rows[i])} tokens): {problem}"
    return None


def scenario_outcome(model_type: str = "qwen3_5"):
    """Text requests of 3, 17 and 9 tokens sent at once to vllm-mlx's vision engine on a tiny
    mlx-vlm ``model_type`` equal each prompt alone."""
    from mlx_lm_patches.engine.contract import Outcome

    if not available(model_type):
        return Outcome.not_applicable(f"vllm-mlx's vision engine or mlx-vlm's {model_type} is not installed")
    why = unsupported_api(model_type)
    if why:
        return Outcome.not_applicable(why)
    model = tiny_vlm.build(model_type)
    try:
        problem = batched_problem(model, model_type)
    except Exception as exc:
        return Outcome.failure(f"vllm-mlx MLLMBatchGenerator on a tiny mlx-vlm {model_type}", exc)
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, f"vllm-mlx MLLMBatchGenerator (mlx-vlm {model_type}): text requests of "
                         f"{'/'.join(map(str, PROMPT_LENGTHS))} tokens at once equal each alone")


# -- vllm-mlx's own --enable-mtp on a vision-language checkpoint ----------------------------------

MTP_TOKENS = 16


def engine_answers(folder, items, max_tokens: int, **engine_options):
    """``items`` (``(chat-formatted prompt, image data URLs or None)``) sent at once to a started
    vllm-mlx ``BatchedEngine(folder, **engine_options)``; its outputs, in order, and its stats.
    ``mlx_lm.generate.generation_stream`` (which the engine points at its worker's stream) is
    put back afterwards."""
    import asyncio

    from vllm_mlx.engine.batched import BatchedEngine

    module = importlib.import_module("mlx_lm.generate")

    async def run():
        engine = BatchedEngine(str(folder), **engine_options)
        await engine.start()
        try:
            outputs = await asyncio.gather(*(
                engine.generate(prompt=prompt, images=images, max_tokens=max_tokens, temperature=0.0)
                for prompt, images in items))
            return outputs, engine.get_stats()
        finally:
            await engine.stop()

    stream = module.generation_stream
    try:
        return asyncio.run(run())
    finally:
        module.generation_stream = stream


def enable_mtp_problem(root, model_type: str = "qwen3_5", max_tokens: int = MTP_TOKENS):
    """``(problem or None, MTP stats)``: :func:`image_requests` sent at once to vllm-mlx's engine
    with its own MTP on (``SchedulerConfig(enable_mtp=True)``, ``--enable-mtp``) over a tiny
    mlx-vlm folder carrying vllm-mlx's ``model-mtp.safetensors`` (:func:`write_mtp_sidecar`);
    each request's greedy tokens against :func:`alone_with_images`."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from vllm_mlx.scheduler import SchedulerConfig

    folder, model = tiny_vlm.write_model_folder(f"{root}/model", model_type)
    write_mtp_sidecar(folder, model_type)
    processor = batch_generate.vision_processor(model_type)
    items = image_requests()
    reference = [alone_with_images(model, processor, text, images, max_tokens) for text, images in items]
    sent = [(apply_chat_template(processor, model.config, text, num_images=len(images or ())),
             [image_data_url(image) for image in images] if images else None) for text, images in items]
    with attention_as_found():
        outputs, stats = engine_answers(folder, sent, max_tokens,
                                        scheduler_config=SchedulerConfig(enable_mtp=True))
    mtp = (stats or {}).get("mtp") or {}
    for i, (ref, output) in enumerate(zip(reference, outputs)):
        got = [int(t) for t in output.tokens]
        if got != ref.tokens[:len(got)] or (len(got) < len(ref.tokens) and output.finish_reason != "stop"):
            kind = "image" if items[i][1] else "text"
            return (f"vllm-mlx --enable-mtp, mlx-vlm {model_type}, {kind} request {i}: tokens {got}, "
                    f"alone {ref.tokens}"), mtp
    return None, mtp

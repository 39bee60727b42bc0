"""Image prompts batched through mlx-vlm's ``BatchGenerator`` and vllm-mlx's ``MLLMBatchGenerator``
on a tiny mlx-vlm model, against each prompt alone with its image (test-only)."""

from typing import Optional

from mlx_lm_patches.mechanisms.probing.tiny_vlm import IMAGE_TOKENS, MAX_TOKENS
from mlx_lm_patches.selftest import vllm_mlx_engine as engine
from mlx_lm_patches.selftest.vlm.batch_generate import vision_processor
from mlx_lm_patches.selftest.vlm.batching import drive_rows, prompts


def image_rows(model):
    """Two image prompts of different lengths (a 4 x 4 patch image: 4 placeholders after the
    merge) and a text prompt, as (token ids, pixel values, image grid) - pixel values and grid
    ``None`` for the text row. ``model`` is built with ``images=True``."""
    import mlx.core as mx

    vision = model.config.vision_config
    merge, temporal = getattr(vision, "spatial_merge_size", 2), getattr(vision, "temporal_patch_size", 2)
    width = getattr(vision, "in_channels", 3) * temporal * vision.patch_size ** 2
    grid = (1, 4, 4)
    rows = []
    for seed, prefix in ((1, [1, 2, 3]), (2, list(range(4, 13)))):
        placeholders = [IMAGE_TOKENS["image_token_id"]] * (grid[0] * grid[1] * grid[2] // merge ** 2)
        ids = prefix + [IMAGE_TOKENS["vision_start_token_id"]] + placeholders + [IMAGE_TOKENS["vision_end_token_id"], 7, 8]
        pixels = mx.random.normal((grid[0] * grid[1] * grid[2], width), key=mx.random.key(seed))
        rows.append((ids, pixels, mx.array([list(grid)])))
    return rows + [(prompts()[1], None, None)]


def image_rows_problem(model, model_type: str, max_tokens: int = MAX_TOKENS) -> Optional[str]:
    """``None`` if :func:`image_rows`, each inserted with its own embeddings into mlx-vlm
    (>= 0.5)'s ``BatchGenerator`` (as its server inserts requests), are answered as each alone
    through ``generate_step`` with its image (greedy tokens, chosen log-probabilities within
    1e-4); else what differs. Errors the generator raises propagate."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    rows = image_rows(model)
    language_model = model.language_model
    reference, kwargs = [], []
    for ids, pixels, grid in rows:
        extra = {} if grid is None else {"image_grid_thw": grid}
        language_model._position_ids = language_model._rope_deltas = None
        steps = list(generate_step(mx.array([ids]), model, pixels, None, max_tokens=max_tokens, **extra))
        reference.append(Decoded([int(t) for t, _ in steps], [lp.reshape(-1)[int(t)] for t, lp in steps]))
        language_model._position_ids = language_model._rope_deltas = None
        embedded = model.get_input_embeddings(mx.array([ids]), pixels, **extra).to_dict()
        kwargs.append({k: v for k, v in embedded.items() if v is not None})
    got = drive_rows(model, [ids for ids, _, _ in rows], max_tokens, kwargs)
    for i, (ref, decoded) in enumerate(zip(reference, got)):
        problem = ref.compare(decoded)
        if problem:
            return f"mlx-vlm {model_type}, {'image' if rows[i][1] is not None else 'text'} row {i}: {problem}"
    return None


def image_requests_problem(model, model_type: str, max_tokens: int = engine.MAX_TOKENS) -> Optional[str]:
    """``None`` if :func:`~mlx_lm_patches.selftest.vllm_mlx_engine.image_requests` sent at once
    to vllm-mlx's ``MLLMBatchGenerator`` (chat prompts, images as base64 data URLs, mlx-vlm's own
    processor over a locally built tokenizer:
    :func:`~mlx_lm_patches.selftest.vlm.batch_generate.vision_processor`) are each answered as
    alone (:func:`~mlx_lm_patches.selftest.vllm_mlx_engine.alone_with_images`); else what
    differs. ``model`` is built with ``images=True``."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from vllm_mlx.mllm_batch_generator import MLLMBatchRequest

    processor = vision_processor(model_type)
    items = engine.image_requests()
    reference = [engine.alone_with_images(model, processor, text, images, max_tokens) for text, images in items]
    requests = [MLLMBatchRequest(uid=-1, request_id=f"request{i}", max_tokens=max_tokens,
                                 temperature=0.0, top_p=1.0,
                                 prompt=apply_chat_template(processor, model.config, text,
                                                            num_images=len(images or ())),
                                 images=[engine.image_data_url(image) for image in images] if images else None)
                for i, (text, images) in enumerate(items)]
    with engine.attention_as_found():
        generator = engine.mllm_generator(model, processor, len(requests), max_tokens)
        got = engine.decode_requests(generator, requests, max_tokens)
    for i, (ref, decoded) in enumerate(zip(reference, got)):
        problem = ref.compare(decoded)
        if problem:
            kind = "image" if items[i][1] else "text"
            return f"vllm-mlx MLLMBatchGenerator, mlx-vlm {model_type}, {kind} request {i}: {problem}"
    return None

"""The user's ``mlx_vlm.batch_generate`` call on a tiny mlx-vlm model (text prompts, or prompts
with images through mlx-vlm's own processor over a locally built tokenizer), against
``mlx_vlm.generate`` of each prompt alone: the scenarios of the fixes of how ``batch_generate``
hands its padded rows to its ``BatchGenerator``.
"""

import functools
import importlib
from typing import Optional

from mlx_lm_patches.mechanisms.probing.tiny_vlm import MAX_TOKENS, available, build, write_vision_processor_files
from mlx_lm_patches.selftest.vlm.api import batch_generate_padding, takes_rows, unsupported_api
from mlx_lm_patches.selftest.vlm.batching import scenario_outcome


def batch_generate_scenario(model_type: str, padding: str):
    """The scenario of a fix of ``batch_generate``'s padded rows handed over as ``padding`` (see
    :func:`batch_generate_padding`): not applicable where this mlx-vlm hands them over
    otherwise, else :func:`scenario_outcome` through the ``batch_generate`` path."""
    from mlx_lm_patches.engine.contract import Outcome

    if available(model_type) and not unsupported_api(model_type) and takes_rows():
        handed = batch_generate_padding()
        if handed != padding:
            how = {"stripped": "strips them (insert takes the attention mask)",
                   "told": "tells its generator each row's padding (existing_left_padding)",
                   None: "inserts them as prompt tokens (mlx-vlm-padded-rows-stripped)"}[handed]
            return Outcome.not_applicable(f"this mlx-vlm's batch_generate {how}, not the hand-over this fix is about")
    return scenario_outcome(model_type, only=("batch_generate",))


TEXT_PROMPTS = ("Hi.", "Tell me a story about a cat and a dog, briefly please.",
                "One two three four five six seven eight nine ten eleven twelve.")


@functools.lru_cache(maxsize=1)
def processor():
    """mlx-vlm's processor of a tokenizer built locally (``load_processor`` on a folder holding
    only :func:`mlx_lm_patches.mechanisms.probing.tokenizer_files.build_tokenizer_files`, vocabulary 256: a
    tokenizer with mlx-vlm's detokenizer and stopping criteria)."""
    import pathlib
    import tempfile

    from mlx_vlm.utils import load_processor

    from mlx_lm_patches.mechanisms.probing.tokenizer_files import build_tokenizer_files

    with tempfile.TemporaryDirectory() as folder:
        build_tokenizer_files(folder, 256)
        return load_processor(pathlib.Path(folder))


def vision_processor(model_type: str, padding_side: Optional[str] = None):
    """mlx-vlm's processor of :func:`write_vision_processor_files` (mlx-vlm's model module is
    imported first: it registers the processor class ``load_processor`` finds)."""
    import tempfile

    from mlx_vlm.utils import load_processor

    importlib.import_module(f"mlx_vlm.models.{model_type}")
    with tempfile.TemporaryDirectory() as folder:
        return load_processor(write_vision_processor_files(folder, model_type, padding_side))


def test_images():
    """Three small random RGB images (PIL): two of 16 x 16 pixels (4 placeholders each) and one
    of 16 x 24 (6): ``batch_generate`` batches the two of one shape together."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8))
            for shape in ((16, 16, 3), (16, 24, 3), (16, 16, 3))]


IMAGE_PROMPTS = ("Hi.", "Tell me a story about a cat and a dog, briefly please.",
                 "One two three four five six seven.", "What is this?")


def batch_generate_images_problem(model, model_type, padding_side: Optional[str] = None,
                                  max_tokens: int = MAX_TOKENS) -> Optional[str]:
    """``None`` if mlx-vlm's ``batch_generate`` of :data:`IMAGE_PROMPTS` with :func:`test_images`
    (the first three prompts one image each, the fourth text only; the two 16 x 16 images'
    prompts of different lengths are batched together) answers each prompt with the text
    ``mlx_vlm.generate`` gives it alone with its image (greedy; the same chat template both
    ways); else the first difference. ``model`` is built with ``images=True``; the processor's
    tokenizer pads on ``padding_side``. Errors ``batch_generate`` raises propagate."""
    from mlx_vlm.prompt_utils import apply_chat_template

    generation = importlib.import_module("mlx_vlm.generate")
    proc, images = vision_processor(model_type, padding_side), test_images()
    language_model = model.language_model
    language_model._position_ids = language_model._rope_deltas = None
    batched = generation.batch_generate(model, proc, images=images, prompts=list(IMAGE_PROMPTS),
                                        max_tokens=max_tokens).texts
    for i, prompt in enumerate(IMAGE_PROMPTS):
        image = images[i:i + 1] or None
        language_model._position_ids = language_model._rope_deltas = None
        formatted = apply_chat_template(proc, model.config, prompt, num_images=len(image or ()))
        alone = generation.generate(model, proc, formatted, image=image, max_tokens=max_tokens,
                                    verbose=False).text
        if batched[i] != alone:
            return (f"mlx-vlm {model_type} batch_generate with images ({padding_side or 'default'} "
                    f"padding), prompt {i} of {len(IMAGE_PROMPTS)} ({'image' if image else 'text'}): "
                    f"answered {batched[i]!r}, alone {alone!r}")
    return None


def batch_generate_texts_problem(model, model_type, max_tokens: int = MAX_TOKENS) -> Optional[str]:
    """``None`` if mlx-vlm's ``batch_generate`` of :data:`TEXT_PROMPTS` (different lengths)
    answers each prompt with the text ``mlx_vlm.generate`` gives it alone (greedy; the same
    chat template both ways)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    generation = importlib.import_module("mlx_vlm.generate")
    proc = processor()
    model.language_model._position_ids = model.language_model._rope_deltas = None  # text only
    batched = generation.batch_generate(model, proc, prompts=list(TEXT_PROMPTS), max_tokens=max_tokens).texts
    for i, prompt in enumerate(TEXT_PROMPTS):
        model.language_model._position_ids = model.language_model._rope_deltas = None
        formatted = apply_chat_template(proc, model.config, prompt, num_images=0)
        alone = generation.generate(model, proc, formatted, max_tokens=max_tokens, verbose=False).text
        if batched[i] != alone:
            return (f"mlx-vlm {model_type} batch_generate, prompt {i} of {len(TEXT_PROMPTS)}: answered "
                    f"{batched[i]!r}, alone {alone!r}")
    return None


def _batch_generate_inapplicable(model_type: str, padding: Optional[str]):
    """A "not applicable" outcome where the installed mlx-vlm's ``batch_generate`` is not the
    hand-over ``padding`` names (or cannot be driven), else ``None``."""
    from mlx_lm_patches.engine.contract import Outcome

    if not available(model_type):
        return Outcome.not_applicable(f"mlx-vlm with {model_type} is not installed")
    why = unsupported_api(model_type)
    if why:
        return Outcome.not_applicable(why)
    if not takes_rows():
        return Outcome.not_applicable("this mlx-vlm's BatchGenerator takes one padded batch (mlx-vlm < 0.5)")
    handed = batch_generate_padding() or "inserted"
    if handed != padding:
        return Outcome.not_applicable(f"this mlx-vlm's batch_generate hands its padded rows over {handed}, "
                                      "not as this fix is about")
    return None


def batch_generate_texts_scenario(model_type: str, padding: Optional[str]):
    """The scenario of a fix of ``batch_generate``'s padded rows handed over as ``padding`` (see
    :func:`batch_generate_padding`; ``"inserted"`` for ``None``), through the user's call:
    :func:`batch_generate_texts_problem`."""
    from mlx_lm_patches.engine.contract import Outcome

    inapplicable = _batch_generate_inapplicable(model_type, padding)
    if inapplicable:
        return inapplicable
    try:
        model = build(model_type)
        problem = batch_generate_texts_problem(model, model_type)
    except Exception as exc:
        return Outcome.failure(f"mlx-vlm {model_type} batch_generate", exc)
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, f"mlx-vlm {model_type}: batch_generate answers each prompt as it is answered alone",
                   [f"{len(TEXT_PROMPTS)} text prompts of different lengths, {MAX_TOKENS} tokens each"])


def batch_generate_images_scenario(model_type: str, padding: str):
    """The scenario of a fix of ``batch_generate``'s image rows handed over as ``padding`` (see
    :func:`batch_generate_padding`), through the user's call: :func:`batch_generate_images_problem`
    with a processor that pads on the right (the tokenizer's default)."""
    from mlx_lm_patches.engine.contract import Outcome

    inapplicable = _batch_generate_inapplicable(model_type, padding)
    if inapplicable:
        return inapplicable
    try:
        problem = batch_generate_images_problem(build(model_type, images=True), model_type)
    except Exception as exc:
        return Outcome.failure(f"mlx-vlm {model_type} batch_generate with images", exc)
    if problem:
        return Outcome.failure(problem)
    return Outcome(True, f"mlx-vlm {model_type}: batch_generate answers each image prompt as it is answered alone",
                   [f"{len(IMAGE_PROMPTS)} prompts (3 with an image, two of one shape batched together), "
                    f"{MAX_TOKENS} tokens each"])

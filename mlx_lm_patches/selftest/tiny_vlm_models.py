"""Batched-text checks of the tiny mlx-vlm models (:mod:`mlx_lm_patches.mechanisms.probing.tiny_vlm`).

The checks compare batched text generation with the model's single-sequence path, mlx-vlm's
``generate_step`` of each prompt alone: the same greedy tokens and log-probabilities within
:data:`mlx_lm_patches.mechanisms.probing.decoded.LOGPROB_TOLERANCE`. Two batched paths:

* :func:`vlm_batched` - mlx-vlm's own ``BatchGenerator`` fed as ``batch_generate`` feeds it
  (left-padded token rows and their embeddings from ``get_input_embeddings``), except that the
  rows keep their own lengths (``batch_generate`` has the processor pad them to one length and
  drops its attention mask, so they arrive as equal-length rows);
* :func:`mlx_lm_batched` - mlx-lm's ``BatchGenerator`` driving the language model through
  :class:`LanguageModelAdapter` (logits instead of mlx-vlm's ``LanguageModelOutput``).

Importing this module does not import mlx-vlm; :func:`available` says whether it is installed.
"""

import functools
import importlib
import importlib.util
from typing import Any, List, Optional

from mlx_lm_patches.mechanisms.probing.tiny_vlm import (IMAGE_TOKENS, MAX_TOKENS, available, build, embeddings,
                                                        generation_module, single, write_vision_processor_files)
from mlx_lm_patches.mechanisms.probing.vlm_problems import apc_mixed_prefill_problem, prefill_positions_problem

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")
PROMPT_LENGTHS = (5, 9, 13)


def prompts() -> List[List[int]]:
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    return [prompt_tokens(n, seed=n) for n in PROMPT_LENGTHS]


def vlm_batched(model, rows, max_tokens: int = MAX_TOKENS):
    """``rows`` decoded together by mlx-vlm's ``BatchGenerator``, as ``_generate_batch`` drives
    it; one :class:`Decoded` per row, in order."""
    import types

    import mlx.core as mx
    from mlx_vlm.generate import BatchGenerator
    from mlx_vlm.utils import StoppingCriteria

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # the generator's own order
    width = max(len(r) for r in rows)
    padded = mx.array([[0] * (width - len(rows[i])) + list(rows[i]) for i in order])
    processor = types.SimpleNamespace(stopping_criteria=StoppingCriteria([], None))  # no stop tokens
    gen = BatchGenerator(model.language_model, processor, max_tokens=max_tokens,
                         prefill_batch_size=len(rows), completion_batch_size=len(rows))
    embedded = model.get_input_embeddings(padded, None)
    uids = gen.insert([list(rows[i]) for i in order], max_tokens)
    results = {uid: Decoded([], []) for uid in uids}
    while True:
        responses = gen.next(**embedded.to_dict())
        if not responses:
            break
        for r in responses:
            results[r.uid].tokens.append(int(r.token))
            results[r.uid].logprobs.append(r.logprobs)
    decoded: List[Any] = [None] * len(rows)
    for uid, i in zip(uids, order):
        mx.eval(results[uid].logprobs)
        decoded[i] = results[uid]
    return decoded


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
    got = _drive_rows(model, [ids for ids, _, _ in rows], max_tokens, kwargs)
    for i, (ref, decoded) in enumerate(zip(reference, got)):
        problem = ref.compare(decoded)
        if problem:
            return f"mlx-vlm {model_type}, {'image' if rows[i][1] is not None else 'text'} row {i}: {problem}"
    return None


def apc_scenario(model_type: str = "qwen3_5", require_hit: bool = True):
    """The scenario of the ``mlx-vlm-apc-hybrid-*`` patches: :func:`apc_mixed_prefill_problem`
    exact; ``require_hit``: a run without a cache hit shows nothing (not applicable), else it
    passes (no reuse is exact)."""
    from mlx_lm_patches.engine.contract import Outcome

    if not available(model_type):
        return Outcome.not_applicable(f"mlx-vlm with {model_type} is not installed")
    if importlib.util.find_spec("mlx_vlm.apc") is None or not takes_rows():
        return Outcome.not_applicable("this mlx-vlm has no prefix cache for its BatchGenerator")
    try:
        problem = apc_mixed_prefill_problem(model_type)
    except Exception as exc:
        return Outcome.failure(f"mlx-vlm {model_type} with its prefix cache", exc)
    if problem == "no hit" and require_hit:
        return Outcome.not_applicable(f"this mlx-vlm's prefix cache does not hit a {model_type} prompt here")
    if problem not in (None, "no hit"):
        return Outcome.failure(problem)
    return Outcome(True, f"mlx-vlm {model_type} with its prefix cache: requests sent together beside a hit, and a "
                         "later request alone, answered as without the cache"
                         + (" (no hit)" if problem == "no hit" else " (a hit)"))


def takes_rows() -> bool:
    """The installed mlx-vlm's ``BatchGenerator`` takes each row with its own prompt tensors
    (``insert(prompts, max_tokens, prompt_kwargs=[...])``, mlx-vlm >= 0.5) rather than one
    padded batch's embeddings through ``next(**kwargs)`` (< 0.5)."""
    import inspect

    generator = getattr(importlib.import_module("mlx_vlm.generate"), "BatchGenerator", None)
    insert = getattr(generator, "insert", None)
    return insert is not None and "prompt_kwargs" in inspect.signature(insert).parameters


def _drive_rows(model, prompts, max_tokens, prompt_kwargs, attention_mask=None, **generator_kwargs):
    """mlx-vlm (>= 0.5)'s ``BatchGenerator`` on ``prompts`` with their per-row tensors, greedy,
    no stop tokens; one :class:`Decoded` per prompt whose log-probabilities are those of the
    chosen tokens (what its responses carry)."""
    import types

    import mlx.core as mx
    from mlx_vlm.utils import StoppingCriteria

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    processor = types.SimpleNamespace(stopping_criteria=StoppingCriteria([], None))
    gen = generation_module().BatchGenerator(
        model.language_model, processor, max_tokens=max_tokens, prefill_batch_size=len(prompts),
        completion_batch_size=len(prompts), compute_logprobs=True, **generator_kwargs)
    extra = {} if attention_mask is None else {"attention_mask": attention_mask}
    uids = gen.insert(prompts, max_tokens, prompt_kwargs=prompt_kwargs, **extra)
    results = {uid: Decoded([], []) for uid in uids}
    try:
        while gen.has_work:
            _, responses = gen.next()
            for r in responses:
                results[r.uid].tokens.append(int(r.token))
                results[r.uid].logprobs.append(mx.array(r.token_logprob))
    finally:
        if hasattr(gen, "close"):
            gen.close()
    return [results[uid] for uid in uids]


def vlm_rows_batched(model, rows, max_tokens: int = MAX_TOKENS, **generator_kwargs):
    """``rows`` decoded together by mlx-vlm (>= 0.5)'s ``BatchGenerator``, each inserted with its
    own embeddings (as its server inserts requests): the generator pads them itself.
    ``generator_kwargs`` go to the generator (e.g. ``prefill_step_size``)."""
    import mlx.core as mx

    model.language_model._position_ids = model.language_model._rope_deltas = None  # text only
    kwargs = [embeddings(model, mx.array([list(r)])) for r in rows]
    return _drive_rows(model, [list(r) for r in rows], max_tokens, kwargs, **generator_kwargs)


def vlm_batch_generate_fed(model, rows, max_tokens: int = MAX_TOKENS):
    """``rows`` fed to mlx-vlm (>= 0.6.15)'s ``BatchGenerator`` as its ``batch_generate`` feeds
    them: one left-padded batch and its attention mask, embeddings computed for the padded batch
    with that mask and split per row; the padded batch is inserted with its mask where
    ``insert`` takes one (0.7), else as token rows, the generator told each row's padding
    (``existing_left_padding``, 0.6.15 - 0.6.17). (0.5 - 0.6.14 insert the padded rows as
    tokens: there :func:`batch_generate_texts_problem` drives ``batch_generate`` itself.)"""
    import inspect

    import mlx.core as mx

    module = generation_module()
    width = max(len(r) for r in rows)
    padded = mx.array([[0] * (width - len(r)) + list(r) for r in rows])
    mask = mx.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    model.language_model._position_ids = model.language_model._rope_deltas = None
    kwargs = module._split_prompt_kwargs_per_row(embeddings(model, padded, mask=mask), len(rows))
    if "attention_mask" in inspect.signature(module.BatchGenerator.insert).parameters:
        return _drive_rows(model, padded, max_tokens, kwargs, attention_mask=mask)
    told = {}
    if "existing_left_padding" in inspect.signature(module.BatchGenerator.__init__).parameters:
        told["existing_left_padding"] = [width - len(r) for r in rows]
    return _drive_rows(model, padded.tolist(), max_tokens, kwargs, **told)


def uses_mlx_lm_caches() -> bool:
    """mlx-vlm's cache classes are mlx-lm's (up to 0.6.x); later releases ship their own."""
    import mlx_lm.models.cache as lm_cache
    from mlx_vlm.models import cache as vlm_cache

    return issubclass(vlm_cache.KVCache, lm_cache.KVCache)


def paths():
    """The batched paths the installed mlx-vlm offers, by name: mlx-vlm's ``BatchGenerator`` as
    its ``batch_generate`` feeds it (and, from 0.5, with rows inserted one by one, as its
    server inserts requests), and - while mlx-vlm's caches are mlx-lm's - mlx-lm's
    ``BatchGenerator`` driving the language model (with mlx-vlm's own cache classes that
    pairing is no longer one anybody runs)."""
    if takes_rows():
        found = {"mlx-vlm": vlm_rows_batched}
        if batch_generate_padding() is not None:  # (inserted as tokens: batch_generate_texts_problem)
            found["batch_generate"] = vlm_batch_generate_fed
    else:
        found = {"mlx-vlm": vlm_batched}
    if uses_mlx_lm_caches():
        found["mlx-lm"] = mlx_lm_batched
    return found


class LanguageModelAdapter:
    """mlx-vlm's language model in mlx-lm's model interface: called with token ids and a cache
    it returns the logits (mlx-vlm returns a ``LanguageModelOutput``); its cache is the one
    mlx-vlm makes for it. A call on an empty single-sequence cache starts a new text sequence:
    the language model's stored rotary state is cleared first, as mlx-vlm's
    ``get_input_embeddings`` does before each generation (mlx-lm's batched prefill runs the rows
    of a batch one after another through the same model)."""

    def __init__(self, language_model):
        self.language_model = language_model

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self):
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.language_model)

    def __call__(self, inputs, cache=None, **kwargs):
        offsets = [getattr(c, "offset", None) for c in cache or () if not hasattr(c, "cache")]
        if any(isinstance(o, int) and o == 0 for o in offsets):
            self.language_model._position_ids = self.language_model._rope_deltas = None
        return self.language_model(inputs, cache=cache, **kwargs).logits


def mlx_lm_batched(model, rows, max_tokens: int = MAX_TOKENS):
    """``rows`` decoded together by mlx-lm's ``BatchGenerator`` driving the language model."""
    from mlx_lm_patches.selftest.scenarios import batched_greedy

    model.language_model._position_ids = model.language_model._rope_deltas = None  # text only
    return batched_greedy(LanguageModelAdapter(model.language_model), rows, max_tokens=max_tokens)


def batched_problem(model, model_type, run=vlm_batched) -> Optional[str]:
    """``None`` if every row of :func:`prompts` batched by ``run`` equals the row alone."""
    rows = prompts()
    reference = [single(model, r) for r in rows]
    got = run(model, rows)
    for i, (ref, decoded) in enumerate(zip(reference, got)):
        if decoded.logprobs and decoded.logprobs[0].ndim == 0 and len(ref.tokens) == len(decoded.tokens):
            # the path reports the chosen tokens' log-probabilities only: compare those
            ref = type(ref)(ref.tokens, [lp.reshape(-1)[t] for lp, t in zip(ref.logprobs, ref.tokens)])
        problem = ref.compare(decoded)
        if problem:
            return f"mlx-vlm {model_type}, prompt {i} ({len(rows[i])} tokens): {problem}"
    return None


# What the scenarios drive: (module, attribute, parameters its call must accept).
_DRIVEN = (
    ("mlx_vlm.utils", "get_model_and_args", ("config",)),
    ("mlx_vlm.utils", "update_module_configs", ()),
    ("mlx_vlm.utils", "StoppingCriteria", ()),
    ("mlx_vlm.generate", "generate_step", ("max_tokens",)),
    ("mlx_vlm.generate", "BatchGenerator", ("max_tokens", "prefill_batch_size", "completion_batch_size")),
    ("mlx_vlm.models.cache", "make_prompt_cache", ()),
)


def unsupported_api(model_type: str) -> Optional[str]:
    """Why the installed mlx-vlm's API is not one these scenarios drive, or None. Checked by name
    and signature before anything runs, so a changed API reads "not applicable" instead of a
    failure of the fix."""
    import inspect

    problems = []
    for module_name, name, params in _DRIVEN:
        try:
            obj = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            problems.append(f"{module_name}.{name} is gone")
            continue
        if not params:
            continue
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        accepted = signature.parameters
        if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            continue
        lacking = [p for p in params if p not in accepted]
        if lacking:
            problems.append(f"{module_name}.{name} takes no {', '.join(lacking)}")
    for method in ("insert", "next"):
        generator = getattr(importlib.import_module("mlx_vlm.generate"), "BatchGenerator", None)
        if generator is not None and not hasattr(generator, method):
            problems.append(f"mlx_vlm.generate.BatchGenerator has no {method}()")
    if takes_rows() and not hasattr(generation_module(), "_split_prompt_kwargs_per_row"):
        problems.append("mlx-vlm's BatchGenerator takes rows but its module has no "
                        "_split_prompt_kwargs_per_row (how batch_generate feeds it)")
    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    for name in ("Model", "ModelConfig"):
        if not hasattr(arch, name):
            problems.append(f"mlx_vlm.models.{model_type}.{name} is gone")
    if not problems:
        return None
    try:
        from importlib import metadata

        version = metadata.version("mlx-vlm")
    except Exception:
        version = "?"
    return (f"mlx-vlm {version}'s API differs from the one this scenario drives "
            f"({'; '.join(problems)})")


def batch_generate_padding() -> Optional[str]:
    """How the installed mlx-vlm's ``batch_generate`` hands its left-padded rows to its
    ``BatchGenerator``: ``"stripped"`` (``insert`` takes the attention mask and strips the
    padding, 0.7), ``"told"`` (the generator is told each row's padding,
    ``existing_left_padding``, 0.6.15 - 0.6.17), or ``None`` (the padding is inserted as prompt
    tokens, 0.5 - 0.6.14: ``mlx-vlm-padded-rows-stripped``)."""
    import inspect

    generator = generation_module().BatchGenerator
    if "attention_mask" in inspect.signature(generator.insert).parameters:
        return "stripped"
    if "existing_left_padding" in inspect.signature(generator.__init__).parameters:
        return "told"
    return None


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


def scenario_outcome(model_type: str, only=None, before_rows: bool = False, prefill_step_size=None):
    """The scenario of the mlx-vlm patches: ``model_type``'s batched text generation through the
    paths of :func:`paths` (those named in ``only``, if given) equals each prompt alone.
    ``before_rows``: a fix of mlx-vlm < 0.5's batching code, not applicable from 0.5.
    ``prefill_step_size``: rows inserted one by one (mlx-vlm >= 0.5) prefilled in chunks of it."""
    from mlx_lm_patches.engine.contract import Outcome

    if not available(model_type):
        return Outcome.not_applicable(f"mlx-vlm with {model_type} is not installed")
    why = unsupported_api(model_type)
    if why:
        return Outcome.not_applicable(why)
    if before_rows and takes_rows():
        return Outcome.not_applicable("mlx-vlm >= 0.5 rewrote the batching code this fix is about (its "
                                      "batched prefill positions: the mlx-vlm-*-prefill-positions patches)")
    try:
        model = build(model_type)  # mlx-vlm's constructors: not what the patches touch
    except Exception as exc:
        return Outcome.not_applicable(f"cannot build a tiny mlx-vlm {model_type} through the API this "
                                      f"scenario drives: {type(exc).__name__}: {exc}")
    details = []
    names = {"mlx-vlm": "mlx-vlm BatchGenerator", "batch_generate": "mlx-vlm BatchGenerator as batch_generate feeds it",
             "mlx-lm": "mlx-lm BatchGenerator"}
    chosen = {key: run for key, run in paths().items() if only is None or key in only}
    if prefill_step_size is not None:
        if not takes_rows():
            return Outcome.not_applicable("mlx-vlm < 0.5 inserts one padded batch, not rows to prefill in chunks")
        chosen = {key: functools.partial(run, prefill_step_size=prefill_step_size)
                  for key, run in chosen.items() if run is vlm_rows_batched}
    if not chosen:
        return Outcome.not_applicable(f"this mlx-vlm has none of the paths {', '.join(only)}")
    for key, run in chosen.items():
        name = names[key]
        try:
            problem = batched_problem(model, model_type, run)
        except Exception as exc:
            return Outcome.failure(f"mlx-vlm {model_type} through the {name}", exc)
        if problem:
            return Outcome.failure(f"{problem} (through the {name})")
        chunks = f", prefilled in chunks of {prefill_step_size}" if prefill_step_size else ""
        details.append(f"{name}: prompts of {'/'.join(map(str, PROMPT_LENGTHS))} tokens{chunks} exact")
    return Outcome(True, f"mlx-vlm {model_type}: batched text generation equals each prompt alone",
                   details)


def prefill_positions_scenario(module_name: str, model_type: str):
    """The scenario of the ``*-prefill-positions`` patches: ``model_type``'s language model (the
    module ``module_name``) prefilling a padded batch on mlx-vlm's caches without positions, and
    prefilled with handed positions, decodes as each row alone; and (where driven) rows inserted
    one by one into mlx-vlm's ``BatchGenerator`` equal each prompt alone."""
    from mlx_lm_patches.engine.contract import Outcome

    language_module = importlib.import_module(module_name) if available(model_type) else None
    if language_module is None:
        return Outcome.not_applicable(f"mlx-vlm with {model_type} is not installed")
    if not takes_rows():
        return Outcome.not_applicable("mlx-vlm < 0.5: its batching code is the *-batch-positions patches'")
    problem = prefill_positions_problem(language_module, model_type)
    if problem:
        return Outcome.failure(problem)
    outcome = scenario_outcome(model_type, only=("mlx-vlm",))
    if outcome.ok is False:
        return outcome
    details = ["language model: a padded batch prefilled without positions, and a row prefilled with "
               "handed positions, decode as each row alone"]
    details += outcome.details if outcome.ok else [f"mlx-vlm BatchGenerator not driven: {outcome.summary}"]
    return Outcome(True, f"mlx-vlm {model_type}: batched prefills place each row at its own positions", details)


# ---------------------------------------------------------------------------------------------
# Probes: two layers, two rows at different offsets, one decode step
# ---------------------------------------------------------------------------------------------

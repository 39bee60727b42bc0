"""Tiny random-weight mlx-vlm Qwen3.5 / Qwen3-VL models, and their batched-text checks.

Built in memory from a config dict through mlx-vlm's own classes (``get_model_and_args``,
``ModelConfig.from_dict``, ``update_module_configs``, ``Model``) - no download, no weights file -
with every floating-point parameter replaced by a deterministic pseudo-random value
(:func:`mlx_lm_patches.selftest.tiny_models._randomize_parameters`). Text model: hidden size 64,
vocabulary 256; Qwen3.5 (and Qwen3.5-MoE, 4 experts) has 4 layers (gated-delta, attention,
gated-delta, attention), Qwen3-VL (and Qwen3-VL-MoE, 4 experts) 2 attention layers. The vision tower is one small block;
text-only generation never runs it.

The checks compare batched text generation with the model's single-sequence path, mlx-vlm's
``generate_step`` of each prompt alone: the same greedy tokens and log-probabilities within
:data:`mlx_lm_patches.selftest.scenarios.LOGPROB_TOLERANCE`. Two batched paths:

* :func:`vlm_batched` - mlx-vlm's own ``BatchGenerator`` fed as ``batch_generate`` feeds it
  (left-padded token rows and their embeddings from ``get_input_embeddings``), except that the
  rows keep their own lengths (``batch_generate`` has the processor pad them to one length and
  drops its attention mask, so they arrive as equal-length rows);
* :func:`mlx_lm_batched` - mlx-lm's ``BatchGenerator`` driving the language model through
  :class:`LanguageModelAdapter` (logits instead of mlx-vlm's ``LanguageModelOutput``).

Importing this module does not import mlx-vlm; :func:`available` says whether it is installed.
"""

import contextlib
import functools
import importlib.util
from typing import Any, Dict, List, Optional

from mlx_lm_patches.engine import bytecode
from mlx_lm_patches.engine.traceless import seeded

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")
PROMPT_LENGTHS = (5, 9, 13)
MAX_TOKENS = 6

_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
           "out_hidden_size": 64, "patch_size": 4, "spatial_patch_size": 4,
           "num_position_embeddings": 16, "deepstack_visual_indexes": []}


def available(model_type: str = "qwen3_5") -> bool:
    """mlx-vlm is installed and has ``model_type``."""
    try:
        return importlib.util.find_spec(f"mlx_vlm.models.{model_type}") is not None
    except ModuleNotFoundError:
        return False


def text_config(model_type: str) -> Dict[str, Any]:
    common = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    if model_type == "qwen3_5_moe":
        return dict(text_config("qwen3_5"), model_type="qwen3_5_moe_text", num_experts=4,
                    num_experts_per_tok=2, shared_expert_intermediate_size=64, moe_intermediate_size=32)
    if model_type == "qwen3_5":
        return dict(common, model_type="qwen3_5_text", num_hidden_layers=4, full_attention_interval=2,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, attention_bias=False,
                    rope_parameters={"type": "default", "mrope_section": [1, 1, 0],
                                     "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if model_type == "qwen3_vl":
        return dict(common, model_type="qwen3_vl_text", num_hidden_layers=2,
                    rope_theta=10000.0, rope_scaling={"type": "default", "mrope_section": [4, 2, 2]})
    if model_type == "qwen3_vl_moe":
        return dict(text_config("qwen3_vl"), model_type="qwen3_vl_moe_text", num_experts=4,
                    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                    moe_intermediate_size=32, norm_topk_prob=True)
    raise KeyError(model_type)


# image placeholder tokens inside the tiny vocabulary (the real ones lie far above 256): its last
# four ids, where :func:`vision_processor`'s tokenizer puts them
IMAGE_TOKENS = {"vision_start_token_id": 252, "vision_end_token_id": 253, "image_token_id": 254,
                "video_token_id": 255}
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def config(model_type: str, images: bool = False) -> Dict[str, Any]:
    return {"model_type": model_type, "vocab_size": 256, "text_config": text_config(model_type),
            "vision_config": dict(_VISION, model_type=model_type), **(IMAGE_TOKENS if images else {})}


def build(model_type: str, seed: int = 1, images: bool = False):
    """A tiny random-weight mlx-vlm model (``Model``: vision tower + ``language_model``);
    ``images``: its image placeholder tokens inside the vocabulary (:data:`IMAGE_TOKENS`)."""
    import mlx.core as mx
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    from mlx_lm_patches.selftest.tiny_models import _randomize_parameters

    cfg = config(model_type, images)
    arch, _ = get_model_and_args(cfg)
    model_config = update_module_configs(arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision"])
    with seeded(seed):  # the caller's random stream is left where it was
        model = arch.Model(model_config)
    _randomize_parameters(model, model_type, seed, mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def prompts() -> List[List[int]]:
    from mlx_lm_patches.selftest.scenarios import prompt_tokens

    return [prompt_tokens(n, seed=n) for n in PROMPT_LENGTHS]


@contextlib.contextmanager
def _no_tqdm_monitor_left():
    """mlx-vlm's chunked prefill opens a (disabled) tqdm bar, and tqdm starts its monitor thread
    for the first bar of a process: a probe stops the one it started."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    before = getattr(tqdm, "monitor", None)
    try:
        yield
    finally:
        started = getattr(tqdm, "monitor", None)
        if before is None and started is not None:
            started.exit()
            tqdm.monitor = None


def single(model, prompt, max_tokens: int = MAX_TOKENS):
    """The reference: mlx-vlm's ``generate_step`` of ``prompt`` alone (text only)."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    from mlx_lm_patches.selftest.scenarios import Decoded

    tokens, logprobs = [], []
    with _no_tqdm_monitor_left():
        steps = generate_step(mx.array([prompt]), model, None, None, max_tokens=max_tokens)
        for token, logprob in steps:
            tokens.append(int(token))
            logprobs.append(logprob)
    mx.eval(logprobs)
    return Decoded(tokens, logprobs)


def vlm_batched(model, rows, max_tokens: int = MAX_TOKENS):
    """``rows`` decoded together by mlx-vlm's ``BatchGenerator``, as ``_generate_batch`` drives
    it; one :class:`Decoded` per row, in order."""
    import types

    import mlx.core as mx
    from mlx_vlm.generate import BatchGenerator
    from mlx_vlm.utils import StoppingCriteria

    from mlx_lm_patches.selftest.scenarios import Decoded

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

    from mlx_lm_patches.selftest.scenarios import Decoded

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


def apc_mixed_prefill_problem(model_type: str = "qwen3_5", max_tokens: int = MAX_TOKENS) -> Optional[str]:
    """mlx-vlm's automatic prefix cache (an ``APCManager`` handed to its ``BatchGenerator``, as
    its server does with ``APC_ENABLED=1``): a 40-token prompt served alone, then two requests
    sent together - one sharing its first 30 tokens, one extending it by 10 - then an
    extension of the latter alone, must each be answered as alone without the cache (greedy
    tokens, chosen log-probabilities within 1e-4). ``None`` if they are; ``"no hit"`` if the
    cache was never hit (nothing shown); else what differs."""
    import types

    import mlx.core as mx
    from mlx_vlm import apc
    from mlx_vlm.utils import StoppingCriteria

    from mlx_lm_patches.selftest.scenarios import Decoded, prompt_tokens

    model = build(model_type)
    language_model = model.language_model
    first = prompt_tokens(40, seed=3)
    shared, extended = first[:30] + prompt_tokens(10, seed=4), first + prompt_tokens(10, seed=5)
    later = extended + prompt_tokens(8, seed=6)  # (the cache keeps few snapshots: the newest)
    generator_class = _generation_module().BatchGenerator
    salted = any("_apc_semantic_hash" in n for n in bytecode.class_names(generator_class))  # >= 0.6.17 keys on it

    def answer(generator, rows):
        kwargs = []
        for row in rows:
            language_model._position_ids = language_model._rope_deltas = None
            kwargs.append(dict(_embeddings(model, mx.array([row])), **({"_apc_semantic_hash": 1} if salted else {})))
        uids = generator.insert(rows, max_tokens, prompt_kwargs=kwargs)
        out = {uid: Decoded([], []) for uid in uids}
        while generator.has_work:
            for r in generator.next()[1]:
                out[r.uid].tokens.append(int(r.token))
                out[r.uid].logprobs.append(mx.array(r.token_logprob))
        return [out[uid] for uid in uids]

    def reference(row):
        language_model._position_ids = language_model._rope_deltas = None
        alone = single(model, row, max_tokens)
        return type(alone)(alone.tokens, [lp.reshape(-1)[t] for lp, t in zip(alone.logprobs, alone.tokens)])

    manager = apc.APCManager()
    processor = types.SimpleNamespace(stopping_criteria=StoppingCriteria([], None))
    generator = generator_class(language_model, processor, max_tokens=max_tokens, prefill_batch_size=2,
                                completion_batch_size=2, compute_logprobs=True, apc_manager=manager)
    try:
        answer(generator, [first])
        together = answer(generator, [shared, extended])
        checks = [("sharing 30 tokens", shared, together[0]), ("extending it", extended, together[1]),
                  ("extending the latter later, alone", later, answer(generator, [later])[0])]
    finally:
        if hasattr(generator, "close"):
            generator.close()
    for name, row, decoded in checks:
        problem = reference(row).compare(decoded)
        if problem:
            return f"mlx-vlm {model_type} with its prefix cache, the request {name}: {problem}"
    stats = getattr(manager, "stats", None)
    hits = sum(getattr(stats, name, 0) or 0 for name in ("exact_hits", "hits"))
    return None if hits else "no hit"


def apc_mixed_prefill_evidence(model_type: str = "qwen3_5"):
    """The probe of ``mlx-vlm-apc-hybrid-batches-cold`` and ``mlx-vlm-apc-hybrid-hits-refused``:
    evidence that requests sent together beside a prefix-cache hit (or, where a lone hit is wrong
    too, a request alone) are answered otherwise than without the cache (or raise); ``None`` if
    they are not; a ``NotNeeded`` where mlx-vlm has no prefix cache."""
    from mlx_lm_patches.engine.contract import NotNeeded

    if importlib.util.find_spec("mlx_vlm.apc") is None:
        return NotNeeded("mlx_vlm.apc missing in this mlx-vlm (no prefix cache): not needed")
    try:
        problem = apc_mixed_prefill_problem(model_type)
    except (ValueError, TypeError) as exc:
        return f"mlx-vlm's mixed prefix-cache prefill raises {type(exc).__name__}: {exc}"
    return None if problem == "no hit" else problem


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


def _generation_module():
    """The module that defines mlx-vlm's ``BatchGenerator`` (``mlx_vlm.generate`` up to 0.5,
    ``mlx_vlm.generate.ar`` from 0.6)."""
    import sys

    generator = importlib.import_module("mlx_vlm.generate").BatchGenerator
    return sys.modules[generator.__module__]


def _drive_rows(model, prompts, max_tokens, prompt_kwargs, attention_mask=None, **generator_kwargs):
    """mlx-vlm (>= 0.5)'s ``BatchGenerator`` on ``prompts`` with their per-row tensors, greedy,
    no stop tokens; one :class:`Decoded` per prompt whose log-probabilities are those of the
    chosen tokens (what its responses carry)."""
    import types

    import mlx.core as mx
    from mlx_vlm.utils import StoppingCriteria

    from mlx_lm_patches.selftest.scenarios import Decoded

    processor = types.SimpleNamespace(stopping_criteria=StoppingCriteria([], None))
    gen = _generation_module().BatchGenerator(
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


def _embeddings(model, input_ids, **kwargs):
    return {k: v for k, v in model.get_input_embeddings(input_ids, None, **kwargs).to_dict().items()
            if v is not None}


def vlm_rows_batched(model, rows, max_tokens: int = MAX_TOKENS, **generator_kwargs):
    """``rows`` decoded together by mlx-vlm (>= 0.5)'s ``BatchGenerator``, each inserted with its
    own embeddings (as its server inserts requests): the generator pads them itself.
    ``generator_kwargs`` go to the generator (e.g. ``prefill_step_size``)."""
    import mlx.core as mx

    model.language_model._position_ids = model.language_model._rope_deltas = None  # text only
    kwargs = [_embeddings(model, mx.array([list(r)])) for r in rows]
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

    module = _generation_module()
    width = max(len(r) for r in rows)
    padded = mx.array([[0] * (width - len(r)) + list(r) for r in rows])
    mask = mx.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    model.language_model._position_ids = model.language_model._rope_deltas = None
    kwargs = module._split_prompt_kwargs_per_row(_embeddings(model, padded, mask=mask), len(rows))
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
    if takes_rows() and not hasattr(_generation_module(), "_split_prompt_kwargs_per_row"):
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

    generator = _generation_module().BatchGenerator
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
    only :func:`mlx_lm_patches.selftest.model_folder.build_tokenizer_files`, vocabulary 256: a
    tokenizer with mlx-vlm's detokenizer and stopping criteria)."""
    import pathlib
    import tempfile

    from mlx_vlm.utils import load_processor

    from mlx_lm_patches.selftest.model_folder import build_tokenizer_files

    with tempfile.TemporaryDirectory() as folder:
        build_tokenizer_files(folder, 256)
        return load_processor(pathlib.Path(folder))


# ChatML whose image parts render as Qwen-VL's placeholder (the processor expands it per image)
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# the image processor's settings for :data:`_VISION` (4-pixel patches, 2 x 2 merge): images are
# resized to multiples of 8 pixels, between 8 x 8 and 32 x 32
IMAGE_PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
                   "max_pixels": 1024, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def write_vision_processor_files(folder, model_type: str, padding_side: Optional[str] = None):
    """The files mlx-vlm's ``load_processor`` reads for ``model_type``'s own (torch-free) Qwen-VL
    processor, written into ``folder``: a tokenizer built locally with the image placeholder
    tokens at :data:`IMAGE_TOKENS`, :data:`VISION_CHAT_TEMPLATE`, ``preprocessor_config.json``
    (:data:`IMAGE_PROCESSOR`) and ``config.json`` (:func:`config` with images). The tokenizer
    pads on ``padding_side`` (unset: the tokenizer's default, the right, as Qwen's tokenizers)."""
    import json
    import pathlib

    from mlx_lm_patches.selftest.model_folder import build_tokenizer_files

    folder = pathlib.Path(folder)
    build_tokenizer_files(folder, 256, VISION_SPECIALS, VISION_CHAT_TEMPLATE)
    if padding_side is not None:
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        settings["padding_side"] = padding_side
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    (folder / "config.json").write_text(json.dumps(config(model_type, images=True), indent=2))
    return folder


def write_model_folder(folder, model_type: str, seed: int = 1):
    """A tiny mlx-vlm ``model_type`` with image tokens (:func:`build` ``images=True``) written as
    a model folder ``mlx_vlm.load`` (and servers built on it) reads: its weights in MLX layout
    (``model.safetensors``, loaded back unchanged) beside :func:`write_vision_processor_files`.
    Returns the folder and the in-memory model."""
    import pathlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_vision_processor_files(folder, model_type)
    model = build(model_type, seed=seed, images=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return folder, model


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


def prefill_positions_scenario(language_module, model_type: str):
    """The scenario of the ``*-prefill-positions`` patches: ``model_type``'s language model
    prefilling a padded batch on mlx-vlm's caches without positions, and prefilled with handed
    positions, decodes as each row alone; and (where driven) rows inserted one by one into
    mlx-vlm's ``BatchGenerator`` equal each prompt alone."""
    from mlx_lm_patches.engine.contract import Outcome

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


def _two_layer_language_model(language_module, model_type: str):
    """``language_module.LanguageModel`` of the tiny ``model_type`` config with two layers,
    random init (seed 0)."""
    import mlx.core as mx

    package = language_module.__name__.rsplit(".", 1)[0]
    configs = importlib.import_module(f"{package}.config")
    model_config = configs.ModelConfig.from_dict(config(model_type))
    model_config.text_config = configs.TextConfig.from_dict(dict(text_config(model_type), num_hidden_layers=2))
    model_config.vision_config = configs.VisionConfig.from_dict(dict(_VISION, model_type=model_type))
    with seeded(0):
        lm = language_module.LanguageModel(model_config.text_config, model_config)
    mx.eval(lm.parameters())
    return lm


def batched_rows_problem(language_module, model_type: str, caches: str = "mlx_lm.models.cache") -> Optional[str]:
    """Evidence that ``language_module.LanguageModel`` (two layers, random init) decodes two rows
    of a batch cache at different offsets (one left-padded) differently from each row alone - or
    raises - or None. The batch prefill starts on empty caches and is given no positions; the
    cache classes are those of the module ``caches`` (mlx-lm's, or mlx-vlm's own from 0.6.4).
    Recurrent caches are finalized after the prefill, as mlx-lm's ``BatchGenerator`` does, so
    only the attention path is probed."""
    import mlx.core as mx

    cache_module = importlib.import_module(caches)
    ArraysCache, BatchKVCache, KVCache = cache_module.ArraysCache, cache_module.BatchKVCache, cache_module.KVCache

    lm = _two_layer_language_model(language_module, model_type)
    def make_cache():
        return lm.make_cache() if hasattr(lm, "make_cache") else [KVCache() for _ in lm.layers]

    rows, last = [[5, 6], [1, 2, 3]], [7, 4]
    want = []
    for row, token in zip(rows, last):
        lm._position_ids = lm._rope_deltas = None  # a new (text) generation
        alone = make_cache()
        lm(mx.array([row]), cache=alone)
        want.append(lm(mx.array([[token]]), cache=alone).logits)
    batch = [ArraysCache(len(c.cache), left_padding=[1, 0]) if isinstance(c, ArraysCache)
             else BatchKVCache([1, 0]) for c in make_cache()]
    lm._position_ids = lm._rope_deltas = None
    try:
        lm(mx.array([[0] + rows[0], rows[1]]), cache=batch)
        for c in batch:
            if isinstance(c, ArraysCache) and hasattr(c, "finalize"):
                c.finalize()
        got = lm(mx.array([[t] for t in last]), cache=batch).logits
    except (ValueError, TypeError) as exc:
        return f"{model_type} language model with a BatchKVCache raises {type(exc).__name__}: {exc}"
    worst = mx.abs(got - mx.concatenate(want)).max().item()
    if worst > 1e-4:
        return (f"{model_type} language model: rows of a batch at different offsets differ from "
                f"the rows alone by {worst:.3g} (row 0's positions, or padding not masked)")
    return None


def handed_positions_decode_problem(language_module, model_type: str) -> Optional[str]:
    """Evidence that ``language_module.LanguageModel`` (two layers, random init), prefilled with
    the ``position_ids`` and ``rope_deltas`` a row's embeddings carry (as mlx-vlm 0.6.4's
    ``BatchGenerator`` hands them over) and then decoding with that ``rope_deltas``, decodes at
    another position than the row prefilled without them, or None."""
    import mlx.core as mx

    lm = _two_layer_language_model(language_module, model_type)
    caches = importlib.import_module("mlx_vlm.models.cache")
    row, token = mx.array([[1, 2, 3]]), mx.array([[4]])
    logits = []
    for handed in ({}, {"position_ids": mx.arange(3)[None], "rope_deltas": mx.zeros((1, 1), dtype=mx.int32)}):
        lm._position_ids = lm._rope_deltas = None  # a new (text) generation
        cache = lm.make_cache() if hasattr(lm, "make_cache") else [caches.KVCache() for _ in lm.layers]
        lm(row, cache=cache, **handed)
        decode = {"rope_deltas": handed["rope_deltas"]} if handed else {}
        logits.append(lm(token, cache=cache, **decode).logits)
    worst = mx.abs(logits[0] - logits[1]).max().item()
    if worst > 1e-4:
        return (f"{model_type} language model prefilled with handed position_ids and rope_deltas "
                f"decodes its next token {worst:.3g} away from the row prefilled without them "
                "(its first decode step recomputes positions from 0)")
    return None


def prefill_positions_problem(language_module, model_type: str) -> Optional[str]:
    """The bugs ``mlx_lm_patches.mechanisms.vlm_positions.prefill_positions_call`` fixes:
    a batched prefill on mlx-vlm's own (empty) batch caches without positions, or a prefill
    given positions then decoding, placing tokens elsewhere than the row alone; or None."""
    return (batched_rows_problem(language_module, model_type, caches="mlx_vlm.models.cache")
            or handed_positions_decode_problem(language_module, model_type))


def gated_delta_advance_problem(language_module) -> Optional[str]:
    """Evidence that ``Qwen3_5GatedDeltaNet.__call__`` leaves a left-padded ``ArraysCache``'s
    padding where it was (so the next step's mask hides the row's new token), or None."""
    import mlx.core as mx
    from mlx_lm.models import cache as lm_cache

    from mlx_lm_patches.engine.traceless import random_state_kept

    try:  # mlx-vlm's own cache classes where it has them (0.7: the layer calls update_window)
        from mlx_vlm.models.cache import ArraysCache
    except ImportError:
        ArraysCache = lm_cache.ArraysCache
    package = language_module.__name__.rsplit(".", 1)[0]
    config_module = importlib.import_module(f"{package}.config")
    with random_state_kept():  # the layer's weights are drawn, and never matter here
        layer = language_module.Qwen3_5GatedDeltaNet(config_module.TextConfig.from_dict(text_config("qwen3_5")))
    cache = ArraysCache(2, left_padding=[1, 0])
    before = cache.left_padding.tolist()
    inputs = mx.zeros((2, 2, 64))
    mx.eval(layer(inputs, mask=cache.make_mask(2), cache=cache))
    after = cache.left_padding.tolist() if cache.left_padding is not None else None
    if after == before:
        return (f"Qwen3_5GatedDeltaNet does not advance its ArraysCache (left padding stays "
                f"{before} after 2 tokens): the next step's mask hides the padded rows' tokens")
    return None


def unpadded_deltas_problem(generation_module) -> Optional[str]:
    """Evidence that ``generation_module._unpad_batch_prompts`` strips a row's padding but keeps
    the ``rope_deltas`` computed against the padded width (text rows of Qwen-VL style models:
    ``max(position) + 1 - width``), or None. Two rows of widths 2 and 3, positions as
    ``get_rope_index`` gives them under the attention mask."""
    import mlx.core as mx

    unpad = getattr(generation_module, "_unpad_batch_prompts", None)
    if unpad is None:
        return None
    mask = mx.array([[0, 1, 1], [1, 1, 1]])
    positions = mx.array([[1, 0, 1], [0, 1, 2]])  # cumsum(mask) - 1, padding at 1
    deltas = positions.max(axis=-1, keepdims=True) + 1 - mask.shape[-1]
    kwargs = [{"position_ids": positions[i:i + 1], "rope_deltas": deltas[i:i + 1]} for i in range(2)]
    rows, kwargs = unpad(mx.array([[0, 5, 6], [7, 8, 9]]), mask, kwargs)
    kept = kwargs[0]["rope_deltas"].reshape(-1)[0].item()
    own = kwargs[0]["position_ids"].max().item() + 1 - len(rows[0])
    if kept != own:
        return (f"_unpad_batch_prompts strips row 0 to {len(rows[0])} tokens (positions "
                f"{kwargs[0]['position_ids'].reshape(-1).tolist()}) but keeps rope_deltas {kept} of the "
                f"padded width (the row alone: {own})")
    return None


def left_padding_deltas_problem(generation_module) -> Optional[str]:
    """Evidence that ``generation_module.BatchGenerator.insert``, on a generator told
    ``existing_left_padding``, keeps a padded row's ``rope_deltas`` of the padded width (the
    row's offset then counts its real tokens only), or None. Two rows of width 3, the first
    left-padded by 1, positions as ``get_rope_index`` gives them under the attention mask; the
    generator is a bare stand-in holding what ``insert`` reads (no model is built)."""
    import inspect
    import types

    import mlx.core as mx

    generator = getattr(generation_module, "BatchGenerator", None)
    if generator is None or "existing_left_padding" not in inspect.signature(generator.__init__).parameters:
        return None
    mask = mx.array([[0, 1, 1], [1, 1, 1]])
    positions = mx.array([[1, 0, 1], [0, 1, 2]])  # cumsum(mask) - 1, padding at 1
    deltas = positions.max(axis=-1, keepdims=True) + 1 - mask.shape[-1]
    kwargs = [{"position_ids": positions[i:i + 1], "rope_deltas": deltas[i:i + 1]} for i in range(2)]
    bare = types.SimpleNamespace(max_tokens=4, logits_processors=[], uid_count=0, _unprocessed_sequences=[],
                                 _existing_left_padding=[1, 0])
    generator.insert(bare, [[0, 5, 6], [7, 8, 9]], 4, prompt_kwargs=kwargs)
    stored = {entry[0]: entry[3] for entry in bare._unprocessed_sequences}
    kept = stored[0]["rope_deltas"].reshape(-1)[0].item()
    own = positions[0, 1:].max().item() + 1 - 2
    if kept != own:
        return (f"BatchGenerator.insert with existing_left_padding [1, 0] keeps row 0's rope_deltas "
                f"{kept} of the padded width (its offset counts its 2 real tokens: the row alone has {own})")
    return None

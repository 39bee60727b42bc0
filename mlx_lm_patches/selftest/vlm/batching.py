"""Batched text generation of the tiny mlx-vlm models
(:mod:`mlx_lm_patches.mechanisms.probing.tiny_vlm`), against each prompt alone.

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
from typing import Any, List, Optional

from mlx_lm_patches.mechanisms.probing.tiny_vlm import (MAX_TOKENS, available, build, embeddings, generation_module,
                                                        single)
from mlx_lm_patches.selftest.vlm.api import batch_generate_padding, takes_rows, unsupported_api, uses_mlx_lm_caches


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


def drive_rows(model, prompts, max_tokens, prompt_kwargs, attention_mask=None, **generator_kwargs):
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
    return drive_rows(model, [list(r) for r in rows], max_tokens, kwargs, **generator_kwargs)


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
        return drive_rows(model, padded, max_tokens, kwargs, attention_mask=mask)
    told = {}
    if "existing_left_padding" in inspect.signature(module.BatchGenerator.__init__).parameters:
        told["existing_left_padding"] = [width - len(r) for r in rows]
    return drive_rows(model, padded.tolist(), max_tokens, kwargs, **told)


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

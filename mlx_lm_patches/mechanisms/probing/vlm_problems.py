"""What the mlx-vlm patches' probes look for: each ``*_problem`` returns evidence of a bug (a
string naming it) or ``None``, on a tiny model of :mod:`~mlx_lm_patches.mechanisms.probing.tiny_vlm`
or on a bare stand-in; the caller's mlx random state is left as it was.

Importing this module does not import mlx-vlm.
"""

import importlib
import importlib.util
from typing import Optional

from mlx_lm_patches.engine import bytecode
from mlx_lm_patches.mechanisms.probing.tiny_vlm import (MAX_TOKENS, build, embeddings, generation_module, single,
                                                        text_config, two_layer_language_model)


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

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded, prompt_tokens

    model = build(model_type)
    language_model = model.language_model
    first = prompt_tokens(40, seed=3)
    shared, extended = first[:30] + prompt_tokens(10, seed=4), first + prompt_tokens(10, seed=5)
    later = extended + prompt_tokens(8, seed=6)  # (the cache keeps few snapshots: the newest)
    generator_class = generation_module().BatchGenerator
    salted = any("_apc_semantic_hash" in n for n in bytecode.class_names(generator_class))  # >= 0.6.17 keys on it

    def answer(generator, rows):
        kwargs = []
        for row in rows:
            language_model._position_ids = language_model._rope_deltas = None
            kwargs.append(dict(embeddings(model, mx.array([row])), **({"_apc_semantic_hash": 1} if salted else {})))
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

    lm = two_layer_language_model(language_module, model_type)
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

    lm = two_layer_language_model(language_module, model_type)
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

"""What the installed mlx-vlm offers the scenarios, read before anything runs: whether its
``BatchGenerator`` takes rows, how ``batch_generate`` hands its padded rows over, whether its
caches are mlx-lm's, and whether its API is one these scenarios drive at all (a changed API
reads "not applicable" instead of a failure of the fix).
"""

import importlib
from typing import Optional

from mlx_lm_patches.mechanisms.probing.tiny_vlm import generation_module


def takes_rows() -> bool:
    """The installed mlx-vlm's ``BatchGenerator`` takes each row with its own prompt tensors
    (``insert(prompts, max_tokens, prompt_kwargs=[...])``, mlx-vlm >= 0.5) rather than one
    padded batch's embeddings through ``next(**kwargs)`` (< 0.5)."""
    import inspect

    generator = getattr(importlib.import_module("mlx_vlm.generate"), "BatchGenerator", None)
    insert = getattr(generator, "insert", None)
    return insert is not None and "prompt_kwargs" in inspect.signature(insert).parameters


def uses_mlx_lm_caches() -> bool:
    """mlx-vlm's cache classes are mlx-lm's (up to 0.6.x); later releases ship their own."""
    import mlx_lm.models.cache as lm_cache
    from mlx_vlm.models import cache as vlm_cache

    return issubclass(vlm_cache.KVCache, lm_cache.KVCache)


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

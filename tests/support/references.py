"""Reference decodes computed once per process.

Several tests compare different features (draft kinds, draft lengths, batching situations)
against the same reference: greedy decoding of one prompt alone, cold prefill, through mlx-lm's
``generate_step``. These helpers compute each such reference once and hand out copies.

* :func:`tiny_greedy` builds the tiny model itself from ``(model_type, seed)``, so the reference
  never comes from a model a test has changed.
* :func:`greedy_of` is for a model object a fixture keeps for the whole module; the model is held
  here so its ``id`` cannot be reused by another object.

The key includes the patches applied at the time: a reference computed on stock mlx-lm is never
handed to a patched test, and the other way round.
"""

from mlx_lm_patches.mechanisms.probing.decoded import Decoded
from mlx_lm_patches.selftest.scenarios import greedy
from mlx_lm_patches.selftest.tiny_models import build_tiny_model

_TINY = {}
_OF_MODEL = {}


def _applied() -> tuple:
    from mlx_lm_patches.engine import core

    return tuple(sorted(pid for pid, r in core.get().records.items() if r.state is core.State.APPLIED))


def _copy(decoded: Decoded) -> Decoded:
    return Decoded(list(decoded.tokens), list(decoded.logprobs))


def tiny_greedy(model_type: str, prompt, max_tokens: int = 8, seed: int = 1) -> Decoded:
    """``greedy(build_tiny_model(model_type, seed), prompt, max_tokens)``, computed once."""
    key = (model_type, seed, tuple(int(t) for t in prompt), max_tokens, _applied())
    if key not in _TINY:
        _TINY[key] = greedy(build_tiny_model(model_type, seed=seed), list(key[2]), max_tokens=max_tokens)
    return _copy(_TINY[key])


def greedy_of(model, prompt, max_tokens: int = 8) -> Decoded:
    """``greedy(model, prompt, max_tokens)`` for a model kept by a fixture, computed once."""
    key = (id(model), tuple(int(t) for t in prompt), max_tokens, _applied())
    if key not in _OF_MODEL:
        _OF_MODEL[key] = (model, greedy(model, list(key[1]), max_tokens=max_tokens))
    return _copy(_OF_MODEL[key][1])

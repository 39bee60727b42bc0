"""Deterministic random weights for tiny models built in memory.

Every floating-point parameter is overwritten with a pseudo-random value derived from
``(seed, parameter path)``, independent of construction order. Parameters with a special role
get values that keep a recurrence stable but far from trivial: ``A_log`` and ``dt_bias`` give
per-step decays between roughly 0.05 and 0.95, RG-LRU and RWKV-7 mixing coefficients sit inside
their useful ranges, norm weights stay near their neutral value. The caller's mlx random stream
is not used (each value is drawn from its own key).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


def _key_for(seed: int, path: str):
    # Independent of construction order and of other parameters, so a
    # parameter gets the same value whatever else the model contains.
    mixed = int(seed) * 0x9E3779B1 + zlib.crc32(path.encode("utf-8"))
    return mx.random.key(mixed % (1 << 63))


def _normal(key, shape, std: float, mean: float = 0.0):
    return mean + std * mx.random.normal(shape=tuple(shape), key=key)


def _uniform(key, shape, low: float, high: float):
    return mx.random.uniform(low=low, high=high, shape=tuple(shape), key=key)


def _inv_softplus(y):
    # log(exp(y) - 1), stable for small y
    return y + mx.log(-mx.expm1(-y))


def _constants(values) -> List[Optional[float]]:
    """For each array, its single value if all its entries are equal, else None; one
    evaluation for all of them (a model has hundreds of parameters)."""
    bounds = [None if v.size == 0 else mx.stack([v.reshape(-1).astype(mx.float32).min(),
                                                 v.reshape(-1).astype(mx.float32).max()])
              for v in values]
    mx.eval([b for b in bounds if b is not None])
    out = []
    for b in bounds:
        lo, hi = (None, None) if b is None else b.tolist()
        out.append(lo if b is not None and lo == hi else None)
    return out


def _fan_in(shape, owner) -> int:
    name = type(owner).__name__ if owner is not None else ""
    if "Conv" in name and len(shape) >= 3:
        # mlx conv weights are (out, kernel, in / groups)
        return max(1, int(math.prod(shape[1:])))
    return max(1, int(shape[-1]))


def _rwkv_mix(key, shape):
    return _uniform(key, shape, 0.1, 0.9)


# Extra factor on the embedding std for families that multiply embeddings
# by sqrt(hidden_size) before the first layer.
_EMBED_SCALE: Dict[str, float] = {"gear": 1.0 / math.sqrt(64)}  # the tiny models' hidden size


# Per-family values for parameters whose meaning the generic rules in
# ``_init_value`` cannot guess: (path suffix, function(key, shape) -> array).
_Init = Callable[[Any, Tuple[int, ...]], Any]


_OVERRIDES: Dict[str, List[Tuple[str, _Init]]] = {
    "rwkv7": [
        # token-shift interpolation coefficients live in [0, 1]
        ("attn.x_r", _rwkv_mix),
        ("attn.x_w", _rwkv_mix),
        ("attn.x_k", _rwkv_mix),
        ("attn.x_v", _rwkv_mix),
        ("attn.x_a", _rwkv_mix),
        ("attn.x_g", _rwkv_mix),
        ("ffn.x_k", _rwkv_mix),
        ("k_k", lambda k, s: _uniform(k, s, 0.7, 1.0)),
        ("k_a", lambda k, s: _uniform(k, s, 0.7, 1.0)),
        ("r_k", lambda k, s: _normal(k, s, 0.1)),
        # per-head group norm of the wkv output: multiplicative, not 1+w
        ("g_norm.weight", lambda k, s: _normal(k, s, 0.1, mean=1.0)),
        ("g_norm.bias", lambda k, s: _normal(k, s, 0.02)),
    ],
    "plamo2": [
        # post-mixer / post-MLP norms are applied as weight + 1/5 and
        # weight + 1/5**1.5; trained weights are far from zero, random ones
        # near zero would shrink every layer's output to a whisper
        ("post_mixer_norm.weight", lambda k, s: _normal(k, s, 0.05, mean=0.8)),
        ("post_mlp_norm.weight", lambda k, s: _normal(k, s, 0.05, mean=0.9)),
    ],
    "baichuan_m1": [
        # weights of the 2-tap (previous, current) key/value convolution
        ("conv_k", lambda k, s: _uniform(k, s, 0.2, 1.0)),
        ("conv_v", lambda k, s: _uniform(k, s, 0.2, 1.0)),
    ],
}


def _init_value(model_type: str, path: str, value, owner, key, tied: bool, const: Optional[float]):
    """A deterministic replacement for the parameter ``path`` (``const``: its single
    value at construction, if all its entries are equal)."""
    shape = value.shape
    leaf = path.rsplit(".", 1)[-1]

    for suffix, fn in _OVERRIDES.get(model_type, ()):
        if path == suffix or path.endswith("." + suffix):
            return fn(key, shape)

    owner_name = type(owner).__name__ if owner is not None else ""

    # --- state-space / linear-recurrence parameters ------------------------
    if leaf == "A_log":
        # A = -exp(A_log) in [-8, -1]
        return mx.log(_uniform(key, shape, 1.0, 8.0))
    if leaf == "dt_bias" or path.endswith("dt_proj.bias"):
        # softplus(dt_bias) = dt, log-uniform in [0.01, 0.3]; together with
        # A this gives per-step decays exp(dt * A) spread over (0.09, 0.99)
        log_dt = _uniform(key, shape, math.log(0.01), math.log(0.3))
        return _inv_softplus(mx.exp(log_dt))
    if leaf == "D":
        return _uniform(key, shape, 0.5, 1.5)
    if leaf == "recurrent_param":
        # RG-LRU: a = exp(-8 * gate * softplus(p)); with gate ~ 0.5 this
        # puts a in roughly (0.6, 0.98)
        a = _uniform(key, shape, 0.6, 0.98)
        return _inv_softplus(-mx.log(a) / 4.0)

    # --- normalisation layers ----------------------------------------------
    is_norm_owner = "Norm" in owner_name
    is_norm_leaf = "norm" in leaf.lower()
    if is_norm_owner or is_norm_leaf:
        if leaf == "bias":
            return _normal(key, shape, 0.02)
        if const is not None and const == 0.0:
            # offset-style norm (applied as 1 + w)
            return _normal(key, shape, 0.05)
        return _normal(key, shape, 0.05, mean=1.0 if const is None else const)

    # --- vectors: biases, router biases, per-channel scales -----------------
    if value.ndim <= 1 or leaf in ("bias", "biases"):
        if const is not None and const == 1.0:
            return _normal(key, shape, 0.05, mean=1.0)
        return _normal(key, shape, 0.02)

    # --- matrices, embeddings, convolutions, expert stacks ------------------
    if const is not None and const == 1.0:
        # per-head scale tables initialised to ones (e.g. plamo2 q/k weights)
        return _normal(key, shape, 0.05, mean=1.0)
    if isinstance(owner, nn.Embedding) or "Embedding" in owner_name:
        # With a tied head a large embedding makes the token's own row win
        # the next-token argmax (greedy decoding repeats the input), so
        # tied tables get std 1/sqrt(dim); separate heads can afford a
        # larger one, which keeps attention averaging from washing out the
        # token identity (random models then fall into short cycles).
        std = 1.0 / math.sqrt(shape[-1]) if tied else 0.5
        return _normal(key, shape, std * _EMBED_SCALE.get(model_type, 1.0))
    return _normal(key, shape, 1.0 / math.sqrt(_fan_in(shape, owner)))


# (model class, model_type, seed, dtype, parameter layout) -> the values randomize_parameters
# chose: they depend on nothing else, and tests build the same tiny models again and again
_VALUES: Dict[Tuple, List[Tuple[str, Any]]] = {}


def randomize_parameters(model: nn.Module, model_type: str, seed: int, dtype) -> None:
    """Every floating-point parameter of ``model`` replaced by a deterministic value derived
    from ``seed`` and its path (see the module docstring), cast to ``dtype``."""
    from mlx.utils import tree_flatten

    modules = dict(model.named_modules())
    flat = tree_flatten(model.parameters())
    owners = {path: modules.get(path.rsplit(".", 1)[0]) if "." in path else model for path, _ in flat}
    layout = tuple((path, tuple(v.shape), str(v.dtype), type(owners[path]).__name__)
                   for path, v in flat if isinstance(v, mx.array))
    cls = type(model)
    key = (cls.__module__, cls.__qualname__, model_type, int(seed), str(dtype), layout)
    if key not in _VALUES:
        tied = not any("lm_head" in path for path, _ in flat)
        floating = [(path, value) for path, value in flat
                    if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating)]
        consts = dict(zip((path for path, _ in floating), _constants([v for _, v in floating])))
        new_params = []
        for path, value in flat:
            if path not in consts:
                new_params.append((path, value))
                continue
            new = _init_value(model_type, path, value, owners[path], _key_for(seed, path), tied, consts[path])
            new_params.append((path, new.astype(dtype)))
        mx.eval([v for _, v in new_params if isinstance(v, mx.array)])
        _VALUES[key] = new_params
    # copies: a test that assigns into a parameter must not change the next model's
    model.load_weights([(path, mx.array(v) if isinstance(v, mx.array) else v) for path, v in _VALUES[key]],
                       strict=True)


def random_like(params, seed):
    """``params`` (name -> array) with every floating-point array replaced by small noise
    drawn from ``seed`` (1-D norm weights around 1); other arrays kept."""
    import mlx.core as mx

    out = {}
    for i, (key, value) in enumerate(sorted(params.items())):
        if not mx.issubdtype(value.dtype, mx.floating):
            out[key] = value
            continue
        noise = 0.05 * mx.random.normal(value.shape, key=mx.random.key(seed + i))
        out[key] = noise + 1.0 if "norm" in key and value.ndim == 1 else noise
    return out

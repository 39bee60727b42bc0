"""internlm3 decodes in batches: its dynamic-NTK rotary base is chosen per row.

Bug
    ``internlm3.DynamicNTKScalingRoPE.__call__`` is internlm2's class (``internlm2-batch-rope``):
    ``if x.shape[1] + offset > max_position_embeddings`` with the ``BatchKVCache``'s per-row
    ``mx.array`` offset crashes every batched decode of internlm3 with ``ValueError: [convert]
    Only length-1 arrays can be converted to Python scalars``.

Fix
    As for internlm2: each row gets the base the stock method computes for that row alone, rows
    of different lengths are prefilled alone (``batch-prefill-per-row``); an int offset runs the
    stock method.

Retire
    When 0.31.3 drops out of the supported range.

Metal
    Same ``mx.fast.rope`` kernel as the stock method, called once per group of rows.
"""

import sys

from mlx_lm_patches.engine.contract import NotNeeded, missing
from mlx_lm_patches.mechanisms.internlm_rope import per_row_dynamic_ntk, per_row_failure

MODULE = "mlx_lm.models.internlm3"
PID = "internlm3-batch-rope"


def _ropes_in_use(module):
    """The rotary embeddings internlm3's ``Attention`` builds, without and with ``rope_scaling``
    of type dynamic (a one-layer-sized config; the weights are never used)."""
    from mlx_lm_patches.engine.traceless import random_state_kept

    base = {"model_type": "internlm3", "hidden_size": 8, "num_hidden_layers": 1,
            "intermediate_size": 8, "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 8}
    ropes = []
    with random_state_kept():  # nn.Linear draws its initial weights
        for scaling in (None, {"rope_type": "dynamic", "factor": 2.0}):
            try:
                ropes.append(module.Attention(module.ModelArgs.from_dict(dict(base, rope_scaling=scaling))).rope)
            except (ValueError, TypeError, KeyError):  # a config this internlm3 rejects
                continue
    return ropes


def probe():
    gone = missing(f"{MODULE}:DynamicNTKScalingRoPE", f"{MODULE}:Attention", f"{MODULE}:ModelArgs")
    if gone is not None:
        return gone
    module = sys.modules[MODULE]
    cls = module.DynamicNTKScalingRoPE
    used = [type(rope) for rope in _ropes_in_use(module)]
    if used and not any(issubclass(t, cls) for t in used):
        # main after #1606: the class is still defined, the attention builds its rope with
        # initialize_rope (dynamic scaling: rope_utils' class, dynamic-ntk-rope-batch)
        names = sorted({f"{t.__module__}.{t.__qualname__}" for t in used})
        return NotNeeded(f"internlm3's attention builds {' / '.join(names)}, not its own "
                         "DynamicNTKScalingRoPE: not needed")
    return per_row_failure(cls)


def apply(p):
    p.wrap(f"{MODULE}:DynamicNTKScalingRoPE.__call__", per_row_dynamic_ntk)


def scenario():
    """internlm3, three prompts batched with rows on both sides of the NTK threshold."""
    from mlx_lm_patches.selftest.tiny_rope_models import scenario_outcome

    return scenario_outcome(PID, "internlm3 dynamic-NTK RoPE")

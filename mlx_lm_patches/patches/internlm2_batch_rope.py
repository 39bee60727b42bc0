"""internlm2 decodes in batches: its dynamic-NTK rotary base is chosen per row.

Bug
    ``internlm2.DynamicNTKScalingRoPE.__call__`` picks its rotary base in Python:
    ``seq_len = x.shape[1] + offset; if seq_len > max_position_embeddings: base = ...``. In
    batched generation ``offset`` is the ``BatchKVCache``'s per-row ``mx.array``, so every batched
    decode (``BatchGenerator``, ``batch_generate``, the server's batched path) crashes with
    ``ValueError: [convert] Only length-1 arrays can be converted to Python scalars``; internlm2
    uses this class for every config. (``x.shape[1]`` is the number of heads of the
    ``(B, heads, L, D)`` input, not ``L``: that is the stock single-sequence behaviour, and it is
    kept.)

Fix
    With per-row offsets, each row gets the base the stock method computes for that row's int
    offset (rows grouped by base, ``mx.fast.rope`` with the group's per-row offsets; see
    ``mlx_lm_patches/mechanisms/rope_rows.py``); an int offset runs the stock method. The base also depends
    on how a prompt is cut into forward passes, so rows of different lengths are prefilled alone
    (``batch-prefill-per-row`` recognises this rotary class); decoding stays batched.

Retire
    When 0.31.3 drops out of the supported range.

Metal
    Same ``mx.fast.rope`` kernel as the stock method, called once per group of rows.
"""

import sys

from mlx_lm_patches.engine.contract import missing
from mlx_lm_patches.mechanisms.internlm_rope import per_row_dynamic_ntk, per_row_failure

MODULE = "mlx_lm.models.internlm2"
PID = "internlm2-batch-rope"


def probe():
    gone = missing(f"{MODULE}:DynamicNTKScalingRoPE")
    if gone is not None:  # (a NotNeeded is falsy)
        return gone
    return per_row_failure(sys.modules[MODULE].DynamicNTKScalingRoPE)


def apply(p):
    p.wrap(f"{MODULE}:DynamicNTKScalingRoPE.__call__", per_row_dynamic_ntk)


def scenario():
    """internlm2, three prompts batched with rows on both sides of the NTK threshold."""
    from mlx_lm_patches.selftest.tiny_rope_models import scenario_outcome

    return scenario_outcome(PID, "internlm2 dynamic-NTK RoPE")

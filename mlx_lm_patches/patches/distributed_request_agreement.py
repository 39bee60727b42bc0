"""Distributed ``mlx_lm.server``: a request that fails to tokenize on some ranks only fails on
every rank, instead of hanging the server.

Bug
    With more than one rank (``mlx.launch ... mlx_lm.server``), rank 0 shares each request and
    every rank runs it, in lockstep: their collectives (the sharded model's ``all_sum``, the next
    request's share) must pair up. ``ResponseGenerator._tokenize`` (chat template, tokenizer)
    runs on every rank, and a rank where it raises answers the request with the error and goes
    on to the next request's share, while the ranks where it worked enter the model forward and
    wait in its collective for that rank. Nothing ever pairs them again: the request never
    ends, nor does any later one. One rank is enough: a chat template or tokenizer file that
    differs between hosts, a host-local fault, a bug that depends on the rank.

Fix
    Wrap ``_tokenize``. In a group of more than one rank, every rank reports whether its call
    raised in one small ``all_sum`` (a flag per rank) - every rank calls ``_tokenize`` for the
    same shared request at the same point of its loop, so these collectives always pair. If
    any rank failed, every rank raises: its own error, or ``RuntimeError("... failed on rank(s)
    N ...")``; each rank's loop then answers (rank 0: the client gets the error) and moves on to
    the next request together. With one process nothing changes (no collective is added).

Affected
    Releases whose server shares requests across ranks (``ResponseGenerator._share_request``):
    0.31.2 - 0.32.2. The probe decides elsewhere.

Upstream
    https://github.com/ml-explore/mlx-lm/blob/v0.32.2/mlx_lm/server.py (``_share_object``,
    ``_tokenize``, the batch loop in ``_generate`` and ``_serve_single``).

Retire
    When mlx-lm agrees on per-request failures across ranks itself.

Metal
    Server control flow and one ``all_sum`` of a few integers per request; no kernel involved.

Not covered
    A failure inside the model forward on one rank only (after the ranks agreed that the
    request is valid) still desynchronises them: they cannot agree without a collective they
    are all in (docs/distributed.md).
"""

import sys

from mlx_lm_patches.engine import bytecode
from mlx_lm_patches.engine.contract import NotNeeded, Outcome
from mlx_lm_patches.mechanisms import server_ranks

SERVER = "mlx_lm.server"


def agree(group, error):
    """Every rank's ``error`` (an exception or None) made common: raise on every rank if any
    rank failed. One ``all_sum`` of a flag per rank."""
    import mlx.core as mx

    flags = mx.zeros((group.size(),), dtype=mx.int32)
    if error is not None:
        flags[group.rank()] = 1
    failed = [rank for rank, flag in enumerate(mx.distributed.all_sum(flags, group=group).tolist()) if flag]
    if error is not None:
        server_ranks.mark_agreed(error)
        raise error
    if failed:
        ranks = ", ".join(map(str, failed))
        refusal = RuntimeError(f"the request failed on rank(s) {ranks} of {group.size()} (see that rank's log); "
                               "every rank refuses it")
        server_ranks.mark_agreed(refusal)
        raise refusal


def _tokenize_on_every_rank(wrapped, instance, args, kwargs):
    group = server_ranks.group()
    if group is None:
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        agree(group, exc)
        raise
    agree(group, None)
    return result


def probe():
    generator = sys.modules[SERVER].ResponseGenerator
    if not hasattr(generator, "_share_request") or not hasattr(generator, "_tokenize"):
        return NotNeeded("this mlx_lm.server does not share requests across ranks")
    # read from the code object, not the source (an install may ship bytecode only)
    if any("distributed" in n for n in bytecode.names(generator._tokenize)):
        return None  # the ranks already agree on a tokenization failure
    return "ResponseGenerator._tokenize fails on one rank without telling the others"


def apply(p):
    p.wrap(f"{SERVER}:ResponseGenerator._tokenize", _tokenize_on_every_rank)


def scenario():
    """Needs ranks: ``tests/test_distributed.py`` launches two (``mlx.launch -n 2``) and fails
    one request on rank 1 only. In one process there is nothing to agree on."""
    return Outcome(None, "needs more than one rank (mlx.launch); proven by tests/test_distributed.py")

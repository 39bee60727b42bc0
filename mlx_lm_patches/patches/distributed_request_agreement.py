"""Distributed ``mlx_lm.server``: a request that fails to tokenize on some ranks only fails on
every rank, instead of hanging the server.

Bug
    Under ``mlx.launch`` every rank runs each shared request in lockstep. A rank whose
    ``ResponseGenerator._tokenize`` raises (a chat template or tokenizer that differs between
    hosts, a host-local fault) answers the error and moves on, while the others wait in the
    model's collective for it: that request and every later one hang.

Fix
    Wrap ``_tokenize``. With more than one rank, every rank reports whether its call raised in
    one small ``all_sum`` (every rank tokenizes the same request at the same point, so these
    collectives pair); if any rank failed, every rank raises (its own error, or "failed on
    rank(s) N") and marks it agreed (``mechanisms/server_ranks.py``), and the ranks move on to
    the next request together. One process: nothing changes.

Retire
    When mlx-lm agrees on per-request failures across ranks itself.

Metal
    Server control flow and one ``all_sum`` of a few integers per request.

Not covered
    A failure inside the model forward on one rank only still desynchronises the ranks
    (``distributed-generation-death`` ends the group; docs/distributed.md).
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

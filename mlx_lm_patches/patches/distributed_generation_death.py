"""Distributed ``mlx_lm.server``: a rank whose generation loop died ends its process, so that
``mlx.launch`` ends the others and every client gets an error, instead of the server hanging.

Bug
    Under ``mlx.launch`` every rank runs the generation loop in lockstep (requests shared from
    rank 0, the sharded forward meeting in collectives). When one rank's loop dies (an exception
    in the forward on that rank only), the others wait forever in their next collective; rank 0
    stays alive and another rank exits 0, which ``mlx.launch`` takes for success: the request in
    flight and every later one hang and no process exits.

Fix
    With more than one rank, a raise out of ``ResponseGenerator._generate`` is logged and ends
    the process with ``EXIT_CODE`` (rank 0 ``GRACE_SECONDS`` later, after its requests in flight
    got the error; other ranks at once); ``mlx.launch`` then ends the rest. In requests served
    alone (``_serve_single``) the reply queue is wrapped: an error the ranks did not agree on
    (``distributed-request-agreement`` marks those they did) ends the rank the same way; an
    error every rank raises alike there ends the server too, where stock answers it. One
    process: nothing changes. Details: docs/distributed.md.

Retire
    When mlx-lm ends (or recovers) a distributed server whose generation loop died on one rank.

Metal
    Server control flow only.
"""

import atexit
import logging
import os
import sys
import threading
import time
from functools import partial

from mlx_lm_patches.engine import bytecode
from mlx_lm_patches.engine.contract import NotNeeded, Outcome
from mlx_lm_patches.mechanisms import server_ranks

SERVER = "mlx_lm.server"
GRACE_SECONDS = 3.0  # for rank 0's handlers to answer the requests in flight with the error
LAST_WORDS_SECONDS = 1.0  # for mlx.launch to forward what the rank wrote last (before mlx 0.32.4 it
# stops reading a rank's output once the rank has exited)
EXIT_CODE = 70  # EX_SOFTWARE

log = logging.getLogger("mlx_lm_patches")


def _end_process():
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(LAST_WORDS_SECONDS)
    os._exit(EXIT_CODE)


def _generate_or_end_the_rank(memo, wrapped, instance, args, kwargs):
    group = server_ranks.group()
    if group is None:
        return wrapped(*args, **kwargs)
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        _end_the_rank(memo, group, "the generation loop", exc)
        raise


class _EndingQueue:
    """A request's reply queue in a request served alone: an error put on it that the ranks did
    not agree on ends the rank (after the error is handed on)."""

    def __init__(self, queue, group, memo):
        self._queue, self._group, self._memo = queue, group, memo

    def put(self, item, *args, **kwargs):
        if isinstance(item, BaseException) and not server_ranks.agreed(item):
            _end_the_rank(self._memo, self._group, "a request served alone", item)
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


def _serve_single_or_end_the_rank(memo, wrapped, instance, args, kwargs):
    """``_serve_single((rqueue, request, args), ...)`` catches a request's error and answers it on
    this rank only, which then goes on to the next request while the others may wait in the
    model's collective: with more than one rank, such an error ends the rank instead."""
    group = server_ranks.group()
    if group is None or not args or not isinstance(args[0], tuple) or len(args[0]) != 3:
        return wrapped(*args, **kwargs)
    rqueue, request, arguments = args[0]
    return wrapped((_EndingQueue(rqueue, group, memo), request, arguments), *args[1:], **kwargs)


ENDING = "the rank is on its way out"  # in the patcher's memo (revert clears it, status lists it)


def _end_the_rank(memo, group, what, exc):
    grace = GRACE_SECONDS if group.rank() == 0 else 0.0  # only rank 0 has clients to answer
    if memo.get(ENDING) is not None:
        return
    memo[ENDING] = what
    log.error("mlx-lm-patches: %s of rank %d of %d stopped on %s: %s; the other ranks "
              "would wait for it forever, so this rank ends in %.0f s (exit code %d) and mlx.launch "
              "ends the others", what, group.rank(), group.size(), type(exc).__name__, exc, grace, EXIT_CODE)
    # A rank other than 0 returns from main once its loop ended: exit code 0, which mlx.launch
    # takes for a rank that completed, leaving the others waiting. So the exit code is ours
    # however the process ends.
    atexit.register(_end_process)
    timer = threading.Timer(grace, _end_process)
    timer.daemon = True
    timer.start()


def probe():
    generator = sys.modules[SERVER].ResponseGenerator
    # read from the code objects, not the sources (an install may ship bytecode only)
    if "_is_distributed" not in bytecode.names(generator.__init__):
        return NotNeeded("this mlx_lm.server does not run distributed")
    ends = [getattr(generator, name, None) for name in ("_run_generate", "_generate")]
    if any(f is not None and any("_exit" in n for n in bytecode.names(f)) for f in ends):
        return None  # mlx-lm ends the process itself (os._exit)
    return "ResponseGenerator keeps a rank alive after its generation loop died (the other ranks wait forever)"


def apply(p):
    p.wrap(f"{SERVER}:ResponseGenerator._generate", partial(_generate_or_end_the_rank, p.memo))
    p.wrap_if_present(f"{SERVER}:ResponseGenerator._serve_single", partial(_serve_single_or_end_the_rank, p.memo))


def scenario():
    """Needs ranks: ``tests/test_distributed.py`` launches two (``mlx.launch -n 2``) and fails
    the model forward on rank 1 only. In one process nothing changes."""
    return Outcome(None, "needs more than one rank (mlx.launch); proven by tests/test_distributed.py")

"""``mlx_lm.server`` answers with an error, instead of hanging, once its generation thread died.

Bug
    ``mlx_lm.server`` generates in one thread; HTTP handlers queue a request and wait for its
    answer without a timeout. An exception the loop does not catch ends the thread, the server
    keeps accepting requests (``/health`` says ok) and every request hangs forever. Seen with
    real inputs: a model or draft that fails to load inside that thread (e.g. ``--draft-model
    mtp`` for a checkpoint without MTP tensors), a chat template that raises on one batched
    request (``Conversation roles must alternate``), transformers 5's chat templates
    (``chat-template-token-ids``).

Fix
    Wrap ``ResponseGenerator._generate`` (the thread's target). When it raises, log the
    exception, hand the error to the requests the dying loop was serving (their reply queues,
    found in the loop's frames), and keep the thread alive as an error responder: every queued
    and later request is answered at once with ``RuntimeError("Cannot generate: the
    mlx_lm.server generation thread stopped on <error>")`` until the server stops. While the loop
    runs nothing changes; the server does not recover until it is restarted.

Retire
    When the oldest supported mlx-lm answers requests once its generation thread died.

Metal
    Server control flow only.
"""

import importlib
import logging
import queue
import sys

from mlx_lm_patches.engine.contract import Outcome

SERVER = "mlx_lm.server"

_POLL_SECONDS = 0.25


def _reply_queues(value, depth=0):
    """Queues reachable from a frame local through dicts, lists and tuples (request tuples
    ``(rqueue, request, args)``, ``batch_results[uid]["rqueue"]``, ...)."""
    if isinstance(value, queue.Queue):
        yield value
    elif depth < 3 and isinstance(value, dict):
        for item in list(value.values()):
            yield from _reply_queues(item, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in list(value):
            yield from _reply_queues(item, depth + 1)


def _in_flight(traceback, requests):
    seen = {id(requests)}
    while traceback is not None:
        for value in list(traceback.tb_frame.f_locals.values()):
            for q in _reply_queues(value):
                if id(q) not in seen:
                    seen.add(id(q))
                    yield q
        traceback = traceback.tb_next


def _generate_or_answer_errors(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        logging.exception("The mlx_lm.server generation thread stopped on %s: %s; every request "
                          "is answered with this error from now on (restart the server)",
                          type(exc).__name__, exc)
        error = RuntimeError(f"Cannot generate: the mlx_lm.server generation thread stopped on "
                             f"{type(exc).__name__}: {exc} (restart the server)")
        requests = instance.requests
        for reply in _in_flight(exc.__traceback__, requests):
            reply.put(error)
        del exc  # the traceback keeps the dead loop's frames alive
        while not getattr(instance, "_stop", False):
            try:
                item = requests.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            reply = item[0] if isinstance(item, tuple) and item else None
            if isinstance(reply, queue.Queue):
                reply.put(error)


def probe():
    generator = sys.modules[SERVER].ResponseGenerator
    if "generation_available" in vars(generator) or "_run_generate" in vars(generator):
        return None  # the server notices a dead generation thread itself (0.32.0+)
    return ("ResponseGenerator waits for its generation thread without a timeout and nothing "
            "notices when that thread dies")


def apply(p):
    p.wrap(f"{SERVER}:ResponseGenerator._generate", _generate_or_answer_errors)


class _Provider:
    """A model provider that is never reached: the loop fails before it needs a model."""

    def load_default(self):  # 0.31.3+ load the default model when the thread starts
        return None

    def __getattr__(self, name):
        raise RuntimeError(f"model_provider.{name} was not expected to be used")


class _FailingOnce(queue.Queue):
    """The request queue; the first time the generation loop takes a request from it, it
    raises instead: an error the loop does not catch (as a model that fails to load, a template
    that raises, ... are on some releases). The request stays queued."""

    failed = False

    def get(self, block=True, timeout=None):
        if not self.failed and self.qsize():
            self.failed = True
            raise RuntimeError("injected failure in the generation loop")
        return super().get(block, timeout)


def scenario():
    """A server's generation loop fails; a request sent afterwards must get an error, not wait
    forever (3 s allowed)."""
    import threading
    from types import SimpleNamespace

    server = importlib.import_module(SERVER)
    request = SimpleNamespace(request_type="chat", messages=[{"role": "user", "content": "hi"}],
                              tools=None, role_mapping=None, prompt="hi")
    model = SimpleNamespace(model="default_model", draft="default_model", adapter=None)
    args = SimpleNamespace(model=model, seed=None, logprobs=-1, max_tokens=4, stop_words=[],
                           logits=SimpleNamespace(logit_bias=None, repetition_penalty=0.0),
                           sampling=None, num_draft_tokens=2, top_logprobs=-1)
    outcome = {}
    excepthook = threading.excepthook
    threading.excepthook = lambda hook_args: None  # the stock thread's traceback is expected
    logging.disable(logging.CRITICAL)  # so is the patched thread's log line
    try:
        generator = server.ResponseGenerator(_Provider(), None)
        generator.requests = _FailingOnce()  # looked up by the loop at every poll

        def ask():
            try:
                generator.generate(request, args)
                outcome["answer"] = "an answer"
            except Exception as exc:
                outcome["answer"] = exc

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(3.0)
        generator._stop = True  # ends the error responder; a stock dead thread is already gone
        generator._generation_thread.join(3.0)
    finally:
        logging.disable(logging.NOTSET)
        threading.excepthook = excepthook
    answer = outcome.get("answer")
    if answer is None:
        return Outcome.failure("after the generation thread died, a request waited more than 3 s "
                               "(it would wait forever)")
    if not isinstance(answer, RuntimeError):
        return Outcome.failure(f"the request got {answer!r}, not an error")
    return Outcome(True, "a dead generation thread: requests get an error at once",
                   [f"injected failure in the generation loop: the request got {answer}"])

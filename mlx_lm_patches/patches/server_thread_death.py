"""``mlx_lm.server`` answers with an error, instead of hanging, once its generation thread died.

Bug
    ``mlx_lm.server`` serves HTTP from many threads and generates in one thread
    (``ResponseGenerator._generate``); handlers put a request on a queue and wait, without a
    timeout, for that thread's answer. Any exception the loop does not catch ends the thread;
    the HTTP side keeps accepting requests (``/health`` still says ok) and every request in
    flight and every later one waits forever. Seen here with real inputs:

    * 0.31.3: the model (or draft) is loaded inside that thread, so a model that fails to
      load - e.g. ``--draft-model mtp`` for a checkpoint whose config declares an MTP head but
      has no ``mtp.*`` tensors, or a draft folder that does not exist - leaves a server that
      never answers (older releases load before serving and exit with the error);
    * 0.28.4 - 0.30.5, batched requests (on 0.28.4: with ``repetition_penalty: 0``): a chat
      template that raises (``raise_exception('Conversation roles must alternate
      user/assistant')``, common in Llama, Mistral, Gemma templates) on one bad request hangs
      that request and every later one (0.30.6 catches it per request);
    * 0.28.4 with transformers 5: the first chat completion (``chat-template-token-ids``).

Fix
    Wrap ``ResponseGenerator._generate`` (the thread's target). When it raises, log the
    exception as the thread would have, hand the error to the requests the dying loop was
    serving (their reply queues, found in the loop's frames), then keep the thread alive as an
    error responder: every queued and later request is answered at once with
    ``RuntimeError("Cannot generate: the mlx_lm.server generation thread stopped on <error>")``
    (a 404 with that message, as the server does for a request it cannot serve). It ends when
    the server stops (``stop_and_join``). While the loop runs nothing changes. The server does
    not recover: it says why it cannot answer until it is restarted.

Affected
    mlx-lm before 0.32.0 (0.32.0 answers "generation thread died" and ``/health`` says
    unavailable).

Upstream
    https://github.com/ml-explore/mlx-lm/issues/1505, https://github.com/ml-explore/mlx-lm/issues/1909,
    https://github.com/ml-explore/mlx-lm/pull/1514; fixed by ``ResponseGenerator._run_generate``
    / ``_await_response`` in https://github.com/ml-explore/mlx-lm/blob/v0.32.0/mlx_lm/server.py.

Retire
    When the oldest supported mlx-lm is 0.32.0.

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

"""Generation works from any thread again when an older mlx-lm runs on mlx >= 0.32.

Bug
    mlx 0.32 binds a stream to the thread that created it. mlx-lm up to 0.31.2 creates its
    ``generation_stream`` with ``mx.new_stream`` when ``mlx_lm.generate`` is imported (the main
    thread) and every generation enters it (``with mx.stream(generation_stream)``). Generating in
    any other thread then fails: ``RuntimeError: There is no Stream(cpu, 0) in current thread``.
    ``mlx_lm.server`` always generates in another thread (the request handler, or its
    generation thread), so with the mlx that ``pip install mlx-lm==0.28.4`` (... 0.31.2) resolves
    to today, the server answers no request; so does an application calling ``stream_generate``
    from a worker thread.

Fix
    Give ``mlx_lm.generate.generation_stream`` the thread-local stream mlx 0.32 offers
    (``mx.new_thread_local_stream``), which is what mlx-lm 0.31.3 itself switched to: each thread
    gets its own stream on the same device. ``mlx_lm.server`` (0.30.6 - 0.31.2 import the name
    from ``mlx_lm.generate``) sees the new object when it is imported afterwards; if it was
    imported before, its copy is replaced too.

Retire
    When the oldest supported mlx-lm is 0.31.3.

Metal
    Same stream kind as mlx-lm 0.31.3 uses on every device.
"""

import gc
import sys
import threading

from mlx_lm_patches.engine.contract import Outcome

GENERATE = "mlx_lm.generate"
SERVER = "mlx_lm.server"


def _works_in_another_thread(stream) -> bool:
    import mlx.core as mx

    result = {}

    def run():
        try:
            with mx.stream(stream):
                mx.eval(mx.zeros(2) + 1)
            result["ok"] = True
        except RuntimeError:
            result["ok"] = False

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return result.get("ok", False)


def probe():
    stream = getattr(sys.modules[GENERATE], "generation_stream", None)
    if stream is None or _works_in_another_thread(stream):
        return None
    return ("the generation_stream of mlx_lm.generate belongs to the thread that imported mlx-lm: "
            "generating in any other thread (mlx_lm.server) fails")


def apply(p):
    import mlx.core as mx

    stream = mx.new_thread_local_stream(mx.default_device())
    p.set(f"{GENERATE}:generation_stream", stream)
    server = sys.modules.get(SERVER)
    if server is not None and "generation_stream" in vars(server):
        p.set(f"{SERVER}:generation_stream", stream)


def scenario():
    """Greedy decoding of a tiny model with ``stream_generate``'s own loop in a worker thread
    (as ``mlx_lm.server`` does), equal to the same decoding in the main thread."""
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE, build_tiny_model

    model = build_tiny_model(DENSE_MODEL_TYPE, seed=1)
    prompt = prompt_tokens(9, seed=2)
    reference = greedy(model, prompt, max_tokens=6)
    result = {}

    def run():
        try:
            result["got"] = greedy(model, prompt, max_tokens=6)
        except Exception as exc:  # keep the text only: the traceback holds the failed graph
            result["error"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    # The failed decoding leaves arrays of the other thread's stream in reference cycles; freed
    # at interpreter exit they make mlx >= 0.32 abort ("terminate called without an active
    # exception", about 1 run in 8 with mlx-lm 0.28.4). Free them now, while mlx is whole.
    gc.collect()
    if "error" in result:
        return Outcome.failure(f"decoding in a worker thread: {result['error']}")
    problem = reference.compare(result["got"])
    if problem:
        return Outcome.failure(f"decoding in a worker thread: {problem}")
    return Outcome(True, "decoding in a worker thread works and equals the main thread's")

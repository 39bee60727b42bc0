"""A bounded load on ``mlx_lm.server`` over loopback, patched vs stock, in one run.

    python benchmarks/server_load.py [--model-type nemotron_h] [--requests 200] [--concurrency 8]
                                     [--max-tokens 16] [--rounds 2] [--no-stock]

Writes a tiny random-weight hybrid model folder (local tokenizer, ChatML template), then, for the
installed package (patches on) and for ``MLX_LM_PATCHES=0`` (stock mlx-lm), starts
``python -m mlx_lm.server`` on 127.0.0.1, warms it up and sends the same requests with the
``openai`` client from ``--concurrency`` threads: shared system prompts, a shared document that
diverges in the last user message, second turns carrying a first turn's answer, and repeats
(``support.server_load.workload``); a third are streamed. Each answer is compared
with its sequential cold reference (greedy, single sequence, computed in this process).

Reported per mode: errors, lost requests, answers differing from the reference, completion
tokens/s, p50/p95 latency; then patched/stock ratios (throughput, p50, p95). Rounds alternate
the two servers (patched, stock, patched, ...), each on a fresh server, and the best round of
each is kept. Stock counts only where it works: a stock server that answers wrong, errs or
hangs is reported as such (its speed is printed for information, marked). On 0.28.4 requests
carry ``repetition_penalty: 0`` so the server batches them (its default 1.0 does not).
Tiny model on CPU: the numbers measure the serving path (batching, caching, HTTP), not a real
model's speed. Run by hand; tests never assert on speed.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# test-only support (the mlx_lm.server harness, hinted drafts) lives in tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="nemotron_h")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per request; after --concurrency errors a run stops")
    parser.add_argument("--no-stock", action="store_true", help="patched server only")
    parser.add_argument("--server-args", default="", help="extra mlx_lm.server arguments")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()  # the reference path is untouched; this only makes 0.28.4 tokenize
    from packaging.version import Version

    from mlx_lm_patches.engine import env as ours
    import machine
    from mlx_lm_patches.engine import versions
    from support.server import serve
    from support.server_load import load_rounds, tiny_workload

    version = versions.mlx_lm().parsed
    extra = {}
    if version < Version("0.29.0"):
        extra["repetition_penalty"] = 0

    base_env = {k: v for k, v in os.environ.items() if k not in ours.ALL_VARIABLES and k != "PYTHONPATH"}
    base_env["HF_HUB_OFFLINE"] = "1"
    modes = {"patched": dict(base_env)}
    if not args.no_stock:
        modes["stock"] = dict(base_env, MLX_LM_PATCHES="0")

    with tempfile.TemporaryDirectory(prefix="server-load-") as tmp:
        folder, reference, jobs, distinct = tiny_workload(tmp, args.model_type, args.requests, args.max_tokens)
        print(machine.header())
        print(f"{args.model_type} "
              f"(tiny, CPU), {args.requests} requests ({distinct} distinct) at concurrency "
              f"{args.concurrency}, max_tokens {args.max_tokens}", flush=True)

        best, broken = load_rounds(
            modes, lambda mode: serve(folder, *args.server_args.split(), env=modes[mode], ready_timeout=180),
            jobs, reference, args.rounds, args.concurrency, args.max_tokens, args.timeout, extra=extra)
    stock_works = "stock" in best and not (best["stock"]["errors"] or best["stock"]["lost"] or best["stock"]["wrong"])
    if "patched" in best and "stock" in best:
        p, s = best["patched"], best["stock"]
        if s["errors"] or s["lost"]:
            print(f"patched/stock: no ratio, stock fails ({s['errors']} errors; first: {s['first_error']})")
        else:
            mark = "" if stock_works else f"   (stock: {s['wrong']} wrong answers; for information only)"
            print(f"patched/stock: throughput {p['tokens_per_second'] / s['tokens_per_second']:.2f}x, "
                  f"p50 {p['p50_s'] / s['p50_s']:.2f}x, p95 {p['p95_s'] / s['p95_s']:.2f}x{mark}")
    if args.json:
        print(json.dumps({"best": best, "broken": broken, "stock_works": stock_works}))
    patched = best.get("patched")
    return 0 if patched and not (patched["errors"] or patched["lost"] or patched["wrong"]) else 1


if __name__ == "__main__":
    sys.exit(main())

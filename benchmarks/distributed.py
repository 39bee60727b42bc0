"""``mlx_lm.server`` on one process vs two ``mlx.launch`` ranks, same tiny model, one run.

    python benchmarks/distributed.py [--model-type qwen3_5] [--pipeline] [--requests 60]
                                     [--concurrency 4] [--max-tokens 16] [--rounds 1] [--draft-model-mtp]

Writes a tiny random-weight hybrid model folder, then starts ``python -m mlx_lm.server`` alone
and under ``mlx.launch -n 2 --backend ring`` (tensor parallel, or ``--pipeline``), both with the
installed package (``--draft-model-mtp``: a checkpoint with an MTP head, both servers run with
``--draft-model mtp``), and sends each the same requests (``support.server_load.workload``: shared
and diverging prefixes, second turns) from ``--concurrency`` threads with the ``openai`` client.
Every answer is compared with its cold single-sequence reference computed in this process.

Reported per mode: errors, lost requests, wrong answers, completion tokens/s, p50/p95 latency,
then the 2-rank/1-process ratios. Rounds alternate the modes, each on a fresh server; the best
round of each is kept. On one machine both ranks share its cores and talk over loopback, and
the model is tiny: the ratio measures the cost of the collectives on the serving path, not what
two Macs gain on a real model. Run by hand; tests never assert on speed.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# test-only support (the mlx_lm.server harness, the load) lives in tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="qwen3_5")
    parser.add_argument("--pipeline", action="store_true", help="pipeline instead of tensor parallel")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="rounds per mode, alternating")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--draft-model-mtp", action="store_true",
                        help="a checkpoint with an MTP head, both servers with --draft-model mtp")
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()

    from mlx_lm_patches.engine import env as ours
    import machine
    from support.server import serve
    from support.server_load import load_rounds, tiny_workload

    env = {k: v for k, v in os.environ.items() if k not in ours.ALL_VARIABLES and k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    layout = "pipeline" if args.pipeline else "tensor"
    draft = ("--draft-model", "mtp") if args.draft_model_mtp else ()
    modes = {"1 process": dict(ranks=1, extra=draft),
             "2 ranks": dict(ranks=2, extra=draft + (("--pipeline",) if args.pipeline else ()))}

    with tempfile.TemporaryDirectory(prefix="distributed-bench-") as tmp:
        folder, reference, jobs, distinct = tiny_workload(tmp, args.model_type, args.requests, args.max_tokens,
                                                         mtp=args.draft_model_mtp)
        print(machine.header())
        print(f"{args.model_type} "
              f"(tiny, CPU, {os.cpu_count()} cores{', --draft-model mtp' if draft else ''}), 2 ranks: {layout} "
              f"parallel, {args.requests} requests "
              f"({distinct} distinct) at concurrency {args.concurrency}, max_tokens {args.max_tokens}",
              flush=True)

        best, broken = load_rounds(
            modes, lambda mode: serve(folder, *modes[mode]["extra"], ranks=modes[mode]["ranks"],
                                      env=env, ready_timeout=180),
            jobs, reference, args.rounds, args.concurrency, args.max_tokens, args.timeout)
    one, two = best.get("1 process"), best.get("2 ranks")
    if one and two:
        print(f"2 ranks / 1 process: throughput {two['tokens_per_second'] / one['tokens_per_second']:.2f}x, "
              f"p50 {two['p50_s'] / one['p50_s']:.2f}x, p95 {two['p95_s'] / one['p95_s']:.2f}x")
    if args.json:
        print(json.dumps({"best": best, "broken": broken}))
    ok = [best.get(m) for m in modes]
    return 0 if all(r and not (r["errors"] or r["lost"] or r["wrong"]) for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())

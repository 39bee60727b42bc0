"""Batched vs one-at-a-time greedy decoding of a hybrid model, side by side in one run.

    python benchmarks/batched_vs_sequential.py [--model-type qwen3_next] [--tokens 64]

For 4 and 8 concurrent prompts: the time to decode them all one after another with
``generate_step`` (the reference path) and together with mlx-lm's ``BatchGenerator`` (with the
installed patches active), as tokens/s and the ratio batched/sequential. Also says whether the
batched tokens equal the sequential ones. Tiny random-weight model on whatever device mlx uses
(CPU on Linux): the numbers measure the framework path, not a real model's speed.
Run by hand; tests never assert on speed.
"""

import argparse
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="qwen3_next")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    import machine
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import batched_greedy, greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    model = build_tiny_model(args.model_type, seed=0)
    print(machine.header())
    print(f"{args.model_type} (tiny), {args.tokens} new tokens per prompt")
    print(f"{'prompts':>7} {'sequential tok/s':>17} {'batched tok/s':>14} {'ratio':>6}  exact")
    for n in args.batches:
        prompts = [prompt_tokens(args.prompt_len + 3 * i, seed=i) for i in range(n)]
        greedy(model, prompts[0], max_tokens=4)  # warm up compiled kernels
        seq_best = bat_best = float("inf")
        reference = got = None
        for _ in range(args.repeats):
            start = time.perf_counter()
            reference = [greedy(model, p, max_tokens=args.tokens) for p in prompts]
            seq_best = min(seq_best, time.perf_counter() - start)
            try:
                start = time.perf_counter()
                got = batched_greedy(model, prompts, max_tokens=args.tokens)
                bat_best = min(bat_best, time.perf_counter() - start)
            except Exception as exc:
                got = exc
                break
        total = n * args.tokens
        if isinstance(got, Exception):
            print(f"{n:>7} {total / seq_best:>17.1f} {'crashes':>14} {'-':>6}  {type(got).__name__}: {got}")
            continue
        exact = all(r.compare(g) is None for r, g in zip(reference, got))
        print(f"{n:>7} {total / seq_best:>17.1f} {total / bat_best:>14.1f} "
              f"{seq_best / bat_best:>5.2f}x  {'yes' if exact else 'NO'}")


if __name__ == "__main__":
    main()

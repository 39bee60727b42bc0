"""Speculation on a gated-delta hybrid with the states after each token of a verify pass kept
(``mechanisms/step_states.py``) against the same without them (a rollback restores the state
before the pass and re-runs the accepted tokens in front of the next verify pass), side by side.

    python benchmarks/step_states.py [--family qwen3_5] [--accept 0.6 0.8] [--ks 3] [--tokens 64]
        [--repeats 5] [--hidden 1024] [--draft model|mtp]

One sequence through mlx-lm's ``speculative_generate_step`` (``--ks``: fixed draft lengths, with
adaptive drafting off; ``0``: adaptive drafting, at most 3), the model of
``benchmarks/speculation_costs.py`` (real proportions: 24 layers, an 8192-token vocabulary), its
separate draft model or its one-layer MTP head, acceptance hinted as there. Runs alternate
with / without, the ratio with / without is the median over ``--repeats`` pairs; every run's
tokens are checked against greedy decoding. Run by hand; tests never assert on speed.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test-only support: hints


def without_step_states(run):
    """``run()`` with no states recorded between a pass's tokens (the journal replays)."""
    from mlx_lm_patches.mechanisms import journal

    recorder = journal.StepStates
    journal.StepStates = lambda model: None
    try:
        return run()
    finally:
        journal.StepStates = recorder


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--accept", type=float, nargs="+", default=[0.6, 0.8])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--draft", choices=("model", "mtp"), default="model")
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    from mlx_lm import load

    import machine
    from speculation_costs import HintedDraft, accepts, adaptive_drafting, describe, draft_proportions, proportions
    from speculation_costs import speculate
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model
    from support.mtp_drafts import hinted_draft

    shape = proportions(args.family, args.layers, args.hidden, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        model = load(str(write_mtp_checkpoint(tmp, args.family, dtype="float32", config_overrides=shape).folder))[0]
    prompt = prompt_tokens(16, vocab=256, seed=5)
    ref = greedy(model, prompt, max_tokens=args.tokens)
    sequence = prompt + ref.tokens
    if args.draft == "mtp":
        make_draft = lambda hint: hinted_draft(model, sequence, hint=hint)  # noqa: E731
    else:
        small = build_tiny_model(args.family, seed=1, overrides=draft_proportions(args.family, args.hidden, args.vocab))
        make_draft = lambda hint: HintedDraft(small, sequence, hint)  # noqa: E731
    print(machine.header())
    print(f"{args.family}: {describe(shape)}; draft: {args.draft}; {args.tokens} tokens, "
          f"median of {args.repeats} alternating pairs")
    print(f"{'accept':>6} {'k':>9} | {'with (s)':>8} {'without (s)':>11} | {'with/without':>12} | exact")
    for share in args.accept:
        hint = accepts(share)
        for k in args.ks:
            adaptive_drafting(k == 0)
            most = k or 3

            def run():
                start = time.perf_counter()
                got, _ = speculate(model, make_draft(hint), prompt, args.tokens, most)
                return time.perf_counter() - start, ref.compare(got) is None

            run(), without_step_states(run)  # warm-up
            ratios, times, exact = [], {"with": [], "without": []}, True
            for _ in range(args.repeats):
                (a, ok_a), (b, ok_b) = run(), without_step_states(run)
                times["with"].append(a)
                times["without"].append(b)
                ratios.append(b / a)
                exact = exact and ok_a and ok_b
            adaptive_drafting(True)
            label = f"k={k}" if k else "adaptive"
            print(f"{share:>6.0%} {label:>9} | {statistics.median(times['with']):>8.2f} "
                  f"{statistics.median(times['without']):>11.2f} | {statistics.median(ratios):>11.2f}x | {exact}",
                  flush=True)


if __name__ == "__main__":
    main()

"""Speculative decoding called again and again with the same model and draft (a server, an engine
calling ``stream_generate`` per request, a user asking for several answers): adaptive drafting's
later sequences start from the costs and acceptance the one before measured
(``mechanisms/adaptive.py``, "a sequence starts from what the last one left"); the first one of
a process measures them.

    python benchmarks/repeated_speculation.py [--families qwen3_5 nemotron_h deepseek_v3]
        [--tokens 128] [--repeats 5] [--ks 1 2 3] [--tiny] [--drafts "never accepted" "as costly" ...]

Per family (``--tiny``: the test-suite's tiny models, 2-4 layers, where a round's fixed costs
weigh most; otherwise ``speculation_costs.proportions``: 24 layers of width 256, a draft of the
family's smallest pattern at half the width), with ``speculative_generate_step`` (greedy,
``num_draft_tokens`` = the largest of ``--ks``) against plain ``generate_step``, three drafts:

* ``never accepted``: a draft model of other random weights;
* ``as costly``: the main model as its own draft (every draft accepted, none pays);
* ``cheap, accepted``: the draft model, hinted to propose the true token everywhere.

Side by side in one run, interleaved, each speculative run set against the mean of the plain
runs on either side of it, the median over ``--repeats``:

* ``first``: the memory forgotten before the run (every run is a process's first sequence);
* ``later``: the run after such a first one, same model and draft objects;
* ``fixed k``: adaptive drafting off (stock's fixed draft length), for each of ``--ks``.

Every run's tokens are checked against greedy decoding; runs whose log-probabilities differ by more
than 1e-4 are named (with an optimized BLAS a verify pass of several tokens rounds differently
from a step: docs/speculation-speed.md). Run by hand; tests never assert on speed.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DRAFTS = ("never accepted", "as costly", "cheap, accepted")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen3_5", "nemotron_h", "deepseek_v3"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="the test-suite's tiny models")
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=list(DRAFTS))
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    from speculation_costs import HintedDraft, adaptive_drafting, draft_proportions, proportions, speculate

    from mlx_lm_patches.patches.adaptive_drafting import forget_sequences
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    vocab = 256 if args.tiny else 8192
    print(f"{args.tokens} tokens, median of {args.repeats}; ratio to plain generate_step "
          f"({'tiny models' if args.tiny else f'24 layers of width {args.hidden}'})")
    for family in args.families:
        main_shape = None if args.tiny else proportions(family, 24, args.hidden, vocab)
        draft_shape = None if args.tiny else draft_proportions(family, args.hidden, vocab)
        model = build_tiny_model(family, seed=1, overrides=main_shape)
        small = build_tiny_model(family, seed=2, overrides=draft_shape)
        prompt = prompt_tokens(16, vocab=min(vocab, 256), seed=5)
        reference = greedy(model, prompt, max_tokens=args.tokens)
        sequence = prompt + reference.tokens
        drafts = {"never accepted": small, "as costly": model,
                  "cheap, accepted": HintedDraft(small, sequence, lambda t: True)}

        def plain():
            start = time.perf_counter()
            greedy(model, prompt, max_tokens=args.tokens)
            return time.perf_counter() - start

        print(f"\n{family}")
        print(f"  {'draft':<16} {'first':>7} {'later':>7} " + " ".join(f"{f'k={k}':>7}" for k in args.ks)
              + "  later/first  later/best")
        for name, draft in ((name, drafts[name]) for name in args.drafts):
            runs = {"first": [], "later": [], **{k: [] for k in args.ks}}
            inexact = set()
            speculate(model, draft, prompt, 4, max(args.ks))  # warm-up
            before = plain()
            for _ in range(args.repeats):
                for run in runs:
                    adaptive_drafting(not isinstance(run, int))
                    if run == "first":
                        forget_sequences()
                    start = time.perf_counter()
                    got, _ = speculate(model, draft, prompt, args.tokens, run if isinstance(run, int) else max(args.ks))
                    spent = time.perf_counter() - start
                    after = plain()
                    runs[run].append((before + after) / 2 / spent)
                    before = after
                    assert got.tokens == reference.tokens, f"{family}, {name}, {run}: tokens differ from greedy"
                    if reference.compare(got) is not None:  # log-probabilities beyond 1e-4
                        inexact.add(run)
            adaptive_drafting(True)
            median = {run: statistics.median(ratios) for run, ratios in runs.items()}
            best = max([1.0] + [median[k] for k in args.ks])
            print(f"  {name:<16} {median['first']:>6.2f}x {median['later']:>6.2f}x "
                  + " ".join(f"{median[k]:>6.2f}x" for k in args.ks)
                  + f"  {median['later'] / median['first']:>10.2f}x  {median['later'] / best:>9.2f}x"
                  + (f"  (log-probabilities beyond 1e-4: {', '.join(map(str, sorted(inexact, key=str)))})" if inexact else ""))
    print("\nlater/best: against the better of plain decoding and the best fixed k")


if __name__ == "__main__":
    main()

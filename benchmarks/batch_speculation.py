"""Concurrent requests with a draft model: batched speculation against batched greedy decoding and
against speculative requests served one at a time (what ``mlx_lm.server --draft-model`` did).

    python benchmarks/batch_speculation.py [--rows 4 8] [--accept 0 0.8] [--tokens 48] [--repeats 3]
        [--family qwen3_5] [--k 3]

Models with real proportions (``benchmarks/speculation_costs.py``'s ``proportions``): the main
model 24 layers of width 256 with an 8192-token vocabulary, the draft the family's smallest pattern
at half the width (its cost per token, about 1/10 of the main model's, is printed). Acceptance is
controlled: the draft runs in full and then proposes each row's true next token (from a greedy
reference run) at a pseudo-random share of the positions, its own proposal elsewhere.

Per row count and acceptance, side by side in one process (interleaved runs, best of
``--repeats``), aggregate tokens per second of:

* ``greedy``: ``BatchGenerator(model)``, every row at once (what the server does without a draft);
* ``batched spec``: ``BatchGenerator(model, draft_model=draft, num_draft_tokens=k)`` (patch
  ``batch-speculative-decoding``);
* ``one at a time``: each request through ``speculative_generate_step`` after the previous one
  (what the server did with ``--draft-model``: adaptive drafting on, as by default).

Every row's tokens are checked against the greedy reference. Run by hand; tests never assert on
speed. CPU numbers: ratios only.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def hint(share):
    return lambda row, target: random.Random(row * 100003 + target * 7919 + 13).random() < share


def _held(cache):
    """Tokens each row of a cache list holds (from its first attention leaf), or None."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.caches import flat_caches

    for c in flat_caches(cache or []):
        offset = getattr(c, "offset", None)
        if isinstance(offset, mx.array):
            return offset.tolist()
        if isinstance(offset, int) and hasattr(c, "keys"):
            return [offset]
    return None


class Hinted:
    """The draft model, its proposal for each row's next position replaced by the true token where
    ``hinted(row, position)``. ``sequences``: each row's prompt + greedy continuation; ``rows``:
    which request each batch row is (set by the caller as rows join and leave)."""

    def __init__(self, model, sequences, hinted):
        self.model, self.sequences, self.hinted = model, sequences, hinted
        self.rows = list(range(len(sequences)))

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        logits = self.model(inputs, cache=cache, **kwargs)
        held = _held(cache)
        if held is None or inputs.shape[1] != 1 or len(held) != logits.shape[0]:
            return logits
        bonus = mx.zeros(logits.shape)
        for b, (row, target) in enumerate(zip(self.rows, held)):
            sequence = self.sequences[row]
            if target < len(sequence) and self.hinted(row, target):
                bonus[b, -1, sequence[target]] = 1e4
        return logits + bonus

    def __getattr__(self, name):
        return getattr(self.model, name)


def greedy_batch(model, prompts, tokens):
    return _batch(model, prompts, tokens)


def spec_batch(model, draft, prompts, tokens, k):
    return _batch(model, prompts, tokens, draft=draft, num_draft_tokens=k)


def _batch(model, prompts, tokens, draft=None, **options):
    """Every prompt through one ``BatchGenerator`` (with ``draft_model=draft`` if given): each
    row's tokens. A ``Hinted`` draft is told which request each batch row is, round by round."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=tokens, **(dict(draft_model=draft, **options) if draft else {}))
    uids = gen.insert([list(p) for p in prompts], [tokens] * len(prompts))
    out = {u: [] for u in uids}
    done = 0
    while done < len(uids):
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
            done += r.finish_reason is not None
        if draft is not None:
            draft.rows = [uids.index(u) for u in gen._generation_batch.uids]
    gen.close()
    return [out[u] for u in uids]


def one_at_a_time(model, draft, prompts, tokens, k):
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    results = []
    for row, prompt in enumerate(prompts):
        draft.rows = [row]
        steps = speculative_generate_step(mx.array(prompt), model, draft, max_tokens=tokens, num_draft_tokens=k)
        results.append([int(t) for (t, _, _), _ in zip(steps, range(tokens))])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--accept", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    import mlx.core as mx

    from speculation_costs import describe, draft_proportions, proportions
    from mlx_lm_patches.selftest.scenarios import prompt_tokens
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    main_shape = proportions(args.family, args.layers, args.hidden, args.vocab)
    draft_shape = draft_proportions(args.family, args.hidden, args.vocab)
    model = build_tiny_model(args.family, seed=1, overrides=main_shape)
    draft_model = build_tiny_model(args.family, seed=2, overrides=draft_shape)
    step = lambda m: _step_seconds(m, args.vocab)  # noqa: E731
    main_cost, draft_cost = step(model), step(draft_model)
    print(f"{args.family}: main {describe(main_shape)}; draft {describe(draft_shape)}, "
          f"a draft step {draft_cost / main_cost:.2f} of a main step; k = {args.k}, {args.tokens} tokens a request")
    print(f"{'rows':>4} {'accept':>6} | {'greedy tok/s':>12} {'batched spec':>12} {'one at a time':>13} | "
          f"{'spec/greedy':>11} {'spec/one-at-a-time':>18} | exact")
    for rows in args.rows:
        prompts = [prompt_tokens(20 + 7 * i, vocab=args.vocab, seed=i + 1) for i in range(rows)]
        reference = greedy_batch(model, prompts, args.tokens)
        sequences = [p + r for p, r in zip(prompts, reference)]
        for share in args.accept:
            draft = Hinted(draft_model, sequences, hint(share))
            best = {"greedy": 1e9, "spec": 1e9, "single": 1e9}
            exact = True
            for _ in range(args.repeats):
                for name, run in (("greedy", lambda: greedy_batch(model, prompts, args.tokens)),
                                  ("spec", lambda: spec_batch(model, draft, prompts, args.tokens, args.k)),
                                  ("single", lambda: one_at_a_time(model, draft, prompts, args.tokens, args.k))):
                    start = time.perf_counter()
                    got = run()
                    best[name] = min(best[name], time.perf_counter() - start)
                    exact = exact and got == reference
            total = rows * args.tokens
            rate = {name: total / seconds for name, seconds in best.items()}
            print(f"{rows:>4} {share:>6.0%} | {rate['greedy']:>12.1f} {rate['spec']:>12.1f} {rate['single']:>13.1f} | "
                  f"{rate['spec'] / rate['greedy']:>10.2f}x {rate['spec'] / rate['single']:>17.2f}x | {exact}")
    mx.clear_cache()


def _step_seconds(model, vocab, repeats=20):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[1] * 64]), cache=cache)
    x = mx.array([[5]])
    mx.eval(model(x, cache=cache))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(model(x, cache=cache))
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    main()

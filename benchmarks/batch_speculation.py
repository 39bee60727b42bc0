"""Concurrent requests with a draft model or the MTP head: batched speculation against batched
greedy decoding and against speculative requests served one at a time (what ``mlx_lm.server
--draft-model`` did).

    python benchmarks/batch_speculation.py [--rows 4 8] [--accept 0 0.8] [--tokens 48] [--repeats 3]
        [--family qwen3_5] [--k 3] [--draft model|mtp] [--prompt 20] [--moving-rows]

Models with real proportions (``benchmarks/speculation_costs.py``'s ``proportions``): the main
model 24 layers of width 256 with an 8192-token vocabulary; the draft (``--draft model``) the
family's smallest pattern at half the width (its cost per token, about 1/10 of the main model's,
is printed), or (``--draft mtp``) the model's own one-layer MTP head, written to disk with the
checkpoint and loaded. Acceptance is controlled (``tests/support/batch_hints.py``,
``tests/support/mtp_drafts.py``): the draft runs in full, then its pick for a row's next
position is the true token (from a greedy reference run) at a pseudo-random share of the
positions, its own proposal elsewhere.

Per row count and acceptance, side by side in one process (interleaved runs, best of
``--repeats``), aggregate tokens per second of:

* ``greedy``: ``BatchGenerator(model)``, every row at once (what the server does without a draft);
* ``batched spec``: ``BatchGenerator(model, draft_model=draft, num_draft_tokens=k)`` (patch
  ``batch-speculative-decoding``);
* ``one at a time``: each request through ``speculative_generate_step`` after the previous one
  (what the server did with ``--draft-model``: adaptive drafting on, as by default).

Beside the end-to-end ratio (prompts included), ``decoding: spec/greedy`` compares only the
decoding: from the moment every row has its first token to the last one (mlx-lm reports prompt
and generation speeds apart in the same way). Every row's prefill is the same for both and, on
this CPU, where mlx-lm's recurrences run a token at a time, a large share of a short request.

Every row's tokens are checked against the greedy reference. Run by hand; tests never assert on
speed. CPU numbers: ratios only.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test-only support: hints


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
    """A draft model for one request at a time, its proposal for the row's next position replaced
    by the true token where ``hinted(row, position)`` (``row``: set by the caller)."""

    def __init__(self, model, sequences, hinted):
        self.model, self.sequences, self.hinted = model, sequences, hinted
        self.row = 0

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        logits = self.model(inputs, cache=cache, **kwargs)
        held = _held(cache)
        if held is None or inputs.shape[1] != 1:
            return logits
        sequence, target = self.sequences[self.row], held[0]
        if target < len(sequence) and self.hinted(self.row, target):
            return logits + mx.zeros(logits.shape).at[..., -1, sequence[target]].add(1e4)
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


def greedy_batch(model, prompts, tokens, timing=None):
    return _batch(model, prompts, tokens, timing=timing)


def spec_batch(model, draft, prompts, tokens, k, sequences, hinted, timing=None):
    return _batch(model, prompts, tokens, draft, sequences, hinted, timing=timing, num_draft_tokens=k)


def _batch(model, prompts, tokens, draft=None, sequences=None, hinted=None, timing=None, **options):
    """Every prompt through one ``BatchGenerator`` (with ``draft_model=draft`` if given, its
    proposals hinted towards ``sequences``): each row's tokens. ``timing`` (a dict), if given,
    gets ``"decode"``: the seconds from the moment every row has its first token (the prompts'
    prefill behind them) to the last token."""
    from mlx_lm.generate import BatchGenerator

    from support.batch_hints import hint_proposals

    gen = BatchGenerator(model, max_tokens=tokens, **(dict(draft_model=draft, **options) if draft else {}))
    uids = gen.insert([list(p) for p in prompts], [tokens] * len(prompts))
    if draft is not None:
        row = {uid: i for i, uid in enumerate(uids)}
        hint_proposals(gen, {uid: sequences[i] for i, uid in enumerate(uids)},
                       lambda uid, target: hinted(row[uid], target))
    out = {u: [] for u in uids}
    done, started, first = 0, 0, None
    while done < len(uids):
        for r in gen.next_generated():
            started += not out[r.uid]
            out[r.uid].append(int(r.token))
            done += r.finish_reason is not None
        if first is None and started == len(uids):
            first = time.perf_counter()
    if timing is not None:
        timing["decode"] = time.perf_counter() - first
    gen.close()
    return [out[u] for u in uids]


def going_back(run, *args):
    """``run(*args)`` with no recurrent states recorded per token: a hybrid row that rejected goes
    back to the round's start and feeds its accepted tokens again in the next round."""
    from mlx_lm_patches.mechanisms import batch_speculation

    recorder = batch_speculation.StepStates
    batch_speculation.StepStates = lambda model: None
    try:
        return run(*args)
    finally:
        batch_speculation.StepStates = recorder


def moving_rows(run, *args):
    """``run(*args)`` with attention rows that drop more rejected positions than others moved right
    by the difference every round (before 7 December), not kept in place, masked."""
    from mlx_lm_patches.mechanisms import batch_speculation, kv_gaps

    in_place = kv_gaps.drop_newest
    kv_gaps.drop_newest = lambda c, extra: batch_speculation._move_right(c, extra) if any(extra) else None
    try:
        return run(*args)
    finally:
        kv_gaps.drop_newest = in_place


def one_at_a_time(model, draft, prompts, tokens, k, sequences, hinted):
    """Each request through ``speculative_generate_step`` after the previous one; ``draft``: a
    ``Hinted`` draft model, or ``"mtp"`` (the model's head, hinted as ``support/mtp_drafts`` does)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from support.mtp_drafts import hinted_draft

    results = []
    for row, prompt in enumerate(prompts):
        if draft == "mtp":
            row_draft = hinted_draft(model, sequences[row], hint=lambda target, row=row: hinted(row, target))
        else:
            row_draft, draft.row = draft, row
        steps = speculative_generate_step(mx.array(prompt), model, row_draft, max_tokens=tokens, num_draft_tokens=k)
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
    parser.add_argument("--draft", choices=("model", "mtp"), default="model",
                        help="a separate draft model, or the main model's MTP head")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--going-back", action="store_true",
                        help="also batched spec with hybrid rows going back to the round's start on a "
                             "rejection (no step states: before 6 December), side by side")
    parser.add_argument("--moving-rows", action="store_true",
                        help="also batched spec with attention rows moved right every round to drop "
                             "rejected positions (before 7 December), side by side")
    parser.add_argument("--prompt", type=int, default=20,
                        help="the first prompt's length; each next one is 7 tokens longer")
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    import mlx.core as mx

    import machine
    from speculation_costs import describe, draft_proportions, proportions
    from mlx_lm_patches.selftest.scenarios import prompt_tokens
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    main_shape = proportions(args.family, args.layers, args.hidden, args.vocab)
    step = lambda m: _step_seconds(m, args.vocab)  # noqa: E731
    if args.draft == "mtp":
        import tempfile

        from mlx_lm import load

        from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            model = load(str(write_mtp_checkpoint(tmp, args.family, dtype="float32",
                                                  config_overrides=main_shape).folder))[0]
        batch_draft, single_draft = model.make_draft_model(), "mtp"
        drafting = f"its one-layer MTP head ({model.mtp_status.split(',')[0]})"
    else:
        draft_shape = draft_proportions(args.family, args.hidden, args.vocab)
        model = build_tiny_model(args.family, seed=1, overrides=main_shape)
        batch_draft = build_tiny_model(args.family, seed=2, overrides=draft_shape)
        single_draft = None  # hinted per run below
        drafting = (f"draft {describe(draft_shape)}, a draft step {step(batch_draft) / step(model):.2f} "
                    f"of a main step")
    print(machine.header())
    print(f"{args.family}: main {describe(main_shape)}; {drafting}; k = {args.k}, {args.tokens} tokens a request")
    print(f"{'rows':>4} {'accept':>6} | {'greedy tok/s':>12} {'batched spec':>12} {'one at a time':>13} | "
          f"{'spec/greedy':>11} {'spec/one-at-a-time':>18} | {'decoding: spec/greedy':>21} | exact"
          + (" | spec/going back" if args.going_back else "")
          + (" | spec/moving rows (decoding)" if args.moving_rows else ""))
    for rows in args.rows:
        prompts = [prompt_tokens(args.prompt + 7 * i, vocab=args.vocab, seed=i + 1) for i in range(rows)]
        reference = greedy_batch(model, prompts, args.tokens)
        sequences = [p + r for p, r in zip(prompts, reference)]
        for share in args.accept:
            hinted = hint(share)
            single = single_draft or Hinted(batch_draft, sequences, hinted)
            best = {"greedy": 1e9, "spec": 1e9, "single": 1e9, "back": 1e9, "moving": 1e9}
            decoding = {"greedy": 1e9, "spec": 1e9, "moving": 1e9}  # after every row's first token
            timing = {}
            exact = True
            for _ in range(args.repeats):
                for name, run in (("greedy", lambda: greedy_batch(model, prompts, args.tokens, timing)),
                                  ("spec", lambda: spec_batch(model, batch_draft, prompts, args.tokens, args.k,
                                                              sequences, hinted, timing)),
                                  ("single", lambda: one_at_a_time(model, single, prompts, args.tokens, args.k,
                                                                   sequences, hinted)),
                                  ("back", lambda: going_back(spec_batch, model, batch_draft, prompts, args.tokens,
                                                              args.k, sequences, hinted)),
                                  ("moving", lambda: moving_rows(spec_batch, model, batch_draft, prompts, args.tokens,
                                                                 args.k, sequences, hinted, timing))):
                    if (name == "back" and not args.going_back) or (name == "moving" and not args.moving_rows):
                        continue
                    start = time.perf_counter()
                    got = run()
                    best[name] = min(best[name], time.perf_counter() - start)
                    if name in decoding:
                        decoding[name] = min(decoding[name], timing.pop("decode"))
                    exact = exact and got == reference
            total = rows * args.tokens
            rate = {name: total / seconds for name, seconds in best.items()}
            print(f"{rows:>4} {share:>6.0%} | {rate['greedy']:>12.1f} {rate['spec']:>12.1f} {rate['single']:>13.1f} | "
                  f"{rate['spec'] / rate['greedy']:>10.2f}x {rate['spec'] / rate['single']:>17.2f}x | "
                  f"{decoding['greedy'] / decoding['spec']:>20.2f}x | {exact}"
                  + (f" | {rate['spec'] / rate['back']:.2f}x" if args.going_back else "")
                  + (f" | {rate['spec'] / rate['moving']:.2f}x ({decoding['moving'] / decoding['spec']:.2f}x)"
                     if args.moving_rows else ""), flush=True)
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

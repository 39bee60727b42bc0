"""MTP self-speculative decoding vs greedy decoding, side by side in one run.

    python benchmarks/mtp_speculation.py [--model-types qwen3_5 deepseek_v3 deepseek_v32 glm4_moe] [--tokens 64]

A tiny float32 checkpoint with an MTP head is written and loaded (``mlx_lm.load``, patches on).
A random head never agrees with a random model, so the acceptance rate is controlled: the draft
runs the real MTP head (its full cost) and then, for a share ``p`` of its proposals, proposes the
model's true next greedy token instead (known from a reference run). For each ``p``: acceptance
``a`` (accepted / drafted tokens), throughput of speculative decoding
through mlx-lm's own loop vs greedy ``generate_step`` as a ratio, whether the tokens are
identical, and ``(1+a)/(2-a)``, the ratio for one draft token per round if a round cost two
greedy steps. Then the cost split of one round: a draft step, the verify pass, and the rollback
after a rejection: attention-only models (the DeepSeek-V3 layout, ...) trim their caches, no
model call; hybrids restore the recurrent state kept before the verify pass, and the next
verify pass re-runs the accepted tokens since in front of its own (also shown: the restore with
that re-run as a pass of its own).
Every model type given is run, one after another, in the same process.

Tiny models on whatever device mlx uses (CPU on Linux): only the ratios mean anything.
Run by hand; tests never assert on speed.
"""

import argparse
import tempfile
import time
import sys
from pathlib import Path

# test-only support (the mlx_lm.server harness, hinted drafts) lives in tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _timed(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def oracle_mixed_draft(model, reference, share):
    """The model's MTP draft, except that a share of its proposals is the true next token."""
    from support.mtp_drafts import hinted_draft

    calls = [0]

    def hint(target):  # every 1/share-th proposal, spread evenly
        calls[0] += 1
        return (calls[0] * share) % 1 + share >= 1

    return hinted_draft(model, reference, hint=hint)


def compare(model, share, args):
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy

    prompt = prompt_tokens(32, seed=5)
    ref = greedy(model, prompt, max_tokens=args.tokens)
    draft = oracle_mixed_draft(model, prompt + ref.tokens, share)
    for num_draft in (1, 2):
        t_ref = t_spec = float("inf")
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            t_ref = min(t_ref, _timed(lambda: greedy(model, prompt, max_tokens=args.tokens), 1)[0])
            t, got = _timed(lambda: speculative_greedy(model, draft, prompt, max_tokens=args.tokens,
                                                       num_draft_tokens=num_draft), 1)
            t_spec = min(t_spec, t)
        flags = [d for _, _, d in speculative_generate_step(mx.array(prompt), model, draft,
                                                            num_draft_tokens=num_draft, max_tokens=args.tokens)]
        # a round ends with the main model's own token; a last round cut by max_tokens may end
        # on an accepted draft token instead
        rounds = len(flags) - sum(flags) + (1 if flags and flags[-1] else 0)
        a = sum(flags) / max(rounds * num_draft, 1)  # accepted / drafted
        print(f"{share:>6.0%} {num_draft:>5} {a:>9.0%} {args.tokens / t_ref:>13.1f} {args.tokens / t_spec:>11.1f} "
              f"{t_ref / t_spec:>6.2f}x {(1 + a) / (2 - a):>7.2f}x  {'yes' if ref.compare(got) is None else 'NO'}")


def cost_split(model, args):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_lm_patches.mechanisms.journal import Journal
    from mlx_lm_patches.mechanisms.mtp.decoding import depths_of
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    prompt = prompt_tokens(256, seed=7)
    draft = model.make_draft_model()

    def prepared():
        cache = make_prompt_cache(model)
        journal = Journal(model, cache, window=4)
        journal.forward(mx.array(prompt)[None], cache)
        mx.eval([c.state for c in cache])
        return cache, journal

    def one_step():
        cache, journal = prepared()
        start = time.perf_counter()
        mx.eval(journal.forward(mx.array([[5]]), cache))
        spent = time.perf_counter() - start
        journal.detach()
        return spent

    def verify(k):
        cache, journal = prepared()
        start = time.perf_counter()
        mx.eval(journal.forward(mx.array([[5] * (k + 1)]), cache))
        spent = time.perf_counter() - start
        journal.detach()
        return spent

    replays = {}

    def rollback(k, rerun):
        """Undo ``k`` rejected tokens of a verify pass: the restore alone (``rerun=False``: the
        accepted tokens since the kept state are left to the next verify pass, which runs them in
        front of its own - what the speculative loop does), or with that re-run done at once
        (``rerun=True``: a pass of its own, for comparison)."""
        cache, journal = prepared()
        journal.fuse = not rerun
        journal.forward(mx.array([[5] * (k + 1)]), cache)
        mx.eval([c.state for c in cache])
        start = time.perf_counter()
        trim_prompt_cache(cache, k)
        mx.eval([c.state for c in cache])
        spent = time.perf_counter() - start
        if not rerun:
            replays[k] = journal.position - journal.pos  # left to the next pass
        journal.detach()
        return spent

    def draft_step():
        cache, journal = prepared()
        draft_cache = draft.make_cache()
        draft(mx.array([[5]]), cache=draft_cache)  # first call of a round: catch-up over 256 slots
        start = time.perf_counter()
        mx.eval(draft(mx.array([[6]]), cache=draft_cache))
        spent = time.perf_counter() - start
        journal.detach()
        return spent

    best = lambda fn, *a: min(fn(*a) for _ in range(args.repeats))  # noqa: E731
    step = best(one_step)
    print(f"\ncost of one round after {len(prompt)} tokens, relative to one greedy step ({step * 1e3:.2f} ms):")
    layered = depths_of(model) > 1  # step 2 is the head's second MTP layer, here over the whole prompt
    label = "draft step 2 (layer 2, cold)" if layered else "draft step (recycled)"
    print(f"  {label:<29}{best(draft_step) / step:>5.2f}")
    for k in (1, 2):
        print(f"  verify pass of {k + 1} tokens     {best(verify, k) / step:>5.2f}")
        restore = best(rollback, k, False) / step
        replayed = replays[k]
        if not replayed:
            print(f"  rollback of {k} rejected token{'s' if k > 1 else ' '} {restore:>5.2f}  (caches trimmed: no model call)")
            continue
        rerun = best(rollback, k, True) / step
        print(f"  rollback of {k} rejected token{'s' if k > 1 else ' '} {restore:>5.2f}  (state restore; the next verify "
              f"pass re-runs {replayed} accepted token{'' if replayed == 1 else 's'} in front of its own; {rerun:.2f} "
              "with that re-run as a pass of its own)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-types", nargs="+", default=["qwen3_5", "deepseek_v3", "deepseek_v32", "glm4_moe", "exaone_moe", "mimo_v2_flash", "step3p5",
                                 "bailing_moe_v3", "longcat_flash", "longcat_flash_ngram"])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    from mlx_lm import load

    import machine
    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint

    for model_type in args.model_types:
        with tempfile.TemporaryDirectory() as tmp:
            model, _ = load(str(write_mtp_checkpoint(tmp, model_type, dtype="float32").folder))
        print(f"\n{machine.header()}\n{model_type} (tiny)")
        print(f"{'p':>6} {'draft':>5} {'a':>9} {'greedy tok/s':>13} {'spec tok/s':>11} {'ratio':>7} "
              f"{'(1+a)/(2-a)':>8}  exact")
        for share in args.shares:
            compare(model, share, args)
        cost_split(model, args)


if __name__ == "__main__":
    main()

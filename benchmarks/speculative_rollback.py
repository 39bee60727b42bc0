"""Speculative decoding with exact rollback: what it costs a hybrid model, side by side in one run.

    python benchmarks/speculative_rollback.py [--model-type qwen3_next] [--tokens 48]

1. Speedup of speculative over greedy decoding (the same model as its own draft, with every
   k-th draft call perturbed so that a controlled share of drafts is rejected), for the hybrid
   model and for the dense control, and the ratio hybrid speedup / dense speedup at equal
   acceptance: what the rollback costs on top of what speculation costs a dense model - with
   the accepted tokens re-run in front of the next verify pass (the default, MTP drafts
   included) and in a pass of their own (what a draft declaring ``reads_main_model`` gets).
2. A rejected round's rollback (restore the kept state, trim the attention caches, replay the
   accepted tokens) vs re-running the whole sequence from scratch, the only exact alternative.
3. Bytes kept per recurrent layer for one snapshot.

Tiny random-weight models on whatever device mlx uses (CPU on Linux): the numbers measure the
framework path, not a real model's speed. Run by hand; tests never assert on speed.
"""

import argparse
import time


class PerturbedDraft:
    """The model as its own draft, except that every ``every``-th call its last-position
    logits prefer another token: that draft token is rejected. ``separate_replay``: declare
    that the draft reads the main model's caches between passes (``reads_main_model``), which
    makes the main model's rollback re-run accepted tokens in a pass of their own instead of
    fused into the next."""

    def __init__(self, model, every, separate_replay=False):
        self.model, self.every, self.calls = model, every, 0
        self.reads_main_model = separate_replay

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        logits = self.model(inputs, cache=cache, **kwargs)
        self.calls += 1
        if self.every and self.calls % self.every == 0:
            bias = mx.zeros(logits.shape[-1]).at[(self.calls * 31) % logits.shape[-1]].add(1e4)
            logits = mx.concatenate([logits[:, :-1], logits[:, -1:] + bias], axis=1)
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


def _timed(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def speculation(model_types, args):
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    prompt = prompt_tokens(args.prompt_len, seed=1)
    print(f"\n1. speculative / greedy throughput, num_draft_tokens={args.num_draft}, {args.tokens} tokens")
    print(f"{'perturb every':>13} {'model':>18} {'greedy tok/s':>13} {'spec tok/s':>11} {'speedup':>8} {'drafted':>8}  exact")
    hybrid, dense = model_types
    runs = [(hybrid, False), (hybrid, True), (dense, False)]
    for every in args.perturb:
        speedups = {}
        for model_type, separate in runs:
            label = f"{model_type}{' (sep.)' if separate else ''}"
            model = build_tiny_model(model_type, seed=0)
            greedy(model, prompt, max_tokens=4)  # warm up
            speculative_greedy(model, PerturbedDraft(model, every, separate), prompt, max_tokens=4)
            draft = PerturbedDraft(model, every, separate)
            t_ref = t_spec = float("inf")
            for _ in range(args.repeats):  # interleaved, so both see the same machine load
                t, ref = _timed(lambda: greedy(model, prompt, max_tokens=args.tokens), 1)
                t_ref = min(t_ref, t)
                t, got = _timed(lambda: speculative_greedy(
                    model, draft, prompt, max_tokens=args.tokens, num_draft_tokens=args.num_draft), 1)
                t_spec = min(t_spec, t)
            drafted = _share_from_draft(model, draft, prompt, args)
            speedups[label] = t_ref / t_spec
            print(f"{every or 'never':>13} {label:>18} {args.tokens / t_ref:>13.1f} {args.tokens / t_spec:>11.1f} "
                  f"{t_ref / t_spec:>7.2f}x {drafted:>7.0%}  {'yes' if ref.compare(got) is None else 'NO'}")
        print(f"{'':>13} {'ratio':>18} hybrid speedup / dense speedup = {speedups[hybrid] / speedups[dense]:.2f} "
              f"(replay fused into the next pass), {speedups[hybrid + ' (sep.)'] / speedups[dense]:.2f} (separate replay pass)")


def _share_from_draft(model, draft, prompt, args):
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    flags = [d for _, _, d in speculative_generate_step(
        mx.array(prompt), model, draft, num_draft_tokens=args.num_draft, max_tokens=args.tokens)]
    return sum(flags) / len(flags)


def rollback_cost(model_type, args):
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache, trim_prompt_cache

    from mlx_lm_patches.mechanisms.journal import Journal
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model

    model = build_tiny_model(model_type, seed=0)
    prefix = prompt_tokens(args.context, seed=2)
    verify = prompt_tokens(args.num_draft + 1, seed=3)
    print(f"\n2. {model_type}: rejected round after {args.context} tokens, verify pass of {len(verify)}")
    print(f"{'accepted':>8} {'rollback ms':>12} {'re-forward ms':>14} {'ratio':>6}")
    for keep in range(1, len(verify)):
        def rollback():
            cache = make_prompt_cache(model)
            journal = Journal(model, cache, window=len(verify))
            journal.forward(mx.array(prefix)[None], cache)
            journal.forward(mx.array(verify)[None], cache)
            mx.eval([c.state for c in cache])
            start = time.perf_counter()
            trim_prompt_cache(cache, len(verify) - keep)
            mx.eval([c.state for c in cache])
            spent = time.perf_counter() - start
            journal.detach()
            return spent

        def reforward():
            cache = make_prompt_cache(model)
            start = time.perf_counter()
            model(mx.array(prefix + verify[:keep])[None], cache=cache)
            mx.eval([c.state for c in cache])
            return time.perf_counter() - start

        t_roll = min(rollback() for _ in range(args.repeats))
        t_full = min(reforward() for _ in range(args.repeats))
        print(f"{keep:>8} {t_roll * 1e3:>12.2f} {t_full * 1e3:>14.2f} {t_roll / t_full:>5.2f}x")
    cache = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=cache)
    layers = [c for c in cache if isinstance(c, ArraysCache)]
    per_layer = sum(a.nbytes for c in layers for a in c.cache if a is not None) / max(len(layers), 1)
    print(f"\n3. {model_type}: one kept snapshot = {per_layer:.0f} bytes per recurrent layer "
          f"({len(layers)} recurrent layers; references to states the model already produced)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="qwen3_next")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--num-draft", type=int, default=3)
    parser.add_argument("--perturb", type=int, nargs="+", default=[0, 8, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import mlx_lm_patches

    mlx_lm_patches.apply()
    import machine
    from mlx_lm_patches.selftest.tiny_models import DENSE_MODEL_TYPE

    print(f"{machine.header()}\ntiny models")
    speculation([args.model_type, DENSE_MODEL_TYPE], args)
    rollback_cost(args.model_type, args)


if __name__ == "__main__":
    main()

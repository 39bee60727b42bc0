"""What speculative decoding costs on models with real proportions, and where fixed-k drafting loses.

    python benchmarks/speculation_costs.py [--families qwen3_5 nemotron_h deepseek_v3] [--tokens 64]
        [--repeats 3] [--accept 0 0.3 0.6 0.9 1] [--ks 1 2 3 4] [--quick]

Groundwork for adaptive drafting (issue 34): the numbers an adaptive choice of the draft length k
must decide from, measured on this machine, beside what today's fixed k gives.

Models: random weights (float32) with the proportions of real checkpoints, not the 2-4 layer test
models (those exaggerate the draft's share): ``--layers`` (default 24) layers of width ``--hidden``
(256) in the family's own layer pattern (qwen3_5: three gated-delta layers per full-attention
layer; nemotron_h: ``M-M-M-M*-`` repeated, Mamba-2 / MLP / attention blocks; deepseek_v3: first
layer dense, the others MoE, latent attention), a vocabulary of ``--vocab`` (8192, so the output
head is a realistic share of a step), an MTP head of one layer (written as a checkpoint by
``selftest.mtp_checkpoints`` and loaded through ``mlx_lm.load``, patches on), and a separate draft
model of the same family, four layers (deepseek_v3: two) of half the width: its cost per token is
measured and printed (about 1/10 of the main model's is the target).

Acceptance is controlled (a random draft never agrees with a random model): for a hinted rate
``a`` the draft - run in full, its cost paid - proposes the model's true next greedy token (known
from a reference run) at a pseudo-random share ``a`` of the positions (the same positions for
every k), its own proposal elsewhere (``tests/support/mtp_drafts.hinted_draft`` for the MTP head,
``HintedDraft`` below for the draft model).

Printed per family:

1. Costs relative to one plain decode step of the main model after ``--context`` tokens (each
   operation timed beside a plain step, so both see the same load; the median of
   ``--cost-repeats`` ratios): a draft step (draft model; MTP head, a recycled step), a verify
   pass of k+1 tokens (through the journal the speculative loop keeps), the rollback of a round
   whose first draft token was rejected (hybrids: the journal's state restore plus what the fused
   re-run of the kept token adds to the next verify pass, against the same pass without it;
   attention-only models: the cache trim).
2. Throughput ratio speculation / plain greedy (mlx-lm's ``speculative_generate_step`` vs
   ``generate_step``, prompt and ``--tokens`` tokens; each speculative run between two plain
   runs, against their mean, the median of ``--repeats``; the variants of a rate interleaved in
   each repeat) for every fixed k and hinted rate, with the modelled ratio and whether the
   tokens and log-probabilities equal greedy decoding; then the best fixed k measured and the
   "oracle": the best modelled choice of k, k = 0 (plain decoding) included; adaptive drafting
   against plain, against the best measured, and against the best chosen on held-out repeats
   (``held_out_best``); and the A/A spread: each plain run against the next one, what the
   machine's drift alone does to a ratio.

Cost model (per-token acceptance ``a``, costs in main decode steps):

    E[tokens per round](k) = (1 - a^(k+1)) / (1 - a)        (k + 1 at a = 1)
    cost(k)                = k * draft + verify(k+1) + (1 - a^k) * rollback(k, a)
    ratio(k)               = E[tokens](k) / cost(k),   ratio(0) = 1 (plain decoding)

``rollback(k, a)`` is the expected rollback of a rejected round: the first rejection at draft
position j (probability proportional to a^(j-1) (1-a)) restores the state and re-runs the j kept
tokens in front of the next verify pass: restore + what that re-run adds to the pass, both
measured for each j needed; attention-only models: the trim alone. The costs table shows j = 1.

Run by hand; tests never assert on speed. CPU numbers: ratios only.
"""

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

# test-only support (hinted MTP drafts) lives in tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FAMILIES = ("qwen3_5", "nemotron_h", "deepseek_v3")  # the default run
SHAPED = FAMILIES + ("deepseek_v32", "glm4_moe_lite")  # the families proportions() can shape
NEMOTRON_UNIT = "M-M-M-M*-"  # Nemotron-H's blocks: Mamba-2 mixers and MLPs, one attention per nine


# --- models with real proportions ------------------------------------------------------------

def proportions(family, layers, hidden, vocab):
    """Config overrides (for ``build_tiny_model`` / ``write_mtp_checkpoint``) giving ``family``
    ``layers`` layers (rounded up to its pattern) of width ``hidden`` and a vocabulary of
    ``vocab``, keeping the family's layer pattern."""
    from mlx_lm_patches.selftest.tiny_models import tiny_config

    heads = max(1, hidden // 64)
    if family == "qwen3_5":
        text = tiny_config(family)["text_config"]
        text.update(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                    num_hidden_layers=4 * math.ceil(layers / 4), full_attention_interval=4,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                    linear_num_value_heads=hidden // 32, linear_num_key_heads=max(1, hidden // 64),
                    linear_key_head_dim=32, linear_value_head_dim=32)
        text["rope_parameters"]["mrope_section"] = [3, 3, 2]  # rotary 64 * 0.25 = 16 dims
        return {"vocab_size": vocab, "text_config": text}
    if family == "nemotron_h":
        pattern = NEMOTRON_UNIT * math.ceil(layers / len(NEMOTRON_UNIT)) if layers > 4 else "M*M-"
        return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden,
                "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
                "mamba_num_heads": hidden // 32, "mamba_head_dim": 32, "ssm_state_size": 64,
                "n_groups": 2, "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    if family in ("deepseek_v3", "deepseek_v32", "glm4_moe_lite"):
        return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden,
                "moe_intermediate_size": hidden // 2, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": 8,
                "num_experts_per_tok": 2, "kv_lora_rank": hidden // 4, "q_lora_rank": 3 * hidden // 8,
                "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
    raise ValueError(f"no proportions for family {family!r}; known: {', '.join(SHAPED)}")


def draft_proportions(family, hidden, vocab):
    """The draft model: the family's smallest whole pattern (four layers; two for the
    DeepSeek-V3 layout: a dense layer and an MoE one), half the width."""
    return proportions(family, 4 if family in ("qwen3_5", "nemotron_h") else 2, hidden // 2, vocab)


def describe(model_overrides):
    text = model_overrides.get("text_config", model_overrides)
    pattern = text.get("hybrid_override_pattern")
    return (f"{text['num_hidden_layers']} layers{f' ({pattern})' if pattern else ''}, "
            f"hidden {text['hidden_size']}")


# --- controlled acceptance -------------------------------------------------------------------

def accepts(share):
    """``hint(target)``: whether the draft proposes the true token for position ``target`` -
    pseudo-random, a share ``share`` of the positions, the same positions at every k."""
    return lambda target: random.Random(target * 7919 + 13).random() < share


class HintedDraft:
    """A separate draft model whose proposal for position ``t`` (its cache's offset after the
    call) gets a large logit bonus on ``sequence[t]`` where ``hint(t)``; the model runs in full."""

    def __init__(self, model, sequence, hint):
        self.model, self.sequence, self.hint = model, sequence, hint

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        from mlx_lm_patches.mechanisms.mtp.decoding import _offset

        logits = self.model(inputs, cache=cache, **kwargs)
        target = _offset(cache)
        if target is not None and target < len(self.sequence) and self.hint(target):
            bonus = mx.zeros(logits.shape[-1]).at[self.sequence[target]].add(1e4)
            logits = mx.concatenate([logits[:, :-1], logits[:, -1:] + bonus], axis=1)
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


# --- costs -----------------------------------------------------------------------------------

class Costs:
    """Costs of one round's parts in main decode steps. Each operation is timed beside a plain
    decode step of the main model (on a cache of its own), so both see the same machine load;
    a cost is the median of ``repeats`` such ratios over consecutive operations (after one not
    counted), on caches prefilled with ``context`` tokens."""

    def __init__(self, model, context, repeats):
        import mlx.core as mx

        from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

        self.model, self.repeats = model, repeats
        self.prompt = mx.array(prompt_tokens(context, vocab=256, seed=7))[None]
        self._verify, self._rejected, self.replayed = {}, {}, {}
        self.steps = []  # seconds of every plain step timed

    def _prefilled(self, model, journaled, window=1):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from mlx_lm_patches.mechanisms.journal import Journal

        cache = make_prompt_cache(model)
        journal = Journal(model, cache, window=window, fuse=True) if journaled else None
        (journal.forward if journaled else model)(self.prompt, cache=cache)
        mx.eval([c.state for c in cache])
        return cache, journal

    def _series(self, op, journaled=True, model=None, window=1):
        """Median of ``op(cache, journal)`` / a plain main step over consecutive calls; the
        journal keeps what a trim of ``window`` tokens needs (the speculative loop's: k+1)."""
        import statistics

        import mlx.core as mx

        cache, journal = self._prefilled(model or self.model, journaled, window)
        plain, _ = self._prefilled(self.model, False)
        ratios = []
        for i in range(self.repeats + 1):
            start = time.perf_counter()
            mx.eval(self.model(mx.array([[5]]), cache=plain))
            step = time.perf_counter() - start
            spent = op(cache, journal)
            if i:
                self.steps.append(step)
                ratios.append([t / step for t in spent] if isinstance(spent, tuple) else spent / step)
        if journal is not None:
            journal.detach()
        if isinstance(ratios[0], list):  # several times per operation: a median each
            return tuple(statistics.median(column) for column in zip(*ratios))
        return statistics.median(ratios)

    @property
    def step_s(self):
        import statistics

        return statistics.median(self.steps)

    def verify(self, n):
        """A verify pass of ``n`` tokens (through the journal, as the speculative loop runs it)."""
        import mlx.core as mx

        def op(cache, journal):
            start = time.perf_counter()
            mx.eval(journal.forward(mx.array([[5] * n]), cache))
            return time.perf_counter() - start

        if n not in self._verify:
            self._verify[n] = self._series(op, window=n)
        return self._verify[n]

    def rejected(self, k, kept):
        """(restore, re-run) of a round that verifies k+1 tokens and keeps ``kept`` of them, on a
        freshly prefilled cache each time: the trim of the k+1-kept rejected tokens (hybrids: the
        state restore), and what the re-run of the kept tokens adds to the next verify pass
        (hybrids: fused in front of its tokens; attention-only models replay nothing: 0)."""
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        def op(_cache, _journal):
            cache, journal = self._prefilled(self.model, True, window=k + 1)
            mx.eval(journal.forward(mx.array([[5] * (k + 1)]), cache))
            start = time.perf_counter()
            trim_prompt_cache(cache, k + 1 - kept)
            mx.eval([c.state for c in cache])
            restored = time.perf_counter() - start
            self.replayed[k] = journal.position - journal.pos  # left to the next pass
            start = time.perf_counter()
            mx.eval(journal.forward(mx.array([[6] * (k + 1)]), cache))  # re-runs them in front
            passed = time.perf_counter() - start
            journal.detach()
            cache, journal = self._prefilled(self.model, True, window=k + 1)  # the same pass, no re-run
            start = time.perf_counter()
            mx.eval(journal.forward(mx.array([[6] * (k + 1)]), cache))
            alone = time.perf_counter() - start
            journal.detach()
            return restored, passed, alone

        if (k, kept) not in self._rejected:
            restore, fused, alone = self._series(op, journaled=False)
            rerun = max(0.0, fused - alone) if self.replayed[k] else 0.0
            self._rejected[k, kept] = (restore, rerun)
        return self._rejected[k, kept]

    def rollback(self, k, a=0.0):
        """Expected rollback of a rejected round at per-token acceptance ``a``: the first
        rejection at draft position j (probability a^(j-1)(1-a), normalised) keeps j tokens."""
        weights = [(j, a ** (j - 1) * (1 - a)) for j in range(1, k + 1)]
        total = sum(w for _, w in weights)
        if total == 0:
            return 0.0
        return sum(w * sum(self.rejected(k, j)) for j, w in weights if w) / total

    def draft_model_step(self, draft):
        import mlx.core as mx

        def op(cache, _journal):
            start = time.perf_counter()
            mx.eval(draft(mx.array([[5]]), cache=cache))
            return time.perf_counter() - start

        return self._series(op, journaled=False, model=draft)

    def mtp_step(self):
        """A recycled MTP draft step (a round's second and later calls)."""
        import mlx.core as mx

        draft = self.model.make_draft_model()
        draft_cache = draft.make_cache()  # before the main pass: the draft follows it from here
        calls = [0]

        def op(_cache, _journal):
            if not calls[0]:
                mx.eval(draft(mx.array([[5]]), cache=draft_cache))  # a round's first call: catch-up
            calls[0] += 1
            start = time.perf_counter()
            mx.eval(draft(mx.array([[6]]), cache=draft_cache))
            return time.perf_counter() - start

        return self._series(op)


def modelled(a, k, draft, costs):
    """The cost model's ratio speculation / plain decoding for draft length ``k``."""
    if k == 0:
        return 1.0
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    cost = k * draft + costs.verify(k + 1) + (1 - a ** k) * costs.rollback(k, a)
    return tokens / cost


# --- throughput ------------------------------------------------------------------------------

def speculate(model, draft, prompt, tokens, k):
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from mlx_lm_patches.mechanisms.probing.decoded import Decoded

    out, logprobs, flags = [], [], []
    for token, lp, from_draft in speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=k,
                                                           max_tokens=tokens):
        out.append(int(token))
        logprobs.append(lp)
        flags.append(bool(from_draft))
    mx.eval(logprobs)
    return Decoded(out, logprobs), flags


def adaptive_drafting(on):
    """Turn the ``adaptive-drafting`` patch's choice of k on or off (its environment variable)."""
    import os

    from mlx_lm_patches.engine import env

    os.environ[env.ADAPTIVE_DRAFTING] = "1" if on else "0"


def measure_row(model, make_draft, prompt, ref, ks, args):
    """One hinted rate: every variant - each fixed k of ``ks`` and, unless ``--no-adaptive``, adaptive
    drafting (k <= max of ``ks``) - run ``--repeats`` times, interleaved with plain runs:
    P V1 P V2 P ... Vn P in each repeat, the variants' order rotating from one repeat to the
    next. A run's ratio is the mean of the plain runs on either side of it over its own time (the
    machine's speed drifts over seconds; every variant of a repeat sees the same stretch). Each
    plain run against the next one goes to ``args.plain_pairs`` (A/A: what the machine alone
    moves a ratio). Every adaptive run is a process's first sequence (its memory forgotten).
    Returns {variant: [(ratio, flags, exact), ...]} in repeat order; variant ``k`` or "adaptive"."""
    from mlx_lm_patches.patches.adaptive_drafting import forget_sequences
    from mlx_lm_patches.selftest.scenarios import greedy

    def plain():
        start = time.perf_counter()
        greedy(model, prompt, max_tokens=args.tokens)
        return time.perf_counter() - start

    variants = list(ks) + (["adaptive"] if args.adaptive else [])
    for variant in variants:  # warm-up, every path once
        adaptive_drafting(variant == "adaptive")
        speculate(model, make_draft(), prompt, 4, max(ks) if variant == "adaptive" else variant)
    runs = {variant: [] for variant in variants}
    plains = [plain()]
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            adaptive = variant == "adaptive"
            adaptive_drafting(adaptive)
            draft = make_draft()
            forget_sequences()  # an MTP draft made anew counts as its model's head: start afresh
            start = time.perf_counter()
            got, flags = speculate(model, draft, prompt, args.tokens, max(ks) if adaptive else variant)
            spent = time.perf_counter() - start
            plains.append(plain())
            runs[variant].append(((plains[-2] + plains[-1]) / 2 / spent, flags, ref.compare(got) is None))
            args.plain_pairs.append(plains[-2] / plains[-1])
    adaptive_drafting(True)
    return runs


def acceptance(flags, k):
    """Accepted / drafted over one fixed-k run: a round ends with the main model's own token,
    except a last round cut by max_tokens."""
    rounds = len(flags) - sum(flags) + (1 if flags and flags[-1] else 0)
    return sum(flags) / max(rounds * k, 1)


def held_out_best(runs, ks):
    """Adaptive against the best of plain decoding and fixed k, the choice made without the run
    it is judged on: for each repeat, the option (plain = 1.0, or a fixed k) with the best median
    over the *other* repeats, and the adaptive run's ratio to that option's run in the same
    repeat; the median of those. The plain "best measured" (the largest of the medians) is
    biased up: where several k are about as fast, the largest of noisy medians is the luckiest
    (the winner's curse), and that is the 60 % cells' case. Needs two repeats or more."""
    import statistics

    repeats = len(runs["adaptive"])
    if repeats < 2:
        return None
    paired = []
    for r in range(repeats):
        others = {k: statistics.median(ratio for i, (ratio, _, _) in enumerate(runs[k]) if i != r) for k in ks}
        chosen = max(others, key=others.get)
        best = runs[chosen][r][0] if others[chosen] > 1.0 else 1.0
        paired.append(runs["adaptive"][r][0] / best)
    return statistics.median(paired)


def sweep(label, model, make_draft, draft_cost, costs, prompt, ref, args):
    import statistics

    ks = args.ks
    print(f"\n  {label}: ratio speculation / plain greedy, measured (modelled), exact; {args.tokens} tokens, "
          f"median of {args.repeats}, each run between two plain runs, the variants interleaved")
    args.plain_pairs = []
    print(f"  {'accept':>6} {'a meas':>6} " + " ".join(f"{f'k={k}':>17}" for k in ks)
          + f" {'best fixed k':>13} {'oracle k (model)':>17}"
          + (f" {f'adaptive (k<={max(ks)})':>20} {'/plain':>6} {'/best':>6} {'/held':>6} {'drafted':>7}"
             if args.adaptive else ""))
    for share in args.accept:
        hint = accepts(share)
        runs = measure_row(model, lambda: make_draft(hint), prompt, ref, ks, args)
        cells = [(k, statistics.median(r for r, _, _ in runs[k]),
                  modelled(share, k, draft_cost, costs) if costs else float("nan"), all(e for _, _, e in runs[k]))
                 for k in ks]
        rates = [acceptance(runs[k][-1][1], k) for k in ks]
        best_k, best = max(((k, r) for k, r, _, _ in cells), key=lambda kr: kr[1])
        if costs:
            oracle_k, oracle = max(((k, modelled(share, k, draft_cost, costs)) for k in (0, *range(1, max(ks) + 1))),
                                   key=lambda kr: kr[1])
            oracle_shown = f"k={oracle_k} {oracle:.2f}x"
        else:
            oracle_shown = "-"
        shown = " ".join(f"{r:>5.2f}x ({m:>4.2f}) {'ok' if e else 'NO':>2}" for _, r, m, e in cells)
        line = (f"  {share:>6.0%} {sum(rates) / len(rates):>6.0%} {shown} {f'k={best_k} {best:.2f}x':>13} "
                f"{oracle_shown:>17}")
        if args.adaptive:
            ratio = statistics.median(r for r, _, _ in runs["adaptive"])
            exact = all(e for _, _, e in runs["adaptive"])
            flags = runs["adaptive"][-1][1]  # the rounds' draft lengths are not known here: the share drafted
            held = held_out_best(runs, ks)
            line += (f" {f'{ratio:.2f}x':>17} {'ok' if exact else 'NO':>2} {ratio:>5.2f}x "
                     f"{ratio / max(best, 1.0):>5.2f}x {'-' if held is None else f'{held:.2f}x':>6} "
                     f"{sum(flags) / max(len(flags), 1):>7.0%}")
        print(line)
    pairs = sorted(args.plain_pairs)
    print(f"  A/A (a plain run / the next one, {len(pairs)} pairs): {pairs[0]:.2f}-{pairs[-1]:.2f}x, middle half "
          f"{pairs[len(pairs) // 4]:.2f}-{pairs[(3 * len(pairs)) // 4]:.2f}x: what the machine alone moves a run")
    if args.adaptive:
        print("  /best: adaptive over the better of plain and the largest fixed-k median (biased up where several k"
              "\n  are about as fast); /held: the best option chosen on the other repeats, judged on the same repeat")


def run_family(family, args):
    import mlx.core as mx
    from mlx_lm import load

    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy
    from mlx_lm_patches.selftest.tiny_models import build_tiny_model
    from support.mtp_drafts import hinted_draft

    main_shape = proportions(family, args.layers, args.hidden, args.vocab)
    draft_shape = draft_proportions(family, args.hidden, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        written = write_mtp_checkpoint(tmp, family, dtype="float32", config_overrides=main_shape)
        model, _ = load(str(written.folder))
    draft_model = build_tiny_model(family, seed=1, overrides=draft_shape)

    prompt = prompt_tokens(args.prompt_len, vocab=256, seed=5)
    ref = greedy(model, prompt, max_tokens=args.tokens)
    sequence = prompt + ref.tokens

    costs = Costs(model, args.context, args.cost_repeats)
    draft_cost = costs.draft_model_step(draft_model)
    print(f"\n== {family}: main {describe(main_shape)}, vocab {args.vocab}; draft model {describe(draft_shape)}; "
          "MTP head of one layer")
    print(f"  costs after {args.context} tokens, in main decode steps ({costs.step_s * 1e3:.2f} ms):")
    print(f"    draft model step {draft_cost:>5.2f}")
    ks = range(1, max(args.ks) + 1)
    print("    k                " + " ".join(f"{k:>5}" for k in ks))
    print("    verify of k+1    " + " ".join(f"{costs.verify(k + 1):>5.2f}" for k in ks))
    if args.no_model:
        print("    (rollback costs and the modelled ratios left out: --no-model)")
    else:
        print_rollback(costs, ks)

    model_costs = None if args.no_model else costs
    sweep(f"draft model ({draft_cost:.2f} main step)", model,
          lambda hint: HintedDraft(draft_model, sequence, hint), draft_cost, model_costs, prompt, ref, args)

    mtp_cost = costs.mtp_step()  # installs the head's capture on the main model from here on
    print(f"\n    MTP head step    {mtp_cost:>5.2f}")
    sweep(f"MTP head ({mtp_cost:.2f} main step)", model,
          lambda hint: hinted_draft(model, sequence, hint=hint), mtp_cost, model_costs, prompt, ref, args)
    mx.clear_cache()


def print_rollback(costs, ks):
    print("    rollback         " + " ".join(f"{costs.rollback(k):>5.2f}" for k in ks), end="")
    if any(costs.replayed[k] for k in ks):
        print("  (first draft rejected: state restore", " ".join(f"{costs.rejected(k, 1)[0]:.2f}" for k in ks),
              "+ what the fused re-run of the kept token adds to the next verify pass",
              " ".join(f"{costs.rejected(k, 1)[1]:.2f}" for k in ks) + ")")
    else:
        print("  (first draft rejected: caches trimmed, no model call)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", help=f"default: {' '.join(FAMILIES)} (--quick: qwen3_5)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accept", type=float, nargs="+", default=[0.0, 0.3, 0.6, 0.9, 1.0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128, help="tokens before the cost measurements")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--cost-repeats", type=int, default=9, help="timings per cost (median)")
    parser.add_argument("--no-model", action="store_true",
                        help="leave out the rollback costs and the modelled ratios (much faster)")
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                        help="leave out the adaptive column (adaptive-drafting patch, k <= max of --ks)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke setting (< 60 s of CPU): qwen3_5 unless --families, 8 tokens, one "
                        "repeat, accept 0 1, k 1 3, context 16, 3 timings per cost")
    args = parser.parse_args()
    if args.quick:
        args.families, args.tokens, args.repeats = args.families or ["qwen3_5"], 8, 1
        args.accept, args.ks, args.cost_repeats, args.context = [0.0, 1.0], [1, 3], 3, 16
    args.families = args.families or list(FAMILIES)
    bad = [a for a in args.accept if not 0 <= a <= 1] + [k for k in args.ks if k < 1]
    if bad:
        parser.error(f"--accept takes rates in [0, 1] and --ks draft lengths >= 1; got {bad}")
    unknown = [f for f in args.families if f not in SHAPED]
    if unknown:
        parser.error(f"--families: no proportions for {', '.join(unknown)}; known: {', '.join(SHAPED)}")

    import mlx_lm_patches

    mlx_lm_patches.apply()
    import machine

    print(machine.header())
    print(f"random weights, float32, real proportions{' (--quick)' if args.quick else ''}")
    start = time.perf_counter()
    for family in args.families:
        run_family(family, args)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

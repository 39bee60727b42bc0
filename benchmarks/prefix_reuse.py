"""Diverging prefix reuse for a hybrid model: time to first token, cold vs reused, in one run.

    python benchmarks/prefix_reuse.py [--shared 2048] [--tail 64] [--hidden 256] [--layers 8]

Two requests share ``--shared`` tokens and then differ (``--tail`` tokens each). Request A is
decoded and stored in mlx-lm's ``LRUPromptCache`` (prompt + generated tokens, as
``mlx_lm.server`` stores it). Request B is then served

* cold: an empty cache, prefill of all of B, first token;
* reused: ``fetch_nearest_cache`` (the patched store hands back an exact earlier state),
  prefill of the rest, first token - fetch time included;

alternately, several times, through mlx-lm's own ``generate_step`` (the server's single-sequence
path), for each ``--prefill-step-size``. Reported: median times, the ratio reused / cold (target
<= 0.2 at 2k shared tokens), tokens reused, and that B's first tokens are equal both ways.

Then the same through ``speculative_generate_step`` with a draft model and one supplied cache
list for both (what ``mlx_lm.server --draft-model`` stores): time to first token, cold vs reused.

Then the cost of keeping states: prefill throughput of an engine calling the model itself in
chunks, and decode steps per second, with keeping on (default) vs off
(``MLX_LM_PATCHES_PREFIX_CHECKPOINTS=0``), alternated; the ratio on/off (target >= 0.98).

Then bytes kept per recurrent layer per checkpoint: measured on the benchmark model, and on one
gated-delta layer with the dimensions of Qwen3-Next-80B-A3B (hidden 2048, 32 value / 16 key
heads of 128, conv kernel 4) run on a few tokens - the state a real checkpoint keeps per layer.

A small random-weight qwen3_next (``--hidden``, ``--layers``) on whatever device mlx uses (CPU on
Linux): ratios, not absolute speed. Run by hand; tests never assert on speed.
"""

import argparse
import statistics
import time


def _model(hidden, layers):
    import mlx.core as mx
    from mlx_lm.models.qwen3_next import Model, ModelArgs

    from mlx_lm_patches.selftest.tiny_models import tiny_config

    config = dict(tiny_config("qwen3_next"), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=hidden // 8, linear_num_value_heads=8, linear_num_key_heads=4,
                  linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 8)
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    model.eval()
    return model


def _first_tokens(model, prompt, cache, step, n=4):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out, first_at, start = [], None, time.perf_counter()
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                                  prefill_step_size=step):
        if first_at is None:
            first_at = time.perf_counter() - start
        out.append(int(token))
    return first_at, out


def time_to_first_token(model, args):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import lru_prompt_cache_class

    shared = prompt_tokens(args.shared, vocab=256, seed=5)
    a = shared + prompt_tokens(args.tail, seed=6)
    b = shared + prompt_tokens(args.tail, seed=8)
    print(f"\n1. time to first token of B ({len(b)} tokens, {args.shared} shared with stored A), "
          f"median of {args.repeats}")
    print(f"{'prefill step':>12} {'cold ms':>9} {'reused ms':>10} {'ratio':>7} {'reused tok':>11}  same tokens")
    for step in args.steps:
        store = lru_prompt_cache_class()()
        cache = make_prompt_cache(model)
        _, generated = _first_tokens(model, a, cache, step)
        store.insert_cache("m", a + generated, cache)
        cold, warm, reused, same = [], [], None, True
        for _ in range(args.repeats):
            t, cold_tokens = _first_tokens(model, b, make_prompt_cache(model), step)
            cold.append(t)
            start = time.perf_counter()
            fetched, rest = store.fetch_nearest_cache("m", b)
            fetch_time = time.perf_counter() - start
            reused = len(b) - len(rest)
            t, warm_tokens = _first_tokens(model, rest, fetched or make_prompt_cache(model), step)
            warm.append(t + fetch_time)
            same = same and warm_tokens == cold_tokens
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"{step:>12} {c * 1e3:>9.1f} {w * 1e3:>10.1f} {w / c:>7.3f} {reused:>11}  {same}")


def _first_tokens_speculative(model, draft, prompt, cache, step, n=4):
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    out, first_at, start = [], None, time.perf_counter()
    for token, _, _ in speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=3, max_tokens=n,
                                                 prompt_cache=cache, prefill_step_size=step):
        if first_at is None:
            first_at = time.perf_counter() - start
        out.append(int(token))
    return first_at, out


def speculative_time_to_first_token(model, draft, args):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import lru_prompt_cache_class

    def both():
        return make_prompt_cache(model) + make_prompt_cache(draft)

    shared = prompt_tokens(args.shared, vocab=256, seed=5)
    a, b = shared + prompt_tokens(args.tail, seed=6), shared + prompt_tokens(args.tail, seed=8)
    step = args.steps[0]
    store = lru_prompt_cache_class()()
    cache = both()
    _, generated = _first_tokens_speculative(model, draft, a, cache, step)
    store.insert_cache("m", a + generated, cache)
    cold, warm, reused, same = [], [], None, True
    for _ in range(args.repeats):
        t, cold_tokens = _first_tokens_speculative(model, draft, b, both(), step)
        cold.append(t)
        start = time.perf_counter()
        fetched, rest = store.fetch_nearest_cache("m", b)
        fetch_time = time.perf_counter() - start
        reused = len(b) - len(rest)
        t, warm_tokens = _first_tokens_speculative(model, draft, rest, fetched or both(), step)
        warm.append(t + fetch_time)
        same = same and warm_tokens == cold_tokens
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"\n2. speculative (draft: {len(draft.layers)}-layer qwen3_next, 3 drafted tokens), prefill step {step}: "
          f"time to first token of B, median of {args.repeats}")
    print(f"cold {c * 1e3:.1f} ms, reused {w * 1e3:.1f} ms, ratio {w / c:.3f}, {reused} tokens reused, "
          f"same tokens {same}")


def keeping_cost(model, args):
    import os

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    prompt, chunk = prompt_tokens(args.shared * 2, vocab=256, seed=11), 512

    def prefill():
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        for i in range(0, len(prompt), chunk):
            model(mx.array([prompt[i:i + chunk]]), cache=cache)
            mx.eval([c.state for c in cache])
        return len(prompt) / (time.perf_counter() - start), cache

    def decode(cache, steps=64):
        y = mx.array([[1]])
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(y, cache=cache)
            y = mx.argmax(logits[:, -1:], axis=-1)
            mx.async_eval(y)
        mx.eval(y)
        return steps / (time.perf_counter() - start)

    results = {"on": ([], []), "off": ([], [])}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            if mode == "off":
                os.environ["MLX_LM_PATCHES_PREFIX_CHECKPOINTS"] = "0"
            else:
                os.environ.pop("MLX_LM_PATCHES_PREFIX_CHECKPOINTS", None)
            rate, cache = prefill()
            results[mode][0].append(rate)
            results[mode][1].append(decode(cache))
    os.environ.pop("MLX_LM_PATCHES_PREFIX_CHECKPOINTS", None)
    on_p, off_p = (statistics.median(results[m][0]) for m in ("on", "off"))
    on_d, off_d = (statistics.median(results[m][1]) for m in ("on", "off"))
    print(f"\n3. keeping states: an engine's own prefill of {len(prompt)} tokens in chunks of {chunk}, then 64 "
          f"decode steps, median of {args.repeats}")
    print(f"prefill: on {on_p:,.0f} tok/s, off {off_p:,.0f} tok/s, ratio {on_p / off_p:.3f}")
    print(f"decode:  on {on_d:,.1f} steps/s, off {off_d:,.1f} steps/s, ratio {on_d / off_d:.3f}")


def bytes_per_checkpoint(model):
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import lru_prompt_cache_class

    print("\n4. bytes kept per recurrent layer per checkpoint")
    lru_prompt_cache_class()()  # states are kept while a prompt cache exists
    cache = make_prompt_cache(model)
    _first_tokens(model, prompt_tokens(1000, seed=3), cache, 256)
    kept = pc.checkpoints(cache)
    layers = [c for c in cache if isinstance(c, ArraysCache)]
    per_layer = pc.retained_nbytes(layers[0]) / len(kept)
    print(f"benchmark model: {len(kept)} checkpoints at {[p for p, _, _ in kept]}, "
          f"{per_layer:,.0f} B per layer per checkpoint, {len(layers)} recurrent layers")

    import mlx.core as mx
    from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextGatedDeltaNet

    from mlx_lm_patches.selftest.tiny_models import tiny_config

    real = dict(tiny_config("qwen3_next"), hidden_size=2048, linear_num_value_heads=32,
                linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4)
    layer = Qwen3NextGatedDeltaNet(ModelArgs.from_dict(real))
    layer_cache = ArraysCache(2)
    layer(mx.zeros((1, 3, 2048), mx.bfloat16), cache=layer_cache)
    mx.eval(layer_cache.state)
    state = sum(a.nbytes for a in layer_cache.cache if a is not None)
    shapes = [(tuple(a.shape), str(a.dtype)) for a in layer_cache.cache if a is not None]
    print(f"Qwen3-Next-80B-A3B gated-delta layer: {state:,} B per checkpoint ({shapes}); "
          f"x36 linear layers = {36 * state / 2**20:,.1f} MiB per checkpoint")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=int, default=2048)
    parser.add_argument("--tail", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, nargs="+", default=[256, 2048])
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm

    import mlx_lm_patches

    mlx_lm_patches.apply()
    print(f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, device {mx.default_device()}")
    model = _model(args.hidden, args.layers)
    time_to_first_token(model, args)
    speculative_time_to_first_token(model, _model(args.hidden // 2, 2), args)
    keeping_cost(model, args)
    bytes_per_checkpoint(model)


if __name__ == "__main__":
    main()

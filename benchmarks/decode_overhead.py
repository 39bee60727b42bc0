"""Plain decoding of a hybrid model, patched vs stock, side by side in one process.

    python benchmarks/decode_overhead.py [--tokens 16384] [--block 1024] [--layers 24] [--hidden 256]

Two sequences of the same prompt are decoded with mlx-lm's own ``generate_step`` (greedy, no
draft): one with the patches applied (the hybrid forward is recorded for prefix reuse), one
with every wrapper of every patch switched off, as ``revert`` does (``--revert``: reverted and
applied again at each switch, which also runs the probes again). They advance in alternating blocks of ``--block``
tokens up to ``--tokens``, so both see the same machine load at the same sequence lengths.
Reported per block: milliseconds per token each way (wall clock) and the ratio of speeds
patched / stock by wall clock and by the process's CPU time (less sensitive to other processes
on a shared machine); over the whole run the target is >= 0.99. At the end: whether both decoded
the same tokens.

Then the package's own cost per decode step, apart from the model: the recording wrapper run on
the benchmark model's cache list (after a real prefill) with a forward that does nothing, for
``--tokens`` steps; microseconds per step at the start and at the end of the sequence (it must
not grow) against the model's own decode step. Unlike the side-by-side ratio this does not
depend on what else the machine runs.

The model is a random-weight qwen3_5 (qwen3_next where mlx-lm lacks it) with the proportions of
the real ones - ``--layers`` layers, three gated-delta layers to one attention layer - at a
small width (``--hidden``), on whatever device mlx uses (CPU on Linux): ratios, not absolute
speed. Run by hand; tests never assert on speed (tests/test_decode_overhead.py counts calls).
"""

import argparse
import time


def _model(layers, hidden):
    import mlx.core as mx

    from mlx_lm_patches.selftest.tiny_models import available_model_types, build_tiny_model, tiny_config

    model_type = "qwen3_5" if "qwen3_5" in available_model_types() else "qwen3_next"
    config = tiny_config(model_type)
    text = config.get("text_config", config)
    sizes = dict(num_hidden_layers=layers, full_attention_interval=4, hidden_size=hidden,
                 intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=hidden // 8, linear_num_value_heads=8, linear_num_key_heads=4,
                 linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 8,
                 max_position_embeddings=1 << 20)
    overrides = {"text_config": dict(text, **sizes)} if "text_config" in config else sizes
    model = build_tiny_model(model_type, seed=0, dtype=mx.float32, overrides=overrides)
    return model_type, model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--skip-side-by-side", action="store_true", help="only the wrapper's own cost")
    parser.add_argument("--revert", action="store_true",
                        help="switch sides by reverting and applying the patches (probes run again at each "
                             "switch) instead of turning their wrappers off and on")
    args = parser.parse_args(argv)

    import mlx.core as mx
    import mlx_lm_patches
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens

    mlx_lm_patches.apply()
    model_type, model = _model(args.layers, args.hidden)
    prompt = mx.array(prompt_tokens(args.prompt, seed=1))
    applied = [row.id for row in mlx_lm_patches.status() if row.state == "applied"]

    def start():
        return generate_step(prompt, model, max_tokens=args.tokens, prompt_cache=make_prompt_cache(model))

    def patched(on):
        if args.revert:
            if on:
                mlx_lm_patches.apply(applied)
            else:
                mlx_lm_patches.revert(applied)
        else:  # the engine's switch of every wrapper (what revert turns off), without re-probing
            from mlx_lm_patches.engine import core

            for patch_id in applied:
                core.get().records[patch_id].active = on

    print(f"{model_type}, {args.layers} layers ({args.layers // 4} attention), hidden {args.hidden}, "
          f"prompt {args.prompt}, {args.tokens} tokens; patches applied: {len(applied)}")
    model_step = None
    if not args.skip_side_by_side:
        model_step = side_by_side(args, start, patched)
    own_cost(args, model, prompt, model_step)


def side_by_side(args, start, patched):
    """Both sequences in alternating blocks; the stock model's seconds per decode step."""
    runs = {}
    for side in (True, False):
        patched(side)
        generator = start()
        runs[side] = {"gen": generator, "tokens": [next(generator)[0]], "time": 0.0, "cpu": 0.0}
    print(f"{'tokens':>13} {'patched ms/tok':>15} {'stock ms/tok':>13} {'ratio':>7} {'cpu ratio':>10}", flush=True)
    done = 1
    while done < args.tokens:
        n = min(args.block, args.tokens - done)
        block, cpu = {}, {}
        for side in (done // args.block % 2 == 0, done // args.block % 2 != 0):  # alternate who goes first
            patched(side)
            run = runs[side]
            begin, begin_cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                run["tokens"].append(next(run["gen"])[0])
            block[side], cpu[side] = time.perf_counter() - begin, time.process_time() - begin_cpu
            run["time"] += block[side]
            run["cpu"] += cpu[side]
        print(f"{done:>6}-{done + n:<6} {block[True] / n * 1e3:>15.3f} {block[False] / n * 1e3:>13.3f} "
              f"{block[False] / block[True]:>7.3f} {cpu[False] / cpu[True]:>10.3f}", flush=True)
        done += n
    patched(True)
    on, off = runs[True], runs[False]
    count = len(on["tokens"]) - 1
    print(f"whole run: patched {on['time'] / count * 1e3:.3f} ms/token, stock {off['time'] / count * 1e3:.3f} "
          f"ms/token, ratio patched/stock (speed) {off['time'] / on['time']:.4f}, by CPU time "
          f"{off['cpu'] / on['cpu']:.4f} (target >= 0.99)")
    print(f"same tokens: {on['tokens'] == off['tokens']}")
    return off["time"] / count


def own_cost(args, model, prompt, model_step):
    """The recording wrapper alone, on a real cache list, with a forward that does nothing."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_patches.mechanisms import prefix_reuse as pc
    from mlx_lm_patches.mechanisms.caches import recurrent_caches

    cache = make_prompt_cache(model)
    for _ in generate_step(prompt, model, max_tokens=2, prompt_cache=cache):
        pass
    assert pc.known_log(cache) is not None, "the prefill was recorded"
    token = mx.array([[7]])
    kwargs = {"cache": cache}

    def nothing(*a, **k):
        return None

    block = 128  # the fastest of the first and of the last 8 blocks: robust to other processes
    times, done = [], 0
    while done < args.tokens:
        begin = time.perf_counter()
        for _ in range(block):
            pc.recorded_forward(nothing, model, (token,), kwargs)
        times.append((done, (time.perf_counter() - begin) / block))
        done += block
    log = pc.trails(recurrent_caches(cache)[0])[0].log  # (attention offsets did not move)
    assert len(log) == args.prompt + 2 + done, ("every step was recorded", len(log))
    first, last = min(t for _, t in times[:8]), min(t for _, t in times[-8:])
    print(f"\nthe package's own cost per decode step ({len(recurrent_caches(cache))} recurrent caches), fastest "
          f"block of {block}: {first * 1e6:.2f} us over tokens 0-{8 * block}, {last * 1e6:.2f} us over "
          f"{times[-8][0]}-{done}"
          + (f"; the model's step: {model_step * 1e3:.2f} ms, so {last / model_step * 100:.3f}% of it"
             if model_step else ""))


if __name__ == "__main__":
    main()

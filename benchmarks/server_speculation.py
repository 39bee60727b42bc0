"""Concurrent chats against the same chats one after another, on ``mlx_lm.server`` with a draft.

    python benchmarks/server_speculation.py [--model-type qwen3_5] [--chats 4] [--max-tokens 96]
                                            [--rounds 3] [--drafts none mtp self]

Writes a tiny random-weight float32 checkpoint with an MTP head (local tokenizer, ChatML
template) and, per draft setting, starts ``python -m mlx_lm.server`` on 127.0.0.1 (the installed
package active): ``none`` (no draft: batched greedy), ``mtp`` (``--draft-model mtp``: the head)
or ``self`` (``--draft-model`` the checkpoint's own folder: a draft as costly as the model whose
every proposal is accepted). Each round sends ``--chats`` chats with the ``openai`` client one
after another, then all at once from as many threads (best round of each kept); every answer is
compared with its cold greedy reference (single sequence, computed in this process).

Reported per setting: the wall time of the chats at once over their wall time one after another
(batching gains below 1.0), and whether every answer equals its reference. Tiny model on CPU:
the numbers measure the serving path, not a real model's speed. Run by hand; tests never assert
on speed.
"""

import argparse
import concurrent.futures
import sys
import tempfile
import threading
import time
from pathlib import Path

# test-only support (the mlx_lm.server harness, chat references) lives in tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _chat(server, messages, max_tokens):
    reply = server.client().chat.completions.create(model="default_model", messages=messages,
                                                    max_tokens=max_tokens, temperature=0.0)
    return reply.choices[0].message.content


def _at_once(server, chats, max_tokens):
    barrier = threading.Barrier(len(chats))

    def ask(messages):
        barrier.wait(timeout=60)
        return _chat(server, messages, max_tokens)

    with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
        return list(pool.map(ask, chats))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="qwen3_5")
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafts", nargs="+", default=["none", "mtp", "self"], choices=("none", "mtp", "self"))
    args = parser.parse_args()

    import machine
    from support.server import serve
    from support.server_load import tiny_workload

    with tempfile.TemporaryDirectory() as root:
        folder, reference, jobs, _ = tiny_workload(root, args.model_type, 0, args.max_tokens, mtp=True)
        chats = [[{"role": "user", "content": f"question {i}: " + "tell me about item " * (1 + 3 * i)}]
                 for i in range(args.chats)]
        wanted = [reference(messages).text for messages in chats]
        print(machine.header())
        print(f"{args.model_type} (tiny, float32, MTP head): {args.chats} chats of {args.max_tokens} tokens; "
              f"best of {args.rounds} rounds")
        print(f"{'draft':>6} | {'one after another':>17} {'at once':>8} | {'at once / sequential':>20} | exact")
        for draft in args.drafts:
            extra = [] if draft == "none" else ["--draft-model", "mtp" if draft == "mtp" else str(folder),
                                                 "--num-draft-tokens", "3"]
            best = {"sequential": 1e9, "together": 1e9}
            exact = True
            with serve(folder, *extra) as server:
                _chat(server, chats[0], 4)  # warm up
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    got = [_chat(server, messages, args.max_tokens) for messages in chats]
                    best["sequential"] = min(best["sequential"], time.perf_counter() - start)
                    exact = exact and got == wanted
                    start = time.perf_counter()
                    got = _at_once(server, chats, args.max_tokens)
                    best["together"] = min(best["together"], time.perf_counter() - start)
                    exact = exact and got == wanted
            print(f"{draft:>6} | {best['sequential']:>16.2f}s {best['together']:>7.2f}s | "
                  f"{best['together'] / best['sequential']:>19.2f}x | {exact}", flush=True)


if __name__ == "__main__":
    main()

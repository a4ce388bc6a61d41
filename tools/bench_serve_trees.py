"""Warm-turn TTFT of ``spec-cache serve`` from several source trees (before / after a change) and ``mlx_lm.server``,
all running at once, every request sent to each back to back in rotating order (``bench_mlx_lm_server.py
--paired``'s method): on a loaded machine, only servers that see the same load can be compared.

Why a separate tool: ``bench_mlx_lm_server.py`` compares server kinds from one checkout; this one compares one
kind across checkouts (each ``--tree NAME=DIR`` is a copy of the repository, e.g. ``cp -r spec_cache store schemas
tools pyproject.toml DIR/`` before a change), which is how a change to the serving path is measured.

    .venv/bin/python tools/bench_serve_trees.py --tree before=/tmp/before --tree after=. [--clients 1]
        [--conversations 4] [--turns 3] [--system-words 1500] [--user-words 150] [--max-tokens 24]
        [--history mlx-lm|NAME] [--json OUT]

Prints per turn the TTFT p50 of each server and mlx-lm / serve ratios (> 1: serve faster), the warm turns' (turn >=
2) p50, and each serve tree's ``spec_cache_stage_seconds`` means (queue, restore, prefill, round, checkpoint,
stream). Each server sees about ``clients / servers`` requests at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_mlx_lm_server as bench  # noqa: E402


def start(kind: str, tree: Path, model: str, tmp: Path, name: str):
    bench.REPO = tree  # the server's working directory: ``python -m`` imports that tree's spec_cache
    try:
        server = bench.Server(bench.server_argv(kind, model, str(tmp / f"store-{name}")), tmp / f"{name}.log",
                              bench.server_env(tmp))
    finally:
        bench.REPO = Path(__file__).resolve().parents[1]
    bench.chat(server.port, [{"role": "user", "content": "w3 w4"}], 2)  # the model load, outside the timing
    return server


def _row(ms: dict) -> str:
    return "  ".join(f"{n} {v:.1f}" + ("" if n == "mlx-lm" else f" ({ms['mlx-lm'] / v:.2f}x)") for n, v in ms.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR: serve from the repository copy DIR")
    p.add_argument("--model")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--user-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--history", default="mlx-lm", help="whose replies the histories carry: mlx-lm, or a tree's NAME "
                   "(serve leaves special tokens out of its text, so its own replies re-tokenize differently)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = [(name, Path(d).resolve()) for name, d in (t.split("=", 1) for t in args.tree)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-trees-"))
    model = args.model
    if model is None:
        from spec_cache.testing.tiny import write_tiny_target

        model = str(write_tiny_target(tmp / "tiny"))
    servers = {"mlx-lm": start("mlx-lm", bench.REPO, model, tmp, "mlx-lm")}
    try:
        for name, tree in trees:
            servers[name] = start("serve", tree, model, tmp, name)
        names = list(servers)
        before = {n: bench.stage_totals(servers[n].port) for n in names[1:]}
        system = bench.words(args.system_words, 999)
        ttft = {n: [[None] * args.turns for _ in range(args.conversations)] for n in names}
        texts = {n: [[None] * args.turns for _ in range(args.conversations)] for n in names}
        lock = threading.Lock()
        rotation = [0]

        def conversation(conv):
            history = [{"role": "system", "content": system}]
            for turn in range(args.turns):
                history.append({"role": "user", "content": bench.words(args.user_words, conv * 10 + turn)})
                with lock:
                    shift = rotation[0] % len(names)
                    rotation[0] += 1
                order = names[shift:] + names[:shift]
                for n in order:
                    got = bench.chat(servers[n].port, history, args.max_tokens)
                    ttft[n][conv][turn], texts[n][conv][turn] = got.ttft, got.text
                history.append({"role": "assistant", "content": texts[args.history][conv][turn]})

        bench.pool(args.conversations, args.clients, conversation)
        stages = {n: bench.stage_breakdown(before[n], bench.stage_totals(servers[n].port)) for n in names[1:]}
    finally:
        for server in servers.values():
            server.stop()
    out = {"args": vars(args), "turns": {}, "warm": {}, "stages": stages}
    print(f"{args.conversations} conversations x {args.turns} turns, {args.clients} clients, all servers at once; "
          "TTFT p50 ms (ratio mlx-lm / serve)")
    for turn in range(args.turns):
        row = {n: statistics.median(ttft[n][c][turn] for c in range(args.conversations)) * 1e3 for n in names}
        out["turns"][turn + 1] = row
        print(f"turn {turn + 1}: " + _row(row))
    warm = {n: statistics.median(ttft[n][c][t] for c in range(args.conversations) for t in range(1, args.turns)) * 1e3
            for n in names}
    out["warm"] = warm
    print("warm turns p50: " + _row(warm))
    for n, st in stages.items():
        print(f"stages {n} (mean ms x count): " + ", ".join(f"{k} {v['mean_ms']:.2f} x {v['count']}"
                                                             for k, v in st.items()))
    same = {n: sum(texts[n][c][t] == texts[names[1]][c][t] for c in range(args.conversations)
                   for t in range(args.turns)) for n in names[2:]}
    print(f"replies identical to {names[1]}'s: {same} of {args.conversations * args.turns}")
    out["identical_to_first_tree"] = same
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-turn chat TTFT: ``mlx_lm.server`` (its in-RAM LRUPromptCache) vs ``spec_cache.mlx_lm_server``.

    .venv/bin/python tools/bench_mlx_lm_server.py [--model DIR] [--conversations 8] [--turns 3] [--clients 4]
        [--system-words 1500] [--user-words 150] [--max-tokens 24] [--json OUT]

Without ``--model`` a tiny float32 llama is written to a temporary directory (``spec_cache.tiny``). Each server
is started on 127.0.0.1, driven with streaming ``/v1/chat/completions`` (TTFT = time to the first content
chunk), then stopped (SIGTERM) and started again on the same store:

* ``turns``: every conversation's turns in order, ``--clients`` conversations at a time; all conversations share
  one system prompt. TTFT p50/p95 per turn.
* ``after restart``: each conversation's last turn (its whole history) sent to the restarted server. mlx-lm's
  server lost its RAM cache; ours restores the history from the store.

Prints a table and the ratios (mlx-lm / spec-cache: > 1 means spec-cache is faster). Greedy, so both servers
produce the same replies and the same histories.

``--paired``: both servers run at once and every request goes to both, back to back, in alternating order, so
both see the same host load (on a shared, busy machine the sequential figures drift by tens of percent between
runs); they are restarted together.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], log: Path):
        self.port = free_port()
        self.out = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *argv, "--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=REPO, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited; see {log}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise SystemExit(f"server not ready; see {log}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def chat(port: int, messages: list[dict], max_tokens: int) -> tuple[float, str, int | None]:
    """One streaming chat request: (TTFT seconds, reply text, cached prompt tokens if reported)."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft, parts, cached = None, [], None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        d = json.loads(data)
        if d.get("usage"):
            cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        for ch in d.get("choices", []):
            text = (ch.get("delta") or {}).get("content")
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
    c.close()
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts), cached


def words(n: int, salt: int) -> str:
    return " ".join(f"w{(i * 13 + salt * 31) % 240 + 3}" for i in range(n))


def run_turns(port: int, args, system: str) -> tuple[dict[int, list[float]], list[list[dict]]]:
    ttfts: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    cached: dict[int, list[int]] = {t: [] for t in range(args.turns)}
    histories: list[list[dict]] = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    lock = threading.Lock()
    todo = list(range(args.conversations))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                conv = todo.pop(0)
            for turn in range(args.turns):
                histories[conv].append({"role": "user", "content": words(args.user_words, conv * 10 + turn)})
                ttft, reply, hit = chat(port, histories[conv], args.max_tokens)
                histories[conv].append({"role": "assistant", "content": reply})
                with lock:
                    ttfts[turn].append(ttft)
                    cached[turn].append(hit or 0)

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, cached, histories


def resume(port: int, args, histories) -> list[float]:
    """Each conversation's last turn (history without its reply) against a restarted server."""
    out: list[float] = []
    cached: list[int] = []
    lock = threading.Lock()
    todo = list(range(len(histories)))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                conv = todo.pop(0)
            ttft, _, hit = chat(port, histories[conv][:-1], args.max_tokens)
            with lock:
                out.append(ttft)
                cached.append(hit or 0)

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, cached


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def bench(kind: str, model: str, store: str, args, system: str, logdir: Path) -> dict:
    argv = server_argv(kind, model, store)
    s = Server(argv, logdir / f"{kind}-1.log")
    try:
        chat(s.port, [{"role": "user", "content": "w3 w4"}], 2)  # warm up the model load and kernels
        t0 = time.perf_counter()
        ttfts, cached, histories = run_turns(s.port, args, system)
        wall = time.perf_counter() - t0
    finally:
        s.stop()
    s = Server(argv, logdir / f"{kind}-2.log")
    try:
        chat(s.port, [{"role": "user", "content": "w5 w6"}], 2)
        after, after_cached = resume(s.port, args, histories)
    finally:
        s.stop()
    return {"turns": {t + 1: {"p50": pct(v, 50), "p95": pct(v, 95), "n": len(v),
                              "cached_mean": statistics.mean(cached[t]) if cached[t] else 0} for t, v in ttfts.items()},
            "after_restart": {"p50": pct(after, 50), "p95": pct(after, 95), "n": len(after),
                              "cached_mean": statistics.mean(after_cached) if after_cached else 0},
            "turns_wall_s": wall, "replies": [h[-1]["content"] for h in histories]}


KINDS = ("mlx-lm", "spec-cache")


def server_argv(kind: str, model: str, store: str) -> list[str]:
    return ["mlx_lm.server", "--model", model] if kind == "mlx-lm" else \
        ["spec_cache.mlx_lm_server", "--model", model, "--cache", store]


def bench_paired(model: str, store: str, args, system: str, logdir: Path) -> dict:
    """Both servers at once; each request to both, back to back, the order alternating."""
    out = {k: {"ttft": {t: [] for t in range(args.turns)}, "cached": {t: [] for t in range(args.turns)},
               "after": [], "after_cached": []} for k in KINDS}
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    same = [True]
    lock = threading.Lock()

    def both(ports, messages, n):
        order = KINDS if n % 2 == 0 else KINDS[::-1]
        got = {k: chat(ports[k], messages, args.max_tokens) for k in order}
        if got["mlx-lm"][1] != got["spec-cache"][1]:
            same[0] = False
        return got

    def pool(work):
        todo = list(range(args.conversations))

        def client():
            while True:
                with lock:
                    if not todo:
                        return
                    conv = todo.pop(0)
                work(conv)
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def start():
        servers = {k: Server(server_argv(k, model, store), logdir / f"paired-{k}.log") for k in KINDS}
        for k in KINDS:
            chat(servers[k].port, [{"role": "user", "content": "w3 w4"}], 2)
        return servers

    servers = start()
    ports = {k: servers[k].port for k in KINDS}

    def turns(conv):
        for turn in range(args.turns):
            histories[conv].append({"role": "user", "content": words(args.user_words, conv * 10 + turn)})
            got = both(ports, histories[conv], conv + turn)
            histories[conv].append({"role": "assistant", "content": got["mlx-lm"][1]})
            with lock:
                for k in KINDS:
                    out[k]["ttft"][turn].append(got[k][0])
                    out[k]["cached"][turn].append(got[k][2] or 0)

    try:
        pool(turns)
    finally:
        for s in servers.values():
            s.stop()
    servers = start()
    ports = {k: servers[k].port for k in KINDS}

    def after(conv):
        got = both(ports, histories[conv][:-1], conv)
        with lock:
            for k in KINDS:
                out[k]["after"].append(got[k][0])
                out[k]["after_cached"].append(got[k][2] or 0)

    try:
        pool(after)
    finally:
        for s in servers.values():
            s.stop()
    results = {}
    for k in KINDS:
        o = out[k]
        results[k] = {"turns": {t + 1: {"p50": pct(v, 50), "p95": pct(v, 95), "n": len(v),
                                        "cached_mean": statistics.mean(o["cached"][t])}
                                for t, v in o["ttft"].items()},
                      "after_restart": {"p50": pct(o["after"], 50), "p95": pct(o["after"], 95), "n": len(o["after"]),
                                        "cached_mean": statistics.mean(o["after_cached"])},
                      "turns_wall_s": float("nan"), "replies": []}
    results["mlx-lm"]["replies"] = [same[0]]  # compared per request above
    results["spec-cache"]["replies"] = [True]
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--user-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--paired", action="store_true", help="both servers at once, every request to both")
    p.add_argument("--json")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-mlx-lm-server-"))
    model = args.model
    if model is None:
        from spec_cache.tiny import write_tiny_target

        model = str(write_tiny_target(tmp / "tiny"))
    system = words(args.system_words, 999)
    if args.paired:
        results = bench_paired(model, str(tmp / "store"), args, system, tmp)
    else:
        results = {kind: bench(kind, model, str(tmp / "store"), args, system, tmp) for kind in KINDS}
    same = results["mlx-lm"].pop("replies") == results["spec-cache"].pop("replies")
    print(f"model {model}; {args.conversations} conversations x {args.turns} turns, {args.clients} clients, "
          f"system {args.system_words} words, user {args.user_words} words/turn, {args.max_tokens} tokens/reply")
    print(f"{'phase':<16}{'mlx-lm p50':>12}{'p95':>9}{'spec-cache p50':>16}{'p95':>9}{'ratio p50':>11}{'p95':>8}"
          f"{'cached mlx-lm':>15}{'spec-cache':>12}")
    rows = [(f"turn {t}", results["mlx-lm"]["turns"][t], results["spec-cache"]["turns"][t])
            for t in results["mlx-lm"]["turns"]]
    rows.append(("after restart", results["mlx-lm"]["after_restart"], results["spec-cache"]["after_restart"]))
    for name, a, b in rows:
        print(f"{name:<16}{a['p50'] * 1e3:>10.1f}ms{a['p95'] * 1e3:>7.1f}ms{b['p50'] * 1e3:>14.1f}ms"
              f"{b['p95'] * 1e3:>7.1f}ms{a['p50'] / b['p50']:>10.2f}x{a['p95'] / b['p95']:>7.2f}x"
              f"{a['cached_mean']:>15.0f}{b['cached_mean']:>12.0f}")
    if args.paired:
        print(f"paired run (both servers up, each request to both); identical replies: {same}")
    else:
        print(f"turns wall: mlx-lm {results['mlx-lm']['turns_wall_s']:.2f}s, "
              f"spec-cache {results['spec-cache']['turns_wall_s']:.2f}s; identical replies: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "identical_replies": same, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-turn chat benchmark: ``mlx_lm.server`` (its in-RAM LRUPromptCache) vs ``spec_cache.apps.mlx_lm_server`` (our
launcher) and/or ``spec_cache.apps.server`` (``spec-cache serve``).

Why one file: a script run by hand (``tools/bench_serve.py`` is its only importer): server processes, the two
driving modes and the report share its argument set.

    .venv/bin/python tools/bench_mlx_lm_server.py [--model DIR] [--servers mlx-lm,spec-cache] [--conversations 8]
        [--turns 3] [--clients 4] [--system-words 1500] [--user-words 150] [--max-tokens 24] [--paired] [--json OUT]
        [--warmup tiny|shapes] [--serve-arg=ARG ...] [--launcher-arg=ARG ...] [--mlx-lm-arg=ARG ...] [--cwd DIR]

``tools/bench_serve.py`` is this tool with ``--servers mlx-lm,serve,spec-cache``. Server kinds: ``mlx-lm``
(``mlx_lm.server``), ``spec-cache`` (``spec_cache.apps.mlx_lm_server``: mlx-lm's server with our cache), ``serve``
(``spec_cache.apps.server``: our engine, continuous batching, the store); each of ours gets its own store.

Without ``--model`` a tiny float32 llama is written to a temporary directory (``spec_cache.testing.tiny``). Each server
is started on 127.0.0.1, driven with streaming ``/v1/chat/completions`` (TTFT = time to the first content
chunk), then stopped (SIGTERM) and started again on the same store:

* ``turns``: every conversation's turns in order, ``--clients`` conversations at a time; all conversations share
  one system prompt. TTFT p50/p95/p99 per turn; aggregate output tokens/s = completion tokens of the phase / its
  wall; per-request decode tok/s = (tokens - 1) / (request seconds - TTFT), p50 and mean.
* ``after restart``: each conversation's last turn (its whole history) sent to the restarted server. mlx-lm's
  server lost its RAM cache; ours restore the history from the store.

Prints a table and the ratios (mlx-lm / X: > 1 means X is faster). Greedy: the replies are compared turn by turn
(each server builds its histories from its own replies, so one differing reply changes that conversation's later
prompts; the count of identical replies and the first difference are printed).

``--paired``: all servers run at once and every request goes to each, back to back, in rotating order, so all see
the same host load (on a shared, busy machine the sequential figures drift by tens of percent between runs); the
histories follow the first server's replies (so all see the same prompts); they are restarted together. No tokens/s
there (the servers share the wall), and each server sees about ``clients / len(servers)`` requests at once, not
``clients``: it hides the cost of concurrency, which the sequential mode measures.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
BASELINE = "mlx-lm"
KINDS = ("mlx-lm", "spec-cache", "serve")
LABELS = {"mlx-lm": "mlx_lm.server", "spec-cache": "mlx-lm-server (ours)", "serve": "spec-cache serve"}
# every request names "default_model": mlx_lm.server maps it to its --model, serve is started with that model id
MODEL_NAME = "default_model"
#: seconds a server may take to answer /health (an 8B model loads from disk, then serve compiles its kernels)
STARTUP_S = float(os.environ.get("BENCH_SERVER_STARTUP_S", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    #: servers started and not yet stopped, so a driver that gives up mid-run (tools/device/serve_8b_bench.py's
    #: deadline) can kill what is left
    live: set = set()

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.port = free_port()
        self.out = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *argv, "--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=REPO, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=env or dict(os.environ, PYTHONUNBUFFERED="1"))
        Server.live.add(self)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited; see {log}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)  # refused, or 503 while the model loads (serve)
        self.stop()
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
        Server.live.discard(self)

    def kill(self):
        """SIGKILL, no drain: for a driver out of time (the store may lose its queued writes)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        Server.live.discard(self)


class Reply(NamedTuple):
    ttft: float          # seconds to the first content chunk
    text: str
    cached: int | None   # cached prompt tokens, if reported
    tokens: int          # completion tokens (usage, else content chunks)
    seconds: float       # the whole request
    prompt_tokens: int | None = None  # prompt tokens the server counted (usage), if reported


def chat(port: int, messages: list[dict], max_tokens: int) -> Reply:
    """One streaming, greedy chat request."""
    body = json.dumps({"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"port {port}: HTTP {r.status}: {r.read()[:300]!r}")
    ttft, parts, cached, tokens, prompt = None, [], None, None, None
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
            tokens = d["usage"].get("completion_tokens")
            prompt = d["usage"].get("prompt_tokens")
        for ch in d.get("choices", []):
            text = (ch.get("delta") or {}).get("content")
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
    end = time.perf_counter() - t0
    c.close()
    return Reply(ttft if ttft is not None else end, "".join(parts), cached,
                 tokens if tokens is not None else len(parts), end, prompt)


def words(n: int, salt: int) -> str:
    return " ".join(f"w{(i * 13 + salt * 31) % 240 + 3}" for i in range(n))


def pool(n: int, clients: int, work) -> float:
    """``work(i)`` for i in range(n), ``clients`` at a time; returns the wall seconds. A ``work(i)`` that raises
    stops the run: the first such error is raised here, naming ``i`` (a failed request, a server that died), not
    left behind as a short result list for a later IndexError (issue 35's GPU agent run at 4 clients)."""
    lock = threading.Lock()
    todo = list(range(n))
    failed: list[tuple[int, BaseException]] = []

    def client():
        while True:
            with lock:
                if not todo or failed:
                    return
                i = todo.pop(0)
            try:
                work(i)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread below
                with lock:
                    failed.append((i, exc))
                return

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        i, exc = failed[0]
        raise SystemExit(f"client work {i} failed: {type(exc).__name__}: {exc}") from exc
    return time.perf_counter() - t0


def run_turns(port: int, args, system: str) -> dict:
    """Every conversation's turns in order: {"replies": [conv][turn] Reply, "histories", "wall"}."""
    replies: list[list[Reply]] = [[] for _ in range(args.conversations)]
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]

    def conversation(conv):
        for turn in range(args.turns):
            histories[conv].append({"role": "user", "content": words(args.user_words, conv * 10 + turn)})
            got = chat(port, histories[conv], args.max_tokens)
            histories[conv].append({"role": "assistant", "content": got.text})
            replies[conv].append(got)

    wall = pool(args.conversations, args.clients, conversation)
    return {"replies": replies, "histories": histories, "wall": wall}


def resume(port: int, args, histories) -> dict:
    """Each conversation's last turn (history without its reply) against a restarted server."""
    replies: list[Reply | None] = [None] * len(histories)

    def last(conv):
        replies[conv] = chat(port, histories[conv][:-1], args.max_tokens)

    wall = pool(len(histories), args.clients, last)
    return {"replies": replies, "wall": wall}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def decode_rates(replies: list[Reply]) -> list[float]:
    """Each request's decode rate: the tokens after the first over the time after the first (prefill and the
    prompt-cache lookup left out, which the aggregate tokens/s counts)."""
    return [(r.tokens - 1) / (r.seconds - r.ttft) for r in replies if r.tokens > 1 and r.seconds > r.ttft]


def summary(replies: list[Reply], wall: float | None) -> dict:
    """TTFT percentiles over the replies that brought tokens (a reply that came back empty has no first token:
    counting the whole request as one put an erroring server's time among the TTFTs), ``failed`` the others."""
    ttfts = [r.ttft for r in replies if r.tokens]
    tokens = sum(r.tokens for r in replies)
    rates = decode_rates(replies)
    return {"p50": pct(ttfts, 50), "p95": pct(ttfts, 95), "p99": pct(ttfts, 99), "n": len(replies),
            "decode_tok_s_p50": statistics.median(rates) if rates else float("nan"),
            "decode_tok_s_mean": statistics.mean(rates) if rates else float("nan"), "decode_requests": len(rates),
            "cached_mean": statistics.mean(r.cached or 0 for r in replies) if replies else 0,
            "tokens": tokens, "tokens_per_s": tokens / wall if wall else float("nan"),
            "wall_s": wall if wall else float("nan"), "failed": sum(1 for r in replies if not r.tokens)}


def answered(replies) -> list:
    """Each request's TTFT, None where the reply came back empty: ``figures`` pairs the servers' requests by
    position (``paired_p50``)."""
    return [r.ttft if r.tokens else None for r in replies]


def paired_p50(base: list, ours: list) -> tuple[float, float, int]:
    """mlx_lm.server's and our p50 TTFT over the requests both answered (``answered`` lists, same order), and how
    many requests were left out."""
    pairs = [(a, b) for a, b in zip(base, ours) if a is not None and b is not None]
    return pct([a for a, _ in pairs], 50), pct([b for _, b in pairs], 50), len(base) - len(pairs)


def server_argv(kind: str, model: str, store: str, extra: dict | None = None) -> list[str]:
    """The server's ``python -m`` command line; ``extra[kind]`` (``--serve-arg``, ``--launcher-arg``) appended."""
    return base_argv(kind, model, store) + list((extra or {}).get(kind, ()))


def base_argv(kind: str, model: str, store: str) -> list[str]:
    if kind == "mlx-lm":
        return ["mlx_lm.server", "--model", model]
    if kind == "spec-cache":
        return ["spec_cache.apps.mlx_lm_server", "--model", model, "--cache", store]
    if kind == "serve":
        return ["spec_cache.apps.server", "--model", model, "--model-id", MODEL_NAME, "--cache", store,
                "--log-level", "warning", "--cached-tokens-granularity", "1"]  # exact counts, as mlx-lm reports
    raise ValueError(kind)


def server_env(tmp: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPEC_CACHE_IDENTITY_DIR=str(tmp / "identity-memo"))
    env.pop("SPEC_CACHE_API_KEY", None)  # serve would require it
    return env


#: prompt lengths (words) of ``--warmup shapes``, up to the longest prompt the workload sends
WARMUP_WORDS = (1, 3, 6, 12, 24, 48, 96, 192, 384, 768, 1536)


def warm_up(port: int, args) -> None:
    """Before timing: one tiny request (the model load); with ``--warmup shapes`` also one request per prompt length
    class up to the workload's longest prompt and ``--clients`` requests at once, so MLX's CUDA backend compiles the
    prefill, decode and batch kernels here, not in a measured TTFT (``spec-cache serve --warmup on`` compiles its
    own; mlx_lm.server has no such flag). Their words (salt >= 5000) share no prefix with the workload's."""
    chat(port, [{"role": "user", "content": "w3 w4"}], 2)
    if getattr(args, "warmup", "tiny") != "shapes":
        return
    longest = args.system_words + args.turns * (args.user_words + args.max_tokens)
    for n in sorted({n for n in WARMUP_WORDS if n < longest} | {longest}):
        chat(port, [{"role": "user", "content": words(n, 5000 + n)}], 2)
    pool(args.clients, args.clients,
         lambda i: chat(port, [{"role": "user", "content": words(args.user_words, 6000 + i)}], args.max_tokens))
    time.sleep(getattr(args, "warmup_settle", 0.0))  # ours: let the writer store what the warm-up left


def start(kind: str, model: str, tmp: Path, name: str, args=None) -> Server:
    extra = getattr(args, "server_args", None)
    s = Server(server_argv(kind, model, str(tmp / f"store-{kind}"), extra), tmp / f"{kind}-{name}.log",
               server_env(tmp))
    try:
        if args is None:
            chat(s.port, [{"role": "user", "content": "w3 w4"}], 2)  # warm up the model load and kernels
        else:
            warm_up(s.port, args)
    except BaseException:
        s.stop()
        raise
    return s


def stage_totals(port: int) -> dict:
    """``spec-cache serve``'s ``spec_cache_stage_seconds`` sums and counts by stage (``{stage: [sum, count]}``),
    read from its ``/metrics``; {} from a server without them."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/metrics")
        response = c.getresponse()
        text = response.read().decode("utf-8", "replace") if response.status == 200 else ""
    except (OSError, http.client.HTTPException):
        text = ""  # mlx_lm.server (and the launcher) may answer an unknown path by closing the connection
    finally:
        c.close()
    totals: dict = {}
    for line in text.splitlines():
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            head = f"spec_cache_stage_seconds{suffix}{{stage=\""
            if line.startswith(head):
                stage, value = line[len(head):].split("\"}", 1)
                totals.setdefault(stage, [0.0, 0.0])[slot] = float(value)
    return totals


def stage_breakdown(before: dict, after: dict) -> dict:
    """Per stage between two ``stage_totals``: observations, total seconds and mean milliseconds."""
    out = {}
    for stage, (total, count) in after.items():
        total -= before.get(stage, [0.0, 0.0])[0]
        count -= before.get(stage, [0.0, 0.0])[1]
        out[stage] = {"count": int(count), "total_s": total, "mean_ms": total / count * 1e3 if count else 0.0}
    return out


def staged(kind: str, port: int, work):
    """``(work(), serve's stage breakdown over it)``; {} for a server without stages (the baseline)."""
    before = stage_totals(port) if kind != BASELINE else {}
    out = work()
    return out, (stage_breakdown(before, stage_totals(port)) if kind != BASELINE else {})


def bench(kind: str, model: str, args, system: str, tmp: Path) -> dict:
    s = start(kind, model, tmp, "1", args)
    try:
        turns, stages = staged(kind, s.port, lambda: run_turns(s.port, args, system))
    finally:
        s.stop()
    s = start(kind, model, tmp, "2", args)
    try:
        after, restart_stages = staged(kind, s.port, lambda: resume(s.port, args, turns["histories"]))
    finally:
        s.stop()
    per_turn = [[turns["replies"][c][t] for c in range(args.conversations)] for t in range(args.turns)]
    return {"turns": {t + 1: summary(v, None) for t, v in enumerate(per_turn)},
            "all_turns": summary([r for conv in turns["replies"] for r in conv], turns["wall"]),
            "warm_turns": summary([r for conv in turns["replies"] for r in conv[1:]], None),
            "after_restart": summary(after["replies"], after["wall"]),
            "texts": [[r.text for r in conv] for conv in turns["replies"]],
            "texts_after_restart": [[r.text] for r in after["replies"]], "stages": stages,
            "stages_after_restart": restart_stages,
            "answered_warm": answered([r for conv in turns["replies"] for r in conv[1:]]),
            "answered_after_restart": answered(after["replies"])}


def bench_paired(kinds: list[str], model: str, args, system: str, tmp: Path) -> dict:
    """All servers at once; each request to each, back to back, the order rotating."""
    got_turns = {k: [[None] * args.turns for _ in range(args.conversations)] for k in kinds}
    got_after = {k: [None] * args.conversations for k in kinds}
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]

    def each(ports, messages, n):
        order = kinds[n % len(kinds):] + kinds[:n % len(kinds)]
        return {k: chat(ports[k], messages, args.max_tokens) for k in order}

    def start_all(name):
        servers = {}
        try:
            for k in kinds:
                servers[k] = start(k, model, tmp, f"paired-{name}", args)
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
        return servers

    servers = start_all("1")
    ports = {k: servers[k].port for k in kinds}

    def turns(conv):
        for turn in range(args.turns):
            histories[conv].append({"role": "user", "content": words(args.user_words, conv * 10 + turn)})
            got = each(ports, histories[conv], conv + turn)
            histories[conv].append({"role": "assistant", "content": got[kinds[0]].text})
            for k in kinds:
                got_turns[k][conv][turn] = got[k]

    try:
        pool(args.conversations, args.clients, turns)
    finally:
        for s in servers.values():
            s.stop()
    servers = start_all("2")
    ports = {k: servers[k].port for k in kinds}

    def after(conv):
        got = each(ports, histories[conv][:-1], conv)
        for k in kinds:
            got_after[k][conv] = got[k]

    try:
        pool(args.conversations, args.clients, after)
    finally:
        for s in servers.values():
            s.stop()
    return {k: {"turns": {t + 1: summary([got_turns[k][c][t] for c in range(args.conversations)], None)
                          for t in range(args.turns)},
                "all_turns": summary([r for conv in got_turns[k] for r in conv], None),
                "warm_turns": summary([r for conv in got_turns[k] for r in conv[1:]], None),
                "after_restart": summary(got_after[k], None),
                "texts": [[r.text for r in conv] for conv in got_turns[k]],
                "texts_after_restart": [[r.text] for r in got_after[k]],
                "answered_warm": answered([r for conv in got_turns[k] for r in conv[1:]]),
                "answered_after_restart": answered(got_after[k])} for k in kinds}


def visible(text: str) -> str:
    """``text`` without special-token words (``<s>``, ``</s>``): mlx_lm.server streams a generated special token's
    text, serve decodes with ``skip_special_tokens=True``; the token ids are the same."""
    return " ".join(w for w in text.split() if not (w.startswith("<") and w.endswith(">")))


def compare_texts(a: list[list[str]], b: list[list[str]]) -> dict:
    """Replies identical turn by turn (as sent, and without special-token text); the first difference of the
    latter (conversation, turn, both texts' starts)."""
    same = same_visible = total = 0
    first = None
    for c, (ca, cb) in enumerate(zip(a, b)):
        for t, (ta, tb) in enumerate(zip(ca, cb)):
            total += 1
            same += ta == tb
            if visible(ta) == visible(tb):
                same_visible += 1
            elif first is None:
                va, vb = visible(ta), visible(tb)
                at = next((i for i, (x, y) in enumerate(zip(va, vb)) if x != y), min(len(va), len(vb)))
                first = {"conversation": c, "turn": t + 1, "at_char": at, "of_chars": [len(va), len(vb)],
                         "a": va[max(0, at - 30) : at + 50], "b": vb[max(0, at - 30) : at + 50]}
    return {"identical": same, "identical_visible": same_visible, "total": total, "first_difference": first}


def report(results: dict, kinds: list[str], args, title: str | None = None, warm_row: bool = False) -> dict:
    """Prints the tables; returns the ratios, identical replies, stages and figures. ``title``: the first line
    (default: this workload's sizes; tools/bench_agent.py gives its own); ``warm_row``: a TTFT row for the turns >= 2
    pooled (the agent workload's headline; the chat table keeps its rows and ratio keys)."""
    print(title or f"model {args.model or 'tiny llama (spec_cache.testing.tiny)'}; {args.conversations} conversations"
          f" x {args.turns} turns, {args.clients} clients, system {args.system_words} words, user {args.user_words} "
          f"words/turn, {args.max_tokens} tokens/reply{'; paired' if args.paired else ''}")
    others = [k for k in kinds if k != BASELINE]
    head = f"{'TTFT ms':<15}" + "".join(f"{LABELS[k] + ' p50/p95':>30}" for k in kinds) + \
        "".join(f"{'ratio ' + k + ' p50/p95':>26}" for k in others)
    print(head)
    phases = [(f"turn {t}", lambda r, t=t: r["turns"][t]) for t in results[kinds[0]]["turns"]]
    if warm_row:
        phases.append(("warm turns", lambda r: r["warm_turns"]))
    phases.append(("after restart", lambda r: r["after_restart"]))
    ratios: dict = {k: {} for k in others}
    for name, get in phases:
        line = f"{name:<15}"
        for k in kinds:
            s = get(results[k])
            line += f"{s['p50'] * 1e3:>14.1f} /{s['p95'] * 1e3:>7.1f} (c{s['cached_mean']:>5.0f})"
        base = get(results[BASELINE]) if BASELINE in results else None
        for k in others:
            s = get(results[k])
            r50 = base["p50"] / s["p50"] if base else float("nan")
            r95 = base["p95"] / s["p95"] if base else float("nan")
            ratios[k][name] = {"p50": r50, "p95": r95}
            line += f"{r50:>17.2f}x /{r95:>5.2f}x"
        print(line)
    if not args.paired:
        for phase, key in (("turns", "all_turns"), ("after restart", "after_restart")):
            line = f"{'tok/s ' + phase:<15}"
            for k in kinds:
                s = results[k][key]
                line += f"{s['tokens_per_s']:>14.1f} ({s['tokens']:>4d} tok, {s['wall_s']:>5.2f}s)"
            base = results[BASELINE][key] if BASELINE in results else None
            for k in others:
                # a baseline that produced no tokens (mlx_lm.server's 8 restarted requests at 8 clients on the H100
                # all came back empty) gives no ratio, not a ZeroDivisionError that loses the whole report
                r = (results[k][key]["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] > 0
                     else float("nan"))
                ratios[k][f"tok/s {phase}"] = r
                line += f"{r:>17.2f}x (X / mlx-lm)"
            print(line)
    print("(c N: mean cached prompt tokens reported; TTFT ratio = mlx-lm / X, > 1: X faster; tok/s ratio = X / mlx-lm)")
    for k in kinds:
        for phase, key in (("turns", "all_turns"), ("after restart", "after_restart")):
            if results[k][key].get("n") and not results[k][key].get("tokens"):
                print(f"WARNING: {LABELS[k]} produced no tokens {phase} ({results[k][key]['n']} requests): its "
                      "ratios there mean nothing")
            elif results[k][key].get("failed"):
                print(f"WARNING: {LABELS[k]} produced no tokens on {results[k][key]['failed']} of "
                      f"{results[k][key]['n']} requests {phase}: they count in no TTFT, and the figures compare "
                      "the requests every server answered")
    pooled = [] if warm_row else [("warm turns", lambda r: r["warm_turns"])]
    for name, get in phases + pooled:
        print(f"{'p99 ' + name:<19}" + "".join(f"{LABELS[k]} {get(results[k])['p99'] * 1e3:.1f} ms  " for k in kinds))
    for phase, key in (("turns", "all_turns"), ("after restart", "after_restart")):
        print(f"decode tok/s per request, {phase} (p50 / mean, n): " + "; ".join(
            f"{LABELS[k]} {results[k][key]['decode_tok_s_p50']:.1f} / {results[k][key]['decode_tok_s_mean']:.1f}, "
            f"{results[k][key]['decode_requests']}" for k in kinds))
    stages = {k: results[k].get("stages") for k in kinds if results[k].get("stages")}
    for k, by_stage in stages.items():
        print(f"stages of {k} over the turns (mean ms x count): " + ", ".join(
            f"{stage} {s['mean_ms']:.2f} x {s['count']}" for stage, s in by_stage.items()))
    restarted = {k: results[k].get("stages_after_restart") for k in kinds if results[k].get("stages_after_restart")}
    for k, by_stage in restarted.items():  # the restart's restore from LMDB is a stage of its own (issue 39)
        print(f"stages of {k} after the restart (mean ms x count): " + ", ".join(
            f"{stage} {s['mean_ms']:.2f} x {s['count']}" for stage, s in by_stage.items()))
    same = {}
    for k in others:
        if BASELINE in results:
            same[k] = compare_texts(results[BASELINE]["texts"], results[k]["texts"])
            print(f"replies {k} vs mlx-lm: {same[k]['identical']}/{same[k]['total']} identical, "
                  f"{same[k]['identical_visible']}/{same[k]['total']} without special-token text"
                  + (f"; first difference {same[k]['first_difference']}" if same[k]["first_difference"] else ""))
            if "texts_after_restart" in results[BASELINE] and "texts_after_restart" in results[k]:
                same[k]["after_restart"] = compare_texts(results[BASELINE]["texts_after_restart"],
                                                         results[k]["texts_after_restart"])
                r = same[k]["after_restart"]
                print(f"  after restart: {r['identical']}/{r['total']} identical, {r['identical_visible']}/{r['total']}"
                      " without special-token text")
    return {"ratios": ratios, "identical_replies": same, "stages": stages, "stages_after_restart": restarted,
            "figures": figures(results, args)}


FIGURE_NAMES = {"serve": "serve", "spec-cache": "launcher"}


def figures(results: dict, args) -> dict:
    """The serving issue's keys: ``{serve,launcher}_{warm_ttft,tok_s,restart_ttft}_c<clients>`` (TTFT: mlx_lm.server's
    p50 / ours over every turn >= 2 pooled, and after the restart; tokens/s: ours / mlx_lm.server over the turns;
    > 1: ours faster). Needs the mlx-lm baseline in the same run; tokens/s only without --paired."""
    base = results.get(BASELINE)
    out: dict = {}
    if base is None:
        return out
    for kind, name in FIGURE_NAMES.items():
        ours = results.get(kind)
        if ours is None:
            continue
        c = args.clients
        for phase, key in (("warm", "warm_turns"), ("restart", "after_restart")):
            if not base[key].get("tokens", 1):  # a baseline whose replies all came back empty: no figure
                continue
            theirs, mine = _p50s(base, ours, key)
            if mine and mine == mine and theirs == theirs:  # (no request both answered: no figure)
                out[f"{name}_{phase}_ttft_c{c}"] = theirs / mine
        if not args.paired and base["all_turns"]["tokens_per_s"] > 0:
            out[f"{name}_tok_s_c{c}"] = ours["all_turns"]["tokens_per_s"] / base["all_turns"]["tokens_per_s"]
    return out


def _p50s(base: dict, ours: dict, key: str) -> tuple[float, float]:
    """The two p50 TTFTs of a phase (``warm_turns`` / ``after_restart``): over the requests both servers answered
    when either has empty replies there (issue 35's H100 agent run: mlx_lm.server's two turn-8 replies came back
    empty and their request times had counted as TTFTs), else each summary's own."""
    field = {"warm_turns": "answered_warm", "after_restart": "answered_after_restart"}[key]
    lists = (base.get(field), ours.get(field))
    if all(x is not None for x in lists) and (base[key].get("failed") or ours[key].get("failed")):
        theirs, mine, _ = paired_p50(*lists)
        return theirs, mine
    return base[key]["p50"], ours[key]["p50"]


def parse(argv=None, servers: str = "mlx-lm,spec-cache"):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--servers", default=servers, help=f"comma-separated, of {', '.join(KINDS)} (default {servers})")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--user-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--paired", action="store_true", help="all servers at once, every request to each")
    add_server_options(p)
    return server_options(p, p.parse_args(argv))


def add_server_options(p: argparse.ArgumentParser) -> None:
    """The options every workload of this tool shares (``tools/bench_agent.py`` too): warm-up, the servers'
    extra arguments and directory, the JSON and the kept logs."""
    p.add_argument("--warmup", choices=("tiny", "shapes"), default="tiny",
                   help="before timing each server: one tiny request (default), or also one per prompt-length class "
                        "and --clients at once (GPU: kernels compile there, not in a measured TTFT)")
    p.add_argument("--warmup-settle", type=float, default=0.0, help="seconds to wait after a shapes warm-up")
    p.add_argument("--serve-arg", action="append", default=[], help="append to serve's command line (repeatable)")
    p.add_argument("--launcher-arg", action="append", default=[],
                   help="append to the launcher's (spec-cache) command line (repeatable)")
    p.add_argument("--mlx-lm-arg", action="append", default=[],
                   help="append to mlx_lm.server's command line (repeatable): e.g. --prompt-cache-bytes where its "
                        "prompt cache would not fit the device beside the model (the baseline's own setting; say so)")
    p.add_argument("--cwd", help="start the servers in this directory (where `python -m spec_cache...` resolves)")
    p.add_argument("--json")
    p.add_argument("--keep", action="store_true",
                   help="keep the servers' logs and stores (a temporary folder; removed unless the run fails)")


def server_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``server_args`` (extra arguments by server kind) and ``kinds`` (``--servers`` checked)."""
    args.server_args = {"serve": args.serve_arg, "spec-cache": args.launcher_arg, "mlx-lm": args.mlx_lm_arg}
    args.kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad or not args.kinds:
        p.error(f"--servers: unknown {bad}; known: {', '.join(KINDS)}")
    return args


def main(argv=None, servers: str = "mlx-lm,spec-cache") -> int:
    args = parse(argv, servers)
    kinds = args.kinds
    if args.cwd:
        global REPO
        REPO = Path(args.cwd)
    tmp = Path(tempfile.mkdtemp(prefix="bench-mlx-lm-server-"))
    done = False
    try:
        model = args.model
        if model is None:
            from spec_cache.testing.tiny import write_tiny_target

            model = str(write_tiny_target(tmp / "tiny"))
        system = words(args.system_words, 999)
        if args.paired:
            results = bench_paired(kinds, model, args, system, tmp)
        else:
            results = {kind: bench(kind, model, args, system, tmp) for kind in kinds}
        done = True
    finally:
        if args.keep or not done:  # a failed run keeps its servers' logs for a look
            print(f"logs and stores: {tmp}" + ("" if done else " (kept: the run failed)"))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    extra = report(results, kinds, args)
    if args.json:
        out = {"args": {k: v for k, v in vars(args).items()}, **extra,
               **{k: {key: v for key, v in results[k].items()} for k in kinds}}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long after ``save(..., background=True)`` returns is a checkpoint durable in LMDB (the window a SIGKILL can
lose), and what ``durability="sync"`` costs the caller instead.

Checkpoints are KV states of float16 MLX arrays (``--layers`` layers, 8 KV heads, head_dim 128; a token is
``layers * 4 KiB``): ``small`` (64 tokens, 2 layers: 512 KiB) and ``large`` (800 tokens, 16 layers: 50 MiB), each under
a new prefix, into a store with the default ``durable=True`` (LMDB fsyncs each commit).

* lag (idle): ``save`` returns at t0; the writer thread's commit of that checkpoint ends at t1; ``t1 - t0``. The
  next save waits for the previous commit (an idle writer: the best case, what one request at a time sees).
* lag (burst): ``--burst`` saves back to back, then the same ``t1 - t0`` for each: queueing behind earlier writes.
* sync: how long ``save`` itself takes under ``durability="sync"`` (the cost moved onto the request).
* exit (``--exit N``): a child process queues N ``large`` checkpoints and ends without ``close()``; how long the
  exit drain took (from the script's last line to the process's end) and how many checkpoints LMDB then holds.

Usage: python tools/bench_durability.py [--reps 30] [--burst 8] [--exit 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from spec_cache.tiers.cache import SpecCache  # noqa: E402

SIZES = {"small": (64, 2), "large": (800, 16)}  # tokens, layers


def state(tokens: int, layers: int, seed: int) -> list[KVCache]:
    out = []
    for i in range(layers):
        c = KVCache()
        c.keys = mx.random.normal((1, 8, tokens, 128), dtype=mx.float16, key=mx.random.key(seed * 1000 + i))
        c.values = -c.keys
        c.offset = tokens
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(values) * 1e3, 2), "p99_ms": round(pct(values, 0.99) * 1e3, 2),
            "max_ms": round(max(values) * 1e3, 2), "n": len(values)}


def timed_cache(path: str, **options) -> tuple[SpecCache, dict]:
    """A cache whose writer thread stamps the end of each commit (by the checkpoint's first token)."""
    cache = SpecCache.open(path, **options)
    done: dict[int, float] = {}
    if cache._writer is not None:
        write = cache._writer._write

        def stamped(job):
            write(job)
            done[job.tokens[0]] = time.perf_counter()
        cache._writer._write = stamped
    return cache, done


def run(size: str, reps: int, burst: int, root: str) -> dict:
    tokens, layers = SIZES[size]
    states = [state(tokens, layers, s) for s in range(min(reps, 4))]  # reused: a new prefix each time
    nbytes = sum(c.keys.nbytes + c.values.nbytes for c in states[0])
    result = {"bytes": nbytes}

    cache, done = timed_cache(os.path.join(root, f"{size}-idle"))
    ns = cache.namespace("ab" * 32, "{}")
    lags = []
    for i in range(reps):
        cache.save(ns, [i + 3] + [1] * (tokens - 1), states[i % len(states)], background=True)
        t0 = time.perf_counter()
        assert cache.drain(120)
        lags.append(done[i + 3] - t0)
    result["lag_idle"] = summary(lags)

    lags = []
    for rnd in range(max(1, reps // burst)):
        base = 10_000 + rnd * burst
        returned = {}
        for j in range(burst):
            cache.save(ns, [base + j] + [2] * (tokens - 1), states[j % len(states)], background=True)
            returned[base + j] = time.perf_counter()
        assert cache.drain(300)
        lags += [done[k] - t0 for k, t0 in returned.items()]
    result["lag_burst"] = summary(lags)
    result["burst"] = burst
    cache.close()

    cache, _ = timed_cache(os.path.join(root, f"{size}-sync"), durability="sync")
    ns = cache.namespace("ab" * 32, "{}")
    costs = []
    for i in range(reps):
        t0 = time.perf_counter()
        assert cache.save(ns, [i + 3] + [1] * (tokens - 1), states[i % len(states)], background=True) is not None
        costs.append(time.perf_counter() - t0)
    result["sync_save"] = summary(costs)
    cache.close()
    return result


EXIT_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[3])
from tools.bench_durability import SIZES, state
from spec_cache.tiers.cache import SpecCache
cache = SpecCache.open(sys.argv[1])
ns = cache.namespace("ab" * 32, "{}")
tokens, layers = SIZES["large"]
states = [state(tokens, layers, s) for s in range(4)]
for i in range(int(sys.argv[2])):
    cache.save(ns, [i + 3] + [1] * (tokens - 1), states[i % 4], background=True)
print(cache.memory_stats()["writes"]["pending_bytes"], time.perf_counter(), flush=True)
"""


def run_exit(n: int, root: str) -> dict:
    """A child queues ``n`` large checkpoints and ends without ``close()``: the exit drain's duration and result."""
    path = os.path.join(root, "exit")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", EXIT_CHILD, path, str(n), repo], stdout=subprocess.PIPE,
                             text=True)
    queued, _ = child.stdout.readline().split()
    t0 = time.perf_counter()  # perf_counter is system-wide on Linux (CLOCK_MONOTONIC): the child's line ~ now
    child.wait(600)
    took = time.perf_counter() - t0
    tokens, _ = SIZES["large"]
    with SpecCache.open(path, memory_bytes=0) as cache:
        ns = cache.namespace("ab" * 32, "{}")
        held = sum(cache.store.lookup(ns, [i + 3] + [1] * (tokens - 1)) is not None for i in range(n))
    return {"queued_bytes_at_end": int(queued), "checkpoints": n, "in_lmdb_after_exit": held,
            "exit_s": round(took, 2), "returncode": child.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--exit", type=int, default=0, metavar="N",
                        help="also time the exit drain of N queued 50 MiB checkpoints (20: a full default queue)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-durability-")
    try:
        out = {size: run(size, args.reps, args.burst, root) for size in args.sizes}
        if args.exit:
            out["exit"] = run_exit(args.exit, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    exit_run = out.pop("exit", None)
    if exit_run is not None:
        print(f"exit drain: {exit_run['checkpoints']} queued ({exit_run['queued_bytes_at_end'] / 2**20:.0f} MiB) "
              f"-> {exit_run['in_lmdb_after_exit']} in LMDB after exit, which took {exit_run['exit_s']} s")
    for size, r in out.items():
        print(f"{size} ({r['bytes'] / 2**20:.2f} MiB): durable after return, idle writer p50 "
              f"{r['lag_idle']['p50_ms']} ms p99 {r['lag_idle']['p99_ms']} ms; burst of {r['burst']} p50 "
              f"{r['lag_burst']['p50_ms']} ms p99 {r['lag_burst']['p99_ms']} ms; sync save() p50 "
              f"{r['sync_save']['p50_ms']} ms p99 {r['sync_save']['p99_ms']} ms")


if __name__ == "__main__":
    main()

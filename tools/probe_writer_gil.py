"""How long the write-behind thread keeps other Python threads waiting while it writes large checkpoints.

    .venv/bin/python tools/probe_writer_gil.py [--layers 16] [--tokens 6000] [--json]

Three checkpoints (bf16 KV, 8 KV heads x 128, ``--layers`` layers, ``--tokens`` + 0 / 500 / 1000 tokens: ~375 MiB
each by default, an 8B-shaped row's size at ~3k tokens) are saved with ``background=True`` into a fresh store while
a ticker thread sleeps 1 ms at a time; the gaps between its wake-ups say how long it waited for the GIL (on an idle
machine a gap is ~1.1 ms). Why: on the GPU the scheduler thread's admissions and checkpoint queueing slowed 4-5x
once the write-behind thread had a backlog (docs/bench-gpu.md, the 2cb2304 trace); this tells whether the
writer's store path holds the GIL. Run it on an idle machine; ``py-spy record --gil --threads -- ...`` on it names
the holders. The figures are gaps, not ratios: a timing probe, never asserted by a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

try:  # installed; else the checkout this file is in
    import spec_cache  # noqa: F401
except ModuleNotFoundError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kv(tokens: int, seed: int, heads: int = 8, dim: int = 128):
    """One layer's evaluated bf16 ``KVCache`` of ``tokens`` random positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    keys = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(seed)).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys + 1)
    mx.eval(cache.keys, cache.values)
    return cache


class Ticker(threading.Thread):
    """Sleeps 1 ms at a time and keeps (time, gap since the last wake-up) for each wake-up."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="ticker")
        self.gaps: list[tuple[float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        last = time.perf_counter()
        while not self.stopped.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append((now, now - last))
            last = now


def probe(layers: int, tokens: int) -> dict:
    from spec_cache.tiers.cache import SpecCache

    ticker = Ticker()
    with tempfile.TemporaryDirectory() as work, SpecCache.open(Path(work) / "store", memory_bytes=8 << 30) as cache:
        ns = cache.namespace("cd" * 32, "prefix")
        ids = list(range(10, 10 + tokens + 1000))
        rows = [[kv(tokens + 500 * i, seed=j + 100 * i) for j in range(layers)] for i in range(3)]
        # the held positions (a KVCache buffer grows in steps of 256)
        checkpoint_mib = sum(c.keys[..., : c.offset, :].nbytes * 2 for c in rows[0]) / 2**20
        ticker.start()
        time.sleep(0.2)
        began = time.perf_counter()
        caller_ms = []
        for i, row in enumerate(rows):
            t0 = time.perf_counter()
            cache.save(ns, ids[: tokens + 500 * i], row, background=True)
            caller_ms.append(round(1e3 * (time.perf_counter() - t0), 2))
        drained = cache.drain(600)
        ended = time.perf_counter()
    ticker.stopped.set()
    ticker.join()
    during = sorted(gap for at, gap in ticker.gaps if began <= at <= ended)
    # (written before the ticker woke once, a tiny shape: no gap to report, None)
    longest = round(1e3 * during[-1], 2) if during else None
    p99 = round(1e3 * during[int(len(during) * 0.99)], 2) if during else None
    return {"checkpoint_mib": round(checkpoint_mib, 1), "checkpoints": 3, "drained": drained,
            "written_s": round(ended - began, 3), "save_on_caller_ms": caller_ms, "wakeups": len(during),
            "gap_max_ms": longest, "gap_p99_ms": p99,
            "gaps_over_5ms": sum(gap > 0.005 for gap in during),
            "waited_over_2ms_s": round(sum(gap for gap in during if gap > 0.002), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    if args.layers < 1 or args.tokens < 1:
        p.error("--layers and --tokens must be at least 1")
    result = probe(args.layers, args.tokens)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"3 checkpoints of {result['checkpoint_mib']} MiB written behind in {result['written_s']} s "
              f"(save on the caller: {result['save_on_caller_ms']} ms); ticker: {result['wakeups']} wake-ups, "
              f"longest gap {result['gap_max_ms']} ms, p99 {result['gap_p99_ms']} ms, "
              f"{result['gaps_over_5ms']} over 5 ms, {result['waited_over_2ms_s']} s in gaps over 2 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

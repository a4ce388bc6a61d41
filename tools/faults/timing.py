"""Timing side channel between tenants: does a tenant's miss take longer or shorter when another tenant has
stored the very same tokens?

A tenant's lookups only ever touch its own namespace key (the tenant salt is hashed into it, so even chunk keys
differ), so the answer should be "no". This measures ``Store.lookup`` and ``Store.fetch`` latency of tenant B's
miss in three stores of equal volume: empty for B, tenant A holding the *same* prompts, tenant A holding
*other* prompts. It reports medians, 90th percentiles and the two-sample Kolmogorov-Smirnov distance between the
"same" and "other" samples (no wall-clock assertion anywhere; this is a measurement). Tenant B holds entries
of its own in all three, so its lookups walk its own chains.

    python -m tools.faults.timing --samples 4000
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

import numpy as np

from spec_cache.naming.namespace import namespace_key
from spec_cache.store import LayerState, Store, Tensor
from tools.faults.common import parser, report

TARGET = "c" * 64
PREFIX = '{"method":null,"adapters":""}'


def _layers(tokens) -> list[LayerState]:
    t = np.asarray(tokens, np.float32)[None, None, :, None] * np.ones((1, 2, 1, 16), np.float32)
    return [LayerState("kv", {}, [Tensor.from_numpy(t), Tensor.from_numpy(-t)], token_axis=2)]


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic (max distance between the empirical CDFs)."""
    grid = np.sort(np.concatenate([a, b]))
    ca = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.max(np.abs(ca - cb)))


def run(samples: int = 4000, *, prompts: int = 200, length: int = 700, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ns_a = namespace_key(TARGET, PREFIX, "tenant-a")
    ns_b = namespace_key(TARGET, PREFIX, "tenant-b")
    queries = [rng.integers(0, 32000, length).tolist() for _ in range(prompts)]
    others = [rng.integers(0, 32000, length).tolist() for _ in range(prompts)]
    own = [rng.integers(0, 32000, length).tolist() for _ in range(prompts)]  # tenant B's own entries
    base = tempfile.mkdtemp(prefix="faults-timing-")
    result = {"harness": "timing", "samples": samples, "prompts": prompts, "prompt_tokens": length, "failures": []}
    try:
        stores = {}
        for name, content in (("empty", None), ("same", queries), ("other", others)):
            store = Store.open(f"{base}/{name}", chunk_tokens=256, durable=False)
            for ns, tenant in ((ns_a, True), (ns_b, True)):
                store.register_namespace(ns, target=TARGET, prefix_namespace=PREFIX, tenant=tenant)
            filler = content if content is not None else others
            for tokens in filler:  # equal volume everywhere: "empty" holds the other prompts under a third key
                ns = ns_a if content is not None else namespace_key(TARGET, PREFIX, "tenant-c")
                if content is None and ns not in stores:
                    store.register_namespace(ns, target=TARGET, prefix_namespace=PREFIX, tenant=True)
                store.put(ns, tokens, _layers(tokens))
            for tokens in own:  # B has entries of its own, so its lookups walk real chains of its own
                store.put(ns_b, tokens, _layers(tokens))
            store.flush()
            stores[name] = store
        timings: dict[str, dict[str, list[float]]] = {n: {"lookup": [], "fetch": []} for n in stores}
        answers = {n: set() for n in stores}
        order = list(stores)
        for i in range(samples):
            tokens = queries[i % prompts]
            rng.shuffle(order)  # interleave the stores so drift hits all three alike
            for name in order:
                store = stores[name]
                t0 = time.perf_counter_ns()
                hit = store.lookup(ns_b, tokens)
                t1 = time.perf_counter_ns()
                restored = store.fetch(ns_b, tokens)
                t2 = time.perf_counter_ns()
                timings[name]["lookup"].append((t1 - t0) / 1e3)
                timings[name]["fetch"].append((t2 - t1) / 1e3)
                answers[name].add((hit is None, restored is None))
        for name, store in stores.items():
            store.flush()
            if answers[name] != {(True, True)}:
                result["failures"].append(f"tenant B saw a hit in the '{name}' store: {answers[name]}")
        for api in ("lookup", "fetch"):
            for name in stores:
                a = np.asarray(timings[name][api])
                result[f"{api}_{name}_us"] = f"median {np.median(a):.1f}, p90 {np.percentile(a, 90):.1f}"
            result[f"{api}_ks_same_vs_other"] = round(_ks(np.asarray(timings["same"][api]),
                                                          np.asarray(timings["other"][api])), 3)
            result[f"{api}_ks_same_vs_empty"] = round(_ks(np.asarray(timings["same"][api]),
                                                          np.asarray(timings["empty"][api])), 3)
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4000)
    args = p.parse_args(argv)
    return report(run(args.samples, seed=args.seed), args.json)


if __name__ == "__main__":
    sys.exit(main())

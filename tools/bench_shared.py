"""First token from the shared tier vs a cold prefill vs the local LMDB store, through the public ``Generator`` API.

Model: llama, hidden 512, 4 layers, 8 heads / 2 KV heads (head_dim 64), intermediate 1408, vocab 32000, float32,
random weights written locally; drafter: the assistant (its row is restored too). A throwaway ``redis-server`` (or
``--server PATH``) on 127.0.0.1 is the shared tier.

Timed: time to first token of ``generate([prompt], max_tokens=1)``: ``Result.ttft_s``, from the call (lookup,
fetch, verification, rebuild) to the first token. The whole call, with the checkpoint writes after the token, is
printed as "visit".

* cold:   no cache: a full prefill.
* local:  host A, whose LMDB holds the prompt's checkpoint (the shared tier is not asked: the local hit is full).
* shared: a fresh host each repetition (empty LMDB, same server): the prefix comes from the shared tier, is
          verified, used, and promoted into LMDB in the background (not on the request's path).
* after:  that fresh host again: the promoted copy is a local hit.

Also timed apart: ``SharedTier.restore`` alone (round trips, transfer, checksums, assembly) and the promotion
(``Store.put`` of the restored layers, what the background thread does). Loopback only: on a network add the transfer (4 MiB per 1k tokens here).

Usage: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python tools/bench_shared.py [--lengths 1024 4096]
       [--reps 5] [--server /usr/bin/redis-server] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spec_cache.apps.bench.ttft import blas_in_use  # noqa: E402  (one answer for every bench, GPU included)

#: one random fleet secret per run (every host of the run gets it; spawned hosts receive it in their options)
BENCH_SECRET = secrets.token_hex(32)


def fleet_auth(args) -> dict:
    """The hosts' fleet secret options: one secret for every host of the run (or none with ``--trusted``)."""
    if args.trusted:
        return {"trusted_network": True}
    return {"secret": os.environ.get("SPEC_CACHE_SHARED_SECRET") or BENCH_SECRET}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def first_token(gen, prompt) -> tuple[float, float, object]:
    """(seconds to the first token, seconds for the whole call, result) of one ``generate`` call.

    ``Result.ttft_s`` counts from the ``generate`` call (lookup, fetch, verification and rebuild included).
    """
    t0 = time.perf_counter()
    (r,) = gen.generate([prompt], max_tokens=1)
    return r.ttft_s, time.perf_counter() - t0, r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-reps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--server", help="redis-server or valkey-server binary (default: the first one found)")
    p.add_argument("--timeout", type=float, default=0.05, help="SharedConfig.timeout_s (default 0.05, the default)")
    p.add_argument("--budget", type=float, default=0.5, help="SharedConfig.lookup_budget_s (default 0.5)")
    p.add_argument("--trusted", action="store_true",
                   help="no fleet secret: the unkeyed formats 1/2 (default: a secret, $SPEC_CACHE_SHARED_SECRET or "
                        "a random one per run: keyed names, sealed records)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from spec_cache.decode.generator import Generator
    from spec_cache.store.keys import pack_tokens
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
    from spec_cache.tiers.cache import SpecCache
    from tests.redis_servers import ThrowawayServer, server_binaries

    binary = args.server or next(iter(server_binaries().values()), None)
    if binary is None:
        print("no redis-server or valkey-server found (apt-get install redis-server)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="bench-shared-")
    target = write_tiny_target(os.path.join(work, "target"), hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256), head_dim=64,
                               intermediate_size=int(args.hidden * 2.75), vocab_size=32000, tokenizer=False)
    drafter = write_tiny_drafter(os.path.join(work, "assistant"), "assistant", target, seed=1)
    rng = np.random.default_rng(0)
    server = ThrowawayServer(binary, maxmemory="2gb")
    result = {"blas": blas_in_use(), "server": os.path.basename(binary),
              "model": f"llama hidden {args.hidden}, {args.layers} layers, float32", "drafter": "assistant"}
    try:
        cold_gen = Generator.load(target, drafter)
        for n in args.lengths:
            prompt = rng.integers(3, 32000, n).tolist()
            key = f"{n // 1024}k" if n % 1024 == 0 else str(n)
            cold, visit = [], {"cold": [], "local": [], "shared": [], "after": []}
            for _ in range(args.cold_reps):
                seconds, wall, r = first_token(cold_gen, prompt)
                cold.append(seconds)
                visit["cold"].append(wall)
            expect = r.tokens

            options = {"timeout_s": args.timeout, "lookup_budget_s": args.budget, **fleet_auth(args)}
            a = SpecCache.open(os.path.join(work, f"a-{n}"), shared=server.url, durable=False, shared_options=options)
            gen_a = Generator.load(target, drafter, cache=a)
            gen_a.generate([prompt], max_tokens=1)
            assert a.drain(60), "write-behind or publish did not finish"
            local = []
            for _ in range(args.reps):
                seconds, wall, r = first_token(gen_a, prompt)
                assert r.tokens == expect and r.cached_tokens == n - 1 and r.restored_drafter
                local.append(seconds)
                visit["local"].append(wall)
            assert a.shared_status()["lookups"] == 1  # only the first, cold visit asked the shared tier

            shared, after, fetch_only, promote, misses = [], [], [], [], []
            i = 0
            while len(shared) < args.reps:
                i += 1
                path = os.path.join(work, f"b-{n}-{i}")
                b = SpecCache.open(path, shared=server.url, durable=False, shared_options=options)
                gen_b = Generator.load(target, drafter, cache=b)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    seconds, wall, r = first_token(gen_b, prompt)
                assert r.tokens == expect
                if r.cached_tokens != n - 1:  # e.g. a read timed out on a loaded machine: counted, not timed
                    misses.append("; ".join(str(w.message) for w in caught) or "miss")
                    b.close()
                    if len(misses) > 3 * args.reps:
                        raise SystemExit(f"shared tier keeps missing: {misses[-1]}")
                    continue
                assert r.restored_drafter
                shared.append(seconds)
                visit["shared"].append(wall)
                assert b.drain(60)  # the background promotion and the publishes of this visit
                seconds, wall, r = first_token(gen_b, prompt)
                assert r.tokens == expect and r.cached_tokens == n - 1
                after.append(seconds)
                visit["after"].append(wall)
                # the two halves of a shared restore, apart: fetch + verify + assemble, then the promotion put
                packed = pack_tokens(prompt[:-1])
                b.shared.health.retry_at = 0.0  # a timeout above must not hide the tier from this measurement
                for _ in range(5):
                    seconds, got = timed(lambda: b.shared.restore(gen_b.ns_key, packed, drafter=gen_b.drafter_namespace,
                                                                  chunk_tokens=b.store.chunk_tokens))
                    if got is not None:
                        break
                    b.shared.health.retry_at = 0.0
                assert got is not None and got.length == n - 1, "the shared tier keeps timing out"
                fetch_only.append(seconds)
                c = SpecCache.open(os.path.join(work, f"c-{n}-{i}"), durable=False)
                ns = c.namespace(gen_b.target_identity, gen_b.prefix_namespace)
                seconds, _ = timed(lambda: c.store.put(ns, packed[:got.length], got.layers,
                                                       drafter=(gen_b.drafter_namespace, got.attachment),
                                                       minimum_reusable=got.minimum_reusable))
                promote.append(seconds)
                mib = got.nbytes / (1 << 20)
                c.close()
                b.close()
                shutil.rmtree(path, ignore_errors=True)
            a.close()
            med = {name: statistics.median(v) for name, v in
                   (("cold", cold), ("local", local), ("shared", shared), ("after", after),
                    ("fetch", fetch_only), ("promote", promote))}
            result[f"checkpoint_mib_{key}"] = round(mib, 2)
            result[f"shared_misses_{key}"] = len(misses)
            for name, v in med.items():
                result[f"{name}_s_{key}"] = v
            for name, v in visit.items():
                result[f"visit_{name}_s_{key}"] = statistics.median(v)
            result[f"cold_vs_shared_{key}"] = med["cold"] / med["shared"]
            result[f"shared_vs_local_{key}"] = med["shared"] / med["local"]
            if not args.json:
                v = {name: statistics.median(x) * 1e3 for name, x in visit.items()}
                print(f"{n:6d} tokens ({mib:.1f} MiB) first token: cold {med['cold'] * 1e3:7.1f} ms | local "
                      f"{med['local'] * 1e3:6.1f} ms | shared {med['shared'] * 1e3:6.1f} ms | after promotion "
                      f"{med['after'] * 1e3:6.1f} ms || cold/shared {med['cold'] / med['shared']:.1f}x, shared/local "
                      f"{med['shared'] / med['local']:.2f}x || shared restore alone {med['fetch'] * 1e3:.1f} ms, "
                      f"promotion put {med['promote'] * 1e3:.1f} ms || whole visit: cold {v['cold']:.0f}, local "
                      f"{v['local']:.0f}, shared {v['shared']:.0f}, after {v['after']:.0f} ms", flush=True)
                for m in misses:
                    print(f"        shared miss (not timed): {m[:200]}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"blas: {result['blas']}; {result['model']}; server {result['server']} on loopback; "
              f"medians of {args.reps} (cold: {args.cold_reps}); drafter row restored too")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

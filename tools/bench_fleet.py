"""Fleet benchmark: N host processes x M conversations with one shared system prompt, over a Redis Cluster.

Each host is a separate process with its own LMDB directory and a ``SpecCache`` opened with
``shared="redis+cluster://..."`` (a throwaway cluster of ``--masters`` primaries started here, or ``--shared URL``).
Conversations run turn by turn; every turn of every conversation goes to a host drawn at random (a load balancer
without affinity), so a turn usually lands on a host that did not serve the previous one. A turn's prompt is the
previous prompt, the reply and a new user message; all conversations start with the same system prompt.

Per request it records where the prefix came from (``cold``: nothing cached; ``local``: memory tier or LMDB;
``shared``: the shared tier answered), TTFT (``Result.ttft_s``), and the bytes the shared tier sent (and the chunk
bytes it did not have to send because the host held them). Every ``--cold-every``-th request is also run cold
(no cache) on the same prompt: its TTFT is the cold figure and its first token must equal the cached run's.

Printed: hit ratio (requests that reused a prefix), the share served by the shared tier, bytes moved per shared
hit (and what they would be without skipping locally-held chunks), TTFT p50/p95 for cold / local / shared,
publish-queue drops, keys per cluster primary, and a paper projection of hit ratio and bytes moved to 100 hosts
(the model is printed with it and described in docs/SHARED_TIER.md).

Usage: python tools/bench_fleet.py [--hosts 3] [--conversations 8] [--turns 3] [--system 512] [--user 64]
       [--reply 8] [--spread 1] [--masters 3] [--replicas 0] [--shared URL] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import shutil
import sys
import tempfile
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 32000



#: one random fleet secret per run (every host of the run gets it; spawned hosts receive it in their options)
BENCH_SECRET = secrets.token_hex(32)


def fleet_auth(args) -> dict:
    """The hosts' fleet secret options: one secret for every host of the run (or none with ``--trusted``)."""
    if args.trusted:
        return {"trusted_network": True}
    return {"secret": os.environ.get("SPEC_CACHE_SHARED_SECRET") or BENCH_SECRET}

def host_main(conn, index: int, url: str, work: str, target: str, drafter: str, options: dict,
              chunk_tokens: int) -> None:
    """One host: serve the jobs of each round, drain its queues, report its results and shared-tier counters."""
    warnings.simplefilter("ignore")
    from spec_cache.decode.generator import Generator
    from spec_cache.tiers.cache import SpecCache

    cache = SpecCache.open(os.path.join(work, f"host-{index}"), shared=url, durable=False, shared_options=options,
                           chunk_tokens=chunk_tokens)
    gen = Generator.load(target, drafter, cache=cache)
    cold = Generator.load(target, drafter)
    conn.send("ready")
    while True:
        jobs = conn.recv()
        if jobs is None:
            break
        out = []
        for conv, prompt, max_tokens, measure_cold in jobs:
            before = cache.shared_status()
            (r,) = gen.generate([prompt], max_tokens=max_tokens)
            after = cache.shared_status()
            source = "shared" if after["hits"] > before["hits"] else ("local" if r.cached_tokens else "cold")
            rec = {"conv": conv, "host": index, "tokens": r.tokens, "ttft_s": r.ttft_s, "cached": r.cached_tokens,
                   "prompt": len(prompt), "source": source,
                   "fetched": after["bytes_fetched"] - before["bytes_fetched"],
                   "skipped": after["bytes_local"] - before["bytes_local"]}
            if measure_cold:
                (c,) = cold.generate([prompt], max_tokens=1)
                rec["cold_ttft_s"] = c.ttft_s
                rec["same_first_token"] = c.tokens[:1] == r.tokens[:1]
            out.append(rec)
        drained = cache.drain(120)
        conn.send({"results": out, "drained": drained, "status": cache.shared_status()})
    cache.close()
    conn.send("closed")


def receive(conn):
    try:
        return conn.recv()
    except EOFError:
        raise SystemExit("a host process died (its traceback is above)") from None


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def projection(measured: dict, args, hosts_list=(1, 2, 4, 8, 16, 32, 64, 100)) -> list[dict]:
    """Hit ratio and bytes moved per request for H hosts, from the measured bytes per token (see the docstring of
    the printed table and docs/SHARED_TIER.md): uniform routing, T turns of ``user + reply`` tokens each after an
    S-token system prompt; turn 1 finds the system prompt locally (each host fetches it once), a later turn finds
    the previous turn on its own host with probability 1/H, else on the shared tier."""
    b = measured["bytes_per_token"]
    S, g, T = args.system, args.user + args.reply, args.turns
    rows = []
    for H in hosts_list:
        local_prev, shared_prev = 1 / H, 1 - 1 / H
        # prompt length of turn t (1-based): S + t*user + (t-1)*reply; prefix reusable at turn t >= 2: L_{t-1} + reply
        prefix = [S + (t - 1) * g for t in range(2, T + 1)]
        with_skip = sum(shared_prev * b * (p - S) for p in prefix) / T      # system-prompt chunks held locally
        without_skip = sum(shared_prev * b * p for p in prefix) / T
        rows.append({"hosts": H, "turn_hit_ratio_shared": 1.0, "turn_hit_ratio_local_only": local_prev,
                     "shared_share": (T - 1) * shared_prev / T, "bytes_per_request": with_skip,
                     "bytes_per_request_no_skip": without_skip, "system_prompt_fetches": H - 1})
    return rows


def run(args) -> dict:
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
    from tests.redis_servers import ThrowawayCluster, server_binaries

    work = tempfile.mkdtemp(prefix="bench-fleet-")
    cluster = None
    procs, conns = [], []
    try:
        if args.shared:
            url = args.shared
        else:
            binary = args.server or server_binaries().get("redis") or next(iter(server_binaries().values()), None)
            if binary is None:
                raise SystemExit("no redis-server found (tools/redis_server.sh install)")
            cluster = ThrowawayCluster(binary, masters=args.masters, replicas=args.replicas, maxmemory=args.maxmemory)
            url = cluster.url
        target = write_tiny_target(os.path.join(work, "target"), hidden_size=args.hidden, num_layers=args.layers,
                                   num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 256),
                                   head_dim=64, intermediate_size=int(args.hidden * 2.75), vocab_size=VOCAB,
                                   tokenizer=False)
        drafter = write_tiny_drafter(os.path.join(work, "ngram"), "ngram", target)
        options = {"timeout_s": args.timeout, "connect_timeout_s": max(args.timeout, 0.5),
                   "spread_chunks": args.spread, "queue_bytes": args.queue_bytes, "backoff_s": 0.2,
                   "lookup_budget_s": args.budget, **fleet_auth(args)}
        ctx = multiprocessing.get_context("spawn")  # MLX in forked children is not safe
        for i in range(args.hosts):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=host_main, args=(child, i, url, work, str(target), str(drafter), options,
                                                         args.chunk_tokens),
                            daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            receive(c)

        rng = np.random.default_rng(args.seed)
        system = rng.integers(3, VOCAB, args.system).tolist()
        history = {conv: list(system) for conv in range(args.conversations)}
        records, statuses, n = [], {}, 0
        for turn in range(args.turns):
            jobs = {h: [] for h in range(args.hosts)}
            for conv in range(args.conversations):
                history[conv] += rng.integers(3, VOCAB, args.user).tolist()
                host = int(rng.integers(args.hosts))
                jobs[host].append((conv, list(history[conv]), args.reply, n % args.cold_every == 0))
                n += 1
            # hosts run their jobs of a round concurrently; the round ends when every host has drained
            for h, c in enumerate(conns):
                c.send(jobs[h])
            for h, c in enumerate(conns):
                got = receive(c)
                records += got["results"]
                statuses[h] = got["status"]
                for rec in got["results"]:
                    history[rec["conv"]] += rec["tokens"]
        for c in conns:
            c.send(None)
        for c in conns:
            receive(c)
        keys_per_node = None
        if cluster is not None:
            import redis
            keys_per_node = sorted((redis.Redis(port=node.port).dbsize() for node in cluster.primaries()),
                                   reverse=True)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return summarize(args, records, statuses, keys_per_node)


def summarize(args, records: list[dict], statuses: dict, keys_per_node) -> dict:
    by = {s: [r for r in records if r["source"] == s] for s in ("cold", "local", "shared")}
    shared = by["shared"]
    fetched = sum(r["fetched"] for r in records)
    skipped = sum(r["skipped"] for r in records)
    cached_shared = sum(r["cached"] for r in shared)
    cold_ttft = [r["cold_ttft_s"] for r in records if "cold_ttft_s" in r]
    totals = {name: sum(s.get(name, 0) for s in statuses.values()) for name in
              ("published", "bytes_published", "chunks_uploaded", "chunks_present", "dropped_full", "dropped_down",
               "dropped_close", "dropped_gone", "publish_failed", "timeouts", "errors", "corrupt", "migrating")}
    out = {
        "hosts": args.hosts, "conversations": args.conversations, "turns": args.turns, "requests": len(records),
        "system_tokens": args.system, "user_tokens": args.user, "reply_tokens": args.reply,
        "spread_chunks": args.spread, "chunk_tokens": args.chunk_tokens,
        "model": f"llama hidden {args.hidden}, {args.layers} layers, float32, random weights",
        "hit_ratio": (len(by["local"]) + len(shared)) / len(records),
        "shared_share": len(shared) / len(records),
        "requests_by_source": {s: len(v) for s, v in by.items()},
        "bytes_moved_per_shared_hit": fetched / len(shared) if shared else None,
        "bytes_skipped_per_shared_hit": skipped / len(shared) if shared else None,
        "bytes_per_token": (fetched + skipped) / cached_shared if cached_shared else None,
        "first_token_mismatches": sum(1 for r in records if r.get("same_first_token") is False),
        "keys_per_primary": keys_per_node, **totals,
        "publish_queue_drops": totals["dropped_full"] + totals["dropped_down"] + totals["dropped_close"],
    }
    for name, values in (("cold", cold_ttft), ("local", [r["ttft_s"] for r in by["local"]]),
                         ("shared", [r["ttft_s"] for r in shared])):
        out[f"ttft_{name}_p50_ms"] = None if not values else percentile(values, 50) * 1e3
        out[f"ttft_{name}_p95_ms"] = None if not values else percentile(values, 95) * 1e3
    if out["bytes_per_token"]:
        out["projection"] = projection(out, args)
    return out


def report(out: dict) -> str:
    def ms(name):
        p50, p95 = out[f"ttft_{name}_p50_ms"], out[f"ttft_{name}_p95_ms"]
        return "-" if p50 is None else f"{p50:.1f} / {p95:.1f}"
    mib = 1 << 20
    lines = [
        f"{out['hosts']} hosts x {out['conversations']} conversations x {out['turns']} turns = {out['requests']} "
        f"requests; system prompt {out['system_tokens']} tokens, +{out['user_tokens']} user / {out['reply_tokens']} "
        f"reply per turn; chunk {out['chunk_tokens']}, spread {out['spread_chunks']}; {out['model']}",
        f"hit ratio {out['hit_ratio']:.2f} (requests by source: {out['requests_by_source']}), shared tier served "
        f"{out['shared_share']:.2f}",
        f"TTFT p50 / p95 ms: cold {ms('cold')} | local {ms('local')} | shared {ms('shared')}",
    ]
    if out["bytes_moved_per_shared_hit"] is not None:
        lines.append(f"bytes moved per shared hit {out['bytes_moved_per_shared_hit'] / mib:.2f} MiB (chunks held "
                     f"locally, not sent: {out['bytes_skipped_per_shared_hit'] / mib:.2f} MiB); "
                     f"{out['bytes_per_token']:.0f} bytes per cached token")
    lines.append(f"published {out['published']} checkpoints ({out['bytes_published'] / mib:.1f} MiB, "
                 f"{out['chunks_uploaded']} chunks uploaded, {out['chunks_present']} already there); publish queue "
                 f"drops {out['publish_queue_drops']}, failures {out['publish_failed']}; errors {out['errors']}, "
                 f"timeouts {out['timeouts']}, corrupt {out['corrupt']}; first-token mismatches vs cold "
                 f"{out['first_token_mismatches']}")
    if out["keys_per_primary"] is not None:
        lines.append(f"keys per cluster primary: {out['keys_per_primary']}")
    if out.get("projection"):
        lines.append("paper projection (uniform routing, no affinity; bytes per token as measured; turn 1 finds the "
                     "system prompt locally, a later turn finds the previous one on its own host with p = 1/H):")
        lines.append("  hosts  turn>=2 prefix hit (shared tier / local only)  served by shared  "
                     "bytes moved per request (skip local chunks / fetch all)")
        for row in out["projection"]:
            lines.append(f"  {row['hosts']:5d}  {row['turn_hit_ratio_shared']:.2f} / "
                         f"{row['turn_hit_ratio_local_only']:.2f}{'':35s}{row['shared_share']:.2f}{'':14s}"
                         f"{row['bytes_per_request'] / mib:7.2f} / "
                         f"{row['bytes_per_request_no_skip'] / mib:.2f} MiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system", type=int, default=512, help="system prompt tokens (shared by every conversation)")
    p.add_argument("--user", type=int, default=64, help="new user tokens per turn")
    p.add_argument("--reply", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--spread", type=int, default=1, help="SharedConfig.spread_chunks")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cold-every", type=int, default=2, help="run every k-th request cold as well")
    p.add_argument("--masters", type=int, default=3)
    p.add_argument("--replicas", type=int, default=0)
    p.add_argument("--maxmemory", default="512mb", help="per cluster node")
    p.add_argument("--shared", help="an existing shared tier URL (default: a throwaway local cluster)")
    p.add_argument("--server", help="redis-server binary for the throwaway cluster")
    p.add_argument("--timeout", type=float, default=0.5, help="SharedConfig.timeout_s")
    p.add_argument("--budget", type=float, default=0.5, help="SharedConfig.lookup_budget_s (default 0.5)")
    p.add_argument("--trusted", action="store_true",
                   help="no fleet secret: the unkeyed formats 1/2 (default: a secret, $SPEC_CACHE_SHARED_SECRET or "
                        "a random one per run: keyed names, sealed records)")
    p.add_argument("--queue-bytes", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("hosts", "conversations", "turns", "system", "user", "reply", "chunk_tokens", "spread", "cold_every",
                 "masters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    out = run(args)
    print(json.dumps(out) if args.json else report(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

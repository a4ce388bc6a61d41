"""The shared tier on a real Redis Cluster: three primaries with a replica each, started once for the module from
Debian's ``redis-server --cluster-enabled yes`` and joined with ``redis-cli --cluster create`` on free ports,
torn down at the end. Skipped only when no server binary or no ``redis-cli`` exists at all.

Hosts are ``SpecCache`` instances opened with ``shared="redis+cluster://..."`` and separate LMDB directories; one
runs in a separate process. Every restored prefix is compared with the state it must hold (``kv_value``), also
while a primary dies and while a slot migrates under the readers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import redis
from redis.cluster import RedisCluster, key_slot

from spec_cache.apps.cli import shared as shared_cli
from spec_cache.store import StoreError
from spec_cache.store.shared import SharedConfig
from spec_cache.store.shared.auth import SALT_BYTES, TAG_BYTES
from spec_cache.store.shared.keys import KeyNames
from spec_cache.store.shared.records import read_outgoing
from spec_cache.tiers.cache import CacheWarning, SpecCache
from tests.redis_servers import ThrowawayCluster, cli_for, free_port, server_binaries
from tests.store.test_shared_tier import (  # noqa: F401  (hosts: a fixture)
    DRAFTER,
    PREFIX_NS,
    SECRET,
    TARGET,
    C,
    assert_holds,
    hosts,
    prompt,
    save,
)

BINARIES = server_binaries()
BINARY = BINARIES.get("redis") or next(iter(BINARIES.values()), None)
pytestmark = pytest.mark.skipif(BINARY is None or cli_for(BINARY) is None,
                                reason="no redis-server / redis-cli installed (tools/redis_server.sh install)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster():
    with ThrowawayCluster(BINARY, masters=3, replicas=1) as c:
        yield c


@pytest.fixture
def flushed(cluster):
    """The module's cluster, emptied and healthy (a killed node restarted as a replica)."""
    for node in cluster.nodes:
        if node.proc is None or node.proc.poll() is not None:
            node.start()
    cluster.wait_ok()
    for node in cluster.primaries():
        redis.Redis(port=node.port).flushall()
    return cluster


def client(cluster) -> RedisCluster:
    return RedisCluster(host="127.0.0.1", port=cluster.primaries()[0].port)


def gets(cluster) -> int:
    """GET commands served by the cluster's primaries so far (``INFO commandstats``)."""
    return sum(redis.Redis(port=n.port).info("commandstats").get("cmdstat_get", {}).get("calls", 0)
               for n in cluster.primaries())


def restore_checked(cache, ns, tokens, **kwargs):
    """A restore that may miss (with a warning) but never returns a wrong prefix."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = cache.restore(ns, tokens, **kwargs)
    if hit is not None:
        assert_holds(hit, tokens)
    return hit, [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


# --- configuration and layout ----------------------------------------------------------------------------
def test_cluster_urls_are_parsed_and_bad_ones_named():
    config = SharedConfig("redis+cluster://u:pw@10.0.0.1:7000,[::1]:7001,node-3:7002")
    assert config.cluster and config.prefix == "sc:2:"
    assert config.cluster_nodes == [("10.0.0.1", 7000), ("::1", 7001), ("node-3", 7002)]
    assert config.credentials == ("u", "pw") and "pw" not in config.safe_url
    assert SharedConfig("redis://h:1/0").prefix == "sc:1:" and not SharedConfig("redis://h:1/0").cluster
    # an IPv6 node among others parses on every Python (Debian's 3.11.2 urllib calls it "Invalid IPv6 URL")
    assert SharedConfig("redis+cluster://[::1]:7001,h:2").cluster_nodes == [("::1", 7001), ("h", 2)]
    for bad, says in [("redis+cluster://h", "is not host:port"), ("redis+cluster://h:1,", "is not host:port"),
                      ("redis+cluster://h:1/2", "no database"), ("redis+cluster://h:99999", "is not host:port"),
                      ("cluster://h:1", "must start with"), ("redis+cluster://[::1:7000", "is not host:port"),
                      ("redis://[::1:6379/0", "cannot be parsed"), ("redis://u:pw@[zz]:1/0", "cannot be parsed")]:
        with pytest.raises(StoreError, match=says) as caught:  # named, never urllib's bare ValueError
            SharedConfig(bad)
        assert "pw" not in str(caught.value)
    with pytest.raises(ValueError, match="without { or }"):
        SharedConfig("redis+cluster://h:1", prefix="a{b}:")
    with pytest.raises(ValueError, match="spread_chunks"):
        SharedConfig("redis+cluster://h:1", spread_chunks=0)


def test_key_groups_follow_the_spread():
    chain = [bytes([i]) * 32 for i in range(5)]  # root, chunk 1..4
    one, flat = KeyNames("sc:2:", cluster=True, spread=1), KeyNames("sc:1:")
    assert one.groups(chain) == [(chain[0], 0), (chain[1], 4)]
    assert one.group_of(chain[:1]) == chain[0] and one.group_of(chain[:4]) == chain[1]
    three = KeyNames("sc:2:", cluster=True, spread=3)
    assert three.groups(chain) == [(chain[0], 0), (chain[1], 1), (chain[2], 2), (chain[3], 4)]
    assert three.group_of(chain[:3]) == chain[2] and three.group_of(chain) == chain[3]
    assert flat.groups(chain) == [(None, 4)] and flat.chunk(chain[2]) == b"sc:1:chunk:" + chain[2].hex().encode()
    assert one.chunk(chain[2], chain[1]) == b"sc:2:{" + chain[1].hex()[:16].encode() + b"}chunk:" + \
        chain[2].hex().encode()
    with pytest.raises(ValueError, match="needs its group"):
        one.chunk(chain[2])


def test_a_checkpoint_lives_in_one_slot_and_conversations_spread(flushed, hosts, monkeypatch, capsys):
    monkeypatch.setenv("SPEC_CACHE_SHARED_SECRET", SECRET)  # shared-stats reads the fleet's prefix (sc:4:)
    a = hosts("a", flushed.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    prompts = [prompt(200 + i, 100) for i in range(12)]
    results = [save(a, ns, p) for p in prompts]
    assert a.drain(20)
    assert a.shared_status()["published"] == 12 and a.shared_status()["errors"] == 0
    r = client(flushed)
    names = list(r.scan_iter(match="sc:4:*", target_nodes=RedisCluster.PRIMARIES))  # format 4: keyed names
    assert not any(ns.hex().encode() in n for n in names)
    slots_of_checkpoint = []
    for result in results:
        out = read_outgoing(a.store, result.entry, [DRAFTER])
        group = a.shared.keys.group_of(out.chain)
        assert not any(group.hex()[:16].encode() in n for n in names)  # hash tags are keyed too
        mine = [n for n in names if n.startswith(b"sc:4:{" + a.shared.keys.auth.tag_hex(group) + b"}")]
        assert len(mine) == 2 * len(out.chain) + 2  # chunks, nodes (with the root), entry, manifest, draft
        slots_of_checkpoint.append({key_slot(n) for n in mine})
    assert all(len(s) == 1 for s in slots_of_checkpoint)
    slots = {next(iter(s)) for s in slots_of_checkpoint}
    assert len(slots) == 12  # 12 conversations (different first chunks): 12 slots
    owners = {flushed.node_of_slot(s).port for s in slots}
    assert len(owners) >= 2  # ... over several primaries (12 random slots on 3 nodes: all on one has p < 1e-5)
    stats = shared_cli.shared_health(flushed.url)  # what `spec-cache --shared redis+cluster://... shared-stats` shows
    assert stats["reachable"] and stats["cluster"]["state"] == "ok" and len(stats["cluster"]["primaries"]) == 3
    assert stats["published_checkpoints"] == 12 and stats["keys"] == len(names)  # the stats hash included
    assert "16384 of 16384 slots served, 3 primaries" in shared_cli.format_health(stats)
    monkeypatch.setenv(shared_cli.ENV, flushed.url)  # $SPEC_CACHE_SHARED names the cluster as --shared does
    capsys.readouterr()
    assert shared_cli.cmd_shared_stats(argparse.Namespace(json=True)) == 0
    assert json.loads(capsys.readouterr().out)["published_checkpoints"] == 12


def test_a_cluster_down_at_start_is_a_miss_not_a_crash(tmp_path):
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    cache = SpecCache.open(tmp_path / "a", shared=url, chunk_tokens=C, durable=False,
                           shared_options={"timeout_s": 0.2, "connect_timeout_s": 0.2, "backoff_s": 60,
                                           "secret": SECRET})
    try:
        ns = cache.namespace(TARGET, PREFIX_NS)
        p = prompt(50, 40)
        with pytest.warns(CacheWarning, match="cluster not reachable"):
            assert cache.restore(ns, p) is None
        save(cache, ns, p)  # saved locally; the publish is dropped while the tier backs off
        assert cache.drain(10)
        hit, _ = restore_checked(cache, ns, p + [1])
        assert hit.length == 40 and hit.tier != "shared"
        s = cache.shared_status()
        assert s["state"] == "down" and s["errors"] == 1 and s["dropped_down"] == 1
    finally:
        cache.close()


# --- two hosts -------------------------------------------------------------------------------------------
HOST_SCRIPT = """
import json, sys
from spec_cache.tiers.cache import SpecCache
from tests.store.test_shared_tier import TARGET, PREFIX_NS, SECRET, C, prompt, save
url, path, seeds = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
cache = SpecCache.open(path, shared=url, shared_options={"timeout_s": 2.0, "connect_timeout_s": 2.0, "secret": SECRET},
                       chunk_tokens=C, durable=False)
ns = cache.namespace(TARGET, PREFIX_NS)
for seed in seeds:
    save(cache, ns, prompt(seed, 100))
ok = cache.drain(30)
print(json.dumps({"drained": ok, **cache.shared_status()}))
cache.close()
"""


def test_two_host_processes_share_prefixes_over_the_cluster(flushed, hosts, tmp_path, store_invariants):
    done = subprocess.run([sys.executable, "-c", HOST_SCRIPT, flushed.url, str(tmp_path / "host-a"), "1,2,3"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    status = json.loads(done.stdout.strip().splitlines()[-1])
    assert status["drained"] and status["published"] == 3 and status["errors"] == 0

    b = hosts("b", flushed.url)
    ns = b.namespace(TARGET, PREFIX_NS)
    for seed in (1, 2, 3):
        p = prompt(seed, 100)
        hit, said = restore_checked(b, ns, p + [7], drafter_namespace=DRAFTER)
        assert hit is not None and hit.length == 100 and hit.draft_checkpoint is not None, said
    q = prompt(2, 100)[:70] + prompt(9, 30)  # shares 70 tokens with seed 2: the 64-token chunk boundary
    d = hosts("d", flushed.url)  # a host that holds nothing yet (B's memory tier would serve 70 tokens)
    hit, _ = restore_checked(d, d.namespace(TARGET, PREFIX_NS), q)
    assert hit.length == 64 and hit.tier == "shared"
    assert b.drain(10) and b.shared_status()["promoted"] == 3
    store_invariants(b.store)
    # B publishes a longer conversation; a third host finds it with A's chunks
    longer = prompt(1, 100) + prompt(10, 40)
    save(b, ns, longer)
    assert b.drain(10)
    assert b.shared_status()["chunks_present"] >= 100 // C  # A's chunks were on the cluster already
    c = hosts("c", flushed.url)
    hit, _ = restore_checked(c, c.namespace(TARGET, PREFIX_NS), longer, drafter_namespace=DRAFTER)
    assert hit.length == 140


def test_fetch_skips_chunks_the_local_store_holds(flushed, hosts):
    a, b = hosts("a", flushed.url), hosts("b", flushed.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    assert b.namespace(TARGET, PREFIX_NS) == ns
    p = prompt(30, 100)
    save(a, ns, p)
    assert a.drain(10)
    save(b, ns, p[:50], drafter=False)  # B holds chunks 1..3 (48 tokens) of the same conversation
    assert b.drain(10)
    before = gets(flushed)
    hit, said = restore_checked(b, ns, p + [1], drafter_namespace=DRAFTER)
    assert hit is not None and hit.length == 100, said
    s = b.shared_status()
    out = read_outgoing(a.store, a.store.lookup(ns, p).entry, [DRAFTER])
    sizes = read_chunk_sizes(a, out.chain[1:])
    assert len(sizes) == 6 and s["chunks_local"] == 3 and s["bytes_local"] == sum(sizes[k] for k in out.chain[1:4])
    # only chunks 4..6, the entry record and the drafter record crossed the network (each sealed: salt and tag)
    sealed = 1 + SALT_BYTES + TAG_BYTES
    assert s["bytes_fetched"] == (sum(sizes[k] for k in out.chain[4:]) + len(out.entry_record) + len(out.drafts[0][2])
                                  + 5 * sealed)
    assert gets(flushed) - before == 3 + 2


def read_chunk_sizes(cache, keys):
    with cache.store.reading() as txn:
        return {k: len(txn.get(k, db=cache.store.env.dbs["chunks"])) for k in keys}


# --- failures ----------------------------------------------------------------------------------------------
def test_a_primary_killed_mid_run_gives_misses_then_its_replica_serves(flushed, hosts):
    a = hosts("a", flushed.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    prompts = [prompt(300 + i, 100) for i in range(6)]
    for p in prompts:
        save(a, ns, p)
    assert a.drain(20)
    r = client(flushed)
    for node in flushed.primaries():  # every write reached its replica before the crash
        redis.Redis(port=node.port).wait(1, 2000)
    out = read_outgoing(a.store, a.store.lookup(ns, prompts[0]).entry, [])
    victim = flushed.node_of_slot(key_slot(a.shared.keys.manifest(out.entry_key, a.shared.keys.group_of(out.chain))))
    victim.kill()

    b = hosts("b", flushed.url, timeout_s=0.5, connect_timeout_s=0.2)
    nsb = b.namespace(TARGET, PREFIX_NS)
    served, missed, messages = 0, 0, []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        hit, said = restore_checked(b, nsb, prompts[0] + [5], drafter_namespace=DRAFTER)  # never wrong
        messages += said
        if hit is None:
            missed += 1
            time.sleep(0.1)
            continue
        served += 1
        if hit.length == 100:
            break
    assert missed >= 1 and any("shared tier" in m for m in messages)  # the dead primary: misses with warnings
    assert served >= 1 and hit.length == 100  # then the promoted replica serves the same checkpoint
    for p in prompts[1:]:
        hit, _ = restore_checked(b, nsb, p + [5])
        assert hit is not None and hit.length == 100
    r.close()


def test_reads_during_a_slot_migration_are_right_or_misses(flushed, hosts):
    a = hosts("a", flushed.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(400, 100)
    save(a, ns, p)
    assert a.drain(10)
    keys = a.shared.keys
    out = read_outgoing(a.store, a.store.lookup(ns, p).entry, [DRAFTER])
    slot = key_slot(keys.manifest(out.entry_key, keys.group_of(out.chain)))
    src = flushed.node_of_slot(slot)
    dst = next(n for n in flushed.primaries() if n is not src)
    src_id, dst_id = flushed.node_id(src), flushed.node_id(dst)
    rs, rd = redis.Redis(port=src.port), redis.Redis(port=dst.port)
    names = rs.cluster("getkeysinslot", slot, 1000)
    assert len(names) == 2 * len(out.chain) + 2

    b = hosts("b", flushed.url, backoff_s=0.01)
    nsb = b.namespace(TARGET, PREFIX_NS)
    assert restore_checked(b, nsb, p + [1])[0].length == 100  # B knows the old owner of the slot
    rd.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    rs.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    lengths, migrating = [], 0
    for i, name in enumerate(names):  # one key at a time, a read after each: ASK redirections, split records
        rs.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", name)
        fresh = hosts(f"b{i}", flushed.url, backoff_s=0.01)  # an empty local store: everything from the cluster
        hit, _ = restore_checked(fresh, fresh.namespace(TARGET, PREFIX_NS), p + [1], drafter_namespace=DRAFTER)
        lengths.append(0 if hit is None else hit.length)
        migrating += fresh.shared_status()["migrating"]
    for node in flushed.primaries():
        redis.Redis(port=node.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    assert flushed.node_of_slot(slot) is dst
    c = hosts("c", flushed.url)
    hit, said = restore_checked(c, c.namespace(TARGET, PREFIX_NS), p + [1], drafter_namespace=DRAFTER)
    assert hit is not None and hit.length == 100 and hit.draft_checkpoint is not None, said
    # B's client still maps the slot to the old owner: MOVED, followed by the client, no error
    b.shared.health.retry_at = 0.0
    hit, said = restore_checked(b, nsb, p[:96] + [2, 3])
    assert hit is not None and hit.length == 96, said
    assert b.shared_status()["corrupt"] == 0 and c.shared_status()["corrupt"] == 0
    # while the records were split over two nodes every read served the whole checkpoint: ASK followed
    assert lengths == [100] * len(names), lengths
    assert migrating >= 1


# --- the fleet benchmark's arithmetic (the tool itself is run by hand: tools/bench_fleet.py) -----------------
def test_fleet_summary_and_projection():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_fleet

    args = argparse.Namespace(hosts=2, conversations=2, turns=3, system=512, user=64, reply=8, spread=1,
                              chunk_tokens=128, hidden=64, layers=2)
    mib = 1 << 20
    records = [
        {"source": "cold", "ttft_s": 0.0, "cached": 0, "fetched": 0, "skipped": 0, "cold_ttft_s": 2.0,
         "same_first_token": True},
        {"source": "local", "ttft_s": 0.2, "cached": 512, "fetched": 0, "skipped": 0},
        {"source": "shared", "ttft_s": 0.4, "cached": 640, "fetched": mib // 4, "skipped": 3 * mib // 4,
         "cold_ttft_s": 1.0, "same_first_token": False},
        {"source": "shared", "ttft_s": 0.6, "cached": 640, "fetched": mib // 4, "skipped": 3 * mib // 4},
    ]
    statuses = {0: {"published": 3, "dropped_full": 1, "dropped_down": 2}, 1: {"published": 1, "dropped_close": 1}}
    out = bench_fleet.summarize(args, records, statuses, [10, 1, 0])
    assert out["hit_ratio"] == 0.75 and out["shared_share"] == 0.5
    assert out["bytes_moved_per_shared_hit"] == mib // 4 and out["bytes_skipped_per_shared_hit"] == 3 * mib // 4
    assert out["bytes_per_token"] == 2 * mib / 1280
    assert out["publish_queue_drops"] == 4 and out["published"] == 4 and out["first_token_mismatches"] == 1
    assert out["ttft_cold_p50_ms"] == 1500 and out["ttft_shared_p50_ms"] == 500
    rows = {row["hosts"]: row for row in out["projection"]}
    assert rows[1]["shared_share"] == 0 and rows[1]["bytes_per_request"] == 0
    assert rows[2]["turn_hit_ratio_local_only"] == 0.5 and rows[100]["turn_hit_ratio_local_only"] == 0.01
    assert rows[100]["shared_share"] == pytest.approx(2 / 3 * 0.99)
    # turns 2 and 3 reuse 584 and 656 tokens, 72 and 144 of them past the system prompt, half of them fetched at H=2
    b = out["bytes_per_token"]
    assert rows[2]["bytes_per_request"] == pytest.approx(0.5 * b * (72 + 144) / 3)
    assert rows[2]["bytes_per_request_no_skip"] == pytest.approx(0.5 * b * (584 + 656) / 3)
    assert "paper projection" in bench_fleet.report(out)

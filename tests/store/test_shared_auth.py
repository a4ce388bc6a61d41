"""The shared tier's fleet secret and its lookup budget, against a real Redis-protocol server (see
tests/store/test_shared_tier.py for the servers and hosts), and a slow server's effect on the server's scheduler.

* a forged entry (another prompt's tensors under this prompt's key, with a recomputed XXH3 and manifest checksum:
  the attack that worked on the unkeyed format) is a miss with one warning and never reaches LMDB;
* another secret is a miss; no secret and no ``trusted_network`` is refused at open;
* key names hide namespace keys and chain keys, values hide tokens;
* a server answering one byte every 20 ms costs one lookup its budget, not a minute;
* in ``spec-cache serve``'s scheduler, a slow shared lookup of one request never stalls another stream.

The slow server is a TCP proxy in this process in front of a real one, trickling replies byte by byte on demand.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import warnings

import pytest
import redis

from spec_cache.store import StoreError
from spec_cache.store.keys import pack_tokens
from spec_cache.store.shared import SharedConfig
from spec_cache.store.shared.records import record_checksum
from spec_cache.tiers.cache import CacheWarning, SpecCache
from tests.redis_servers import ThrowawayServer, server_binaries
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)
from tests.store.test_shared_tier import (
    DRAFTER,
    PREFIX_NS,
    SECRET,
    TARGET,
    C,
    assert_holds,
    caches_for,
    prompt,
    save,
)

BINARIES = server_binaries()
pytestmark = pytest.mark.skipif(not BINARIES, reason="no redis-server or valkey-server binary installed")
BINARY = BINARIES.get("redis") or next(iter(BINARIES.values()), None)


@pytest.fixture(scope="module")
def module_server():
    with ThrowawayServer(BINARY) as server:
        yield server


@pytest.fixture
def server(module_server, monkeypatch):
    redis.Redis.from_url(module_server.url).flushall()
    monkeypatch.delenv("SPEC_CACHE_SHARED_SECRET", raising=False)
    monkeypatch.delenv("SPEC_CACHE_SHARED_TRUSTED", raising=False)
    return module_server


@pytest.fixture
def hosts(tmp_path):
    opened = []

    def host(name, url, **options):
        options.setdefault("timeout_s", 2.0)
        options.setdefault("connect_timeout_s", 2.0)
        options.setdefault("lookup_budget_s", 10.0)  # the budget tests below set their own; the rest check contents
        options.setdefault("backoff_s", 0.05)
        cache = SpecCache.open(tmp_path / name, shared=url, shared_options=options, chunk_tokens=C, durable=False)
        opened.append(cache)
        return cache
    yield host
    for cache in opened:
        cache.close()


class SlowProxy:
    """127.0.0.1 TCP proxy to ``port``; while ``slow`` is set, replies go out one byte every ``gap_s``."""

    def __init__(self, port: int, gap_s: float = 0.02):
        self.target = port
        self.gap_s = gap_s
        self.slow = threading.Event()
        self.trickled = 0  # bytes sent one by one so far
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                for i in range(len(data)):
                    if not (replies and self.slow.is_set()):
                        dst.sendall(data[i:])
                        break
                    dst.sendall(data[i:i + 1])
                    self.trickled += 1
                    time.sleep(self.gap_s)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self.slow.clear()
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def slow_proxy(server):
    proxies = []

    def make(**kwargs):
        proxies.append(SlowProxy(server.port, **kwargs))
        return proxies[-1]
    yield make
    for p in proxies:
        p.close()


def all_keys(url: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(url).scan_iter(count=1000))


def forged_entry_record(tmp_path, ns_name_args, p, other) -> bytes:
    """What the attacker writes: an entry record for ``p``'s key, holding ``other``'s tensors, with every
    checksum inside it recomputed (a valid record to any reader without the secret)."""
    with SpecCache.open(tmp_path / "attacker", memory_bytes=0) as evil:
        ns = evil.namespace(*ns_name_args)
        result = evil.save(ns, p, caches_for(other[:len(p)]))
        raw = evil.store.env.env.begin(db=evil.store.env.dbs["edata"]).get(result.entry)
        return bytes(raw)


# --- authentication ---------------------------------------------------------------------------------------
def test_a_forged_entry_is_a_miss_with_one_warning_and_never_promoted(server, hosts, tmp_path, caplog):
    a = hosts("a", server.url, secret=SECRET)
    ns = a.namespace(TARGET, PREFIX_NS)
    p, other = prompt(20, 100), prompt(21, 100)
    save(a, ns, p)
    assert a.shared.drain(10)
    entry = a.store.lookup(ns, p).entry
    tier, r = a.shared, redis.Redis.from_url(server.url)
    entry_name, man_name = tier.keys.entry(entry), tier.keys.manifest(entry)
    assert r.exists(entry_name) and r.exists(man_name)
    manifest = r.hgetall(man_name)
    forged = forged_entry_record(tmp_path, (TARGET, PREFIX_NS), p, other)

    def attack():  # the attack that worked on format 1: other tensors, XXH3 and the manifest's sum recomputed
        r.set(entry_name, forged)
        r.delete(man_name)
        r.hset(man_name, mapping={**manifest, b"sum": record_checksum(forged)})
    b = hosts("b", server.url, secret=SECRET)
    nsb = b.namespace(TARGET, PREFIX_NS)
    caplog.set_level(logging.WARNING, logger="spec_cache.shared")
    quiet = []
    for i in range(3):  # three lookups meet the forgery: each a miss of the entry, one warning per cause in all
        attack()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hit = b.restore(nsb, p, drafter_namespace=DRAFTER)
            assert b.drain(10)
        assert hit is not None and hit.length == 96  # the chunk boundary below it: the fleet's own chunks
        assert_holds(hit, p)
        messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
        assert (any("failed authentication" in m for m in messages)) == (i == 0)
        quiet.append(messages)
        b.memory.clear()
    status = b.shared_status()
    assert status["unauthenticated"] >= 3 and status["corrupt"] == 0
    logged = [rec.getMessage() for rec in caplog.records if "failed authentication" in rec.getMessage()]
    assert sorted(m.split(": ")[1].split(" failed")[0] for m in logged) == ["entry record", "manifest"], logged
    # promoted: the 96-token chunk boundary only; B's LMDB never holds an entry at 100 tokens
    assert status["promoted"] == 1
    local = b.store.lookup(nsb, p)
    assert local.length == 96
    again = b.restore(nsb, p)
    assert again.length == 96 and again.tier == "local"
    assert_holds(again, p)


def test_another_secret_is_a_miss_and_names_hide_namespaces_and_tokens(server, hosts):
    a = hosts("a", server.url, secret=SECRET)
    ns = a.namespace(TARGET, PREFIX_NS, tenant="acme")
    p = prompt(22, 100)
    save(a, ns, p)
    assert a.shared.drain(10)
    keys = all_keys(server.url)
    assert keys and all(k.startswith(b"sc:3:") for k in keys)
    chain = a.store.lookup(ns, p).chain
    secrets_in_names = [ns.hex(), *(key.hex() for key in chain)]
    assert not any(s.encode() in k for k in keys for s in secrets_in_names)
    r = redis.Redis.from_url(server.url)
    values = b"".join(r.get(k) for k in keys if r.type(k) == b"string")
    assert pack_tokens(p)[:C].tobytes() not in values  # sealed: no tokens (nor tensors) readable

    other = hosts("other", server.url, secret="another fleet's secret, 32 bytes")
    assert other.restore(other.namespace(TARGET, PREFIX_NS, tenant="acme"), p) is None
    s = other.shared_status()
    assert s["lookups"] == 1 and s["misses"] == 1 and s["unauthenticated"] == 0  # other names: nothing found
    assert redis.Redis.from_url(server.url).dbsize() == len(keys)  # and nothing of the fleet's removed

    # the unkeyed format, on a trusted network only, shows all of it (what the secret hides)
    trusted = hosts("t", server.url, trusted_network=True)
    save(trusted, trusted.namespace(TARGET, PREFIX_NS, tenant="acme"), p)
    assert trusted.shared.drain(10)
    plain = [k for k in all_keys(server.url) if k.startswith(b"sc:1:")]
    assert any(ns.hex().encode() in k for k in plain)
    assert pack_tokens(p)[:C].tobytes() in b"".join(r.get(k) for k in plain if r.type(k) == b"string")
    t2 = hosts("t2", server.url, trusted_network=True)  # trusted hosts share the unkeyed format as before
    hit = t2.restore(t2.namespace(TARGET, PREFIX_NS, tenant="acme"), p + [1])
    assert hit.length == 100 and hit.tier == "shared"
    assert_holds(hit, p)


def test_no_secret_is_refused_unless_the_network_is_trusted(server, tmp_path, monkeypatch, caplog):
    with pytest.raises(StoreError, match="no fleet secret.*trusted_network"):
        SpecCache.open(tmp_path / "s", shared=server.url)
    with SpecCache.open(tmp_path / "s") as cache:  # the refused open closed its store
        assert cache.shared is None
    with pytest.raises(StoreError, match="at least 16"):
        SpecCache.open(tmp_path / "s", shared=server.url, shared_options={"secret": "short"})
    with pytest.raises(StoreError, match="secret_file"):
        SharedConfig(server.url, secret_file=str(tmp_path / "missing"))
    config = SharedConfig(server.url, secret=SECRET)
    assert SECRET not in repr(config) and config.prefix == "sc:3:" and config.keyed
    assert SharedConfig("redis+cluster://h:1", secret=SECRET).prefix == "sc:4:"

    secret_file = tmp_path / "fleet.key"
    secret_file.write_text(SECRET + "\n")
    from_file = SharedConfig(server.url, secret_file=str(secret_file))
    monkeypatch.setenv("SPEC_CACHE_SHARED_SECRET", SECRET)
    from_env = SharedConfig(server.url)
    assert from_file.key_material == from_env.key_material == SECRET.encode() and from_env.prefix == "sc:3:"
    monkeypatch.delenv("SPEC_CACHE_SHARED_SECRET")

    caplog.set_level(logging.WARNING, logger="spec_cache.shared")
    for how in ({"trusted_network": True}, {}):
        if not how:
            monkeypatch.setenv("SPEC_CACHE_SHARED_TRUSTED", "1")
        with SpecCache.open(tmp_path / "t", shared=server.url, shared_options=how) as cache:
            assert cache.shared.config.prefix == "sc:1:" and not cache.shared.status()["keyed"]
    assert sum("WITHOUT a fleet secret" in rec.getMessage() for rec in caplog.records) == 2  # each start


def test_prefetch_holds_a_prefix_for_a_restore_that_never_asks_the_network(server, hosts):
    a = hosts("a", server.url, secret=SECRET)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(23, 100)
    save(a, ns, p)
    assert a.shared.drain(10)
    b = hosts("b", server.url, secret=SECRET)
    nsb = b.namespace(TARGET, PREFIX_NS)
    with b.shared_via_prefetch():
        assert b.restore(nsb, p + [1], drafter_namespace=DRAFTER) is None  # nothing prefetched: no request
    assert b.shared_status()["lookups"] == 0
    assert b.prefetch_shared(nsb, p + [1], DRAFTER, time.monotonic() + 10)
    with b.shared_via_prefetch():
        hit = b.restore(nsb, p + [1], drafter_namespace=DRAFTER)
    assert hit.length == 100 and hit.tier == "shared" and hit.draft_checkpoint is not None
    assert_holds(hit, p)
    s = b.shared_status()
    assert s["lookups"] == 1 and s["prefetch_used"] == 1
    assert b.drain(10) and b.shared_status()["promoted"] == 1


# --- the lookup budget ------------------------------------------------------------------------------------
def test_a_server_trickling_bytes_costs_a_lookup_its_budget(server, hosts, slow_proxy):
    a = hosts("a", server.url, secret=SECRET)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(24, 100)
    save(a, ns, p)
    assert a.shared.drain(10)
    proxy = slow_proxy()
    # every read would wait up to 2 s, and each byte comes in 20 ms: only the total budget ends the lookup
    b = hosts("b", proxy.url, secret=SECRET, timeout_s=2.0, lookup_budget_s=0.3, backoff_s=60)
    nsb = b.namespace(TARGET, PREFIX_NS)
    proxy.slow.set()
    result = {}

    def lookup():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["hit"] = b.restore(nsb, p)
            result["warnings"] = [str(w.message) for w in caught]
    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(30)  # liveness only (the records alone are ~100 KB: a minute and more at one byte per 20 ms)
    proxy.slow.clear()
    assert not t.is_alive(), "a trickling server held the lookup past its budget"
    assert result["hit"] is None and proxy.trickled > 0
    s = b.shared_status()
    assert s["over_budget"] == 1 and s["timeouts"] == 1 and s["misses"] == 1
    assert any("timed out" in w for w in result["warnings"])
    b.shared.health.retry_at = 0.0  # the server is quick again: the next lookup serves
    hit = b.restore(nsb, p + [1])
    assert hit.length == 100
    assert_holds(hit, p)


# --- the server's scheduler ---------------------------------------------------------------------------------
def test_a_slow_shared_lookup_never_stalls_another_stream(tiny, server, hosts, slow_proxy):
    from spec_cache.apps.server.scheduler import Job, Scheduler
    from spec_cache.decode.generator import Generator
    from spec_cache.rows.sampling import RowSampling

    target, drafter = tiny.root / "target", tiny.drafter_dir("assistant")
    b_prompt = list(range(5, 70))
    publisher = hosts("pub", server.url, secret=SECRET)
    Generator.load(target, drafter, cache=publisher).generate([b_prompt], max_tokens=4)
    assert publisher.drain(10)
    proxy = slow_proxy()
    cache = hosts("srv", proxy.url, secret=SECRET, timeout_s=5.0, lookup_budget_s=60.0)
    sched = Scheduler(Generator.load(target, drafter, cache=cache), max_rows=4)
    sched.start()
    events: dict[str, list] = {"a": [], "b": []}
    done = {"a": threading.Event(), "b": threading.Event()}

    def deliver(name):
        def on(event):
            events[name].append(event)
            if event[0] in ("done", "error"):
                done[name].set()
        return on

    def tokens(name):
        return [t for e in list(events[name]) if e[0] == "tokens" for t in e[1]]

    def wait_for(cond, timeout=60.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.01)
        return False
    stream = Job(prompt=[3, 9, 27, 81], max_tokens=100_000, sampling=RowSampling(), deliver=deliver("a"),
                 stop_at_eos=False)
    try:
        sched.submit(stream)
        assert wait_for(lambda: len(tokens("a")) >= 4)  # stream A decodes
        proxy.slow.set()  # from now on the shared server answers one byte every 20 ms
        job_b = Job(prompt=b_prompt, max_tokens=6, sampling=RowSampling(), deliver=deliver("b"))
        sched.submit(job_b)
        assert wait_for(lambda: proxy.trickled > 0)  # B's shared lookup is under way, crawling
        before = len(tokens("a"))
        assert wait_for(lambda: len(tokens("a")) >= before + 16), "stream A stalled behind B's shared lookup"
        assert not done["b"].is_set() and proxy.slow.is_set()  # and B's lookup was still crawling meanwhile
    finally:
        proxy.slow.clear()
    assert done["b"].wait(60)
    sched.cancel(stream)
    assert done["a"].wait(60)
    sched.stop(10)
    # exact: B restored the prefix from the shared tier (prefetched) and continued as a cold run would
    start = next(e for e in events["b"] if e[0] == "start")
    assert start[1] == len(b_prompt) - 1
    assert tokens("b") == plain_greedy(tiny.target, b_prompt, 6)
    got_a = tokens("a")
    assert got_a[:32] == plain_greedy(tiny.target, stream.prompt, 32)
    s = cache.shared_status()
    assert s["prefetch_used"] == 1 and s["prefetch_hits"] == 1

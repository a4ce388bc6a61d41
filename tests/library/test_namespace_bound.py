"""The namespaces a ``SpecCache`` registers are bounded (issue 37, sixth attacker pass): one tenant's fresh
``cache_salt`` on every request used to leave a namespace for good, in process and as an LMDB row outside the byte
budget. Past ``max_namespaces`` the least recently used tenant namespaces that hold nothing are forgotten, and
their LMDB rows dropped when those hold nothing either; what holds something, what is untenanted or kept, and a
request whose namespace was forgotten while it ran, keep working."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from spec_cache.store.maintenance import verify
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.namespaces import NamespaceTable, Registration

TARGET = "ab" * 32
PREFIX = "spec-cache/ngram:v1"


def salted(i: int) -> str:
    return "tenant-a|salt:%064x" % i


def kv(n: int, seed: int = 0) -> list:
    mx.random.seed(seed)
    cache = KVCache()
    cache.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return [cache]


def nsinfo_rows(cache: SpecCache) -> int:
    with cache.store.reading() as txn:
        return sum(1 for _ in txn.cursor(db=cache.store.env.dbs["nsinfo"]))


def test_the_table_stays_bounded_and_empty_rows_leave_lmdb(tmp_path):
    with SpecCache.open(tmp_path / "s", memory_bytes=1 << 20, max_namespaces=64) as cache:
        plain = cache.namespace(TARGET, PREFIX)  # no tenant: kept for good
        first = cache.namespace(TARGET, PREFIX, salted(0))
        for i in range(1, 500):
            cache.namespace(TARGET, PREFIX, salted(i))
        assert cache.namespaces_held() <= 64 + 1
        assert nsinfo_rows(cache) <= 64 + 1
        assert cache.store.namespace_info(first) is None
        assert cache.store.namespace_info(plain) is not None
        # named again: registered again, and a checkpoint under it is stored
        again = cache.namespace(TARGET, PREFIX, salted(0))
        assert again == first and cache.store.namespace_info(first) is not None
        assert cache.save(first, list(range(40)), kv(40)) is not None
        assert not verify(cache.store).damaged


def test_a_namespace_that_holds_something_is_never_forgotten(tmp_path):
    with SpecCache.open(tmp_path / "s", memory_bytes=0, max_namespaces=16) as cache:
        busy = cache.namespace(TARGET, PREFIX, salted(0))
        assert cache.save(busy, list(range(40)), kv(40)) is not None  # memory tier off: held by LMDB only
        for i in range(1, 200):
            cache.namespace(TARGET, PREFIX, salted(i))
        info = cache.store.namespace_info(busy)
        assert info is not None and info.entries == 1
        hit = cache.restore(busy, list(range(40)))
        assert hit is not None and hit.length >= 32
        assert not verify(cache.store).damaged


def test_the_memory_tier_holds_a_namespace_in_process(tmp_path):
    with SpecCache.open(tmp_path / "s", memory_bytes=64 << 20, max_namespaces=16,
                        durability="sync") as cache:
        busy = cache.namespace(TARGET, PREFIX, salted(0))
        cache.save(busy, list(range(40)), kv(40))
        for i in range(1, 200):
            cache.namespace(TARGET, PREFIX, salted(i))
        assert busy in cache._namespaces  # held by the memory tier: not forgotten
        assert cache.tenant_of(busy) != b""


def test_a_request_whose_namespace_was_forgotten_meanwhile_still_stores_its_checkpoint(tmp_path):
    with SpecCache.open(tmp_path / "s", memory_bytes=1 << 20, max_namespaces=16) as cache:
        mine = cache.namespace(TARGET, PREFIX, salted(0))  # the request starts
        for i in range(1, 26):  # others come and go meanwhile (fewer than the bound again: it is recalled)
            cache.namespace(TARGET, PREFIX, salted(i))
        assert mine not in cache._namespaces and cache.store.namespace_info(mine) is None
        cache.save(mine, list(range(40)), kv(40), background=True)
        assert cache.drain()
        info = cache.store.namespace_info(mine)
        assert info is not None and info.entries == 1 and info.tenant_id is not None
        assert cache.tenant_of(mine) == info.tenant_id


def test_a_row_named_by_a_continuation_record_stays(tmp_path):
    from spec_cache.store.continuations import Continuation

    with SpecCache.open(tmp_path / "s", memory_bytes=1 << 20, max_namespaces=8) as cache:
        named = cache.namespace(TARGET, PREFIX, salted(0))
        cache.continuations.table.put(Continuation(b"\x01" * 32, named, 5, (1, 2, 3)))
        for i in range(1, 100):
            cache.namespace(TARGET, PREFIX, salted(i))
        assert cache.store.namespace_info(named) is not None
        assert not verify(cache.store).damaged


def test_the_table_keeps_the_newest_forgotten_for_recall():
    table = NamespaceTable(4)
    for i in range(10):
        table.add(bytes([i]) * 32, Registration("t", "p", True, None))
    table.add(b"k" * 32, Registration("t", "p", False, None, keep=True))
    old = table.over_limit()
    assert old == [bytes([i]) * 32 for i in range(6)]  # the kept key is never offered
    table.forget(old)
    assert len(table) == 5 and table.recall(bytes([0]) * 32) is None  # 0 and 1 fell out of the forgotten table
    assert table.recall(bytes([5]) * 32) is not None and table.recall(bytes([5]) * 32) is None


def test_a_held_namespace_stays_until_its_last_holder_lets_go(tmp_path):
    """``hold`` / ``release`` (the server's scheduler holds each job's namespace while it runs): a held namespace is
    never forgotten however many others are named, and is forgettable again once every holder released it."""
    with SpecCache.open(tmp_path / "s", memory_bytes=0, max_namespaces=8) as cache:
        mine = cache.namespace(TARGET, PREFIX, salted(0))
        cache.hold(mine)
        cache.hold(mine)  # two jobs of one namespace
        for i in range(1, 100):
            cache.namespace(TARGET, PREFIX, salted(i))
        assert mine in cache._namespaces and cache.store.namespace_info(mine) is not None
        assert cache.save(mine, list(range(40)), kv(40)) is not None
        cache.release(mine)
        for i in range(100, 200):
            cache.namespace(TARGET, PREFIX, salted(i))
        assert mine in cache._namespaces  # one holder left
        cache.release(mine)
        cache.release(mine)  # one release too many: nothing
        for i in range(200, 300):
            cache.namespace(TARGET, PREFIX, salted(i))
        assert mine not in cache._namespaces and not cache._namespaces.holds()
        info = cache.store.namespace_info(mine)
        assert info is not None and info.entries == 1  # its row holds an entry: kept in LMDB
        assert cache.namespaces_held() <= 8


def test_empty_tenant_rows_left_by_earlier_processes_are_dropped_when_the_store_opens(tmp_path):
    """Issue 37, eighth pass: each process forgets only the namespaces it registered, so the up to
    ``max_namespaces`` empty rows one process left at its end (a tenant's fresh salts) stayed in LMDB for good, and
    every restart added as many (outside the byte budget). Opening a cache drops the empty tenant rows; what holds
    an entry, and untenanted rows, stay."""
    for run in range(5):
        with SpecCache.open(tmp_path / "s", memory_bytes=0, max_namespaces=8) as cache:
            plain = cache.namespace(TARGET, PREFIX)
            if run == 0:
                full = cache.namespace(TARGET, PREFIX, "tenant-b")
                assert cache.save(full, list(range(40)), kv(40)) is not None
            for i in range(8):
                cache.namespace(TARGET, PREFIX, salted(100 * run + i))
    with SpecCache.open(tmp_path / "s", memory_bytes=0, max_namespaces=8) as cache:
        assert nsinfo_rows(cache) == 2  # the untenanted row and B's
        assert cache.store.namespace_info(plain) is not None
        info = cache.store.namespace_info(full)
        assert info is not None and info.entries == 1
        assert cache.restore(full, list(range(40))) is not None
        assert not verify(cache.store).damaged

"""Per-tenant accounting, quotas and fair-share eviction (issue 20), in real LMDB stores and the memory tier.

One tenant flooding the store must not evict a tenant within its fair share; a tenant over its quota evicts its
own entries; a store without tenant labels (every store written before format 1.1) behaves and reads as before.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.store import CorruptIndex, InvalidInput, LayerState, Store, StoreFullError, Tensor, maintenance
from spec_cache.store.index import Index
from spec_cache.store.keys import tenant_id
from spec_cache.store.values import tenant_key

TARGET = "ab" * 32
PAYLOAD = 1024  # float32 values per checkpoint: ~4 KiB records, all the same size
GOLDEN_A = "6c019d6f63153cf31b860ecbd601429b"  # blake3 derive_key("spec-cache 2026 tenant-id v1", b"key:tenant-a")[:16]
A, B, C = tenant_id("key:tenant-a"), tenant_id("key:tenant-b"), tenant_id("key:tenant-c")


def ns_of(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def layers(seed: int, n: int = PAYLOAD) -> list[LayerState]:
    """One state layer stored whole (no chunks), so an entry's bytes are exactly what evicting it frees."""
    return [LayerState("arrays", {}, [Tensor.from_numpy(np.full(n, seed, np.float32))], token_axis=None)]


def tokens(seed: int) -> list[int]:
    return [seed, seed + 1, seed + 2, 7]


def open_tenants(open_store, *labels: bytes | None, **kwargs) -> Store:
    """A store with one namespace per tenant label (``ns_of("t0")``, ``ns_of("t1")``, ...)."""
    store = open_store(**kwargs)
    for i, label in enumerate(labels):
        store.register_namespace(ns_of(f"t{i}"), target=TARGET, prefix_namespace="{}", tenant=label is not None,
                                 tenant_id=label)
    return store


def entry_size(open_store, tmp_path) -> int:
    with Store.open(tmp_path / "probe", durable=False) as probe:
        probe.register_namespace(ns_of("p"), target=TARGET, prefix_namespace="{}")
        return probe.put(ns_of("p"), tokens(1), layers(1)).bytes_written


def held(store: Store, ns: bytes, seeds) -> list[int]:
    return [s for s in seeds if store.lookup(ns, tokens(s)) is not None]


def by_tenant(store: Store) -> dict[str, int]:
    return {row["tenant"]: row["bytes"] for row in maintenance.stats(store)["tenants"]}


# --- fair share -------------------------------------------------------------------------------------------
def test_a_flooding_tenant_evicts_its_own_oldest_and_never_a_tenant_within_its_share(open_store, store_invariants,
                                                                                     tmp_path):
    one = entry_size(open_store, tmp_path)
    store = open_tenants(open_store, A, B, max_bytes=20 * one)
    a, b = ns_of("t0"), ns_of("t1")
    for s in range(5):                       # B: 5 entries, well within its fair share (10 of 20)
        store.put(b, tokens(1000 + s), layers(1000 + s))
    for s in range(100):                     # A writes 5x the whole budget
        store.put(a, tokens(s), layers(s))
    assert held(store, b, range(1000, 1005)) == list(range(1000, 1005))  # every B entry survived the flood
    kept = held(store, a, range(100))
    assert kept == list(range(100 - len(kept), 100))  # A lost its oldest, kept its newest
    assert len(kept) == 15
    tenants = by_tenant(store)
    assert tenants == {A.hex(): 15 * one, B.hex(): 5 * one}
    assert maintenance.stats(store)["bytes"] <= 20 * one
    store_invariants(store)
    assert maintenance.index_problems(store) == []
    with store.env.read() as txn:
        row = txn.get(tenant_key(A), db=store.env.dbs["meta"])
    assert msgpack.unpackb(bytes(row)) == {"bytes": 15 * one, "entries": 15}  # A's counter row (format 1.1)
    # an older spec-cache writing this store moves namespace counters but not tenant rows: verify names it,
    # gc rebuilds the row from the namespace rows
    store.env.write(lambda txn: Index(txn, store.env.dbs).delete("meta", tenant_key(A)))
    assert any("tenant" in p for p in maintenance.index_problems(store))
    maintenance.gc(store)
    assert maintenance.index_problems(store) == [] and by_tenant(store) == tenants


def test_over_budget_the_largest_tenant_goes_first_even_when_a_smaller_ones_entries_are_older(open_store,
                                                                                               tmp_path):
    one = entry_size(open_store, tmp_path)
    store = open_tenants(open_store, A, B, C, max_bytes=12 * one)
    for s in range(3):                        # C's entries are the oldest in the store
        store.put(ns_of("t2"), tokens(2000 + s), layers(2000 + s))
    for s in range(4):
        store.put(ns_of("t1"), tokens(1000 + s), layers(1000 + s))
    for s in range(5):
        store.put(ns_of("t0"), tokens(s), layers(s))
    assert by_tenant(store) == {A.hex(): 5 * one, B.hex(): 4 * one, C.hex(): 3 * one}
    store.put(ns_of("t1"), tokens(1004), layers(1004))  # over budget by one: A (most bytes) pays, not old C
    assert by_tenant(store) == {A.hex(): 4 * one, B.hex(): 5 * one, C.hex(): 3 * one}
    assert held(store, ns_of("t0"), range(5)) == [1, 2, 3, 4]
    store.put(ns_of("t2"), tokens(2003), layers(2003))  # now A and B tie at 4 and 5: B (most) pays its oldest
    assert held(store, ns_of("t1"), range(1000, 1005)) == [1001, 1002, 1003, 1004]
    assert held(store, ns_of("t2"), range(2000, 2004)) == [2000, 2001, 2002, 2003]


# --- quotas -----------------------------------------------------------------------------------------------
def test_a_tenant_over_its_quota_evicts_its_own_entries_first(open_store, tmp_path):
    one = entry_size(open_store, tmp_path)
    store = open_tenants(open_store, A, B, tenant_quota_bytes=4 * one)   # no store budget at all
    for s in range(3):
        store.put(ns_of("t1"), tokens(1000 + s), layers(1000 + s))
    for s in range(10):
        store.put(ns_of("t0"), tokens(s), layers(s))
    assert held(store, ns_of("t0"), range(10)) == [6, 7, 8, 9]
    assert held(store, ns_of("t1"), range(1000, 1003)) == [1000, 1001, 1002]
    assert by_tenant(store) == {A.hex(): 4 * one, B.hex(): 3 * one}
    assert maintenance.tenants(store)[0]["quota_bytes"] == 4 * one


def test_tenant_share_is_a_fraction_of_the_budget_and_a_quota_held_by_pins_refuses_the_put(open_store, tmp_path):
    one = entry_size(open_store, tmp_path)
    store = open_tenants(open_store, A, B, max_bytes=40 * one, tenant_share=0.1)  # 4 entries a tenant
    for s in range(4):
        store.put(ns_of("t0"), tokens(s), layers(s), pin=True)
    with store.env.read() as txn:
        before = {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)] for name, db in store.env.dbs.items()
                  if name != "memo"}
    with pytest.raises(StoreFullError, match="quota"):
        store.put(ns_of("t0"), tokens(9), layers(9))
    with store.env.read() as txn:
        after = {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)] for name, db in store.env.dbs.items()
                 if name != "memo"}
    assert after == before                                  # refused whole: nothing written, nothing evicted
    store.put(ns_of("t1"), tokens(100), layers(100))        # another tenant is not held back by it
    with pytest.raises(StoreFullError, match="quota"):
        store.put(ns_of("t1"), tokens(101), layers(101, 5 * PAYLOAD))  # alone over the quota
    with pytest.raises(InvalidInput, match="tenant_share"):
        Store.open(tmp_path / "bad", tenant_share=0.5)     # a share of no budget
    with pytest.raises(InvalidInput, match="tenant_quota_bytes"):
        Store.open(tmp_path / "bad", tenant_quota_bytes=0)


# --- single tenant and old stores -------------------------------------------------------------------------
def test_without_tenant_labels_the_store_stays_format_1_0_and_evicts_by_plain_lru(open_store, tmp_path):
    one = entry_size(open_store, tmp_path)
    store = open_tenants(open_store, None, None, max_bytes=6 * one)
    order = [(ns_of(f"t{s % 2}"), s) for s in range(10)]
    for ns, s in order:
        store.put(ns, tokens(s), layers(s))
    survivors = [s for ns, s in order if store.lookup(ns, tokens(s)) is not None]
    assert survivors == [4, 5, 6, 7, 8, 9]                  # global LRU across namespaces, as before tenants
    with store.env.read() as txn:
        rows = [msgpack.unpackb(bytes(v), raw=False) for _, v in txn.cursor(db=store.env.dbs["nsinfo"])]
        minor = Index(txn, store.env.dbs).format_minor()
    assert all("tid" not in row for row in rows) and minor == 0  # the bytes a 1.0 store always had
    assert maintenance.stats(store)["format"].endswith(" 1.0")
    assert by_tenant(store) == {"default": 6 * one}


def test_a_store_written_before_tenants_opens_with_its_namespaces_as_the_default_tenant(tmp_path):
    path = tmp_path / "old"
    one = None
    with Store.open(path, durable=False) as old:
        for i in range(2):  # namespace rows exactly as format 1.0 wrote them (no "tid")
            row = {"target": TARGET, "prefix": "{}", "tenant": bool(i), "created": 1, "entries": 0, "bytes": 0,
                   "hits": 0, "misses": 0, "last_use": None, "sigs": []}
            old.env.write(lambda txn, i=i, row=row: Index(txn, old.env.dbs).put("nsinfo", ns_of(f"old{i}"), row))
        for s in range(6):
            one = old.put(ns_of(f"old{s % 2}"), tokens(s), layers(s)).bytes_written
    with Store.open(path, durable=False, max_bytes=10 * one) as store:
        assert maintenance.stats(store)["format"].endswith(" 1.0")
        assert by_tenant(store) == {"default": 6 * one}
        assert {n["tenant_id"] for n in maintenance.namespaces(store)} == {"default"}
        store.register_namespace(ns_of("new"), target=TARGET, prefix_namespace="{}", tenant=True, tenant_id=A)
        assert maintenance.stats(store)["format"].endswith(" 1.1")  # labels written: format 1.1
        for s in range(100, 120):                           # the new tenant floods
            store.put(ns_of("new"), tokens(s), layers(s))
        assert by_tenant(store) == {"default": 5 * one, A.hex(): 5 * one}  # the old entries keep their fair share
        assert held(store, ns_of("old0"), range(0, 6, 2)) == [2, 4]   # the default tenant's oldest went
        assert maintenance.index_problems(store) == []
        store.register_namespace(ns_of("old1"), target=TARGET, prefix_namespace="{}", tenant=True, tenant_id=B)
        assert by_tenant(store) == {"default": 2 * one, A.hex(): 5 * one, B.hex(): 3 * one}  # relabelled
    with Store.open(path, readonly=True) as again:           # and reads back after close
        assert by_tenant(again) == {"default": 2 * one, A.hex(): 5 * one, B.hex(): 3 * one}
    with Store.open(path, durable=False) as store:
        maintenance.gc(store)
        assert by_tenant(store) == {"default": 2 * one, A.hex(): 5 * one, B.hex(): 3 * one}  # gc keeps labels


# --- property: fair share after random puts ----------------------------------------------------------------
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3)), min_size=1, max_size=30))
def test_fair_share_invariant_after_random_puts(tmp_path_factory, puts):
    """After every put: the store is within budget; a tenant that lost entries was at that moment the most
    over its fair share (within one entry of the largest tenant, and above budget / tenants); within a tenant
    the oldest went."""
    path = tmp_path_factory.mktemp("prop")
    labels = (A, B, C)
    budget = 10 * PAYLOAD * 4
    with Store.open(path, durable=False, max_bytes=budget) as store:
        for i, label in enumerate(labels):
            store.register_namespace(ns_of(f"t{i}"), target=TARGET, prefix_namespace="{}", tenant=True,
                                     tenant_id=label)
        tenant_of = {ns_of(f"t{i}").hex(): label.hex() for i, label in enumerate(labels)}
        before: dict[str, dict] = {}
        for seq, (who, scale) in enumerate(puts):
            store.put(ns_of(f"t{who}"), tokens(seq), layers(seq, scale * PAYLOAD))
            rows = {r["key"]: r for r in maintenance.entries(store)}
            new = next(k for k, r in rows.items() if k not in before)
            gone = [r for k, r in before.items() if k not in rows]
            now: dict[str, int] = {}
            for r in rows.values():
                now[tenant_of[r["namespace"]]] = now.get(tenant_of[r["namespace"]], 0) + r["bytes"]
            active = len({tenant_of[r["namespace"]] for r in list(before.values()) + [rows[new]]})
            assert sum(now.values()) <= budget
            for t in {tenant_of[r["namespace"]] for r in gone}:
                lost = [r for r in gone if tenant_of[r["namespace"]] == t]
                last = max(r["bytes"] for r in lost)
                assert now.get(t, 0) + last >= max(now.values())
                assert now.get(t, 0) + last > budget / active
                kept = [r["last_use_ns"] for r in rows.values() if tenant_of[r["namespace"]] == t and r["key"] != new]
                assert all(k > max(r["last_use_ns"] for r in lost) for k in kept)
            before = rows


# --- tenant labels: one-way, and how the runtime derives them ----------------------------------------------
def test_tenant_labels_are_one_way_and_a_cache_salt_counts_against_its_tenant(tmp_path):
    from spec_cache.tiers.cache import SpecCache

    assert tenant_id("key:tenant-a").hex() == GOLDEN_A  # a public label: the format pins it
    assert tenant_id("a") == tenant_id(b"a") != tenant_id("b")
    with SpecCache.open(tmp_path / "c", memory_bytes=1 << 20, durable=False, tenant_share=0.5,
                        max_bytes=1 << 30) as cache:
        plain = cache.namespace(TARGET, "{}", "key:secret-api-key-digest")
        salted = cache.namespace(TARGET, "{}", "key:secret-api-key-digest|salt:0123")
        open_salt = cache.namespace(TARGET, "{}", "open|salt:0123")
        shared = cache.namespace(TARGET, "{}")
        explicit = cache.namespace(TARGET, "{\"x\":1}", "anything", account="billing-7")
        info = cache.store.namespace_info
        assert info(plain).tenant_id == info(salted).tenant_id == tenant_id("key:secret-api-key-digest")
        assert info(open_salt).tenant_id is None and info(shared).tenant_id is None
        assert info(explicit).tenant_id == tenant_id("billing-7")
        assert cache.memory._tenant_of[plain] == tenant_id("key:secret-api-key-digest")
        assert cache.memory.tenant_quota == (1 << 20) // 2
    raw = (tmp_path / "c" / "data.mdb").read_bytes()
    assert b"secret-api-key" not in raw and b"billing-7" not in raw  # the tenant string is never stored


# --- memory tier ------------------------------------------------------------------------------------------
def _kv(n: int, seed: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    rng = np.random.default_rng(seed)
    c.keys = mx.array(rng.standard_normal((1, 2, n, 4)).astype(np.float32))
    c.values = mx.array(rng.standard_normal((1, 2, n, 4)).astype(np.float32))
    c.offset = n
    mx.eval(c.keys, c.values)
    return c


def test_memory_tier_fair_share_and_quota():
    from spec_cache.tiers.memory_tier import MemoryTier

    one = _kv(10, 0).keys.nbytes * 2
    tier = MemoryTier(12 * one, idle_seconds=None)
    na, nb = ns_of("ma"), ns_of("mb")
    tier.set_tenant(na, A)
    tier.set_tenant(nb, B)
    for s in range(4):
        tier.put(nb, [1000 + s] * 10, [_kv(10, s)], durable=True)
    for s in range(50):                                      # A floods the tier
        tier.put(na, [s] * 10, [_kv(10, s)], durable=True)
    assert tier.lookup(nb, [1000] * 10) is not None and tier.stats()["tenants"] == {A.hex(): 8 * one,
                                                                                   B.hex(): 4 * one}
    assert [e.tokens[0] for e in tier._entries.values() if e.ns_key == na] == list(range(42, 50))
    quota = MemoryTier(100 * one, idle_seconds=None, tenant_quota_bytes=3 * one)
    quota.set_tenant(na, A)
    for s in range(6):
        quota.put(na, [s] * 10, [_kv(10, s)], durable=True)
        quota.put(nb, [100 + s] * 10, [_kv(10, s)], durable=True)  # the default tenant has a quota too
    assert sorted(e.tokens[0] for e in quota._entries.values()) == [3, 4, 5, 103, 104, 105]
    assert quota.put(na, [9] * 40, [_kv(40, 9)]) is None    # alone over the quota: not held


# --- format 1.1 bytes, and labels through repair ----------------------------------------------------------
NSINFO_1_1 = ("8ba6746172676574a5743a616263a6707265666978a9617373697374616e74a674656e616e74c3a763726561746564cf1877"
              "6f28c3038000a7656e747269657302a56279746573cd3328a46869747305a66d697373657301a86c6173745f757365c0a473"
              "69677391c403919500a3746964c4106c019d6f63153cf31b860ecbd601429b")


def test_a_labelled_namespace_row_is_a_1_0_row_plus_tid_and_packs_back_to_its_bytes():
    from spec_cache.store.values import NamespaceInfo, decode_typed, pack

    raw = bytes.fromhex(NSINFO_1_1)
    info = decode_typed("nsinfo", raw, None)
    assert info.tenant_id == A and pack(info) == raw and info.extra == {}
    as_dict = msgpack.unpackb(raw)
    assert list(as_dict)[-1] == "tid"     # appended after the 1.0 keys: a 1.0 reader keeps it in ``extra``
    old = dict(as_dict)
    del old["tid"]
    assert pack(NamespaceInfo.from_dict(old)) == msgpack.packb(old, use_bin_type=True)  # 1.0 rows unchanged
    with pytest.raises(CorruptIndex, match="malformed"):
        decode_typed("nsinfo", msgpack.packb(dict(as_dict, tid=b"short"), use_bin_type=True), b"k" * 32)


def test_repair_keeps_tenant_labels(tmp_path, open_store):
    from spec_cache.store.repair import repair

    one = entry_size(open_store, tmp_path)
    store = open_tenants(open_store, A, None)
    for s in range(3):
        store.put(ns_of("t0"), tokens(s), layers(s))
        store.put(ns_of("t1"), tokens(100 + s), layers(100 + s))
    store.close()
    repair(str(tmp_path / "store"), str(tmp_path / "fixed"))
    with Store.open(tmp_path / "fixed", readonly=True) as fixed:
        assert by_tenant(fixed) == {A.hex(): 3 * one, "default": 3 * one}

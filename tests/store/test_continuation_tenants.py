"""Continuation records share their bounds by tenant (issue 37, fifth pass): a put over a bound evicts the
oldest record of the tenant holding the largest part, never another tenant's first; records written by older code
(no tenant rows) still go by plain LRU; ``verify`` checks the tenant rows and ``gc`` rebuilds them."""

from __future__ import annotations

import struct

from spec_cache.store import Store, tenant_id
from spec_cache.store import continuations as C
from spec_cache.store.continuations import Continuation, ContinuationTable, continuation_key, continuation_params
from spec_cache.store.maintenance import gc, verify

PARAMS = continuation_params(temperature=0.0, top_p=1.0, seed=None, eos_ids=[2])


def _ns(store: Store, n: int, tenant: str | None) -> bytes:
    ns = bytes([n]) * 32
    store.register_namespace(ns, target="t", prefix_namespace="p", tenant=tenant is not None,
                             tenant_id=None if tenant is None else tenant_id(tenant))
    return ns


def _record(ns: bytes, i: int, tokens: int = 3, written: int = 0) -> Continuation:
    return Continuation(continuation_key(ns, [i, 1, 2], PARAMS), ns, 3, tuple(range(tokens)), False,
                        written or 1000 + i)


def test_one_tenants_puts_evict_its_own_records_before_another_tenants(tmp_path):
    with Store.open(tmp_path / "store") as store:
        a, b, default = _ns(store, 1, "a"), _ns(store, 2, "b"), _ns(store, 3, None)
        table = ContinuationTable(store, max_records=6)
        b_rec, d_rec = _record(b, 0, tokens=20, written=10), _record(default, 0, written=11)
        table.put(b_rec)
        table.put(d_rec)
        for i in range(30):
            table.put(_record(a, i))
        kept = table.records()
        assert len(kept) == 6
        assert table.get(b_rec.key) == b_rec and table.get(d_rec.key) == d_rec  # older than every one of A's
        assert [r.key for r in kept if r.ns_key == a] == [_record(a, i).key for i in range(26, 30)]
        assert not verify(store).damaged


def test_the_largest_tenant_loses_its_oldest_even_when_it_is_not_the_writer(tmp_path):
    with Store.open(tmp_path / "store") as store:
        a, b = _ns(store, 1, "a"), _ns(store, 2, "b")
        table = ContinuationTable(store, max_records=4)
        for i in range(4):
            table.put(_record(a, i))
        table.put(_record(b, 0, written=5000))  # B's first record: A (4 of 4) pays, oldest first
        assert {r.key for r in table.records()} == {_record(a, i).key for i in (1, 2, 3)} | {_record(b, 0).key}


def test_records_without_tenant_rows_go_by_plain_lru_and_gc_gives_them_rows(tmp_path):
    with Store.open(tmp_path / "store") as store:
        a = _ns(store, 1, "a")
        table = ContinuationTable(store, max_records=3)
        for i in range(3):
            table.put(_record(a, i))
        db = store.env.dbs[C.DB]

        def strip(txn) -> None:  # what a store written by code before the tenant rows holds
            for prefix in (C.TENANT_LRU_PREFIX, C.TENANT_SUM_PREFIX):
                for row, _ in list(C._rows(txn, db, prefix)):
                    txn.delete(row, db=db)
        store.env.write(strip)
        assert not verify(store).damaged  # older code's records are not damage
        table.put(_record(a, 3))  # evicts by plain LRU: the tenant rows hold only the new record
        assert [r.key for r in table.records()] == [_record(a, i).key for i in (1, 2, 3)]
        assert not verify(store).damaged
        gc(store)
        with store.reading() as txn:
            rows = list(C._rows(txn, db, C.TENANT_LRU_PREFIX))
            sums = C._tenant_sums(txn, db)
        assert len(rows) == 3 and sums == {tenant_id("a"): [3, sum(struct.unpack("<I", v)[0] for _, v in rows)]}
        assert not verify(store).damaged


def test_verify_reports_tenant_rows_that_disagree_and_gc_repairs_them(tmp_path):
    with Store.open(tmp_path / "store") as store:
        a = _ns(store, 1, "a")
        table = ContinuationTable(store, max_records=8)
        for i in range(3):
            table.put(_record(a, i))
        db = store.env.dbs[C.DB]
        store.env.write(lambda txn: txn.put(C._tenant_sum_row(tenant_id("a")), struct.pack("<QQ", 1, 1), db=db))
        assert any("tenant sum" in p for p in verify(store).index_problems)
        stray = C._tenant_lru_row(tenant_id("a"), 5, bytes(32))
        store.env.write(lambda txn: txn.put(stray, struct.pack("<I", 9), db=db))
        assert any("without its record" in p for p in verify(store).index_problems)
        gc(store)
        assert not verify(store).damaged
        assert len(table.records()) == 3

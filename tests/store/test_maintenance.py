"""Tests for ``store.maintenance``: listing, statistics, eviction by each filter, verify and gc."""

from __future__ import annotations

import time

import blake3
import numpy as np
import pytest

from spec_cache.schemas import NGRAM_HISTORY_V1, CheckpointAttachment
from spec_cache.store import LayerState, Tensor, maintenance
from spec_cache.store.codec import encode_record
from spec_cache.store.index import draft_key

NS_A = bytes.fromhex("abcd01") + blake3.blake3(b"a").digest()[:29]
NS_B = bytes.fromhex("abcd02") + blake3.blake3(b"b").digest()[:29]  # shares the 4-digit prefix "abcd"
NS_C = bytes.fromhex("5eed00") + blake3.blake3(b"c").digest()[:29]
DRAFTER = "ngram-history-v1:3:1"
OTHER = "ngram-history-v1:5:1"


def layers(tokens) -> list[LayerState]:
    t = np.asarray(tokens, np.float32)[None, None, :, None] * np.ones((1, 2, 1, 4), np.float32)
    return [LayerState("kv", {}, [Tensor.from_numpy(t), Tensor.from_numpy(-t)], token_axis=2)]


def attachment(tokens, high=3) -> CheckpointAttachment:
    return CheckpointAttachment(NGRAM_HISTORY_V1, {"max": high, "min": 1}, (np.asarray(tokens, np.int32),))


def tokens_of(seed: int, n: int = 10) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


@pytest.fixture
def filled(open_store):
    """A store with three namespaces: A has 3 entries (one pinned, two with drafter parts), B 2, C none."""
    store = open_store(chunk_tokens=4)
    for ns, name in ((NS_A, "a"), (NS_B, "b"), (NS_C, "c")):
        store.register_namespace(ns, target=name * 64, prefix_namespace=f'{{"method":"{name}"}}')
    a = [tokens_of(i) for i in range(3)]
    b = [tokens_of(10 + i) for i in range(2)]
    store.put(NS_A, a[0], layers(a[0]), drafter=(DRAFTER, attachment(a[0])), pin=True)
    store.put(NS_A, a[1], layers(a[1]), drafter=(DRAFTER, attachment(a[1])))
    store.put(NS_A, a[1], layers(a[1]), drafter=(OTHER, attachment(a[1], 5)))
    store.put(NS_A, a[2], layers(a[2]))
    for t in b:
        store.put(NS_B, t, layers(t), drafter=(DRAFTER, attachment(t)))
    store.tokens = {"a": a, "b": b}
    return store


def test_namespaces_and_entries(filled):
    rows = {r["key"]: r for r in maintenance.namespaces(filled)}
    assert set(rows) == {NS_A.hex(), NS_B.hex(), NS_C.hex()}
    a = rows[NS_A.hex()]
    assert (a["target"], a["prefix_namespace"], a["entries"], a["tenant"]) == ("a" * 64, '{"method":"a"}', 3, False)
    assert rows[NS_C.hex()]["entries"] == 0 and rows[NS_C.hex()]["bytes"] == 0
    assert maintenance.namespaces(filled)[0]["key"] == NS_B.hex()  # most recently used first
    ents = maintenance.entries(filled, NS_A)
    assert len(ents) == 3 and all(e["namespace"] == NS_A.hex() for e in ents)
    assert sorted(e["pinned"] for e in ents) == [False, False, True]
    assert sorted(tuple(e["drafters"]) for e in ents) == sorted([(), (DRAFTER,), tuple(sorted([DRAFTER, OTHER]))])
    assert sum(e["bytes"] for e in ents) <= a["bytes"]  # the rest is chunks
    assert len(maintenance.entries(filled)) == 5
    assert [e["last_use_ns"] for e in maintenance.entries(filled)] == \
        sorted((e["last_use_ns"] for e in maintenance.entries(filled)), reverse=True)


def test_resolve_namespace(filled):
    assert maintenance.resolve_namespace(filled, NS_A.hex()) == NS_A
    assert maintenance.resolve_namespace(filled, NS_A.hex()[:6].upper()) == NS_A
    assert maintenance.resolve_namespace(filled, "5eed") == NS_C
    with pytest.raises(KeyError, match="ambiguous"):
        maintenance.resolve_namespace(filled, "abcd")
    with pytest.raises(KeyError, match="no namespace"):
        maintenance.resolve_namespace(filled, "ffff")
    with pytest.raises(KeyError, match="'5e' is too short"):
        maintenance.resolve_namespace(filled, "5e")  # too short to be meant
    with pytest.raises(KeyError, match="'zz-not-hex' is not hexadecimal"):
        maintenance.resolve_namespace(filled, "zz-not-hex")


def test_stats(filled, store_invariants):
    s = maintenance.stats(filled)
    counts = store_invariants(filled)
    assert (s["entries"], s["bytes"], s["chunks"], s["namespaces"]) == (5, counts["bytes"], counts["chunks"], 3)
    assert s["drafter_parts"] == 5
    assert s["format"] == "spec-cache-store 1.3" and s["chunk_tokens"] == 4  # 1.2 drafter pieces, 1.3 target pieces
    assert s["map_size"] >= s["file_bytes"] > 0 and s["max_bytes"] is None


def test_evict_namespace(filled, store_invariants):
    before = store_invariants(filled)
    r = maintenance.evict(filled, namespace=NS_A)
    # pinned too: the operator named the namespace; the entries' drafter parts went with them and are counted
    assert r.entries == 3 and r.drafter_parts == 3
    after = store_invariants(filled)
    assert after["entries"] == 2 and r.bytes == before["bytes"] - after["bytes"] > 0
    assert maintenance.entries(filled, NS_A) == [] and len(maintenance.entries(filled, NS_B)) == 2


def test_evict_drafter_keeps_target_state(filled, store_invariants):
    r = maintenance.evict(filled, drafter=DRAFTER)
    assert (r.entries, r.drafter_parts) == (0, 4) and r.bytes > 0
    store_invariants(filled)
    a = filled.tokens["a"]
    hit = filled.lookup(NS_A, a[0], drafter=DRAFTER)
    assert hit.length == 10 and not hit.has_drafter
    assert filled.lookup(NS_A, a[1], drafter=OTHER).has_drafter  # other drafters untouched
    assert len(maintenance.entries(filled)) == 5


def test_evict_drafter_within_a_namespace(filled, store_invariants):
    r = maintenance.evict(filled, drafter=DRAFTER, namespace=NS_B)
    assert (r.entries, r.drafter_parts) == (0, 2)
    store_invariants(filled)
    assert filled.lookup(NS_A, filled.tokens["a"][0], drafter=DRAFTER).has_drafter
    assert not filled.lookup(NS_B, filled.tokens["b"][0], drafter=DRAFTER).has_drafter
    assert len(maintenance.entries(filled)) == 5


def test_evict_older_than(filled, store_invariants):
    time.sleep(0.3)
    fresh = tokens_of(99)
    filled.put(NS_B, fresh, layers(fresh))
    filled.fetch(NS_A, filled.tokens["a"][2])  # used now: stays
    r = maintenance.evict(filled, older_than_s=0.2)
    kept = {e["key"] for e in maintenance.entries(filled)}
    assert r.entries == 3 and len(kept) == 3
    assert filled.lookup(NS_B, fresh).length == 10
    assert filled.lookup(NS_A, filled.tokens["a"][2]).length == 10
    assert filled.lookup(NS_A, filled.tokens["a"][0]).length == 10  # pinned
    assert maintenance.evict(filled, older_than_s=3600).entries == 0
    store_invariants(filled)


def test_evict_to_size(filled, store_invariants):
    total = store_invariants(filled)["bytes"]
    r = maintenance.evict(filled, to_size=total // 2)
    after = store_invariants(filled)
    assert after["bytes"] <= total // 2 and r.bytes == total - after["bytes"] and r.entries >= 1
    assert filled.lookup(NS_A, filled.tokens["a"][0]).length == 10  # pinned
    r = maintenance.evict(filled, to_size=0)
    assert store_invariants(filled)["entries"] == 1  # only the pinned entry is left
    assert maintenance.evict(filled, to_size=10**12).entries == 0


def test_evict_all(filled, store_invariants):
    r = maintenance.evict(filled, everything=True)
    assert r.entries == 5
    counts = store_invariants(filled)
    assert counts == {"bytes": 0, "entries": 0, "chunks": 0, "nodes": 0, "drafts": 0}
    assert len(maintenance.namespaces(filled)) == 3  # namespaces stay registered


def test_verify_counts_and_reports_progress(filled):
    calls = []
    report = maintenance.verify(filled, lambda done, total: calls.append((done, total)))
    total = report.records
    assert report.ok == total and report.corrupt == 0 and report.unknown_schema == 0
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    d = report.as_dict()
    assert {"records", "ok", "corrupt", "unknown_schema"} <= set(d)


def _raw_put(store, db: str, key: bytes, value: bytes) -> None:
    store.env.write(lambda txn: txn.put(key, value, db=store.env.dbs[db]))


def test_gc_removes_corrupt_records_and_orphans(filled, store_invariants):
    a = filled.tokens["a"]
    ekey = filled.lookup(NS_A, a[2]).entry
    filled.env.write(lambda txn: txn.put(ekey, b"SPCR" + bytes(60), db=filled.env.dbs["edata"]))
    orphan = encode_record("entry", [("tokens", "uint32", np.arange(3, dtype=np.uint32))])
    _raw_put(filled, "edata", b"\x01" * 32, bytes(orphan))
    _raw_put(filled, "chunks", b"\x02" * 32, bytes(encode_record("chunk", [])))
    _raw_put(filled, "drafts", draft_key(b"\x03" * 32, DRAFTER), bytes(encode_record("draft", [], schema="x")))
    unlisted = draft_key(filled.lookup(NS_A, a[0]).entry, OTHER)  # an entry that does not list this drafter
    _raw_put(filled, "drafts", unlisted, bytes(encode_record("draft", [], schema=NGRAM_HISTORY_V1)))
    v = maintenance.verify(filled)
    assert (v.corrupt, v.unknown_schema) == (1, 1)
    assert v.corrupt_keys[0]["db"] == "edata" and v.corrupt_keys[0]["key"] == ekey.hex()
    r = maintenance.gc(filled)
    assert r.corrupt_removed == 1 and r.orphans_removed == 4 and r.bytes > 0
    v = maintenance.verify(filled)
    assert (v.corrupt, v.unknown_schema, v.records) == (0, 0, v.ok)
    assert store_invariants(filled)["entries"] == 4
    assert filled.lookup(NS_A, a[2]) is None and filled.lookup(NS_A, a[1]).length == 10
    again = maintenance.gc(filled)
    assert (again.corrupt_removed, again.broken_subtrees, again.orphans_removed, again.bytes) == (0, 0, 0, 0)


def test_resolve_entries_and_set_pinned(filled):
    rows = maintenance.entries(filled, NS_A)
    key = rows[0]["key"]
    assert maintenance.resolve_entries(filled, key[:12]) == [bytes.fromhex(key)]
    assert sorted(maintenance.resolve_entries(filled, NS_A.hex())) == sorted(bytes.fromhex(r["key"]) for r in rows)
    with pytest.raises(KeyError, match="no entry or namespace key starts with 'ffffffff'"):
        maintenance.resolve_entries(filled, "ffffffff")
    keys = [bytes.fromhex(r["key"]) for r in rows]
    assert maintenance.set_pinned(filled, keys, True) == 2  # one of the three was pinned already
    assert all(e["pinned"] for e in maintenance.entries(filled, NS_A))
    assert maintenance.evict(filled, to_size=0).entries == 2  # only B's entries could go
    assert maintenance.set_pinned(filled, keys, False) == 3
    assert maintenance.evict(filled, to_size=0).entries == 3


def test_drafter_namespaces_and_the_recorded_budget(filled, open_store, tmp_path):
    assert maintenance.drafter_namespaces(filled) == {DRAFTER, OTHER}
    assert maintenance.stats(filled)["max_bytes"] is None
    budgeted = open_store(tmp_path / "budgeted", max_bytes=5 << 20)
    budgeted.close()
    reader = open_store(tmp_path / "budgeted", readonly=True)
    assert reader.max_bytes is None and maintenance.stats(reader)["max_bytes"] == 5 << 20

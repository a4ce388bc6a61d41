"""Drafter records shared across entries (store format 1.2, ``store/pieces.py``).

Conversations that share a system prompt store its drafter state once: the token-sliceable drafter KV in
content-addressed chunk pieces, large unsliceable tensors (recurrent state) in whole pieces; pieces are
reference-counted, freed with their last entry, checked by ``verify`` and rebuilt by ``gc``; restores are bit
for bit; stores written before 1.2 (the golden store) stay readable next to the new records.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

import spec_cache.store as S
from spec_cache.store import Store
from spec_cache.store.codec import decode_record
from spec_cache.store.gc import gc
from spec_cache.store.index import Index
from spec_cache.store.pieces import PIECE_ROW_PREFIX
from spec_cache.store.read import read_attachment, whole_draft_record
from spec_cache.store.verify import index_problems, verify
from tests.drafter_dedup_data import (
    CHUNK,
    DRAFTER,
    NS,
    PROJECTED,
    conversation,
    projected,
    standalone,
    target_layers,
    write_store,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "store_1_1_drafters.tar.gz"


def _open(tmp_path, name="s") -> Store:
    store = Store.open(tmp_path / name, chunk_tokens=CHUNK, durable=False)
    store.register_namespace(NS, target="golden-target", prefix_namespace="golden")
    return store


def _db_bytes(store: Store, db: str) -> int:
    with store.reading() as txn:
        return sum(len(v) for _k, v in txn.cursor(db=store.env.dbs[db]))


def _piece_rows(store: Store) -> dict[bytes, dict]:
    import msgpack

    out = {}
    with store.reading() as txn:
        cursor = txn.cursor(db=store.env.dbs["meta"])
        more = cursor.set_range(PIECE_ROW_PREFIX)
        while more and bytes(cursor.key()).startswith(PIECE_ROW_PREFIX):
            out[bytes(cursor.key())[len(PIECE_ROW_PREFIX):]] = msgpack.unpackb(cursor.value())
            more = cursor.next()
    return out


def _same(got, want) -> None:
    assert got is not None
    assert got.schema == want.schema and dict(got.metadata) == dict(want.metadata)
    assert len(got.tensors) == len(want.tensors)
    for a, b in zip(got.tensors, want.tensors):
        b = np.asarray(b)
        assert a.dtype == S.tensors.Tensor.from_numpy(b).dtype and a.shape == b.shape
        assert a.array().tobytes() == np.ascontiguousarray(b).tobytes()


def _clean(store: Store) -> None:
    report = verify(store)
    assert not report.damaged, report.as_dict()


@pytest.mark.parametrize("dns,make", [(DRAFTER, standalone), (PROJECTED, projected)])
def test_shared_system_prompt_drafter_state_is_stored_once(tmp_path, dns, make):
    store = _open(tmp_path)
    growth = []
    for i in range(4):
        tokens = conversation(i)
        before = _db_bytes(store, "drafts")
        store.put(NS, tokens, target_layers(tokens), drafter=(dns, make(tokens)))
        growth.append(_db_bytes(store, "drafts") - before)
    # the first conversation writes the prompt's drafter state; later ones only their own tail (before 1.2 each
    # wrote the whole record again: growth[i] == growth[0])
    assert all(g < growth[0] / 2 for g in growth[1:]), growth
    for i in range(4):
        tokens = conversation(i)
        got = store.fetch(NS, tokens, drafter=dns)
        assert got.length == len(tokens)
        _same(got.attachment, make(tokens))
    _clean(store)
    store.close()


def test_equal_recurrent_state_is_one_reference_counted_piece(tmp_path):
    store = _open(tmp_path)
    for i in range(2):  # both boundaries have 46 tokens: the 6 KiB recurrent state is byte-equal
        tokens = conversation(i)
        store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))
    rows = _piece_rows(store)
    state_bytes = standalone(conversation(0)).tensors[4].nbytes
    shared = [r for r in rows.values() if r["refs"] == 2 and r["bytes"] > state_bytes]
    assert shared, rows  # the state piece (and the prompt's full chunks) are named by both entries
    _clean(store)
    store.close()


def test_pieces_outlive_every_entry_but_the_last(tmp_path):
    store = _open(tmp_path)
    keys = [store.put(NS, conversation(i), target_layers(conversation(i)),
                      drafter=(DRAFTER, standalone(conversation(i)))).entry for i in range(3)]
    for gone, key in enumerate(keys):
        store.env.write(lambda txn, key=key: Index(txn, store.env.dbs).remove_entry(key))
        assert index_problems(store) == []
        for i in range(gone + 1, 3):  # the others still restore bit for bit from the shared pieces
            _same(store.fetch(NS, conversation(i), drafter=DRAFTER).attachment, standalone(conversation(i)))
    assert _piece_rows(store) == {}
    assert _db_bytes(store, "drafts") == 0
    with store.reading() as txn:
        assert Index(txn, store.env.dbs).totals().bytes == 0
    store.close()


def test_replacing_a_drafter_part_keeps_pieces_another_entry_names(tmp_path):
    store = _open(tmp_path)
    a, b = conversation(0), conversation(1)
    store.put(NS, a, target_layers(a), drafter=(DRAFTER, standalone(a)))
    store.put(NS, b, target_layers(b), drafter=(DRAFTER, standalone(b)))
    store.put(NS, a, target_layers(a), drafter=(DRAFTER, standalone(a)))  # exact duplicate: replaced
    assert index_problems(store) == []
    _same(store.fetch(NS, b, drafter=DRAFTER).attachment, standalone(b))
    _same(store.fetch(NS, a, drafter=DRAFTER).attachment, standalone(a))
    store.close()


def test_a_corrupt_shared_piece_costs_the_drafter_part_never_a_wrong_answer(tmp_path):
    store = _open(tmp_path)
    for i in range(2):
        store.put(NS, conversation(i), target_layers(conversation(i)),
                  drafter=(DRAFTER, standalone(conversation(i))))
    shared = next(k for k, r in _piece_rows(store).items() if r["refs"] == 2)
    with store.env.env.begin(write=True, db=store.env.dbs["drafts"]) as txn:
        raw = bytearray(txn.get(shared))
        raw[-1] ^= 0x40
        txn.put(shared, bytes(raw))
    warnings: list[str] = []
    got = store.fetch(NS, conversation(0), drafter=DRAFTER, warnings=warnings)
    assert got is not None and got.length == len(conversation(0)) and got.attachment is None
    assert any("piece" in w or "checksum" in w for w in warnings), warnings
    assert verify(store).corrupt == 1
    gc(store)
    _clean(store)
    assert shared not in _piece_rows(store)
    got = store.fetch(NS, conversation(1), drafter=DRAFTER)  # its part named the bad piece: gone, target stays
    assert got is not None and got.attachment is None and got.length == len(conversation(1))
    store.close()


def test_gc_rebuilds_lost_piece_counts(tmp_path):
    store = _open(tmp_path)
    for i in range(3):
        store.put(NS, conversation(i), target_layers(conversation(i)),
                  drafter=(DRAFTER, standalone(conversation(i))))
    key = next(iter(_piece_rows(store)))
    with store.env.env.begin(write=True, db=store.env.dbs["meta"]) as txn:
        txn.delete(PIECE_ROW_PREFIX + key)  # a 1.1 writer or damage: the count is lost
    assert any("no row" in p for p in index_problems(store))
    gc(store)
    _clean(store)
    for i in range(3):
        _same(store.fetch(NS, conversation(i), drafter=DRAFTER).attachment, standalone(conversation(i)))
    store.close()


def test_golden_store_written_before_format_1_2_reads_and_mixes(tmp_path):
    path = tmp_path / "golden"
    path.mkdir(mode=0o700)
    with tarfile.open(GOLDEN) as tar:
        tar.extractall(path, filter="data")
    os.chmod(path / "data.mdb", 0o600)
    store = Store.open(path, durable=False)
    assert store.env.meta["minor"] == 0
    for i in range(3):  # whole drafter records of the old code: read bit for bit
        tokens = conversation(i)
        got = store.fetch(NS, tokens, drafter=DRAFTER)
        assert got.length == len(tokens)
        _same(got.attachment, standalone(tokens))
    _clean(store)
    tokens = conversation(3)
    store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))
    with store.reading() as txn:
        assert Index(txn, store.env.dbs).format_minor() == 3  # 1.2 drafter pieces, 1.3 target pieces
    assert _piece_rows(store)
    _clean(store)
    gc(store)
    _clean(store)
    for i in range(4):
        _same(store.fetch(NS, conversation(i), drafter=DRAFTER).attachment, standalone(conversation(i)))
    store.close()


def test_golden_store_is_what_write_store_writes_with_whole_records(tmp_path):
    """The golden store holds whole drafter records (no pieces): the pre-1.2 layout, as written then."""
    path = tmp_path / "golden"
    path.mkdir(mode=0o700)
    with tarfile.open(GOLDEN) as tar:
        tar.extractall(path, filter="data")
    store = Store.open(path, readonly=True)
    with store.reading() as txn:
        records = [decode_record(v) for _k, v in txn.cursor(db=store.env.dbs["drafts"])]
    assert len(records) == 3 and all("pieced" not in r.meta and r.kind == "draft" for r in records)
    store.close()
    assert callable(write_store)


def test_shared_tier_ships_whole_drafter_records(tmp_path):
    store = _open(tmp_path)
    want = {}
    for i in range(2):
        tokens = conversation(i)
        store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))
        want[store.lookup(NS, tokens).entry] = standalone(tokens)
    with store.reading() as txn:
        draft = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=store.env.dbs["drafts"]) if len(k) == 48]
        assert all("pieced" in decode_record(v).meta for _k, v in draft)
        get = S.read.piece_reader(lambda _kind, key: txn.get(key, db=store.env.dbs["drafts"]))
        wholes = [(k, whole_draft_record(v, k, get)) for k, v in draft]
    assert len(wholes) == 2
    for key, raw in wholes:
        assert "pieced" not in decode_record(raw).meta
        _same(read_attachment(raw, key, len(conversation(0)), []), want[key[:32]])  # no pieces needed
    store.close()


def test_repair_copies_pieced_drafter_parts(tmp_path):
    from spec_cache.store.repair import repair

    store = _open(tmp_path)
    for i in range(3):
        store.put(NS, conversation(i), target_layers(conversation(i)),
                  drafter=(DRAFTER, standalone(conversation(i))))
    store.close()
    report = repair(str(tmp_path / "s"), str(tmp_path / "copy"))
    assert report.entries_copied == 3 and report.drafter_parts_copied == 3
    copy = Store.open(tmp_path / "copy")
    _clean(copy)
    assert _piece_rows(copy)  # written pieced again, shared again
    for i in range(3):
        _same(copy.fetch(NS, conversation(i), drafter=DRAFTER).attachment, standalone(conversation(i)))
    copy.close()


def test_budget_eviction_frees_pieces_with_their_last_entry(tmp_path):
    store = _open(tmp_path)
    tokens = conversation(0)
    store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))
    with store.reading() as txn:
        one = Index(txn, store.env.dbs).totals().bytes
    store.close()
    store = Store.open(tmp_path / "s", max_bytes=int(one * 1.5), durable=False)
    for i in range(1, 6):  # other prompts entirely: nothing shared, so older entries must go
        tokens = [7 * i + t for t in range(46)]
        store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))
        with store.reading() as txn:
            assert Index(txn, store.env.dbs).totals().bytes <= int(one * 1.5)
        assert index_problems(store) == []
    _same(store.fetch(NS, tokens, drafter=DRAFTER).attachment, standalone(tokens))
    with store.reading() as txn:
        assert Index(txn, store.env.dbs).totals().entries < 6  # evictions happened; index_problems == [] above
    store.close()                                              # says no piece outlived its last entry


def test_a_put_rewrites_a_piece_whose_record_was_lost(tmp_path):
    store = _open(tmp_path)
    for i in range(2):
        store.put(NS, conversation(i), target_layers(conversation(i)),
                  drafter=(DRAFTER, standalone(conversation(i))))
    shared = next(k for k, r in _piece_rows(store).items() if r["refs"] == 2)
    with store.env.env.begin(write=True, db=store.env.dbs["drafts"]) as txn:
        txn.delete(shared)
    assert any("record missing" in p for p in index_problems(store))
    tokens = conversation(2)
    store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))  # names the same piece
    assert index_problems(store) == []
    for i in range(3):
        _same(store.fetch(NS, conversation(i), drafter=DRAFTER).attachment, standalone(conversation(i)))
    store.close()

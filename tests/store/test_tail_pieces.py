"""Store format 1.3: entry tails and chunks as shared target pieces (``store/spans.py``; issue 21, write amplification).

An agentic conversation checkpoints several times a turn on one growing chain. Before 1.3 every entry rewrote its
whole tail and every chunk its whole span, so each token's KV was written ~3.5 times; now a put writes the new
tokens' KV once (bytes counted as they go into LMDB), restores stay bit-identical, a damaged piece is never
served, and gc / eviction keep a piece while anything names it.
"""

from __future__ import annotations

import numpy as np
import pytest

from spec_cache.store import LayerState, Store, Tensor
from spec_cache.store import spans as S
from spec_cache.store.gc import gc
from spec_cache.store.index import Index
from spec_cache.store.pieces import piece_row_key
from spec_cache.store.shared import records
from spec_cache.store.values import Entry
from spec_cache.store.verify import verify

NS = b"t" * 32
LAYERS, HEADS, DIM = 3, 4, 32
KV_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # bytes of KV per token (float32): 3 KiB
CHUNK = 64
OVERHEAD = 6 << 10  # record headers, index rows and piece rows of one put, generously


@pytest.fixture
def state(tmp_path):
    rng = np.random.default_rng(21)
    tokens = rng.integers(0, 50_000, 400).tolist()
    kv = rng.standard_normal((LAYERS, 2, 1, HEADS, 400, DIM)).astype(np.float32)
    store = Store.open(tmp_path / "store", chunk_tokens=CHUNK)
    store.register_namespace(NS, target="t", prefix_namespace="p")
    yield store, tokens, kv
    store.close()


def _layers(kv: np.ndarray, n: int) -> list[LayerState]:
    return [LayerState("kv", {}, [Tensor.from_numpy(np.ascontiguousarray(kv[i, j, :, :, :n])) for j in range(2)], 2)
            for i in range(LAYERS)]


class _Counting:
    """A write transaction that counts the bytes of every value put into LMDB."""

    def __init__(self, txn, sink: list):
        self._txn, self._sink = txn, sink

    def put(self, key, value, **kw):
        self._sink.append(len(memoryview(value).cast("B")))
        return self._txn.put(key, value, **kw)

    def __getattr__(self, name):
        return getattr(self._txn, name)


def _put_bytes(store: Store, tokens, kv, n: int) -> int:
    """Bytes the put of ``tokens[:n]`` handed to LMDB (every record and index row)."""
    sink: list = []
    original = store.env._transaction
    store.env._transaction = lambda fn, attempt: original(lambda txn: fn(_Counting(txn, sink)), attempt)
    try:
        store.put(NS, tokens[:n], _layers(kv, n))
    finally:
        del store.env._transaction
    return sum(sink)


def _same(store: Store, tokens, kv, n: int, *, probe: int = 0) -> None:
    got = store.fetch(NS, tokens[:n + probe])
    assert got is not None and got.length == n
    for i, layer in enumerate(got.layers):
        for j in range(2):
            assert np.array_equal(layer.tensors[j].array(), kv[i, j, :, :, :n])
            assert layer.tensors[j].array().tobytes() == kv[i, j, :, :, :n].tobytes()  # bit for bit


def _entry(store: Store, tokens, n: int) -> tuple[bytes, Entry]:
    key = store.entry_key(NS, tokens[:n])
    with store.reading() as txn:
        return key, Index(txn, store.env.dbs).entry(key)


def test_a_tail_extended_over_turns_writes_only_its_new_tokens(state):
    store, tokens, kv = state
    turns = [20, 45, 46, 60, 90, 91, 130, 200, 201, 260]  # several checkpoints a turn, across chunk boundaries
    previous = total = 0
    for n in turns:
        written = _put_bytes(store, tokens, kv, n)
        new = (n - previous) * KV_TOKEN
        again = (S.MIN_PIECE_TOKENS - 1) * KV_TOKEN  # a short last piece is written again with the new tokens
        assert new <= written <= new + again + OVERHEAD, f"put of {n} after {previous}: {written} bytes, {new} new"
        total += written
        previous = n
    assert total <= turns[-1] * KV_TOKEN * 1.2  # the write amplification of these puts, records and index rows
    for n in turns:
        _same(store, tokens, kv, n)
    for boundary in (64, 128, 192, 256):  # chunk-boundary prefixes: pieced chunks alone
        _same(store, tokens, kv, boundary)
    with store.reading() as txn:
        assert Index(txn, store.env.dbs).format_minor() == S.SPANS_MINOR
    assert not verify(store).damaged


def test_before_format_1_3_the_same_turns_rewrite_every_tail(state, monkeypatch):
    """The figure the test above improves on: each put wrote its whole tail again (so that test fails there)."""
    store, tokens, kv = state
    monkeypatch.setattr(S, "WRITE_SPANS", False)
    _put_bytes(store, tokens, kv, 45)
    assert _put_bytes(store, tokens, kv, 46) >= 46 * KV_TOKEN


def test_chunk_boundary_hits_and_reopen_restore_bit_identical(state, tmp_path):
    store, tokens, kv = state
    for n in (30, 50, 70, 140, 150):
        store.put(NS, tokens[:n], _layers(kv, n))
    with store.reading() as txn:  # chunk 1 was covered by the 30- and 50-token tails: it names their pieces
        index = Index(txn, store.env.dbs)
        pieced = [k for k, _ in txn.cursor(db=store.env.dbs["nodes"]) if S.node_spans(index.node(bytes(k)))]
    assert pieced
    store.close()
    again = Store.open(tmp_path / "store")
    try:
        for n in (30, 50, 70, 140, 150):
            _same(again, tokens, kv, n, probe=3)
        _same(again, tokens, kv, 64)  # a chunk boundary of the 70-token entry: the pieced chunk alone
    finally:
        again.close()


def _flip_piece(store: Store, key: bytes) -> None:
    def fn(txn):
        raw = bytearray(txn.get(key, db=store.env.dbs["drafts"]))
        raw[-5] ^= 0x40  # a bit in the tensor bytes
        txn.put(key, bytes(raw), db=store.env.dbs["drafts"])
    store.env.write(fn)


def test_a_corrupted_piece_is_caught_by_verify_and_never_served(state):
    store, tokens, kv = state
    for n in (20, 45, 46):
        store.put(NS, tokens[:n], _layers(kv, n))
    _key, entry = _entry(store, tokens, 46)
    first_piece = bytes(S.entry_spans(entry)[0][0])  # shared by all three entries
    _flip_piece(store, first_piece)
    report = verify(store)
    assert report.corrupt == 1 and report.corrupt_keys[0]["key"] == first_piece.hex()
    # a target tail's piece sits in the drafts sub-database but is labelled what it is (issue 36 first hour, 7)
    assert report.corrupt_keys[0]["db"] == "drafts" and report.corrupt_keys[0]["what"] == "shared piece"
    warnings: list = []
    got = store.fetch(NS, tokens[:47], warnings=warnings)
    assert got is None or got.length < 20  # every entry needs the damaged piece: refused, never a wrong answer
    assert warnings and "piece" in " ".join(warnings)
    gc(store)
    after = verify(store)
    assert not after.damaged, after.as_dict()
    store.put(NS, tokens[:46], _layers(kv, 46))  # written again whole (the damaged piece is gone)
    _same(store, tokens, kv, 46)


def test_a_refused_piece_is_written_again_by_the_next_put_and_heals_the_others(state):
    store, tokens, kv = state
    for n in (20, 45, 46):
        store.put(NS, tokens[:n], _layers(kv, n))
    _key, entry = _entry(store, tokens, 46)
    first_piece = bytes(S.entry_spans(entry)[0][0])
    _flip_piece(store, first_piece)
    assert store.fetch(NS, tokens[:46], max_attempts=1) is None  # the 46-token entry is refused and dropped
    with store.reading() as txn:
        assert txn.get(first_piece, db=store.env.dbs["drafts"]) is None  # the damaged record went with it
    store.put(NS, tokens[:46], _layers(kv, 46))  # writes the piece again (equal bytes, equal key)
    for n in (20, 45, 46):  # the entries that named it are whole again, without gc
        _same(store, tokens, kv, n)
    assert not verify(store).damaged


def test_gc_and_eviction_keep_pieces_another_entry_names(state):
    store, tokens, kv = state
    for n in (20, 45, 46):
        store.put(NS, tokens[:n], _layers(kv, n))
    report = gc(store)
    assert report.orphans_removed == 0 and report.corrupt_removed == 0 and report.entries_removed == 0
    assert not verify(store).damaged
    key20, entry20 = _entry(store, tokens, 20)
    shared = bytes(S.entry_spans(entry20)[0][0])
    with store.reading() as txn:
        assert Index(txn, store.env.dbs).piece_row(shared)["refs"] == 3
    store.env.write(lambda txn: Index(txn, store.env.dbs).remove_entry(key20))  # what eviction does
    with store.reading() as txn:
        assert Index(txn, store.env.dbs).piece_row(shared)["refs"] == 2
    gc(store)
    _same(store, tokens, kv, 45)
    _same(store, tokens, kv, 46)
    for n in (45, 46):
        key, _ = _entry(store, tokens, n)
        store.env.write(lambda txn, key=key: Index(txn, store.env.dbs).remove_entry(key))
    with store.reading() as txn:
        assert txn.get(piece_row_key(shared), db=store.env.dbs["meta"]) is None  # gone with its last reference
        assert txn.get(shared, db=store.env.dbs["drafts"]) is None
    assert not verify(store).damaged


def test_stores_written_whole_mix_with_pieced_writes(state, monkeypatch):
    store, tokens, kv = state
    monkeypatch.setattr(S, "WRITE_SPANS", False)
    for n in (20, 70):
        store.put(NS, tokens[:n], _layers(kv, n))
    monkeypatch.setattr(S, "WRITE_SPANS", True)
    for n in (45, 90, 91):
        store.put(NS, tokens[:n], _layers(kv, n))
    for n in (20, 45, 70, 90, 91):
        _same(store, tokens, kv, n)
    assert not verify(store).damaged


def test_shared_tier_ships_whole_target_records(state):
    store, tokens, kv = state
    for n in (30, 50, 100):
        store.put(NS, tokens[:n], _layers(kv, n))
    key, entry = _entry(store, tokens, 100)
    out = records.read_outgoing(store, key, [])
    chunks = records.read_chunks(store, out.chain[1:])
    layers = records.assemble(packed=np.array(tokens, dtype="<u4"), length=100, chunk_tokens=CHUNK,
                              chain=tuple(out.chain), records={**chunks, key: out.entry_record}, entry=key)
    for i, layer in enumerate(layers):
        assert np.array_equal(layer.tensors[1].array(), kv[i, 1, :, :, :100])

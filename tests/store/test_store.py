"""Tests for ``store.Store``: round trips, prefix lookup, chunk sharing, atomic puts, format and permission
checks, drafter parts, corruption handling, eviction, map growth and several processes on one store."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import blake3
import lmdb
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.schemas import NGRAM_HISTORY_V1, CheckpointAttachment, SchemaError
from spec_cache.store import InvalidInput, LayerState, Store, StoreFormatError, StoreFullError, Tensor, maintenance
from spec_cache.store.codec import encode_record
from spec_cache.store.index import Index, draft_key, pack, unpack
from tools.faults.concurrency import kill_reader_holder

REPO = Path(__file__).resolve().parents[2]
NS = blake3.blake3(b"test namespace a").digest()
NS_B = blake3.blake3(b"test namespace b").digest()
DRAFTER = "ngram-history-v1:3:1"
OTHER_DRAFTER = "ngram-history-v1:4:2"
H, D = 2, 4

# --- deterministic stand-ins for target state: same tokens -> same bytes, like a forward pass -------------------


def _grid(tokens, layer: int, salt: int) -> np.ndarray:
    t = np.asarray(tokens, dtype=np.int64)
    pos = np.arange(len(t), dtype=np.int64)
    rows = (t * 1009 + pos * 7 + layer * 131 + salt * 17)[None, None, :, None]
    return rows + np.arange(H)[None, :, None, None] * 3 + np.arange(D)[None, None, None, :]


def kv_layer(tokens, i: int) -> LayerState:
    g = _grid(tokens, i, 0)
    k, v = (g * 0.25).astype(np.float32), (g * -0.5).astype(np.float32)
    return LayerState("kv", {"step": 256}, [Tensor.from_numpy(k), Tensor.from_numpy(v)], token_axis=2)


def bf16_layer(tokens, i: int) -> LayerState:
    g = _grid(tokens, i, 1)
    return LayerState("kv", {}, [Tensor("bfloat16", g.shape, (g & 0xFFFF).astype(np.uint16)),
                                 Tensor("bfloat16", g.shape, ((g * 3) & 0xFFFF).astype(np.uint16))], token_axis=2)


def qkv_layer(tokens, i: int) -> LayerState:
    """Quantized KV as mlx-lm stores it: packed uint32 words plus float16 scales and biases per group."""
    g = _grid(tokens, i, 2)
    packed = (g.astype(np.uint64) * 2654435761 % 2**32).astype(np.uint32)
    scales = (g[..., :2] % 4096 * 0.125).astype(np.float16)
    biases = (g[..., :2] % 4096 * -0.5).astype(np.float16)
    tensors = [packed, scales, biases, packed ^ np.uint32(0xA5A5A5A5), scales + 1, biases - 1]
    return LayerState("qkv", {"bits": 4, "group_size": 32}, [Tensor.from_numpy(x) for x in tensors], token_axis=2)


def ring_layer(tokens, i: int) -> LayerState:
    """A rotating (sliding window) cache: stored whole, never trimmed; its contents depend on the length."""
    last = list(tokens[-4:]) + [0] * (4 - len(tokens[-4:]))
    g = _grid(last, i, 3).astype(np.float32)
    return LayerState("rotating", {"max_size": 4, "keep": 0},
                      [Tensor.from_numpy(g), Tensor.from_numpy(np.array(len(tokens), np.int64))], token_axis=None)


def arrays_layer(tokens, i: int) -> LayerState:
    """Recurrent state: one array summarising the whole prefix."""
    h = blake3.blake3(np.asarray(tokens, np.uint32).tobytes() + bytes([i])).digest()
    return LayerState("arrays", {}, [Tensor.from_numpy(np.frombuffer(h, np.float32).reshape(1, 8))], token_axis=None)


STRUCTURES = {
    "plain": (kv_layer, qkv_layer, bf16_layer),   # every layer token-sliceable
    "mixed": (kv_layer, ring_layer),              # chunked KV plus an untrimmable layer
    "whole": (arrays_layer,),                     # nothing chunked
}


def layers_for(structure: str, tokens) -> list[LayerState]:
    return [make(list(tokens), i) for i, make in enumerate(STRUCTURES[structure])]


def history(tokens) -> CheckpointAttachment:
    return CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1}, (np.asarray(tokens, dtype=np.int32),))


def assert_restored(restored, structure: str, tokens, *, drafter: bool | None = None) -> None:
    """``restored`` holds exactly the state of ``tokens[:restored.length]``: bit-identical, nothing else."""
    assert restored is not None
    expected = layers_for(structure, list(tokens)[:restored.length])
    assert len(restored.layers) == len(expected)
    for got, want in zip(restored.layers, expected):
        assert (got.kind, got.meta, got.token_axis) == (want.kind, want.meta, want.token_axis)
        assert len(got.tensors) == len(want.tensors)
        for a, b in zip(got.tensors, want.tensors):
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            assert a.array().tobytes() == b.array().tobytes()
    if drafter is not None:
        assert (restored.attachment is not None) == drafter
    if restored.attachment is not None:
        want = history(list(tokens)[:restored.length])
        assert restored.attachment.schema == want.schema
        assert dict(restored.attachment.metadata) == dict(want.metadata)
        (t,) = restored.attachment.tensors
        assert t.dtype == "int32" and t.array().tobytes() == want.tensors[0].tobytes()


def new_store(open_store, path=None, *, chunk_tokens=4, **kwargs) -> Store:
    store = open_store(path, chunk_tokens=chunk_tokens, **kwargs)
    store.register_namespace(NS, target="a" * 64, prefix_namespace='{"method":null,"adapters":""}')
    store.register_namespace(NS_B, target="b" * 64, prefix_namespace='{"method":"x","adapters":""}', tenant=True)
    return store


def put(store, tokens, structure="plain", *, ns=NS, drafter=False, **kwargs):
    return store.put(ns, tokens, layers_for(structure, tokens),
                     drafter=(DRAFTER, history(tokens)) if drafter else None, **kwargs)


def dump(store) -> dict:
    """Every key and value of every sub-database (the memo aside): equal dumps mean an unchanged store."""
    with store.env.read() as txn:
        return {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                for name, db in store.env.dbs.items() if name != "memo"}


def rng_tokens(seed: int, n: int, vocab: int = 50_000) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# --- round trip --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
@pytest.mark.parametrize("chunk_tokens", [4, 8])
def test_put_fetch_round_trip_is_bit_identical(open_store, store_invariants, structure, chunk_tokens):
    store = new_store(open_store, chunk_tokens=chunk_tokens)
    for n in (1, 3, 4, 8, 13, 29):  # below, at and across chunk boundaries
        tokens = rng_tokens(n, n)
        result = put(store, tokens, structure, drafter=True)
        assert result.bytes_written > 0
        restored = store.fetch(NS, tokens, drafter=DRAFTER)
        assert restored.length == n and restored.entry == result.entry and restored.warnings == []
        assert_restored(restored, structure, tokens, drafter=True)
        # a longer prompt restores the stored prefix
        longer = store.fetch(NS, tokens + [7, 7, 7], drafter=DRAFTER)
        assert longer.length == n
        assert_restored(longer, structure, tokens, drafter=True)
    store_invariants(store)


def test_restored_state_owns_its_memory(open_store):
    store = new_store(open_store)
    tokens = rng_tokens(1, 10)
    put(store, tokens)
    restored = store.fetch(NS, tokens)
    store.close()  # the map is gone: restored tensors must not point into it
    assert_restored(restored, "plain", tokens)
    restored.layers[0].tensors[0].array()[...] = 0  # writable copies


def test_put_refuses_bad_input_and_leaves_the_store_unchanged(open_store):
    store = new_store(open_store)
    put(store, [1, 2, 3, 4, 5])
    before = dump(store)
    with pytest.raises(InvalidInput):
        store.put(NS, [], [])
    with pytest.raises(InvalidInput):
        store.put(NS, [1, -2], layers_for("plain", [1, 2]))
    with pytest.raises(InvalidInput):
        store.put(NS, [1, 2, 3], layers_for("plain", [1, 2]))  # layers cover 2 tokens, checkpoint 3
    with pytest.raises(InvalidInput):
        store.put(NS, [1, 2], layers_for("plain", [1, 2]), minimum_reusable=3)
    with pytest.raises(InvalidInput):
        store.put(blake3.blake3(b"never registered").digest(), [1, 2], layers_for("plain", [1, 2]))
    with pytest.raises(InvalidInput):
        store.put(NS, [1, 2], [object()])
    with pytest.raises(InvalidInput):
        store.put(NS, [1, 2], layers_for("plain", [1, 2]), drafter=("", history([1, 2])))
    assert dump(store) == before


# --- lookup against a brute-force model ---------------------------------------------------------------------------

C = 4
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def expected_hit(structure, entries, node_minr, query):
    """(length, has_drafter, is_entry) of the best usable stored prefix of ``query`` by brute force."""
    q = tuple(query)
    cands = []
    for toks, e in entries.items():
        if len(toks) <= len(q) and q[:len(toks)] == toks and len(toks) >= e["minr"]:
            cands.append((len(toks), DRAFTER in e["drafters"], True))
    if structure == "plain":  # chunk boundaries: target only, every layer sliceable
        for k in range(1, len(q) // C + 1):
            prefix = q[:k * C]
            if prefix in node_minr and node_minr[prefix] <= k * C:
                cands.append((k * C, False, False))
    return max(cands) if cands else None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structure=st.sampled_from(sorted(STRUCTURES)),
       puts=st.lists(st.tuples(token_lists, st.one_of(st.just(0), st.integers(0, 14)), st.booleans()),
                     min_size=1, max_size=8),
       queries=st.lists(token_lists, min_size=1, max_size=6))
def test_longest_prefix_lookup_matches_brute_force(structure, puts, queries):
    entries: dict[tuple, dict] = {}
    node_minr: dict[tuple, int] = {}
    with tempfile.TemporaryDirectory() as tmp, Store.open(tmp, chunk_tokens=C, durable=False) as store:
        store.register_namespace(NS, target="a" * 64, prefix_namespace="p")
        for toks, minr, with_drafter in puts:
            minr %= len(toks) + 1
            put(store, toks, structure, drafter=with_drafter, minimum_reusable=minr)
            e = entries.setdefault(tuple(toks), {"drafters": set()})
            e["minr"] = minr
            if with_drafter:
                e["drafters"].add(DRAFTER)
            if structure != "whole":
                for k in range(1, len(toks) // C + 1):
                    node_minr[tuple(toks[:k * C])] = max(node_minr.get(tuple(toks[:k * C]), 0), minr)
        for query in queries + [toks for toks, _, _ in puts]:
            want = expected_hit(structure, entries, node_minr, query)
            hit = store.lookup(NS, query, drafter=DRAFTER)
            if want is None:
                assert hit is None
                assert store.fetch(NS, query, drafter=DRAFTER) is None
                continue
            assert (hit.length, hit.has_drafter, hit.entry is not None) == want
            assert store.lookup(NS, query, drafter=OTHER_DRAFTER).has_drafter is False
            restored = store.fetch(NS, query, drafter=DRAFTER)
            assert restored.length == want[0]
            assert_restored(restored, structure, query, drafter=want[1])
        assert store.lookup(NS_B, queries[0]) is None  # another namespace sees nothing


def test_chunk_boundaries_serve_only_fully_chunked_checkpoints(open_store):
    """Same chunked layers, one more untrimmable layer: a chunk boundary could not restore that layer."""
    store = new_store(open_store)
    tokens = rng_tokens(2, 12)
    put(store, tokens, "plain")
    assert store.lookup(NS, tokens[:9]).length == 8
    with_ring = layers_for("plain", tokens[:10]) + [ring_layer(tokens[:10], 3)]
    store.put(NS, tokens[:10], with_ring)
    assert store.lookup(NS, tokens[:9]) is None
    restored = store.fetch(NS, tokens[:11])
    assert restored.length == 10 and len(restored.layers) == 4


def test_untrimmable_entries_serve_only_their_exact_length(open_store):
    store = new_store(open_store)
    tokens = rng_tokens(3, 11)
    put(store, tokens, "mixed")
    assert store.lookup(NS, tokens + [1]).length == 11
    assert store.lookup(NS, tokens[:10]) is None  # no chunk boundary: the ring cannot be trimmed
    put(store, tokens, "plain")  # plain KV of the same prefix is a separate chain
    assert store.lookup(NS, tokens[:10]).length == 8


# --- chunk sharing, duplicates, atomicity ------------------------------------------------------------------------


def test_prompts_sharing_a_prefix_share_its_chunks(open_store, store_invariants):
    store = new_store(open_store, chunk_tokens=8)
    prefix = rng_tokens(100, 40)  # five full chunks
    results = [put(store, prefix + rng_tokens(200 + i, 20)) for i in range(5)]  # 60 tokens: 7 chunks each
    assert [r.new_chunks for r in results] == [7, 2, 2, 2, 2]
    counts = store_invariants(store)
    assert counts["chunks"] == 5 + 5 * 2 and counts["entries"] == 5
    one = results[0].bytes_written
    shared = sum(r.bytes_written for r in results[1:])
    assert counts["bytes"] == one + shared < 5 * one
    s = maintenance.stats(store)
    assert (s["chunks"], s["entries"], s["bytes"]) == (15, 5, counts["bytes"])


def test_exact_duplicate_replaces_the_entry(open_store, store_invariants):
    store = new_store(open_store)
    tokens = rng_tokens(4, 10)
    put(store, tokens, drafter=True)
    first = store_invariants(store)
    r = put(store, tokens)  # without a drafter: the stored drafter part stays
    assert r.new_chunks == 0
    assert store_invariants(store) == first
    assert store.fetch(NS, tokens, drafter=DRAFTER).attachment is not None
    put(store, tokens, drafter=True, pin=True)
    assert store_invariants(store) == first
    assert maintenance.entries(store)[0]["pinned"] is True
    put(store, tokens)  # pinning survives a replacement
    assert maintenance.entries(store)[0]["pinned"] is True


def _count_calls(monkeypatch, cls, name):
    calls = {"n": 0}
    original = getattr(cls, name)

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, counting)
    return calls, original


@pytest.mark.parametrize("method", ["put", "add_totals", "add_ns", "get"])
def test_a_put_is_all_or_nothing(open_store, monkeypatch, store_invariants, method):
    """Fail the transaction at every one of its index writes: the store is never half-written."""
    base = rng_tokens(5, 9)
    tokens = base + [8, 8, 8, 8, 8]  # shares two chunks with base, adds one, evicts under the budget
    store = new_store(open_store, max_bytes=1 << 20)
    put(store, base, drafter=True)
    put(store, base[:6] + [1, 2, 3, 4, 5, 6])
    store.flush()
    calls, original = _count_calls(monkeypatch, Index, method)
    put(store, tokens, drafter=True)
    total = calls["n"]
    assert total >= 1
    monkeypatch.setattr(Index, method, original)
    for fail_at in range(1, total + 1):
        with tempfile.TemporaryDirectory() as tmp:
            twin = new_store(open_store, tmp, max_bytes=1 << 20)
            put(twin, base, drafter=True)
            put(twin, base[:6] + [1, 2, 3, 4, 5, 6])
            twin.flush()
            twin_before = dump(twin)
            state = {"n": 0}

            def failing(self, *args, _original=original, **kwargs):
                state["n"] += 1
                if state["n"] == fail_at:
                    raise RuntimeError("injected failure")
                return _original(self, *args, **kwargs)
            monkeypatch.setattr(Index, method, failing)
            with pytest.raises(RuntimeError):
                put(twin, tokens, drafter=True)
            monkeypatch.setattr(Index, method, original)
            assert dump(twin) == twin_before
            assert twin.lookup(NS, tokens).length == 9
            store_invariants(twin)
            twin.close()


def test_failing_encode_of_the_drafter_changes_nothing(open_store, monkeypatch):
    import spec_cache.store.write as store_module

    store = new_store(open_store)
    put(store, rng_tokens(6, 7), drafter=True)
    before = dump(store)

    def failing(kind, *args, **kwargs):
        if kind == "draft":
            raise MemoryError("injected")
        return encode_record(kind, *args, **kwargs)
    monkeypatch.setattr(store_module, "encode_record", failing)
    with pytest.raises(MemoryError):
        put(store, rng_tokens(7, 9), drafter=True)
    assert dump(store) == before


# --- persistence, format, permissions ----------------------------------------------------------------------------

READER = textwrap.dedent("""
    import hashlib, json, sys
    from spec_cache.store import Store
    ns, prompts = bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
    out = []
    with Store.open(sys.argv[1], readonly=True) as store:
        for tokens in prompts:
            r = store.fetch(ns, tokens, drafter=sys.argv[4])
            h = hashlib.sha256()
            for layer in r.layers:
                h.update(json.dumps([layer.kind, layer.meta, layer.token_axis]).encode())
                for t in layer.tensors:
                    h.update(json.dumps([t.dtype, list(t.shape)]).encode()); h.update(t.array().tobytes())
            att = r.attachment
            out.append([r.length, h.hexdigest(), None if att is None else
                        [att.schema, dict(att.metadata), [t.array().tobytes().hex() for t in att.tensors]]])
    print(json.dumps(out))
""")


def _digest(restored) -> list:
    import hashlib

    h = hashlib.sha256()
    for layer in restored.layers:
        h.update(json.dumps([layer.kind, layer.meta, layer.token_axis]).encode())
        for t in layer.tensors:
            h.update(json.dumps([t.dtype, list(t.shape)]).encode())
            h.update(t.array().tobytes())
    att = restored.attachment
    return [restored.length, h.hexdigest(), None if att is None else
            [att.schema, dict(att.metadata), [t.array().tobytes().hex() for t in att.tensors]]]


def test_a_new_process_sees_identical_data(open_store, store_dir):
    store = new_store(open_store, durable=True)
    prompts = [rng_tokens(10 + i, 5 + 6 * i) for i in range(4)]
    for i, tokens in enumerate(prompts):
        put(store, tokens, ("plain", "mixed", "whole", "plain")[i], drafter=bool(i % 2))
    expected = [_digest(store.fetch(NS, tokens, drafter=DRAFTER)) for tokens in prompts]
    store.close()
    out = subprocess.run([sys.executable, "-c", READER, str(store_dir), NS.hex(), json.dumps(prompts), DRAFTER],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected


def _file_state(path: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.name == "data.mdb"}


def test_newer_major_format_is_refused_and_left_untouched(open_store, store_dir):
    store = new_store(open_store)
    put(store, [1, 2, 3])
    store.close()
    env = lmdb.open(str(store_dir), max_dbs=16)
    meta_db = env.open_db(b"meta")
    with env.begin(write=True, db=meta_db) as txn:
        meta = msgpack.unpackb(txn.get(b"format"))
        meta.update(major=2, minor=3)
        txn.put(b"format", msgpack.packb(meta))
        txn.drop(env.open_db(b"memo", txn=txn), delete=True)  # format 2 has no memo: it must not be recreated
    env.close()
    before = _file_state(store_dir)
    for readonly in (False, True):
        with pytest.raises(StoreFormatError, match="2.3"):
            Store.open(store_dir, readonly=readonly)
    assert _file_state(store_dir) == before
    # a newer minor of the same major opens
    env = lmdb.open(str(store_dir), max_dbs=16)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        meta.update(major=1, minor=7)
        txn.put(b"format", msgpack.packb(meta))
    env.close()
    with Store.open(store_dir) as again:
        assert again.lookup(NS, [1, 2, 3]).length == 3
        assert again.env.meta["minor"] == 7


def test_other_lmdb_databases_are_refused_and_left_untouched(tmp_path):
    for named in (False, True):
        path = tmp_path / f"foreign-{named}"
        env = lmdb.open(str(path), max_dbs=4)
        db = env.open_db(b"users") if named else None
        with env.begin(write=True, db=db) as txn:
            txn.put(b"alice", b"1")
        env.close()
        before = _file_state(path)
        for readonly in (False, True):
            with pytest.raises(StoreFormatError, match="not a spec-cache store"):
                Store.open(path, readonly=readonly)
        assert _file_state(path) == before


def test_a_store_another_process_is_creating_is_not_taken_for_a_foreign_database(tmp_path):
    """Several processes opening one new store at once: one may find the sub-databases another is creating, the
    ``meta`` one not yet among them (test_several_processes_share_one_store failed so under load). That is a store
    being made, not a foreign LMDB database: it opens, and is a store from then on."""
    path = tmp_path / "s"
    env = lmdb.open(str(path), max_dbs=16)
    env.open_db(b"chunks")  # what the other process got to before its meta sub-database
    env.close()
    with Store.open(path) as store:
        store.register_namespace(NS, target="t", prefix_namespace="p")
        assert store.env.meta["format"] == "spec-cache-store"


def test_unopenable_paths_raise_store_errors(tmp_path):
    from spec_cache.store import StoreOpenError

    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreOpenError):
        Store.open(tmp_path / "file")
    with pytest.raises(StoreOpenError):
        Store.open(tmp_path / "missing", readonly=True)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "data.mdb").write_bytes(os.urandom(8192))
    with pytest.raises(StoreOpenError):
        Store.open(tmp_path / "garbage")
    with pytest.raises(InvalidInput):
        Store.open(tmp_path / "s", max_bytes=0)


def test_permissions(store_dir, open_store):
    old = os.umask(0o022)
    try:
        new_store(open_store)
    finally:
        os.umask(old)
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE((store_dir / name).stat().st_mode) == 0o600


# --- drafter parts ----------------------------------------------------------------------------------------------


def test_drafter_parts_are_per_drafter_namespace(open_store, store_invariants):
    store = new_store(open_store)
    tokens = rng_tokens(20, 10)
    put(store, tokens, drafter=True)
    assert store.lookup(NS, tokens, drafter=DRAFTER).has_drafter is True
    assert store.lookup(NS, tokens, drafter=OTHER_DRAFTER).has_drafter is False
    assert store.lookup(NS, tokens).has_drafter is False
    other = store.fetch(NS, tokens, drafter=OTHER_DRAFTER)
    assert other.length == 10 and other.attachment is None
    assert_restored(store.fetch(NS, tokens, drafter=DRAFTER), "plain", tokens, drafter=True)
    # a second drafter's part joins the same entry
    att = CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 4, "min": 2}, (np.asarray(tokens, np.int32),))
    store.put(NS, tokens, layers_for("plain", tokens), drafter=(OTHER_DRAFTER, att))
    assert maintenance.entries(store)[0]["drafters"] == sorted([DRAFTER, OTHER_DRAFTER])
    assert dict(store.fetch(NS, tokens, drafter=OTHER_DRAFTER).attachment.metadata) == {"max": 4, "min": 2}
    store_invariants(store)


@pytest.mark.parametrize("bad", ["short history", "wrong dtype", "bad metadata", "unknown schema"])
def test_attachment_failing_its_schema_is_refused(open_store, bad):
    store = new_store(open_store)
    tokens = rng_tokens(21, 6)
    put(store, tokens[:3], drafter=True)
    before = dump(store)
    att = {"short history": CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1},
                                                 (np.asarray(tokens[:5], np.int32),)),
           "wrong dtype": CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1},
                                               (np.asarray(tokens, np.int64),)),
           "bad metadata": CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 1, "min": 3},
                                                (np.asarray(tokens, np.int32),)),
           "unknown schema": CheckpointAttachment("future-draft-v9", {}, (np.asarray(tokens, np.int32),))}[bad]
    with pytest.raises(SchemaError):
        store.put(NS, tokens, layers_for("plain", tokens), drafter=(DRAFTER, att))
    assert dump(store) == before


def _write_raw_draft(store, tokens, dns: str, record) -> None:
    ekey = store.lookup(NS, tokens).entry

    def fn(txn):
        txn.put(draft_key(ekey, dns), bytes(record), db=store.env.dbs["drafts"])
        ix = Index(txn, store.env.dbs)
        entry = ix.get("entries", ekey)
        entry["drafters"][dns] = len(record)
        entry["bytes"] += len(record)
        ix.put("entries", ekey, entry)
        ix.add_ns(NS, d_bytes=len(record))
        ix.add_totals(len(record), 0)
    store.env.write(fn)


def test_unknown_schema_in_a_stored_draft_is_skipped_and_counted(open_store, store_invariants, caplog):
    store = new_store(open_store)
    tokens = rng_tokens(22, 9)
    put(store, tokens)
    future = "future-draft-v9:" + "c" * 64
    record = encode_record("draft", [("t0", "float32", np.ones((9, 2), np.float32))], schema="future-draft-v9",
                           meta={"metadata": {"k": 1}, "processed_tokens": 9})
    _write_raw_draft(store, tokens, future, record)
    store_invariants(store)
    assert store.lookup(NS, tokens, drafter=future).has_drafter is True
    with caplog.at_level("WARNING"):
        restored = store.fetch(NS, tokens, drafter=future)
    assert restored.length == 9 and restored.attachment is None
    assert any("future-draft-v9" in w for w in restored.warnings)
    assert any("future-draft-v9" in r.getMessage() for r in caplog.records)
    assert_restored(restored, "plain", tokens)
    report = maintenance.verify(store)
    # chunks, the entry, its tail's target piece (format 1.3), the drafter record
    assert (report.records, report.ok, report.corrupt, report.unknown_schema) == (5, 4, 0, 1)
    assert report.unknown_schemas == {"future-draft-v9": 1}


# --- corrupt records --------------------------------------------------------------------------------------------


def flip(store, db: str, key: bytes, at: int = -1) -> None:
    """Flip one bit of a stored value through a raw write transaction (default: its last tensor byte)."""
    def fn(txn):
        raw = bytearray(txn.get(key, db=store.env.dbs[db]))
        raw[at] ^= 0x10
        txn.put(key, bytes(raw), db=store.env.dbs[db])
    store.env.write(fn)


@pytest.mark.parametrize("at", [-1, 5, 20, 60])  # tensor data, prefix, checksum, header
def test_corrupt_entry_record_is_never_returned(open_store, store_invariants, at):
    store = new_store(open_store)
    tokens = rng_tokens(30, 14)
    put(store, tokens, "mixed")
    put(store, tokens[:6], "mixed")
    ekey = store.lookup(NS, tokens).entry
    flip(store, "edata", ekey, at)
    assert maintenance.verify(store).corrupt == 1
    restored = store.fetch(NS, tokens)
    assert restored.length == 6  # the shorter stored prefix serves; the bad record is dropped
    assert_restored(restored, "mixed", tokens)
    assert any("corrupt" in w for w in restored.warnings)
    assert maintenance.verify(store).corrupt == 0
    assert store_invariants(store)["entries"] == 1
    assert store.fetch(NS, tokens[:6]).length == 6
    flip(store, "edata", store.lookup(NS, tokens).entry)
    assert store.fetch(NS, tokens) is None  # nothing else to fall back on: a miss, never an exception
    store_invariants(store)


def test_corrupt_chunk_falls_back_above_it_and_is_rewritten(open_store, store_invariants):
    store = new_store(open_store)
    tokens = rng_tokens(31, 12)  # three chunks, tail 0
    put(store, tokens, "plain")
    put(store, tokens[:6], "plain")
    hit = store.lookup(NS, tokens)
    flip(store, "chunks", hit.chain[2])
    restored = store.fetch(NS, tokens)
    assert restored.length == 6
    assert_restored(restored, "plain", tokens)
    store_invariants(store)  # the broken node keeps its bytes counted until it is rewritten or collected
    assert maintenance.verify(store).corrupt == 0  # the bad chunk was dropped
    r = put(store, tokens, "plain")  # rewrites the broken chunk in place
    assert r.new_chunks == 1
    store_invariants(store)
    assert_restored(store.fetch(NS, tokens), "plain", tokens)
    assert store.fetch(NS, tokens).length == 12


def test_corrupt_chunk_subtree_is_collected_by_gc(open_store, store_invariants):
    store = new_store(open_store)
    tokens = rng_tokens(32, 12)
    put(store, tokens, "plain")
    put(store, tokens[:6], "plain")
    put(store, tokens[:9] + [5, 5, 5, 5], "plain")
    flip(store, "chunks", store.lookup(NS, tokens).chain[2])
    assert maintenance.verify(store).corrupt == 1
    report = maintenance.gc(store)
    assert report.corrupt_removed == 1 and report.broken_subtrees == 1 and report.bytes > 0
    counts = store_invariants(store)
    assert counts["entries"] == 1
    assert maintenance.verify(store).corrupt == 0
    assert store.fetch(NS, tokens).length == 6


def test_corrupt_drafter_part_leaves_the_target_state(open_store, store_invariants):
    store = new_store(open_store)
    tokens = rng_tokens(33, 7)
    put(store, tokens, drafter=True)
    flip(store, "drafts", draft_key(store.lookup(NS, tokens).entry, DRAFTER))
    restored = store.fetch(NS, tokens, drafter=DRAFTER)
    assert restored.length == 7 and restored.attachment is None
    assert_restored(restored, "plain", tokens)
    assert store.lookup(NS, tokens, drafter=DRAFTER).has_drafter is False
    assert maintenance.entries(store)[0]["drafters"] == []
    store_invariants(store)


def test_read_only_store_skips_corrupt_records_it_cannot_drop(open_store, store_dir):
    store = new_store(open_store)
    tokens = rng_tokens(34, 10)
    put(store, tokens, "mixed")
    put(store, tokens[:5], "mixed")
    flip(store, "edata", store.lookup(NS, tokens).entry)
    store.close()
    with Store.open(store_dir, readonly=True) as ro:
        for _ in range(3):
            assert ro.fetch(NS, tokens).length == 5
        assert ro.lookup(NS, tokens).length == 5


# --- counters ----------------------------------------------------------------------------------------------------


def test_namespace_counters(open_store):
    store = new_store(open_store)

    def ns_row(ns=NS):
        store.flush()
        return next(r for r in maintenance.namespaces(store) if r["key"] == ns.hex())
    start = ns_row()
    assert (start["entries"], start["bytes"], start["hits"], start["misses"]) == (0, 0, 0, 0)
    assert start["last_use_ns"] is None
    r = put(store, rng_tokens(40, 9))
    after_put = ns_row()
    assert (after_put["entries"], after_put["bytes"]) == (1, r.bytes_written)
    assert after_put["last_use_ns"] is not None
    for _ in range(3):
        store.fetch(NS, rng_tokens(40, 9))
    store.fetch(NS, [9, 9, 9])
    row = ns_row()
    assert (row["hits"], row["misses"]) == (3, 1)
    assert row["last_use_ns"] > after_put["last_use_ns"]
    other = ns_row(NS_B)
    assert (other["entries"], other["hits"], other["misses"], other["tenant"]) == (0, 0, 0, True)
    store.fetch(NS_B, [1])
    assert ns_row(NS_B)["misses"] == 1
    s = maintenance.stats(store)
    assert (s["hits"], s["misses"], s["namespaces"], s["entries"]) == (3, 2, 2, 1)


def test_counters_are_flushed_in_batches(open_store, monkeypatch):
    import spec_cache.store.store as store_module
    from spec_cache.store.store import FLUSH_EVERY

    monkeypatch.setattr(store_module, "FLUSH_SECONDS", 3600.0)  # count-triggered flushes only
    store = new_store(open_store)
    put(store, [1, 2, 3])
    with store.env.read() as txn:
        base = unpack(txn.get(NS, db=store.env.dbs["nsinfo"]))["hits"]
    for _ in range(FLUSH_EVERY):
        store.fetch(NS, [1, 2, 3])
    with store.env.read() as txn:  # read the raw record: no explicit flush
        assert unpack(txn.get(NS, db=store.env.dbs["nsinfo"]))["hits"] == base + FLUSH_EVERY
    store.fetch(NS, [1, 2, 3])
    with store.env.read() as txn:  # batched: not written yet
        assert unpack(txn.get(NS, db=store.env.dbs["nsinfo"]))["hits"] == base + FLUSH_EVERY


# --- eviction -----------------------------------------------------------------------------------------------------

FAMILY = [rng_tokens(50, 24)[:n] for n in (5, 9, 13)] + [rng_tokens(51, 17), rng_tokens(52, 30), [3, 3, 3]]
_FOOTPRINT: dict[tuple, int] = {}


def footprint(tokens) -> int:
    """Bytes one checkpoint needs in an empty store (entry + its chunks) in its smallest layout, written whole
    (format 1.3's pieces add record overhead; a put refused for the budget is tried again whole), measured on a
    scratch store."""
    key = tuple(tokens)
    if key not in _FOOTPRINT:
        from spec_cache.store import spans

        with tempfile.TemporaryDirectory() as tmp, Store.open(tmp, chunk_tokens=4, durable=False) as scratch:
            scratch.register_namespace(NS, target="a" * 64, prefix_namespace="p")
            spans.WRITE_SPANS = False
            try:
                _FOOTPRINT[key] = put(scratch, tokens).bytes_written
            finally:
                spans.WRITE_SPANS = True
    return _FOOTPRINT[key]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # stateless fixture
@given(budget_chunks=st.integers(1, 12),
       ops=st.lists(st.tuples(st.integers(0, len(FAMILY) - 1), st.integers(0, 9), st.booleans()),
                    min_size=1, max_size=14))
def test_eviction_holds_the_budget(store_invariants, budget_chunks, ops):
    unit = footprint(FAMILY[0])
    max_bytes = budget_chunks * unit // 2
    pinned: set[tuple] = set()
    with tempfile.TemporaryDirectory() as tmp, Store.open(tmp, chunk_tokens=4, durable=False,
                                                         max_bytes=max_bytes) as store:
        store.register_namespace(NS, target="a" * 64, prefix_namespace="p")
        for which, cut, pin in ops:
            tokens = FAMILY[which][:max(1, len(FAMILY[which]) - cut)]
            pin = pin and which % 2 == 0
            store.flush()  # batched access times are written before a put, outside its transaction
            before = dump(store)
            try:
                put(store, tokens, pin=pin)
            except StoreFullError:
                assert dump(store) == before
                # refused only when it cannot fit: alone, or next to the pinned entries
                assert pinned or footprint(tokens) > max_bytes
            else:
                assert footprint(tokens) <= max_bytes
                if pin:
                    pinned.add(tuple(tokens))
                assert store.lookup(NS, tokens).length == len(tokens)  # the fresh insert is never the victim
            counts = store_invariants(store)
            assert counts["bytes"] <= max_bytes
            stored = {tuple(e["tokens"]) for e in _entry_tokens(store)}
            assert pinned <= stored
            for toks in stored:  # no entry lost its chunks
                restored = store.fetch(NS, list(toks))
                assert restored.length == len(toks)
                assert_restored(restored, "plain", toks)


def _entry_tokens(store) -> list[dict]:
    """Every entry's token list, reassembled from its chain (test helper; the store does not keep them)."""
    from spec_cache.store.codec import decode_record

    out = []
    with store.env.read() as txn:
        dbs = store.env.dbs
        for key, raw in txn.cursor(db=dbs["entries"]):
            e = unpack(raw)
            toks = np.asarray(decode_record(txn.get(bytes(key), db=dbs["edata"])).tensors["tokens"].array()).tolist()
            node = unpack(txn.get(e["node"], db=dbs["nodes"]))
            node_key = e["node"]
            while node["depth"] > 0:
                chunk = decode_record(txn.get(node_key, db=dbs["chunks"]))
                toks = chunk.tensors["tokens"].array().tolist() + toks
                node_key = node["parent"]
                node = unpack(txn.get(node_key, db=dbs["nodes"]))
            out.append({"tokens": toks, "pinned": e["pinned"]})
    return out


def test_lru_order_follows_use(open_store, store_invariants):
    prompts = [rng_tokens(60 + i, 12) for i in range(4)]
    unit = footprint(prompts[0])
    store = new_store(open_store, max_bytes=3 * unit + unit // 2)
    for tokens in prompts[:3]:
        put(store, tokens)
    store.fetch(NS, prompts[0])  # touch the oldest
    store.flush()
    r = put(store, prompts[3])
    assert r.evicted == 1
    assert store.lookup(NS, prompts[1]) is None  # now the least recently used
    for tokens in (prompts[0], prompts[2], prompts[3]):
        assert store.lookup(NS, tokens).length == 12
    store_invariants(store)


def test_checkpoint_larger_than_the_budget_is_refused(open_store):
    tokens = rng_tokens(70, 30)
    need = footprint(tokens)
    store = new_store(open_store, max_bytes=need - 1)
    put(store, [1])
    before = dump(store)
    with pytest.raises(StoreFullError):
        put(store, tokens)  # its entry record alone fits: the chunks make it too large
    assert dump(store) == before


def test_pinned_entries_are_never_evicted(open_store, store_invariants):
    prompts = [rng_tokens(80 + i, 12) for i in range(3)]
    unit = footprint(prompts[0])
    store = new_store(open_store, max_bytes=2 * unit + unit // 2)
    put(store, prompts[0], pin=True)
    put(store, prompts[1], pin=True)
    before = dump(store)
    with pytest.raises(StoreFullError):
        put(store, prompts[2])
    assert dump(store) == before
    assert store.pin(NS, prompts[1], False) is True
    assert put(store, prompts[2]).evicted == 1
    assert store.lookup(NS, prompts[0]).length == 12 and store.lookup(NS, prompts[1]) is None
    assert store.pin(NS, [4, 4, 4]) is False
    store_invariants(store)


def test_full_map_grows(open_store, store_invariants):
    store = new_store(open_store, chunk_tokens=64, map_size=1 << 20)
    rng = np.random.default_rng(0)
    stored = []
    for i in range(20):  # 20 x ~1 MiB, in a map of 1 MiB
        tokens = rng_tokens(90 + i, 256)
        k = rng.standard_normal((1, 4, 256, 256), dtype=np.float32)
        ring = rng.integers(0, 2**32, (1, 4, 64, 64), dtype=np.uint32)
        layers = [LayerState("kv", {}, [Tensor.from_numpy(k)], token_axis=2),
                  LayerState("rotating", {}, [Tensor.from_numpy(ring)], token_axis=None)]
        store.put(NS, tokens, layers)
        stored.append((tokens, k, ring))
    counts = store_invariants(store)
    assert counts["bytes"] > 20 << 20
    assert store.env.env.info()["map_size"] >= counts["bytes"]
    for tokens, k, ring in stored:
        restored = store.fetch(NS, tokens)
        assert restored.length == 256
        assert restored.layers[0].tensors[0].array().tobytes() == k.tobytes()
        assert restored.layers[1].tensors[0].array().tobytes() == ring.tobytes()


# --- several processes --------------------------------------------------------------------------------------------


def _worker(path: str, seed: int, seconds: float, write: bool, queue) -> None:
    """Put and fetch prompts of a shared family; every restored state must be one whole checkpoint."""
    try:
        rng = np.random.default_rng(seed)
        family = [rng_tokens(500 + i, 40) for i in range(6)]
        ops = hits = 0
        with Store.open(path, chunk_tokens=8, durable=False, map_size=128 << 10) as store:
            store.register_namespace(NS, target="a" * 64, prefix_namespace="p")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tokens = family[rng.integers(len(family))][:int(rng.integers(1, 41))]
                if write and rng.random() < 0.5:
                    put(store, tokens, "plain", drafter=bool(rng.random() < 0.5))
                restored = store.fetch(NS, tokens, drafter=DRAFTER)
                if restored is not None:
                    assert_restored(restored, "plain", tokens)
                    hits += 1
                ops += 1
        queue.put(("ok", seed, ops, hits))
    except BaseException as exc:  # report, do not hang the parent
        import traceback

        queue.put(("error", seed, repr(exc), traceback.format_exc()))


def test_several_processes_share_one_store(store_dir, store_invariants):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(store_dir), seed, 2.5, write, queue))
             for seed, write in ((1, True), (2, True), (3, False))]
    for p in procs:
        p.start()
    results = [queue.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors[0][3]
    assert all(r[2] > 5 for r in results)
    with Store.open(store_dir, durable=False) as store:
        store_invariants(store)
        assert maintenance.verify(store).corrupt == 0
        assert maintenance.stats(store)["file_bytes"] > 128 << 10  # the map grew under the workers


CHURN = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from spec_cache.store import LayerState, Store, Tensor
    ns = bytes.fromhex(sys.argv[2])
    with Store.open(sys.argv[1], durable=False) as store:
        readers = store.env.env.readers()
        size0 = os.path.getsize(os.path.join(sys.argv[1], "data.mdb"))
        for i in range(40):  # replace one 256 KiB checkpoint again and again
            data = np.full((1, 1, 8, 8192), i, np.float32)
            store.put(ns, list(range(8)), [LayerState("ring", {}, [Tensor.from_numpy(data)], token_axis=None)])
        size1 = os.path.getsize(os.path.join(sys.argv[1], "data.mdb"))
    print(json.dumps({"readers": readers, "growth": size1 - size0}))
""")


def test_stale_reader_of_a_killed_process_does_not_pin_old_pages(open_store, store_dir):
    store = new_store(open_store)  # this process keeps the environment open (the lock table stays live)
    put(store, [1, 2, 3])
    holder_pid = kill_reader_holder(str(store_dir), str(REPO))
    out = subprocess.run([sys.executable, "-c", CHURN, str(store_dir), NS.hex()], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    pids = {line.split()[0] for line in result["readers"].splitlines()[1:] if line.strip()}
    assert str(holder_pid) not in pids
    assert result["growth"] < 4 << 20  # freed pages are reused: 40 x 256 KiB would be 10 MiB
    assert store.lookup(NS, [1, 2, 3]).length == 3


# --- typed index records: same bytes on disk -------------------------------------------------------------------
_NS32, _PARENT32 = bytes(range(32)), bytes(range(32, 64))
_SIG = b"\x91\x95\x00"
# (sub-database, the dict the store has always written, its msgpack bytes)
INDEX_GOLDEN = [
    ("nodes", {"ns": _NS32, "parent": _PARENT32, "depth": 2, "refs": 3, "tails": {"5": 1, "0": 2}, "bytes": 4096,
               "complete": True, "minr": 7, "sig": b""},
     "89a26e73c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa6706172656e74c420202122232425"
     "262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3fa5646570746802a47265667303a57461696c7382a13501a13002a562"
     "79746573cd1000a8636f6d706c657465c3a46d696e7207a3736967c400"),
    ("nodes", {"ns": _NS32, "parent": None, "depth": 0, "refs": 1, "tails": {}, "bytes": 0, "complete": False,
               "minr": 0, "sig": _SIG},
     "89a26e73c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa6706172656e74c0a5646570746800"
     "a47265667301a57461696c7380a5627974657300a8636f6d706c657465c2a46d696e7200a3736967c403919500"),
    ("nodes", {"ns": _NS32, "parent": _PARENT32, "depth": 2, "refs": 3, "tails": {"5": 1, "0": 2}, "bytes": 4096,
               "complete": True, "minr": 7, "sig": b"", "broken": True},
     "8aa26e73c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa6706172656e74c420202122232425"
     "262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3fa5646570746802a47265667303a57461696c7382a13501a13002a562"
     "79746573cd1000a8636f6d706c657465c3a46d696e7207a3736967c400a662726f6b656ec3"),
    ("entries", {"ns": _NS32, "len": 133, "node": _PARENT32, "tail": 5, "last_use": 1764000000000000000,
                 "created": 1763000000000000000, "pinned": False, "bytes": 9000, "drafters": {"assistant/x": 1200},
                 "minr": 64},
     "8aa26e73c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa36c656ecc85a46e6f6465c4202021"
     "22232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3fa47461696c05a86c6173745f757365cf187afca767ca0000"
     "a763726561746564cf18776f28c3038000a670696e6e6564c2a56279746573cd2328a8647261667465727381ab617373697374616e74"
     "2f78cd04b0a46d696e7240"),
    ("nsinfo", {"target": "t:abc", "prefix": "assistant", "tenant": False, "created": 1763000000000000000,
                "entries": 2, "bytes": 13096, "hits": 5, "misses": 1, "last_use": None, "sigs": [_SIG]},
     "8aa6746172676574a5743a616263a6707265666978a9617373697374616e74a674656e616e74c2a763726561746564cf18776f28c3"
     "038000a7656e747269657302a56279746573cd3328a46869747305a66d697373657301a86c6173745f757365c0a47369677391c403"
     "919500"),
    ("nsinfo", {"target": "", "prefix": "", "tenant": False, "created": 1, "entries": 0, "bytes": 0, "hits": 0,
                "misses": 0, "last_use": None, "sigs": [], "rebuilt": True},
     "8ba6746172676574a0a6707265666978a0a674656e616e74c2a76372656174656401a7656e747269657300a5627974657300a4686974"
     "7300a66d697373657300a86c6173745f757365c0a47369677390a772656275696c74c3"),
    ("meta", {"bytes": 13096, "entries": 2}, "82a56279746573cd3328a7656e747269657302"),
]


@pytest.mark.parametrize("db, old, golden", INDEX_GOLDEN)
def test_typed_index_records_pack_to_the_bytes_the_store_always_wrote(db, old, golden):
    from spec_cache.store.values import TOTALS_KEY, decode_typed

    raw = bytes.fromhex(golden)
    assert msgpack.packb(old, use_bin_type=True) == raw  # the golden bytes are the old dict packing
    record = decode_typed(db, raw, TOTALS_KEY if db == "meta" else None)
    assert pack(record) == raw
    assert record.to_dict() == old and list(record.to_dict()) == list(old)  # same keys, same order
    assert pack(type(record).from_dict(old)) == raw


def test_typed_index_records_keep_fields_they_do_not_know():
    from spec_cache.store.values import Entry, Node

    node = dict(INDEX_GOLDEN[0][1], future=[1, 2])
    assert pack(Node.from_dict(node)) == msgpack.packb(node, use_bin_type=True)
    entry = dict(INDEX_GOLDEN[3][1], future="x")
    assert Entry.from_dict(entry).extra == {"future": "x"}
    assert pack(Entry.from_dict(entry)) == msgpack.packb(entry, use_bin_type=True)


def test_every_index_row_a_store_writes_packs_back_to_its_bytes(open_store):
    """Typed records read from a store written by puts, pins, drafter parts, replacement, eviction and gc pack
    back to exactly the stored bytes (what an older version wrote is rewritten byte for byte)."""
    from spec_cache.store.values import TOTALS_KEY, decode_typed

    store = new_store(open_store, max_bytes=1 << 20)
    put(store, rng_tokens(1, 13), drafter=True, minimum_reusable=5)
    put(store, rng_tokens(2, 9), "mixed")
    put(store, rng_tokens(3, 3), "whole", ns=NS_B, pin=True)
    put(store, rng_tokens(1, 13))  # replacement keeps the drafter part
    store.fetch(NS, rng_tokens(1, 13), drafter=DRAFTER)
    store.flush()
    maintenance.gc(store)
    with store.env.read() as txn:
        rows = [(db, bytes(k), bytes(v)) for db in ("nodes", "entries", "nsinfo")
                for k, v in txn.cursor(db=store.env.dbs[db])]
        rows.append(("meta", TOTALS_KEY, bytes(txn.get(TOTALS_KEY, db=store.env.dbs["meta"]))))
    assert {db for db, _, _ in rows} == {"nodes", "entries", "nsinfo", "meta"}
    for db, key, raw in rows:
        assert pack(decode_typed(db, raw, key)) == raw, db


def test_expected_bookkeeping_recomputes_counters_from_nodes_and_entries():
    from spec_cache.store.index import expected_bookkeeping
    from spec_cache.store.keys import lru_key
    from spec_cache.store.values import Entry, Node, Totals

    root, c1, c2 = b"r" * 32, b"1" * 32, b"2" * 32
    nodes = {root: Node(NS, None, 0, 0, {}, 0, True, 0, _SIG),
             c1: Node(NS, root, 1, 0, {}, 100, True, 0),
             c2: Node(NS, c1, 2, 0, {}, 120, True, 0)}
    entries = {b"a" * 32: Entry(NS, 9, c2, 1, 5, 1, False, 50, {"d": 10}, 0),
               b"b" * 32: Entry(NS, 9, c2, 1, 7, 1, False, 40, {}, 0),
               b"c" * 32: Entry(NS, 3, root, 3, 6, 1, True, 30, {}, 0),
               b"d" * 32: Entry(NS_B, 2, b"x" * 32, 2, 8, 1, False, 20, {}, 0)}  # its node is not given
    books = expected_bookkeeping(nodes, entries)
    assert books.refs == {root: 2, c1: 1, c2: 2}
    assert books.tails == {root: {"3": 1}, c1: {}, c2: {"1": 2}}
    assert books.ns_bytes == {NS: 100 + 120 + 50 + 40 + 30, NS_B: 20}
    assert books.ns_entries == {NS: 3, NS_B: 1}
    assert books.ns_signatures == {NS: [_SIG]}
    assert books.lru == {lru_key(e.last_use, k) for k, e in entries.items()}
    assert books.totals == Totals(360, 4)


def test_expected_bookkeeping_agrees_with_a_store_after_puts_and_evictions(open_store, store_invariants):
    from spec_cache.store.index import expected_bookkeeping
    from spec_cache.store.verify import read_index

    store = new_store(open_store, max_bytes=60_000)
    for seed in range(12):
        put(store, rng_tokens(seed % 4, 5 + seed), "mixed" if seed % 3 else "plain", drafter=seed % 2 == 0)
    store_invariants(store)
    with store.env.read() as txn:
        rows = read_index(txn, store.env.dbs)
    books = expected_bookkeeping(rows.nodes, rows.entries, rows.pieces)  # pieces: store format 1.2
    assert not rows.damaged and books.totals == rows.totals and books.lru == rows.lru
    assert all(books.refs[k] == n.refs and books.tails[k] == n.tails for k, n in rows.nodes.items())


# --- the caller's usability rule, passed down ------------------------------------------------------------------
def _steps(open_store):
    """Entries at 6 (with the drafter part), 10 and 13 tokens of one prompt (chunks of 4: boundaries at 4, 8, 12)."""
    store = new_store(open_store)
    tokens = rng_tokens(7, 16)
    put(store, tokens[:6], drafter=True, minimum_reusable=2)
    put(store, tokens[:10])
    put(store, tokens[:13], minimum_reusable=11)
    return store, tokens


def test_lookup_returns_the_longest_candidate_the_predicate_accepts(open_store):
    store, tokens = _steps(open_store)
    assert store.lookup(NS, tokens).length == 13
    assert store.lookup(NS, tokens, usable=None).length == 13
    hit = store.lookup(NS, tokens, drafter=DRAFTER, usable=lambda h: h.has_drafter)
    assert (hit.length, hit.has_drafter, hit.minimum_reusable) == (6, True, 2)
    hit = store.lookup(NS, tokens, usable=lambda h: h.length <= 12)
    assert (hit.length, hit.entry) == (12, None)  # the chunk boundary between the entries
    hit = store.lookup(NS, tokens, usable=lambda h: h.entry is not None and h.length < 13)
    assert hit.length == 10
    hit = store.lookup(NS, tokens, usable=lambda h: h.minimum_reusable == 0 and h.entry is not None)
    assert hit.length == 10
    seen = []
    assert store.lookup(NS, tokens, usable=lambda h: seen.append(h.length) and False) is None
    # every candidate once, longest first (the boundaries at 4 and 8 carry the 13-token entry's minimum 11)
    assert seen == [13, 12, 10, 6]


def test_fetch_restores_the_longest_usable_prefix_in_one_call(open_store):
    store, tokens = _steps(open_store)
    restored = store.fetch(NS, tokens, drafter=DRAFTER, usable=lambda h: h.has_drafter)
    assert restored.length == 6
    assert_restored(restored, "plain", tokens, drafter=True)
    restored = store.fetch(NS, tokens, usable=lambda h: h.length <= 12)
    assert restored.length == 12 and restored.entry is None
    assert_restored(restored, "plain", tokens)
    assert store.fetch(NS, tokens, usable=lambda h: False) is None  # rejecting everything is a miss
    store.flush()
    assert maintenance.namespaces(store)[0]["misses"] >= 1


def test_fetch_steps_past_a_corrupt_record_to_the_next_usable_prefix(open_store):
    store, tokens = _steps(open_store)
    ekey = store.lookup(NS, tokens, usable=lambda h: h.length == 10).entry
    flip(store, "edata", ekey)
    notes: list[str] = []
    restored = store.fetch(NS, tokens, usable=lambda h: h.entry is not None and h.length < 13, warnings=notes)
    assert restored.length == 6 and any("corrupt" in n for n in notes)
    assert_restored(restored, "plain", tokens)


def test_put_without_a_registered_namespace_raises_a_typed_error(open_store):
    from spec_cache.store import NamespaceNotRegistered

    store = new_store(open_store)
    with pytest.raises(NamespaceNotRegistered, match="not registered"):
        put(store, rng_tokens(1, 5), ns=blake3.blake3(b"unregistered").digest())
    assert issubclass(NamespaceNotRegistered, InvalidInput)

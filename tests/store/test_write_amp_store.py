"""Write amplification at the store (issue 21): what one put costs in LMDB commits.

Every LMDB commit rewrites the b-tree pages it touches plus a meta page (~10 pages, ~40 KB, and two fdatasyncs), so a
put that first flushed the batched access times and hit counters in a transaction of their own cost two commits.
They now ride in the put's transaction: one commit, the access times and counters as durable as before.
"""

from __future__ import annotations

import numpy as np
import pytest

from spec_cache.store import LayerState, Store, StoreFullError, Tensor
from spec_cache.store import store as store_module
from spec_cache.store.index import Index

NS = b"w" * 32


def _layers(kv: np.ndarray, n: int) -> list[LayerState]:
    return [LayerState("kv", {}, [Tensor.from_numpy(np.ascontiguousarray(kv[i, :, :, :n])) for _ in range(2)], 2)
            for i in range(kv.shape[0])]


@pytest.fixture
def conversation(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "FLUSH_SECONDS", 1e9)  # no timed flush on a slow machine: counts are exact
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 50_000, 600).tolist()
    kv = rng.standard_normal((2, 1, 2, 600, 8)).astype(np.float32)
    store = Store.open(tmp_path / "store", chunk_tokens=64)
    store.register_namespace(NS, target="t", prefix_namespace="p")
    yield store, tokens, kv
    store.close()


def _count_commits(store: Store) -> list:
    calls = []
    original = store.env._transaction

    def counted(fn, attempt):
        calls.append(fn)
        return original(fn, attempt)
    store.env._transaction = counted
    return calls


def _entry_and_hits(store: Store, key: bytes):
    """What is committed (a new read transaction sees only committed writes)."""
    with store.reading() as txn:
        index = Index(txn, store.env.dbs)
        return index.entry(key), index.namespace(NS).hits


def test_a_put_after_a_hit_is_one_commit_and_the_hit_is_recorded(conversation):
    store, tokens, kv = conversation
    first = store.put(NS, tokens[:100], _layers(kv, 100))
    restored = store.fetch(NS, tokens[:150])
    assert restored is not None and restored.length == 100
    used_before = _entry_and_hits(store, first.entry)[0].last_use
    commits = _count_commits(store)
    store.put(NS, tokens[:200], _layers(kv, 200))
    assert len(commits) == 1, f"a put made {len(commits)} LMDB commits"
    entry, hits = _entry_and_hits(store, first.entry)
    assert entry.last_use > used_before  # the fetch's access time went in with the put
    assert hits == 1
    # and the store still serves both prefixes, bit for bit
    again = store.fetch(NS, tokens[:250])
    assert again.length == 200
    for layer, i in zip(again.layers, range(kv.shape[0])):
        assert np.array_equal(layer.tensors[0].array(), kv[i, :, :, :200])


def test_a_failed_put_keeps_the_batched_access_times(conversation):
    store, tokens, kv = conversation
    first = store.put(NS, tokens[:100], _layers(kv, 100))
    assert store.fetch(NS, tokens[:120]).length == 100
    used_before = _entry_and_hits(store, first.entry)[0].last_use

    def refuse(txn, checkpoint, pin):
        raise StoreFullError("refused for the test")
    store._commit = refuse
    with pytest.raises(StoreFullError):
        store.put(NS, tokens[:300], _layers(kv, 300))
    del store._commit
    entry, hits = _entry_and_hits(store, first.entry)
    assert entry.last_use == used_before and hits == 0  # the aborted transaction wrote nothing
    store.flush()
    entry, hits = _entry_and_hits(store, first.entry)
    assert entry.last_use > used_before and hits == 1  # kept, and written by the next flush


def test_a_growing_conversation_commits_once_per_put(conversation):
    store, tokens, kv = conversation
    commits = _count_commits(store)
    puts = 0
    for n in range(40, 600, 37):
        hit = store.fetch(NS, tokens[:n])
        assert hit is None or hit.length < n
        store.put(NS, tokens[:n], _layers(kv, n))
        puts += 1
    assert len(commits) == puts  # the hits and misses counted went in with the puts
    with store.reading() as txn:
        info = Index(txn, store.env.dbs).namespace(NS)
    assert info.hits + info.misses == puts  # every fetch counted, written by the put after it


def test_a_put_on_a_stored_chain_rewrites_only_the_nodes_that_change(conversation, monkeypatch):
    """A long prompt's put used to rewrite every node row of its chain (one b-tree leaf page each: node keys are
    hashes); only new nodes, their parent and the entry's node are written now, and lookups still see them."""
    store, tokens, kv = conversation
    store.put(NS, tokens[:520], _layers(kv, 520))  # 8 chunks of 64
    writes = []
    original = Index.put

    def counted(self, db, key, value):
        writes.append((db, bytes(key)))
        return original(self, db, key, value)
    monkeypatch.setattr(Index, "put", counted)
    store.put(NS, tokens[:590], _layers(kv, 590))  # one more chunk, a new tail
    nodes = [key for db, key in writes if db == "nodes"]
    assert len(nodes) <= 3, f"{len(nodes)} node rows written for one new chunk"
    writes.clear()
    store.put(NS, tokens[:591], _layers(kv, 591))  # same chain, one token longer
    assert len([key for db, key in writes if db == "nodes"]) <= 1  # the entry's node (tail count) at most
    # a shorter checkpoint with a larger minimum_reusable still raises the nodes' flag (a changed node is written)
    writes.clear()
    store.put(NS, tokens[:300], _layers(kv, 300), minimum_reusable=200)
    assert len([key for db, key in writes if db == "nodes"]) >= 4
    for n in (300, 520, 590, 591):
        got = store.fetch(NS, tokens[:n] + [1])
        assert got is not None and got.length == n
        assert np.array_equal(got.layers[1].tensors[1].array(), kv[1, :, :, :n])

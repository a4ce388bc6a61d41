"""Shared pytest fixtures (temporary store directories, stores that are always closed) and the automatic markers.

``redis``, ``real_model`` and ``server`` are put on each test from what it uses (tests/markers.py says how), so
``pytest -m "not redis and not real_model"`` needs no mark written by hand; ``server`` and ``real_model`` tests are
``slow`` too, and the other slow ones are named in tests/slow_tests.txt.
"""

from __future__ import annotations

import pytest

from tests.markers import item_markers, listed_slow
from tests.redis_servers import ThrowawayServer, server_binaries


def pytest_collection_modifyitems(items):
    slow = listed_slow()
    for item in items:
        for name in sorted(item_markers(item, slow)):
            item.add_marker(name)


@pytest.fixture
def redis_server():
    """A Redis (else Valkey) server of this test's own on 127.0.0.1, stopped at teardown; skips when none is installed
    (``bash tools/redis_server.sh install``). Tests that share one server per module keep their own fixture."""
    binaries = server_binaries()
    if not binaries:
        pytest.skip("no redis-server or valkey-server binary installed")
    with ThrowawayServer(binaries.get("redis") or next(iter(binaries.values()))) as server:
        yield server


@pytest.fixture
def store_dir(tmp_path):
    """A path (not yet created) for a store directory inside the test's temporary directory."""
    return tmp_path / "store"


@pytest.fixture
def open_store(store_dir):
    """``open_store(path=None, **kwargs)`` opens a ``store.Store`` (non-durable by default); closed at teardown."""
    from spec_cache.store import Store

    opened = []

    def _open(path=None, **kwargs):
        kwargs.setdefault("durable", False)
        store = Store.open(path if path is not None else store_dir, **kwargs)
        opened.append(store)
        return store

    yield _open
    for store in reversed(opened):
        store.close()


@pytest.fixture
def store_invariants():
    """``check(store)``: the index's bookkeeping agrees with the records it describes (raises AssertionError).

    Totals and per-namespace counters equal the stored record sizes, node reference counts and tail counts
    equal the entries and child nodes that hang off them, every chunk has its node (a broken node keeps its
    bytes counted until gc), and LRU rows match the entries' last use.
    """
    from spec_cache.store.index import draft_key, expected_bookkeeping
    from spec_cache.store.values import TOTALS_KEY, decode_typed
    from spec_cache.store.verify import read_index

    def check(store) -> dict:
        dbs = store.env.dbs
        with store.env.read() as txn:
            rows = {name: {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs[name])}
                    for name in ("nsinfo", "nodes", "chunks", "entries", "edata", "drafts", "lru")}
            totals = decode_typed("meta", txn.get(TOTALS_KEY, db=dbs["meta"]), TOTALS_KEY)
            pieces = read_index(txn, dbs).pieces  # shared drafter pieces (store format 1.2)
        nodes = {k: decode_typed("nodes", v, k) for k, v in rows["nodes"].items()}
        entries = {k: decode_typed("entries", v, k) for k, v in rows["entries"].items()}
        expected = expected_bookkeeping(nodes, entries, pieces)
        for key, node in nodes.items():
            if node.depth > 0:
                assert node.parent in nodes, "node without its parent"
                assert key in rows["chunks"] or node.broken, "chunk record missing"
                if key in rows["chunks"]:
                    assert node.chunk_bytes == len(rows["chunks"][key])
        assert set(rows["chunks"]) <= set(nodes), "chunk record without a node"
        for key, e in entries.items():
            assert e.node in nodes, "entry hangs off a missing node"
            assert key in rows["edata"], "entry without its record"
            parts = {dns: len(rows["drafts"][draft_key(key, dns)]) for dns in e.drafters}
            assert parts == e.drafters, "drafter part sizes"
            assert e.entry_bytes == len(rows["edata"][key]) + sum(parts.values())
        for key, node in nodes.items():
            assert node.refs == expected.refs[key] > 0, "node reference count"
            assert node.tails == expected.tails[key], "node tail counts"
        assert set(rows["lru"]) == expected.lru, "LRU rows"
        assert totals is not None or not entries, "totals missing"
        if totals is not None:
            assert totals == expected.totals, "totals"
        for ns, raw in rows["nsinfo"].items():
            info = decode_typed("nsinfo", raw, ns)
            assert (info.bytes, info.entries) == (expected.ns_bytes.get(ns, 0), expected.ns_entries.get(ns, 0)), \
                "ns counters"
        return {"bytes": expected.totals.bytes, "entries": len(entries), "chunks": len(rows["chunks"]),
                "nodes": len(nodes), "drafts": len(rows["drafts"])}

    return check

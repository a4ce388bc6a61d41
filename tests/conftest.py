"""Shared pytest fixtures: temporary store directories and stores that are always closed."""

from __future__ import annotations

import pytest


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
    from spec_cache.store.index import TOTALS_KEY, draft_key, unpack
    from spec_cache.store.keys import lru_key

    def check(store) -> dict:
        dbs = store.env.dbs
        with store.env.read() as txn:
            rows = {name: {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs[name])}
                    for name in ("nsinfo", "nodes", "chunks", "entries", "edata", "drafts", "lru")}
            totals = unpack(txn.get(TOTALS_KEY, db=dbs["meta"])) or {"bytes": 0, "entries": 0}
        nodes = {k: unpack(v) for k, v in rows["nodes"].items()}
        entries = {k: unpack(v) for k, v in rows["entries"].items()}
        refs = {k: 0 for k in nodes}
        tails: dict[bytes, dict[str, int]] = {k: {} for k in nodes}
        ns_bytes: dict[bytes, int] = {}
        ns_entries: dict[bytes, int] = {}
        for key, node in nodes.items():
            if node["depth"] > 0:
                assert node["parent"] in nodes, "node without its parent"
                refs[node["parent"]] += 1
                assert key in rows["chunks"] or node.get("broken"), "chunk record missing"
                if key in rows["chunks"]:
                    assert node["bytes"] == len(rows["chunks"][key])
                ns_bytes[node["ns"]] = ns_bytes.get(node["ns"], 0) + node["bytes"]
        assert set(rows["chunks"]) <= set(nodes), "chunk record without a node"
        lru = set()
        for key, e in entries.items():
            assert e["node"] in nodes, "entry hangs off a missing node"
            refs[e["node"]] += 1
            t = str(e["tail"])
            tails[e["node"]][t] = tails[e["node"]].get(t, 0) + 1
            assert key in rows["edata"], "entry without its record"
            parts = {dns: len(rows["drafts"][draft_key(key, dns)]) for dns in e["drafters"]}
            assert parts == e["drafters"], "drafter part sizes"
            assert e["bytes"] == len(rows["edata"][key]) + sum(parts.values())
            ns_bytes[e["ns"]] = ns_bytes.get(e["ns"], 0) + e["bytes"]
            ns_entries[e["ns"]] = ns_entries.get(e["ns"], 0) + 1
            lru.add(lru_key(e["last_use"], key))
        for key, node in nodes.items():
            assert node["refs"] == refs[key] > 0, "node reference count"
            assert node["tails"] == tails[key], "node tail counts"
        assert set(rows["lru"]) == lru, "LRU rows"
        assert totals["entries"] == len(entries)
        assert totals["bytes"] == sum(ns_bytes.values())
        for ns, raw in rows["nsinfo"].items():
            info = unpack(raw)
            assert info["bytes"] == ns_bytes.get(ns, 0) and info["entries"] == ns_entries.get(ns, 0), "ns counters"
        return {"bytes": totals["bytes"], "entries": len(entries), "chunks": len(rows["chunks"]),
                "nodes": len(nodes), "drafts": len(rows["drafts"])}

    return check

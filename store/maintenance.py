"""Operator work on a store: listing, statistics, eviction, garbage collection and verification.

These functions take a ``Store`` and only use its environment and index helpers, so the CLI stays a thin
layer and a library user can call the same things.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from schemas import SCHEMAS

from .codec import CorruptRecord, decode_record
from .index import Index, TOTALS_KEY, draft_key, unpack
from .store import Store

Progress = Callable[[int, int], None]


def _hex(b: bytes) -> str:
    return bytes(b).hex()


def namespaces(store: Store) -> list[dict]:
    """Every namespace with its counters, most recently used first."""
    out = []
    with store.env.read() as txn:
        for key, raw in txn.cursor(db=store.env.dbs["nsinfo"]):
            info = unpack(raw)
            out.append({"key": _hex(key), "target": info["target"], "prefix_namespace": info["prefix"],
                        "tenant": info["tenant"], "entries": info["entries"], "bytes": info["bytes"],
                        "hits": info["hits"], "misses": info["misses"], "last_use_ns": info["last_use"],
                        "created_ns": info["created"]})
    out.sort(key=lambda d: d["last_use_ns"] or 0, reverse=True)
    return out


def resolve_namespace(store: Store, prefix: str) -> bytes:
    """A namespace key from its hex (or a unique hex prefix of at least 4 characters)."""
    prefix = prefix.lower()
    matches = [bytes.fromhex(n["key"]) for n in namespaces(store) if n["key"].startswith(prefix)]
    if len(prefix) < 4 or not matches:
        raise KeyError(f"no namespace matches {prefix!r}")
    if len(matches) > 1:
        raise KeyError(f"namespace prefix {prefix!r} is ambiguous ({len(matches)} matches)")
    return matches[0]


def entries(store: Store, ns_key: bytes | None = None) -> list[dict]:
    """Entries (exact-boundary checkpoints), optionally of one namespace, most recently used first."""
    out = []
    with store.env.read() as txn:
        for key, raw in txn.cursor(db=store.env.dbs["entries"]):
            e = unpack(raw)
            if ns_key is not None and e["ns"] != ns_key:
                continue
            out.append({"key": _hex(key), "namespace": _hex(e["ns"]), "tokens": e["len"], "bytes": e["bytes"],
                        "drafters": sorted(e["drafters"]), "pinned": e["pinned"], "last_use_ns": e["last_use"],
                        "minimum_reusable": e["minr"]})
    out.sort(key=lambda d: d["last_use_ns"], reverse=True)
    return out


def stats(store: Store) -> dict:
    """Store-wide figures: bytes, entries, chunks, map and file sizes, format, budget."""
    with store.env.read() as txn:
        totals = unpack(txn.get(TOTALS_KEY, db=store.env.dbs["meta"])) or {"bytes": 0, "entries": 0}
        counts = {name: txn.stat(store.env.dbs[name])["entries"] for name in ("chunks", "nodes", "drafts")}
    info = store.env.env.info()
    data_file = os.path.join(store.path, "data.mdb")
    ns = namespaces(store)
    return {"path": store.path, "format": f"{store.env.meta['format']} {store.env.meta['major']}.{store.env.meta['minor']}",
            "chunk_tokens": store.chunk_tokens, "bytes": totals["bytes"], "entries": totals["entries"],
            "chunks": counts["chunks"], "drafter_parts": counts["drafts"], "namespaces": len(ns),
            "hits": sum(n["hits"] for n in ns), "misses": sum(n["misses"] for n in ns),
            "max_bytes": store.max_bytes, "map_size": info["map_size"],
            "file_bytes": os.path.getsize(data_file) if os.path.exists(data_file) else 0}


@dataclass
class EvictReport:
    entries: int = 0
    drafter_parts: int = 0
    bytes: int = 0


def evict(store: Store, *, namespace: bytes | None = None, drafter: str | None = None,
          older_than_s: float | None = None, to_size: int | None = None, everything: bool = False) -> EvictReport:
    """Remove entries (or drafter parts) in one transaction.

    ``namespace``: every entry of that namespace key. ``drafter``: that drafter's parts only, from the
    entries the other filters select (target state stays). ``older_than_s``: unpinned entries not used for
    that many seconds. ``to_size``: unpinned LRU entries until the store holds at most that many bytes.
    ``everything``: all entries, pinned too. Filters combine (an entry must match all given ones), except
    ``to_size`` which runs last.
    """
    store.flush()
    report = EvictReport()
    cutoff = None if older_than_s is None else time.time_ns() - int(older_than_s * 1e9)

    def fn(txn):
        report.entries = report.drafter_parts = report.bytes = 0  # the write may be retried after map growth
        ix = Index(txn, store.env.dbs)
        before = ix.totals()["bytes"]
        if everything or namespace is not None or cutoff is not None or drafter is not None:
            victims = []
            for key, raw in txn.cursor(db=store.env.dbs["entries"]):
                e = unpack(raw)
                if namespace is not None and e["ns"] != namespace:
                    continue
                if cutoff is not None and (e["pinned"] or e["last_use"] >= cutoff):
                    continue
                if drafter is not None and drafter not in e["drafters"]:
                    continue
                victims.append((bytes(key), e))
            for key, e in victims:
                if drafter is not None:
                    ix.drop_drafter(key, e, drafter)
                    report.drafter_parts += 1
                else:
                    ix.delete_entry(key, e)
                    report.entries += 1
        if to_size is not None:
            while ix.totals()["bytes"] > to_size:
                victim = next(ix.lru_victims(set()), None)
                if victim is None:
                    break
                ix.delete_entry(*victim)
                report.entries += 1
        report.bytes = before - ix.totals()["bytes"]
    store.env.write(fn)
    return report


@dataclass
class VerifyReport:
    records: int = 0
    ok: int = 0
    corrupt: int = 0
    unknown_schema: int = 0
    corrupt_keys: list = field(default_factory=list)
    unknown_schemas: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"records": self.records, "ok": self.ok, "corrupt": self.corrupt,
                "unknown_schema": self.unknown_schema, "corrupt_keys": self.corrupt_keys,
                "unknown_schemas": self.unknown_schemas}


RECORD_DBS = ("chunks", "edata", "drafts")


def verify(store: Store, progress: Progress | None = None) -> VerifyReport:
    """Recompute every record's checksum and structure; count corrupt ones and unknown drafter schemas."""
    report = VerifyReport()
    with store.env.read() as txn:
        total = sum(txn.stat(store.env.dbs[db])["entries"] for db in RECORD_DBS)
        if progress:
            progress(0, total)
        for db in RECORD_DBS:
            for key, raw in txn.cursor(db=store.env.dbs[db]):
                report.records += 1
                try:
                    rec = decode_record(raw)
                except CorruptRecord as exc:
                    report.corrupt += 1
                    report.corrupt_keys.append({"db": db, "key": _hex(key), "error": str(exc)})
                else:
                    if db == "drafts" and rec.schema not in SCHEMAS:
                        report.unknown_schema += 1
                        report.unknown_schemas[rec.schema] = report.unknown_schemas.get(rec.schema, 0) + 1
                    else:
                        report.ok += 1
                if progress:
                    progress(report.records, total)
    return report


@dataclass
class GcReport:
    corrupt_removed: int = 0
    broken_subtrees: int = 0
    orphans_removed: int = 0
    bytes: int = 0


def gc(store: Store, progress: Progress | None = None) -> GcReport:
    """Drop corrupt records (and what depends on them), broken chunk subtrees and orphan records."""
    store.flush()
    report = GcReport()
    with store.env.read() as txn:
        start_bytes = (unpack(txn.get(TOTALS_KEY, db=store.env.dbs["meta"])) or {"bytes": 0})["bytes"]
    bad = verify(store, progress)
    for row in bad.corrupt_keys:
        store._drop_corrupt(bytes.fromhex(row["key"]))
        report.corrupt_removed += 1

    def fn(txn):
        report.broken_subtrees = report.orphans_removed = report.bytes = 0  # the write may be retried
        ix = Index(txn, store.env.dbs)
        nodes = {bytes(k): unpack(v) for k, v in txn.cursor(db=store.env.dbs["nodes"])}
        broken = {k for k, n in nodes.items() if n.get("broken")}

        def under_broken(key):
            seen = 0
            while key is not None and seen < 1 << 20:
                if key in broken:
                    return True
                node = nodes.get(key)
                key = node["parent"] if node else None
                seen += 1
            return False
        report.broken_subtrees = len(broken)
        for key, raw in list(txn.cursor(db=store.env.dbs["entries"])):
            e = unpack(raw)
            if e["node"] not in nodes or under_broken(e["node"]):
                ix.delete_entry(bytes(key), e)
        live = {"edata": set(), "drafts": set()}  # records some entry refers to
        for key, raw in txn.cursor(db=store.env.dbs["entries"]):
            live["edata"].add(bytes(key))
            live["drafts"].update(draft_key(bytes(key), dns) for dns in unpack(raw)["drafters"])
        for db in ("edata", "drafts"):
            for key, _ in list(txn.cursor(db=store.env.dbs[db])):
                if bytes(key) not in live[db]:
                    ix.delete(db, bytes(key))
                    report.orphans_removed += 1
        live_nodes = {bytes(k) for k, _ in txn.cursor(db=store.env.dbs["nodes"])}
        for key, _ in list(txn.cursor(db=store.env.dbs["chunks"])):
            if bytes(key) not in live_nodes:
                ix.delete("chunks", bytes(key))
                report.orphans_removed += 1
        report.bytes = start_bytes - ix.totals()["bytes"]
    store.env.write(fn)
    return report

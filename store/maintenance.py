"""Operator work on a store: listing, statistics, eviction; verification (``verify.py``), garbage
collection (``gc.py``), compaction (``compact.py``) and salvage of a damaged store (``repair.py``) are
re-exported here: this module is the operators' sub-API of ``spec_cache.store``.

These functions take a ``Store`` and only use its environment and index helpers, so the CLI stays a thin
layer and a library user can call the same things.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from .compact import CompactReport, compact
from .errors import CorruptIndex, StoreFullError
from .eviction import lru_victims, operator_selection
from .gc import GcReport, gc
from .index import Index
from .pieces import PIECE_ROW_PREFIX, is_piece_row
from .repair import RepairReport, repair
from .store import Store
from .tenants import DEFAULT_TENANT
from .tenants import usage as tenant_usage
from .values import Entry, decode_typed
from .verify import RECORD_DBS, Progress, VerifyReport, index_problems, verify

__all__ = ["namespaces", "tenants", "resolve_namespace", "resolve_entries", "set_pinned", "drafter_namespaces",
           "entries", "stats", "evict", "EvictReport", "verify", "VerifyReport", "index_problems", "gc", "GcReport",
           "RECORD_DBS", "Progress", "compact", "CompactReport", "repair", "RepairReport"]


def _hex(b: bytes) -> str:
    return bytes(b).hex()


def namespaces(store: Store) -> list[dict]:
    """Every namespace with its counters, most recently used first."""
    out = []
    with store.reading() as txn:
        for key, raw in txn.cursor(db=store.env.dbs["nsinfo"]):
            info = decode_typed("nsinfo", raw, bytes(key))
            out.append({"key": _hex(key), "target": info.target, "prefix_namespace": info.prefix_namespace,
                        "tenant": info.tenant, "tenant_id": _tenant_hex(info.tenant_id or DEFAULT_TENANT),
                        "entries": info.entries, "bytes": info.bytes, "hits": info.hits,
                        "misses": info.misses, "last_use_ns": info.last_use, "created_ns": info.created})
    out.sort(key=lambda d: d["last_use_ns"] or 0, reverse=True)
    return out


def _check_key_prefix(prefix: str, what: str) -> str:
    """``prefix`` lowercased, or ``KeyError`` naming what is wrong with it (not hex, too short, too long)."""
    text = prefix.strip().lower()
    if not text or any(c not in "0123456789abcdef" for c in text):
        raise KeyError(f"{what} {prefix!r} is not hexadecimal (a key, or a prefix of >= 4 hex digits, as 'ls' and "
                       "'show' print it)")
    if len(text) < 4:
        raise KeyError(f"{what} prefix {prefix!r} is too short: give at least 4 hex digits")
    if len(text) > 64:
        raise KeyError(f"{what} {prefix!r} is longer than a key (64 hex digits)")
    return text


def resolve_namespace(store: Store, prefix: str) -> bytes:
    """A namespace key from its hex (or a unique hex prefix of at least 4 characters); ``KeyError`` naming the
    prefix and what is wrong with it otherwise."""
    text = _check_key_prefix(prefix, "namespace")
    matches = [bytes.fromhex(n["key"]) for n in namespaces(store) if n["key"].startswith(text)]
    if not matches:
        raise KeyError(f"no namespace key starts with {text!r} (see 'spec-cache ls')")
    if len(matches) > 1:
        raise KeyError(f"namespace prefix {text!r} is ambiguous ({len(matches)} matches)")
    return matches[0]


def resolve_entries(store: Store, prefix: str) -> list[bytes]:
    """Entry keys for ``prefix``: the entry whose key starts with it (``show``'s ENTRY column), or every entry
    of the namespace it names; ``KeyError`` naming the prefix when it matches neither or is ambiguous."""
    text = _check_key_prefix(prefix, "entry or namespace")
    rows = entries(store)
    by_entry = [bytes.fromhex(r["key"]) for r in rows if r["key"].startswith(text)]
    by_ns = sorted({r["namespace"] for r in rows if r["namespace"].startswith(text)})
    if len(by_entry) == 1 and not by_ns:
        return by_entry
    if len(by_ns) == 1 and not by_entry:
        return [bytes.fromhex(r["key"]) for r in rows if r["namespace"] == by_ns[0]]
    if not by_entry and not by_ns:
        raise KeyError(f"no entry or namespace key starts with {text!r} (see 'spec-cache ls' and 'show')")
    raise KeyError(f"prefix {text!r} is ambiguous ({len(by_entry)} entries, {len(by_ns)} namespaces match)")


def set_pinned(store: Store, keys: list[bytes], pinned: bool) -> int:
    """Pin (or unpin) entries by key in one transaction; returns how many changed. A pinned entry is never
    evicted by the byte budget, ``evict --to-size`` or ``--older-than`` (only ``evict --all`` / ``--namespace``)."""
    store.flush_best_effort()

    def fn(txn) -> int:
        index, changed = Index(txn, store.env.dbs), 0
        for key in keys:
            entry = index.entry(key)
            if entry is not None and entry.pinned != pinned:
                changed += index.set_pinned(key, pinned)
        return changed
    return store.env.write(fn, making_room=not pinned)


def drafter_namespaces(store: Store) -> set[str]:
    """Every drafter namespace that has a part stored with some entry."""
    found = set()
    with store.reading() as txn:
        for key, raw in txn.cursor(db=store.env.dbs["entries"]):
            try:
                found.update(decode_typed("entries", raw, bytes(key)).drafters)
            except CorruptIndex:  # a damaged entry is gc's to remove
                continue
    return found


def entries(store: Store, ns_key: bytes | None = None) -> list[dict]:
    """Entries (exact-boundary checkpoints), optionally of one namespace, most recently used first."""
    out = []
    with store.reading() as txn:
        for key, raw in txn.cursor(db=store.env.dbs["entries"]):
            e = decode_typed("entries", raw, bytes(key))
            if ns_key is not None and e.namespace != ns_key:
                continue
            out.append({"key": _hex(key), "namespace": _hex(e.namespace), "tokens": e.length,
                        "bytes": e.entry_bytes, "drafters": sorted(e.drafters), "pinned": e.pinned,
                        "last_use_ns": e.last_use, "minimum_reusable": e.minimum_reusable})
    out.sort(key=lambda d: d["last_use_ns"], reverse=True)
    return out


def _tenant_hex(label: bytes) -> str:
    """How listings name a tenant label: its hex, or ``default`` for namespaces without one."""
    return bytes(label).hex() if label else "default"


def tenants(store: Store) -> list[dict]:
    """Bytes, entries and namespaces per tenant label (``default``: namespaces registered without a tenant
    label, every namespace of a 1.0 store), most bytes first; with the quota each tenant is held to."""
    with store.reading() as txn:
        use = tenant_usage(Index(txn, store.env.dbs))
    counted: dict[bytes, int] = {}
    for n in namespaces(store):
        label = bytes.fromhex(n["tenant_id"]) if n["tenant_id"] != "default" else DEFAULT_TENANT
        counted[label] = counted.get(label, 0) + 1
    quota = store.tenants.quota(store.max_bytes)
    rows = [{"tenant": _tenant_hex(t), "bytes": n, "entries": use.entries[t], "namespaces": counted.get(t, 0),
             "quota_bytes": quota} for t, n in use.bytes.items()]
    rows.sort(key=lambda r: (-r["bytes"], r["tenant"]))
    return rows


def count_pieces(txn, dbs) -> int:
    """Shared pieces: their ``meta`` rows (drafter pieces, format 1.2, and target pieces, format 1.3; both sit in
    ``drafts``; ``stats`` still calls the count ``drafter_pieces``)."""
    cursor = txn.cursor(db=dbs["meta"])
    more, n = cursor.set_range(PIECE_ROW_PREFIX), 0
    while more and is_piece_row(cursor.key()):
        n += 1
        more = cursor.next()
    return n


def stats(store: Store) -> dict:
    """Store-wide figures: bytes, entries, chunks, map and file sizes, format, budget, bytes per tenant."""
    with store.reading() as txn:
        index = Index(txn, store.env.dbs)
        totals = index.totals()
        minor = max(index.format_minor(), int(store.env.meta.get("minor", 0) or 0))
        counts = {name: txn.stat(store.env.dbs[name])["entries"] for name in ("chunks", "nodes", "drafts")}
        pieces = count_pieces(txn, store.env.dbs)  # shared pieces (formats 1.2, 1.3) sit in ``drafts`` too
    info = store.env.env.info()
    data_file = os.path.join(store.path, "data.mdb")
    ns = namespaces(store)
    meta = store.env.meta
    return {"path": store.path, "format": f"{meta['format']} {meta['major']}.{minor}",
            "chunk_tokens": store.chunk_tokens, "bytes": totals.bytes, "entries": totals.entries,
            "chunks": counts["chunks"], "drafter_parts": counts["drafts"] - pieces,
            "drafter_pieces": pieces, "namespaces": len(ns),
            "hits": sum(n["hits"] for n in ns), "misses": sum(n["misses"] for n in ns),
            "max_bytes": store.max_bytes if store.max_bytes is not None else store.env.budget(),
            "map_size": info["map_size"],
            "file_bytes": os.path.getsize(data_file) if os.path.exists(data_file) else 0,
            "tenants": tenants(store)}


@dataclass
class EvictReport:
    entries: int = 0
    drafter_parts: int = 0
    bytes: int = 0


def evict(store: Store, *, namespace: bytes | None = None, drafter: str | None = None,
          older_than_s: float | None = None, to_size: int | None = None, everything: bool = False) -> EvictReport:
    """Remove entries (or drafter parts), in one transaction when the store has room for it.

    ``namespace``: every entry of that namespace key. ``drafter``: that drafter's parts only, from the
    entries the other filters select (target state stays). ``older_than_s``: unpinned entries not used for
    that many seconds. ``to_size``: unpinned LRU entries until the store holds at most that many bytes.
    ``everything``: all entries, pinned too. Filters combine (an entry must match all given ones), except
    ``to_size`` which runs last. Which entries match and which go first: ``eviction.py`` (its table's operator
    row); this function owns only the transactions.

    On a full store (disk or map) one big transaction may not find the pages its own copy-on-write needs;
    then the removal goes on in small transactions, each freeing pages for the next (``StoreFullError`` only
    if not even one entry can be removed).
    """
    store.flush_best_effort()
    cutoff = None if older_than_s is None else time.time_ns() - int(older_than_s * 1e9)
    filtered = everything or namespace is not None or cutoff is not None or drafter is not None
    selected = operator_selection(namespace=namespace, drafter=drafter, cutoff_ns=cutoff)

    def step(txn, limit: int | None) -> tuple[EvictReport, bool]:
        return _evict_step(Index(txn, store.env.dbs), selected if filtered else None, drafter, to_size, limit)

    try:
        return store.env.write(lambda txn: step(txn, None), making_room=True)[0]
    except StoreFullError:
        pass
    report, batch = EvictReport(), 64
    while True:
        try:
            counts, finished = store.env.write(lambda txn: step(txn, batch), making_room=True)
        except StoreFullError:
            if batch == 1:
                raise
            batch = 1
            continue
        report.entries += counts.entries
        report.drafter_parts += counts.drafter_parts
        report.bytes += counts.bytes
        if finished:
            return report


def _evict_step(index: Index, selected: Callable[[Entry], bool] | None, drafter: str | None, to_size: int | None,
                limit: int | None) -> tuple[EvictReport, bool]:
    """One transaction of ``evict``: at most ``limit`` removals; returns what it did and whether it finished."""
    counts = EvictReport()
    before = index.totals().bytes
    done = 0
    if selected is not None:
        victims = []
        for key, e in index.entries():
            if selected(e):
                victims.append((key, e))
        for key, e in victims:
            if limit is not None and done >= limit:
                counts.bytes = before - index.totals().bytes
                return counts, False
            if drafter is not None:
                index.drop_drafter(key, e, drafter)
                counts.drafter_parts += 1
            else:  # the entry's drafter parts go with it, and are counted
                counts.drafter_parts += len(e.drafters)
                index.remove_entry(key, e)
                counts.entries += 1
            done += 1
    finished = True
    if to_size is not None:
        while index.totals().bytes > to_size:
            if limit is not None and done >= limit:
                finished = False
                break
            victim = next(lru_victims(index), None)  # pinned entries stay (eviction.py)
            if victim is None:
                break
            _, key, entry = victim
            counts.drafter_parts += len(entry.drafters)
            index.remove_entry(key, entry)
            counts.entries += 1
            done += 1
    counts.bytes = before - index.totals().bytes
    return counts, finished

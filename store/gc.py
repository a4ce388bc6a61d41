"""``gc``: remove what is damaged and rebuild the bookkeeping from what is left.

Corrupt records and damaged index values go with everything that depends on them (broken chunk subtrees,
entries without their record), orphan records go, and references, tail counts, byte and entry counters,
namespace signatures and LRU rows are recomputed — all in one write transaction. A namespace whose own row
was damaged keeps its entries: the row is rebuilt and learns again what it stands for at the next
``register_namespace``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .codec import CorruptRecord, check_key, decode_record
from .errors import CorruptIndex, StoreError
from .index import TOTALS_KEY, decode, draft_key
from .index import pack as pack_value
from .keys import lru_key
from .store import Store
from .verify import RECORD_DBS, Progress, verify


@dataclass
class GcReport:
    corrupt_removed: int = 0
    broken_subtrees: int = 0
    orphans_removed: int = 0
    bytes: int = 0
    index_rows_removed: int = 0
    namespaces_rebuilt: int = 0
    entries_removed: int = 0
    counters_fixed: int = 0


def gc(store: Store, progress: Progress | None = None) -> GcReport:
    """Drop corrupt records and damaged index values with everything that depends on them (broken chunk
    subtrees, entries without their record), then orphan records, and rebuild the bookkeeping (references,
    tails, byte and entry counters, namespace signatures, LRU rows) from what is left. One write transaction:
    afterwards ``verify`` finds nothing, whatever the damage was, as long as LMDB can read its own pages.
    """
    try:
        store.flush()
    except StoreError:  # batched access times of damaged entries: not worth keeping
        store._touched, store._counts, store._pending = {}, {}, 0
    bad = verify(store, progress, index=False)
    if bad.structure_problems:
        raise StoreError(f"store at {store.path}: LMDB's page structure is damaged ({bad.structure_problems[0]}; "
                         f"{len(bad.structure_problems)} problems); gc cannot fix that: run 'spec-cache repair'")
    corrupt = [(row["db"], bytes.fromhex(row["key"])) for row in bad.corrupt_keys]
    report = GcReport()
    store.env.write(lambda txn: _rebuild(store, txn, corrupt, report), making_room=True)
    return report


def _rebuild(store: Store, txn, corrupt: list[tuple[str, bytes]], report: GcReport) -> None:
    """The body of ``gc``'s transaction (it may run again after map growth: it starts from scratch)."""
    for name in report.__dataclass_fields__:
        setattr(report, name, 0)
    dbs = store.env.dbs
    C = store.chunk_tokens

    def rows(name):
        return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs[name])]

    doomed: dict[str, set[bytes]] = {}

    def drop(db, key):  # deleted at the end through a cursor: a key whose leaf is out of order still goes
        doomed.setdefault(db, set()).add(key)

    try:
        totals = decode("meta", txn.get(TOTALS_KEY, db=dbs["meta"]), TOTALS_KEY) or {"bytes": 0, "entries": 0}
    except CorruptIndex:
        totals = {"bytes": 0, "entries": 0}
    start_bytes = totals["bytes"]
    values: dict[str, dict] = {}
    rebuilt: set[bytes] = set()
    for name in ("nsinfo", "nodes", "entries"):
        values[name] = {}
        for key, raw in rows(name):
            try:
                values[name][key] = decode(name, raw, key)
            except CorruptIndex:
                report.index_rows_removed += 1
                if name == "nsinfo" and len(key) == 32:  # keep the namespace: its entries are fine
                    values[name][key] = _placeholder_nsinfo()
                    rebuilt.add(key)
                else:
                    drop(name, key)
    nsinfo, nodes, entries = values["nsinfo"], values["nodes"], values["entries"]
    for node in nodes.values():  # a namespace row lost entirely (its key damaged): rebuild it as well
        if node["depth"] == 0 and node["ns"] not in nsinfo:
            nsinfo[node["ns"]] = _placeholder_nsinfo()
            rebuilt.add(node["ns"])
    report.namespaces_rebuilt = len(rebuilt)

    # corrupt records: only those still corrupt now (a writer may have replaced one since verify read it)
    sizes = {name: {bytes(k): len(v) for k, v in txn.cursor(db=dbs[name])} for name in RECORD_DBS}
    for db, key in corrupt:
        raw = txn.get(key, db=dbs[db])
        if raw is not None:
            try:
                check_key(decode_record(raw), key, db)
                continue
            except CorruptRecord:
                pass
        elif key not in sizes[db]:
            continue
        drop(db, key)
        sizes[db].pop(key, None)
        report.corrupt_removed += 1
    referenced = {"chunks": set(nodes), "edata": set(entries),
                  "drafts": {draft_key(k, d) for k, e in entries.items() for d in e["drafters"]}}

    # nodes that still stand: registered namespace, parent standing one level up, chunk record present
    standing: set[bytes] = set()
    for key in sorted(nodes, key=lambda k: nodes[k]["depth"]):
        node = nodes[key]
        if node["depth"] == 0:
            ok = True
        else:
            parent = nodes.get(node["parent"])
            whole = key in sizes["chunks"] and not node.get("broken")
            if not whole:
                report.broken_subtrees += 1
            ok = (whole and node["parent"] in standing and parent["depth"] == node["depth"] - 1
                  and parent["ns"] == node["ns"])
        if ok and node["ns"] in nsinfo:
            standing.add(key)

    # entries that still stand: their node stands, their record is there, their length adds up
    kept: dict[bytes, dict] = {}
    for key, e in entries.items():
        node = nodes.get(e["node"])
        if (e["node"] in standing and key in sizes["edata"] and node["ns"] == e["ns"]
                and node["depth"] * C + e["tail"] == e["len"] and (node["depth"] == 0 or e["tail"] < C)):
            parts = {d: sizes["drafts"][draft_key(key, d)] for d in e["drafters"]
                     if draft_key(key, d) in sizes["drafts"]}
            fixed = dict(e, drafters=parts, bytes=sizes["edata"][key] + sum(parts.values()))
            if fixed != e:
                report.counters_fixed += 1
            kept[key] = fixed
        else:
            report.entries_removed += 1

    # references from the leaves up; nodes nothing hangs off any more go
    refs = dict.fromkeys(standing, 0)
    tails: dict[bytes, dict[str, int]] = {k: {} for k in standing}
    for e in kept.values():
        refs[e["node"]] += 1
        t = str(e["tail"])
        tails[e["node"]][t] = tails[e["node"]].get(t, 0) + 1
    live_nodes: set[bytes] = set()
    for key in sorted(standing, key=lambda k: nodes[k]["depth"], reverse=True):
        if refs[key] > 0:
            live_nodes.add(key)
            if nodes[key]["depth"] > 0:
                refs[nodes[key]["parent"]] += 1

    # write back: nodes, entries, LRU, namespaces, totals; delete what no longer stands
    ns_bytes: dict[bytes, int] = {}
    ns_entries: dict[bytes, int] = {}
    ns_sigs: dict[bytes, list[bytes]] = {}
    for key, node in nodes.items():
        if key not in live_nodes:
            drop("nodes", key)
            continue
        nbytes = sizes["chunks"][key] if node["depth"] > 0 else 0
        fixed = dict(node, refs=refs[key], tails=tails[key], bytes=nbytes)
        fixed.pop("broken", None)
        if fixed != node:
            txn.put(key, pack_value(fixed), db=dbs["nodes"])
            report.counters_fixed += 1
        ns_bytes[node["ns"]] = ns_bytes.get(node["ns"], 0) + nbytes
        if node["depth"] == 0:
            ns_sigs.setdefault(node["ns"], []).append(node.get("sig", b""))
    want_lru = set()
    for key, e in entries.items():
        if key not in kept:
            drop("entries", key)
            continue
        fixed = kept[key]
        if fixed != e:
            txn.put(key, pack_value(fixed), db=dbs["entries"])
        ns_bytes[e["ns"]] = ns_bytes.get(e["ns"], 0) + fixed["bytes"]
        ns_entries[e["ns"]] = ns_entries.get(e["ns"], 0) + 1
        want_lru.add(lru_key(fixed["last_use"], key))
    have_lru = {bytes(k) for k, _ in txn.cursor(db=dbs["lru"])}
    for key in have_lru - want_lru:
        drop("lru", key)
    for key in want_lru - have_lru:
        txn.put(key, b"", db=dbs["lru"])
        report.counters_fixed += 1
    for ns, info in nsinfo.items():
        sigs = [s for s in info["sigs"] if s in ns_sigs.get(ns, [])]
        sigs += [s for s in ns_sigs.get(ns, []) if s not in sigs]
        fixed = dict(info, bytes=ns_bytes.get(ns, 0), entries=ns_entries.get(ns, 0), sigs=sigs)
        if fixed != info or ns in rebuilt:
            txn.put(ns, pack_value(fixed), db=dbs["nsinfo"])
            report.counters_fixed += 1
    new_totals = {"bytes": sum(ns_bytes.values()), "entries": len(kept)}
    if new_totals != totals:
        txn.put(TOTALS_KEY, pack_value(new_totals), db=dbs["meta"])

    # records nothing refers to any more; those nothing referred to before this gc are orphans
    live = {"chunks": {k for k in live_nodes if nodes[k]["depth"] > 0}, "edata": set(kept),
            "drafts": {draft_key(k, d) for k, e in kept.items() for d in e["drafters"]}}
    for db in RECORD_DBS:
        for key in sizes[db].keys() - live[db]:
            drop(db, key)
            if key not in referenced[db]:
                report.orphans_removed += 1
    for db, keys in doomed.items():
        _delete_rows(txn, dbs[db], keys)
    report.bytes = max(0, start_bytes - new_totals["bytes"])


def _placeholder_nsinfo() -> dict:
    """A namespace row gc rebuilds from what hangs off it; what it stood for (target, prefix namespace,
    tenant) is filled in again by the next ``register_namespace`` of that key."""
    return {"target": "", "prefix": "", "tenant": False, "created": time.time_ns(), "entries": 0, "bytes": 0,
            "hits": 0, "misses": 0, "last_use": None, "sigs": [], "rebuilt": True}


def _delete_rows(txn, db, keys: set[bytes]) -> None:
    """Delete the rows whose keys are in ``keys`` by walking a cursor over ``db`` (not by key lookup, which
    misses a row whose key was damaged out of order)."""
    cursor = txn.cursor(db=db)
    more = cursor.first()
    while more and keys:
        key = bytes(cursor.key())
        if key in keys:
            keys.discard(key)
            more = cursor.delete()
        else:
            more = cursor.next()

"""``verify``: everything that can be checked without changing anything — LMDB's page structure, every
record (checksum, structure, the key it names) and the index's bookkeeping against the records.

A crash cannot leave anything ``verify`` reports (every write is one transaction), so whatever it finds is
damage: ``gc`` repairs records and bookkeeping, ``repair`` salvages a store whose page structure is broken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from spec_cache.schemas import SCHEMAS

from .codec import CorruptRecord, check_key, decode_record
from .errors import CorruptIndex
from .index import TOTALS_KEY, decode, draft_key
from .keys import lru_key
from .store import Store
from .structure import check_structure

Progress = Callable[[int, int], None]


def _hex(b: bytes) -> str:
    return bytes(b).hex()


@dataclass
class VerifyReport:
    records: int = 0
    ok: int = 0
    corrupt: int = 0
    unknown_schema: int = 0
    corrupt_keys: list = field(default_factory=list)
    unknown_schemas: dict = field(default_factory=dict)
    index_problems: list = field(default_factory=list)
    structure_problems: list = field(default_factory=list)
    structure_checked: bool = False

    @property
    def damaged(self) -> bool:
        """Anything found that is damage (unknown drafter schemas are not)."""
        return bool(self.corrupt or self.index_problems or self.structure_problems)

    def as_dict(self) -> dict:
        return {"records": self.records, "ok": self.ok, "corrupt": self.corrupt,
                "unknown_schema": self.unknown_schema, "corrupt_keys": self.corrupt_keys,
                "unknown_schemas": self.unknown_schemas, "index_problems": len(self.index_problems),
                "index_details": self.index_problems[:20], "structure_checked": self.structure_checked,
                "structure_problems": len(self.structure_problems),
                "structure_details": self.structure_problems[:20]}


RECORD_DBS = ("chunks", "edata", "drafts")


def verify(store: Store, progress: Progress | None = None, *, index: bool = True) -> VerifyReport:
    """Check LMDB's page structure first (``structure_problems``; when it is damaged nothing else is walked:
    liblmdb may abort the process on a damaged page), then recompute every record's checksum and structure
    (and that it sits under the key it names), counting corrupt ones and unknown drafter schemas. With
    ``index``, also check the index's bookkeeping (``index_problems``): damaged index values, dangling
    references, counters that disagree with the records.
    """
    report = VerifyReport()
    found = check_structure(store.path, store.env.env)
    report.structure_checked = found is not None
    report.structure_problems = found or []
    if report.structure_problems:
        return report
    with store.env.read() as txn:
        total = sum(txn.stat(store.env.dbs[db])["entries"] for db in RECORD_DBS)
    if progress:
        progress(0, total)
    for db in RECORD_DBS:
        for key, raw in _scan(store, db):
            report.records += 1
            try:
                rec = decode_record(raw)
                check_key(rec, key, db)
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
                progress(report.records, max(total, report.records))
    if index:
        report.index_problems = index_problems(store)
    return report


SCAN_SLICE_S = 0.2


def _scan(store: Store, db: str, slice_s: float = SCAN_SLICE_S):
    """Every (key, value) of ``db`` in key order, in read transactions of at most ``slice_s`` each.

    A read transaction pins the pages of its snapshot; one held for a whole multi-GB walk would make busy
    writers grow the file by everything they write meanwhile. Each value is valid until the next item is
    asked for. If the keys ever come out of order (a damaged leaf), the walk finishes in the transaction it
    is in rather than resuming by key (which could revisit rows forever).
    """
    last: bytes | None = None
    ordered = True
    while True:
        with store.env.read() as txn:
            cursor = txn.cursor(db=store.env.dbs[db])
            more = cursor.first() if last is None else cursor.set_range(last)
            if more and last is not None and bytes(cursor.key()) == last:
                more = cursor.next()
            start = time.monotonic()
            while more:
                key = bytes(cursor.key())
                if last is not None and key <= last:
                    ordered = False
                yield key, cursor.value()
                last = key
                more = cursor.next()
                if ordered and more and time.monotonic() - start > slice_s:
                    break
            if not more:
                return


def index_problems(store: Store, limit: int = 100) -> list[str]:
    """The index's bookkeeping checked against itself and the records it describes; [] when consistent.

    Damaged values, entries without their record or node, chunks without their node, reference and tail
    counts, byte and entry counters (per namespace and in total) and LRU rows. A crash cannot leave any of
    these behind (every write is one transaction), so each one is damage; ``gc`` repairs them all.
    """
    out: list[str] = []

    def bad(msg: str) -> None:
        if len(out) < limit:
            out.append(msg)

    dbs = store.env.dbs
    with store.env.read() as txn:
        values = {}
        for name in ("nsinfo", "nodes", "entries"):
            values[name] = {}
            for k, v in txn.cursor(db=dbs[name]):
                try:
                    values[name][bytes(k)] = decode(name, v, bytes(k))
                except CorruptIndex as exc:
                    bad(str(exc))
        sizes = {name: {bytes(k): len(v) for k, v in txn.cursor(db=dbs[name])} for name in RECORD_DBS}
        lru_rows = {bytes(k) for k, _ in txn.cursor(db=dbs["lru"])}
        try:
            totals = decode("meta", txn.get(TOTALS_KEY, db=dbs["meta"]), TOTALS_KEY) or {"bytes": 0, "entries": 0}
        except CorruptIndex as exc:
            bad(str(exc))
            totals = None
    nodes, entries, nsinfo = values["nodes"], values["entries"], values["nsinfo"]
    refs = dict.fromkeys(nodes, 0)
    tails: dict[bytes, dict[str, int]] = {k: {} for k in nodes}
    ns_bytes: dict[bytes, int] = {}
    ns_entries: dict[bytes, int] = {}
    for key, node in nodes.items():
        if node["ns"] not in nsinfo:
            bad(f"node {_hex(key)[:16]}: namespace not registered")
        if node["depth"] > 0:
            if node["parent"] not in nodes:
                bad(f"node {_hex(key)[:16]}: parent missing")
            else:
                refs[node["parent"]] += 1
            size = sizes["chunks"].get(key)
            if size is None and not node.get("broken"):
                bad(f"node {_hex(key)[:16]}: chunk record missing")
            if size is not None and node["bytes"] != size:
                bad(f"node {_hex(key)[:16]}: {node['bytes']} bytes counted, record holds {size}")
            ns_bytes[node["ns"]] = ns_bytes.get(node["ns"], 0) + node["bytes"]
    for key in sizes["chunks"].keys() - nodes.keys():
        bad(f"chunk record {_hex(key)[:16]} without a node")
    lru = set()
    for key, e in entries.items():
        if e["node"] not in nodes:
            bad(f"entry {_hex(key)[:16]}: node missing")
        else:
            refs[e["node"]] += 1
            t = str(e["tail"])
            tails[e["node"]][t] = tails[e["node"]].get(t, 0) + 1
        if key not in sizes["edata"]:
            bad(f"entry {_hex(key)[:16]}: record missing")
        parts = {dns: sizes["drafts"].get(draft_key(key, dns)) for dns in e["drafters"]}
        if parts != e["drafters"]:
            bad(f"entry {_hex(key)[:16]}: drafter parts disagree with their records")
        if e["bytes"] != sizes["edata"].get(key, 0) + sum(p or 0 for p in parts.values()):
            bad(f"entry {_hex(key)[:16]}: byte count")
        ns_bytes[e["ns"]] = ns_bytes.get(e["ns"], 0) + e["bytes"]
        ns_entries[e["ns"]] = ns_entries.get(e["ns"], 0) + 1
        lru.add(lru_key(e["last_use"], key))
    listed = {draft_key(k, d) for k, e in entries.items() for d in e["drafters"]}
    for name, live in (("edata", entries.keys()), ("drafts", listed)):
        extra = len(sizes[name].keys() - live)
        if extra:
            bad(f"{extra} {name} records no entry refers to")
    for key, node in nodes.items():
        if node["refs"] != refs[key] or refs[key] <= 0:
            bad(f"node {_hex(key)[:16]}: {node['refs']} references recorded, {refs[key]} found")
        if node["tails"] != tails[key]:
            bad(f"node {_hex(key)[:16]}: tail counts disagree with its entries")
    if lru_rows != lru:
        bad(f"LRU rows disagree with the entries ({len(lru_rows)} rows, {len(lru)} entries)")
    if totals is not None and (totals["entries"], totals["bytes"]) != (len(entries), sum(ns_bytes.values())):
        bad(f"totals say {totals['entries']} entries / {totals['bytes']} bytes, the index holds "
            f"{len(entries)} / {sum(ns_bytes.values())}")
    roots: dict[bytes, set[bytes]] = {}
    for node in nodes.values():
        if node["depth"] == 0:
            roots.setdefault(node["ns"], set()).add(node.get("sig", b""))
    for ns, info in nsinfo.items():
        if (info["bytes"], info["entries"]) != (ns_bytes.get(ns, 0), ns_entries.get(ns, 0)):
            bad(f"namespace {_hex(ns)[:16]}: counters disagree with its entries")
        if set(info["sigs"]) != roots.get(ns, set()):  # lookups start from these: a wrong one hides chains
            bad(f"namespace {_hex(ns)[:16]}: layer signatures disagree with its chain roots")
    return out



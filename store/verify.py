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

from . import continuations
from .codec import CorruptRecord, check_key, decode_record
from .errors import CorruptIndex
from .index import Bookkeeping, draft_key, entry_pieces, expected_bookkeeping, piece_row_ok
from .pieces import PIECE_ROW_PREFIX, is_piece_row
from .spans import entry_spans, node_spans
from .store import Store
from .structure import check_structure
from .tenants import tenant_problems
from .values import TOTALS_KEY, Entry, NamespaceInfo, Node, Totals, decode, decode_typed

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
                report.corrupt_keys.append({"db": db, "what": record_kind(db, key), "key": _hex(key),
                                            "error": str(exc)})
            else:
                if db == "drafts" and rec.kind != "piece" and rec.schema not in SCHEMAS:
                    report.unknown_schema += 1
                    report.unknown_schemas[rec.schema] = report.unknown_schemas.get(rec.schema, 0) + 1
                else:
                    report.ok += 1
            if progress:
                progress(report.records, max(total, report.records))
    with store.env.read() as txn:  # continuation records (``continuations.py``) live in the memo sub-database
        conts = continuations.check(txn, store.env.dbs)
    report.records += conts.records
    report.ok += conts.ok + conts.newer
    report.corrupt += len(conts.corrupt)
    report.corrupt_keys += conts.corrupt
    if index:
        report.index_problems = index_problems(store) + conts.problems
    return report


#: what a record of each sub-database holds, in the words operators read (``drafts`` holds shared pieces too)
_RECORD_KINDS = {"chunks": "target chunk", "edata": "entry data", "drafts": "drafter part"}


def record_kind(db: str, key: bytes) -> str:
    """What the record under ``key`` in ``db`` is: a shared piece (32-byte key in ``drafts``: a drafter part's or,
    from format 1.3, a target tail's) is not a drafter part, whatever sub-database it shares."""
    if db == "drafts" and len(key) == 32:
        return "shared piece"
    return _RECORD_KINDS.get(db, db)


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


@dataclass
class IndexRows:
    """Every index value of a store, decoded and typed, with the sizes of the records they describe."""

    nsinfo: dict[bytes, NamespaceInfo] = field(default_factory=dict)
    nodes: dict[bytes, Node] = field(default_factory=dict)
    entries: dict[bytes, Entry] = field(default_factory=dict)
    damaged: list[tuple[str, bytes, CorruptIndex]] = field(default_factory=list)  # (db, key, error)
    sizes: dict[str, dict[bytes, int]] = field(default_factory=dict)  # record db -> key -> record size
    lru: set[bytes] = field(default_factory=set)                      # LRU row keys
    totals: Totals | None = None                                      # None: the totals value is damaged
    pieces: dict[bytes, dict] = field(default_factory=dict)           # piece key -> {ns, refs, bytes} (1.2)
    live_pieces: set[bytes] = field(default_factory=set)              # gc: the pieces it keeps


def read_index(txn, dbs) -> IndexRows:
    """All index values in one read (or write) transaction; damaged ones are listed in ``damaged``."""
    rows = IndexRows()
    for db, into in (("nsinfo", rows.nsinfo), ("nodes", rows.nodes), ("entries", rows.entries)):
        for key, raw in txn.cursor(db=dbs[db]):
            key = bytes(key)
            try:
                into[key] = decode_typed(db, raw, key)
            except CorruptIndex as exc:
                rows.damaged.append((db, key, exc))
    rows.sizes = {db: {bytes(k): len(v) for k, v in txn.cursor(db=dbs[db])} for db in RECORD_DBS}
    rows.lru = {bytes(k) for k, _ in txn.cursor(db=dbs["lru"])}
    cursor = txn.cursor(db=dbs["meta"])
    more = cursor.set_range(PIECE_ROW_PREFIX)
    while more and is_piece_row(cursor.key()):
        key = bytes(cursor.key())
        try:
            value = decode("meta", cursor.value(), key)  # a plain dict: checked below
            if not piece_row_ok(value):
                raise CorruptIndex("piece row is malformed; the store is damaged: run 'spec-cache gc'", "meta", key)
            rows.pieces[key[len(PIECE_ROW_PREFIX):]] = value
        except CorruptIndex as exc:
            rows.damaged.append(("meta", key, exc))
        more = cursor.next()
    try:
        rows.totals = decode_typed("meta", txn.get(TOTALS_KEY, db=dbs["meta"]), TOTALS_KEY) or Totals()
    except CorruptIndex as exc:
        rows.damaged.append(("meta", TOTALS_KEY, exc))
    return rows


def index_problems(store: Store, limit: int = 100) -> list[str]:
    """The index's bookkeeping checked against itself and the records it describes; [] when consistent.

    Damaged values, entries without their record or node, chunks without their node, reference and tail
    counts, byte and entry counters (per namespace and in total) and LRU rows: ``Index``'s invariants, as
    ``expected_bookkeeping`` computes them. A crash cannot leave any of these behind (every write is one
    transaction), so each one is damage; ``gc`` repairs them all.
    """
    out: list[str] = []

    def bad(msg: str) -> None:
        if len(out) < limit:
            out.append(msg)

    with store.reading() as txn:
        rows = read_index(txn, store.env.dbs)
        tenants = tenant_problems(txn, store.env.dbs, rows.nsinfo)  # per-tenant counters (format 1.1)
    for _db, _key, exc in rows.damaged:
        bad(str(exc))
    for message in tenants:
        bad(message)
    expected = expected_bookkeeping(rows.nodes, rows.entries, rows.pieces)
    _node_problems(rows, expected, bad)
    _entry_problems(rows, bad)
    _piece_problems(rows, expected, bad)
    if rows.lru != expected.lru:
        bad(f"LRU rows disagree with the entries ({len(rows.lru)} rows, {len(expected.lru)} entries)")
    if rows.totals is not None and rows.totals != expected.totals:
        bad(f"totals say {rows.totals.entries} entries / {rows.totals.bytes} bytes, the index holds "
            f"{expected.totals.entries} / {expected.totals.bytes}")
    for ns, info in rows.nsinfo.items():
        if (info.bytes, info.entries) != (expected.ns_bytes.get(ns, 0), expected.ns_entries.get(ns, 0)):
            bad(f"namespace {_hex(ns)[:16]}: counters disagree with its entries")
        if set(info.signatures) != set(expected.ns_signatures.get(ns, ())):  # lookups start from these
            bad(f"namespace {_hex(ns)[:16]}: layer signatures disagree with its chain roots")
    return out


def _node_problems(rows: IndexRows, expected: Bookkeeping, bad: Callable[[str], None]) -> None:
    chunk_sizes = rows.sizes["chunks"]
    for key, node in rows.nodes.items():
        name = f"node {_hex(key)[:16]}"
        if node.namespace not in rows.nsinfo:
            bad(f"{name}: namespace not registered")
        if node.depth > 0:
            if node.parent not in rows.nodes:
                bad(f"{name}: parent missing")
            size = chunk_sizes.get(key)
            if size is None and not node.broken:
                bad(f"{name}: chunk record missing")
            if size is not None and node.chunk_bytes != size:
                bad(f"{name}: {node.chunk_bytes} bytes counted, record holds {size}")
    for key in chunk_sizes.keys() - rows.nodes.keys():
        bad(f"chunk record {_hex(key)[:16]} without a node")
    for key, node in rows.nodes.items():
        refs = expected.refs[key]
        if node.refs != refs or refs <= 0:
            bad(f"node {_hex(key)[:16]}: {node.refs} references recorded, {refs} found")
        if node.tails != expected.tails[key]:
            bad(f"node {_hex(key)[:16]}: tail counts disagree with its entries")


def _entry_problems(rows: IndexRows, bad: Callable[[str], None]) -> None:
    sizes = rows.sizes
    for key, entry in rows.entries.items():
        name = f"entry {_hex(key)[:16]}"
        if entry.node not in rows.nodes:
            bad(f"{name}: node missing")
        if key not in sizes["edata"]:
            bad(f"{name}: record missing")
        parts = {dns: sizes["drafts"].get(draft_key(key, dns)) for dns in entry.drafters}
        if parts != entry.drafters:
            bad(f"{name}: drafter parts disagree with their records")
        if entry.entry_bytes != sizes["edata"].get(key, 0) + sum(p or 0 for p in parts.values()):
            bad(f"{name}: byte count")
    listed = {draft_key(k, d) for k, e in rows.entries.items() for d in e.drafters} | rows.pieces.keys()
    for db, live in (("edata", rows.entries.keys()), ("drafts", listed)):
        extra = len(sizes[db].keys() - live)
        if extra:
            bad(f"{extra} {db} records no entry refers to")


def _piece_problems(rows: IndexRows, expected: Bookkeeping, bad: Callable[[str], None]) -> None:
    """Shared pieces (formats 1.2, 1.3): each named piece has a row and a record, counts and sizes agree."""
    sizes = rows.sizes["drafts"]
    for key, entry in rows.entries.items():
        for check in (entry_pieces, entry_spans):
            try:
                check(entry)
            except CorruptIndex:
                bad(f"entry {_hex(key)[:16]}: piece list is malformed")
    for key, node in rows.nodes.items():
        try:
            node_spans(node)
        except CorruptIndex:
            bad(f"node {_hex(key)[:16]}: piece list is malformed")
    for key, refs in expected.piece_refs.items():
        row = rows.pieces.get(key)
        if row is None:
            bad(f"piece {_hex(key)[:16]}: named {refs} time(s) but has no row")
        elif row["refs"] != refs:
            bad(f"piece {_hex(key)[:16]}: {row['refs']} references recorded, {refs} found")
    for key, row in rows.pieces.items():
        if key not in expected.piece_refs:
            bad(f"piece {_hex(key)[:16]}: nothing refers to it")
        if sizes.get(key) is None:
            bad(f"piece {_hex(key)[:16]}: record missing")
        elif sizes[key] != row["bytes"]:
            bad(f"piece {_hex(key)[:16]}: {row['bytes']} bytes counted, record holds {sizes[key]}")
        if row["ns"] not in rows.nsinfo:
            bad(f"piece {_hex(key)[:16]}: namespace not registered")

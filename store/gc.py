"""``gc``: remove what is damaged and rebuild the bookkeeping from what is left.

Corrupt records and damaged index values go with everything that depends on them (broken chunk subtrees,
entries without their record), orphan records go, and references, tail counts, byte and entry counters,
namespace signatures, LRU rows and per-tenant counters are recomputed — all in one write transaction. A
namespace whose own row was damaged keeps its entries: the row is rebuilt and learns again what it stands for at
the next ``register_namespace``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from . import continuations
from .codec import CorruptRecord, check_key, decode_record
from .errors import CorruptIndex, StoreError
from .index import draft_key, entry_pieces, expected_bookkeeping, expected_piece_refs, piece_owners, set_entry_pieces
from .pieces import is_piece_row, piece_row_key
from .spans import entry_spans, node_spans, span_keys
from .store import Store
from .tenants import rebuild_tenants
from .values import TOTALS_KEY, Entry, NamespaceInfo, Node, Totals, pack
from .verify import RECORD_DBS, IndexRows, Progress, read_index, verify


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
        store.discard_pending()
    bad = verify(store, progress, index=False)
    if bad.structure_problems:
        raise StoreError(f"store at {store.path}: LMDB's page structure is damaged ({bad.structure_problems[0]}; "
                         f"{len(bad.structure_problems)} problems); gc cannot fix that: run 'spec-cache repair'")
    corrupt = [(row["db"], bytes.fromhex(row["key"])) for row in bad.corrupt_keys if row["db"] in RECORD_DBS]
    report = GcReport()
    store.env.write(lambda txn: _Rebuild(store, txn, report).run(corrupt), making_room=True)
    return report


class _Rebuild:
    """The body of ``gc``'s transaction (it may run again after map growth: it starts from scratch)."""

    def __init__(self, store: Store, txn, report: GcReport):
        for name in report.__dataclass_fields__:
            setattr(report, name, 0)
        self.txn, self.dbs, self.report = txn, store.env.dbs, report
        self.chunk_tokens = store.chunk_tokens
        self.doomed: dict[str, set[bytes]] = {}   # rows deleted at the end (through a cursor)
        self.rebuilt: set[bytes] = set()          # namespaces whose row is rebuilt

    def drop(self, db: str, key: bytes) -> None:
        """Delete at the end through a cursor: a key whose leaf is out of order still goes."""
        self.doomed.setdefault(db, set()).add(key)

    def run(self, corrupt: list[tuple[str, bytes]]) -> None:
        rows = read_index(self.txn, self.dbs)
        start_bytes = rows.totals.bytes if rows.totals is not None else 0
        self._damaged_rows(rows)
        self._corrupt_records(rows, corrupt)
        referenced = {"chunks": set(rows.nodes), "edata": set(rows.entries),
                      "drafts": {draft_key(k, d) for k, e in rows.entries.items() for d in e.drafters}
                      | rows.pieces.keys()}
        standing = self._standing_nodes(rows)
        kept = self._kept_entries(rows, standing)
        live = _ancestors(rows.nodes, kept)
        totals = self._write_back(rows, live, kept)
        self._unreferenced_records(rows, live, kept, referenced)
        for db, keys in self.doomed.items():
            _delete_rows(self.txn, self.dbs[db], keys)
        corrupt_records, orphaned = continuations.rebuild(self.txn, self.dbs, set(rows.nsinfo))  # their own rows
        self.report.corrupt_removed += corrupt_records
        self.report.orphans_removed += orphaned
        self.report.bytes = max(0, start_bytes - totals.bytes)

    def _damaged_rows(self, rows: IndexRows) -> None:
        """Damaged values go; a namespace row is rebuilt instead (its entries are fine), as is one lost entirely."""
        for db, key, _exc in rows.damaged:
            self.report.index_rows_removed += db != "meta"
            if db == "nsinfo" and len(key) == 32:
                rows.nsinfo[key] = _placeholder_nsinfo()
                self.rebuilt.add(key)
            elif db != "meta":
                self.drop(db, key)
            elif is_piece_row(key):  # rebuilt from the entries that name the piece
                self.drop(db, key)
        for node in rows.nodes.values():
            if node.depth == 0 and node.namespace not in rows.nsinfo:
                rows.nsinfo[node.namespace] = _placeholder_nsinfo()
                self.rebuilt.add(node.namespace)
        self.report.namespaces_rebuilt = len(self.rebuilt)

    def _corrupt_records(self, rows: IndexRows, corrupt: list[tuple[str, bytes]]) -> None:
        """Drop the records verify found corrupt, if they still are (a writer may have replaced one since)."""
        for db, key in corrupt:
            raw = self.txn.get(key, db=self.dbs[db])
            if raw is not None:
                try:
                    check_key(decode_record(raw), key, db)
                    continue
                except CorruptRecord:
                    pass
            elif key not in rows.sizes[db]:
                continue
            self.drop(db, key)
            rows.sizes[db].pop(key, None)
            self.report.corrupt_removed += 1

    def _standing_nodes(self, rows: IndexRows) -> set[bytes]:
        """Nodes that still stand: registered namespace, parent standing one level up, chunk record present."""
        standing: set[bytes] = set()
        for key in sorted(rows.nodes, key=lambda k: rows.nodes[k].depth):
            node = rows.nodes[key]
            ok = True
            if node.depth > 0:
                parent = rows.nodes.get(node.parent)
                whole = key in rows.sizes["chunks"] and not node.broken and _pieces_there(node, rows)
                if not whole:
                    self.report.broken_subtrees += 1
                ok = (whole and node.parent in standing and parent.depth == node.depth - 1
                      and parent.namespace == node.namespace)
            if ok and node.namespace in rows.nsinfo:
                standing.add(key)
        return standing

    def _kept_entries(self, rows: IndexRows, standing: set[bytes]) -> dict[bytes, Entry]:
        """Entries that still stand (node standing, record there, length adding up), byte counts fixed."""
        kept: dict[bytes, Entry] = {}
        sizes, chunk_tokens = rows.sizes, self.chunk_tokens
        for key, e in rows.entries.items():
            node = rows.nodes.get(e.node)
            if (e.node in standing and key in sizes["edata"] and node.namespace == e.namespace
                    and node.depth * chunk_tokens + e.tail == e.length
                    and (node.depth == 0 or e.tail < chunk_tokens) and _pieces_there(e, rows)):
                parts = {d: sizes["drafts"][draft_key(key, d)] for d in e.drafters
                         if draft_key(key, d) in sizes["drafts"]}
                try:
                    pcs = entry_pieces(e)
                except CorruptIndex:  # which pieces its parts need is lost: the parts go, the target stays
                    pcs, parts = {}, {}
                # a part whose pieces are not all there goes (format 1.2)
                parts = {d: n for d, n in parts.items() if all(k in sizes["drafts"] for k in pcs.get(d, ()))}
                fixed = dataclasses.replace(e, drafters=parts, entry_bytes=sizes["edata"][key] + sum(parts.values()),
                                            extra=dict(e.extra))
                set_entry_pieces(fixed, pcs)
                if fixed != e:
                    self.report.counters_fixed += 1
                kept[key] = fixed
            else:
                self.report.entries_removed += 1
        return kept

    def _write_back(self, rows: IndexRows, live: set[bytes], kept: dict[bytes, Entry]) -> Totals:
        """Nodes, entries, LRU rows, namespaces and totals as ``expected_bookkeeping`` says; the rest goes."""
        fixed_nodes = {key: dataclasses.replace(node, chunk_bytes=rows.sizes["chunks"][key] if node.depth else 0,
                                                broken=False)
                       for key, node in rows.nodes.items() if key in live}
        pieces = self._pieces(rows, kept, fixed_nodes)
        expected = expected_bookkeeping(fixed_nodes, kept, pieces)
        for key, node in rows.nodes.items():
            if key not in live:
                self.drop("nodes", key)
                continue
            fixed = dataclasses.replace(fixed_nodes[key], refs=expected.refs[key], tails=expected.tails[key])
            if fixed != node:
                self._put("nodes", key, fixed)
        for key, e in rows.entries.items():
            if key not in kept:
                self.drop("entries", key)
            elif kept[key] != e:
                self.txn.put(key, pack(kept[key]), db=self.dbs["entries"])
        for key in rows.lru - expected.lru:
            self.drop("lru", key)
        for key in expected.lru - rows.lru:
            self.txn.put(key, b"", db=self.dbs["lru"])
            self.report.counters_fixed += 1
        fixed_nsinfo = {}
        for ns, info in rows.nsinfo.items():
            roots = expected.ns_signatures.get(ns, [])
            signatures = [s for s in info.signatures if s in roots]
            signatures += [s for s in roots if s not in signatures]
            fixed = fixed_nsinfo[ns] = dataclasses.replace(info, bytes=expected.ns_bytes.get(ns, 0),
                                                           entries=expected.ns_entries.get(ns, 0),
                                                           signatures=signatures)
            if fixed != info or ns in self.rebuilt:
                self._put("nsinfo", ns, fixed)
        self.report.counters_fixed += rebuild_tenants(self.txn, self.dbs, fixed_nsinfo)  # per-tenant sums (1.1)
        if expected.totals != rows.totals:
            self.txn.put(TOTALS_KEY, pack(expected.totals), db=self.dbs["meta"])
        return expected.totals

    def _pieces(self, rows: IndexRows, kept: dict[bytes, Entry], nodes: dict[bytes, Node]) -> dict[bytes, dict]:
        """Piece rows (formats 1.2, 1.3) as the kept entries and live nodes name them; the others go."""
        refs = expected_piece_refs(kept, nodes)
        owner = piece_owners(kept, nodes)
        pieces = {k: {"ns": owner[k], "refs": n, "bytes": rows.sizes["drafts"][k]} for k, n in refs.items()}
        for key, row in pieces.items():
            if rows.pieces.get(key) != row:
                self._put("meta", piece_row_key(key), row)
        for key in rows.pieces.keys() - pieces.keys():
            self.drop("meta", piece_row_key(key))
        rows.live_pieces = set(pieces)
        return pieces

    def _put(self, db: str, key: bytes, value) -> None:
        self.txn.put(key, pack(value), db=self.dbs[db])
        self.report.counters_fixed += 1

    def _unreferenced_records(self, rows: IndexRows, live: set[bytes], kept: dict[bytes, Entry],
                              referenced: dict[str, set[bytes]]) -> None:
        """Records nothing refers to any more; those nothing referred to before this gc are orphans."""
        wanted = {"chunks": {k for k in live if rows.nodes[k].depth > 0}, "edata": set(kept),
                  "drafts": {draft_key(k, d) for k, e in kept.items() for d in e.drafters} | rows.live_pieces}
        for db in RECORD_DBS:
            for key in rows.sizes[db].keys() - wanted[db]:
                self.drop(db, key)
                if key not in referenced[db]:
                    self.report.orphans_removed += 1


def _pieces_there(row, rows: IndexRows) -> bool:
    """Every target piece (format 1.3) an entry's tail or a node's chunk names is stored (a malformed list: no)."""
    try:
        keys = span_keys(entry_spans(row) if isinstance(row, Entry) else node_spans(row))
    except CorruptIndex:
        return False
    return all(k in rows.sizes["drafts"] for k in keys)


def _ancestors(nodes: dict[bytes, Node], entries: dict[bytes, Entry]) -> set[bytes]:
    """The nodes the entries hang off and every node above them (what must stay)."""
    live: set[bytes] = set()
    for entry in entries.values():
        key = entry.node
        while key is not None and key not in live:
            live.add(key)
            key = nodes[key].parent
    return live


def _placeholder_nsinfo() -> NamespaceInfo:
    """A namespace row gc rebuilds from what hangs off it; what it stood for (target, prefix namespace,
    tenant) is filled in again by the next ``register_namespace`` of that key."""
    return NamespaceInfo("", "", False, time.time_ns(), 0, 0, 0, 0, None, [], rebuilt=True)


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

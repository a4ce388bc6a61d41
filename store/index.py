"""The prefix index inside one transaction: ``Index`` owns every change to nodes, entries, LRU rows and counters.

Why one file: it is the single owner of every count (the rule below); split, two modules would change counts.

Nothing else in the store changes a reference count, a tail count, a byte counter or an LRU row: ``Store``,
``maintenance``, the shared tier and ``gc`` all ask an ``Index`` (or, for gc's rebuild from scratch,
``expected_bookkeeping``, the same invariants as a pure function).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import blake3
import msgpack

from .errors import CorruptIndex, InvalidInput, NamespaceNotRegistered
from .keys import lru_key
from .pieces import PIECES_MINOR, piece_row_key
from .spans import SPANS_MINOR, entry_spans, node_spans, span_keys
from .values import (
    TENANT_ID_BYTES,
    TENANT_KEY_PREFIX,
    TENANT_MINOR,
    TOTALS_KEY,
    Entry,
    NamespaceInfo,
    Node,
    Totals,
    decode,
    pack,
    tenant_key,
    unpack,
)

__all__ = ["Index", "ChainWrite", "entry_pieces", "piece_owners", "set_entry_pieces", "piece_row_ok", "Bookkeeping",
           "expected_bookkeeping", "TOTALS_KEY", "decode", "draft_key",
           "now_ns", "pack", "unpack"]


FORMAT_KEY = b"format"  # meta: the store's format record (``env.Environment``), whose minor 1.1 marks tenant labels


def draft_key(entry: bytes, drafter_namespace: str) -> bytes:
    """Key of a drafter's part of entry ``entry``: the entry key and 16 bytes of blake3(drafter namespace)."""
    return entry + blake3.blake3(drafter_namespace.encode()).digest()[:16]


def entry_pieces(entry: Entry) -> dict[str, list[bytes]]:
    """Piece keys each drafter part of ``entry`` refers to (format 1.2; ``{}`` for whole drafter records).
    A malformed field raises ``CorruptIndex`` (gc rebuilds the entry without those parts)."""
    pcs = entry.extra.get("pcs")
    if pcs is None:
        return {}
    if not (type(pcs) is dict and all(type(d) is str and type(ks) is list and all(_key32(k) for k in ks)
                                      for d, ks in pcs.items())):
        raise CorruptIndex("entry piece list is malformed; the store is damaged: run 'spec-cache gc'", "entries")
    return pcs


def _pieces_or_none(entry: Entry) -> dict[str, list[bytes]]:
    """``entry_pieces``, or ``{}`` for a damaged field (removal goes on; gc recounts the pieces)."""
    try:
        return entry_pieces(entry)
    except CorruptIndex:
        return {}


def _spans_or_none(row) -> list[bytes]:
    """The target piece keys of an entry or node (format 1.3), ``[]`` for a damaged field (gc recounts)."""
    try:
        return span_keys(entry_spans(row) if isinstance(row, Entry) else node_spans(row))
    except CorruptIndex:
        return []


def set_entry_pieces(entry: Entry, pcs: dict[str, list[bytes]]) -> None:
    """Record ``pcs`` in the entry row (the field is absent when no part has pieces: pre-1.2 bytes)."""
    pcs = {d: ks for d, ks in pcs.items() if ks and d in entry.drafters}
    if pcs:
        entry.extra["pcs"] = pcs
    else:
        entry.extra.pop("pcs", None)


def piece_row_ok(v) -> bool:
    return (type(v) is dict and _key32(v.get("ns")) and type(v.get("refs")) is int
            and type(v.get("bytes")) is int and v["bytes"] >= 0)


def _key32(x) -> bool:
    return type(x) is bytes and len(x) == 32


def now_ns() -> int:
    return time.time_ns()


def _with_spans(written) -> tuple:
    """A ``chunk_record(k)`` result as ``(record, spans)``: a bare record is a whole chunk (no pieces)."""
    return written if isinstance(written, tuple) else (written, [])


@dataclass(frozen=True)
class ChainWrite:
    """What ``Index.extend_chain`` did: chunk records written, their bytes, and the whole chain's bytes."""

    new_chunks: int        # chunk records written (new nodes, or broken ones rewritten)
    written: int           # bytes of those records
    chain_bytes: int       # bytes of every chunk record of the chain (what the checkpoint costs with its chunks)


class Index:
    """Every change to the prefix index, bound to one LMDB transaction and the environment's sub-databases.

    Invariants (a crash cannot break them: each public operation runs inside one write transaction; the same
    rules as a pure function are ``expected_bookkeeping``, which ``verify`` checks and ``gc`` rebuilds from):

    1. ``Node.refs`` = the child nodes plus the entries hanging off the node, and is > 0: a node whose count
       drops to zero is deleted with its chunk record, and the drop cascades to its parent. A stored prefix
       never loses its chunks, and no chunk outlives the last entry that needs it.
    2. ``Node.tails[str(t)]`` = the entries hanging off the node with a tail of ``t`` tokens (so a lookup
       only hashes tails that exist); an entry hangs off the deepest full chunk at or below its length.
    3. ``Node.chunk_bytes`` = its chunk record's size; ``Entry.drafters[d]`` = drafter ``d``'s record size;
       ``Entry.entry_bytes`` = its entry record's size plus those.
    4. ``NamespaceInfo.bytes``/``entries`` = the sums over its nodes and entries, ``Totals`` = the sums over
       every namespace; ``NamespaceInfo.signatures`` = the signatures of its chain roots.
    5. One LRU row ``lru_key(entry.last_use, key)`` per entry and no other.
    6. (format 1.1) ``tenant_totals(t)`` = the sums of ``bytes``/``entries`` over the namespaces labelled ``t``,
       one ``meta`` row per labelled tenant holding something; unlabelled namespaces (the default tenant)
       have no row (``tenants.expected_tenants`` is the pure form; ``verify`` checks it, ``gc`` rebuilds it).
    7. (formats 1.2, 1.3) a piece's ``piece/`` row counts the drafter parts, entry tails and node chunks naming
       it; a piece at zero goes with its record (``pieces.py``, ``spans.py``).

    The raw accessors (``get``, ``put``, ``delete``, ``nsinfo``) read and write plain dict rows; they exist
    for fault-injection tests and tools that must write what the store never would.
    """

    def __init__(self, txn, dbs):
        self.txn = txn
        self.dbs = dbs

    # --- raw rows ----------------------------------------------------------------------------------
    def get(self, db: str, key: bytes):
        """The shape-checked dict under ``key`` (None if absent); a damaged value raises ``CorruptIndex``."""
        return decode(db, self.txn.get(key, db=self.dbs[db]), key)

    def put(self, db: str, key: bytes, value) -> None:
        """Write ``value``: bytes as they are, a typed record or a dict msgpack-packed."""
        self.txn.put(key, value if isinstance(value, (bytes, memoryview)) else pack(value), db=self.dbs[db])

    def delete(self, db: str, key: bytes) -> None:
        self.txn.delete(key, db=self.dbs[db])

    def nsinfo(self, ns: bytes) -> dict | None:
        """The raw namespace row (a dict); code that keeps the books uses ``namespace``."""
        return self.get("nsinfo", ns)

    # --- typed reads -------------------------------------------------------------------------------
    def node(self, key: bytes) -> Node | None:
        value = self.get("nodes", key)
        return None if value is None else Node.from_dict(value)

    def entry(self, key: bytes) -> Entry | None:
        value = self.get("entries", key)
        return None if value is None else Entry.from_dict(value)

    def namespace(self, ns: bytes) -> NamespaceInfo | None:
        value = self.get("nsinfo", ns)
        return None if value is None else NamespaceInfo.from_dict(value)

    def totals(self) -> Totals:
        value = self.get("meta", TOTALS_KEY)
        return Totals() if value is None else Totals.from_dict(value)

    # --- counters ----------------------------------------------------------------------------------
    def add_totals(self, d_bytes: int, d_entries: int) -> None:
        totals = self.totals()
        totals.bytes += d_bytes
        totals.entries += d_entries
        self.put("meta", TOTALS_KEY, totals)

    def add_ns(self, ns: bytes, *, d_bytes=0, d_entries=0, hits=0, misses=0, last_use=None) -> NamespaceInfo | None:
        """Add to a namespace's counters (nothing if the row is gone); returns the row as written."""
        info = self.namespace(ns)
        if info is None:
            return None
        info.bytes += d_bytes
        info.entries += d_entries
        info.hits += hits
        info.misses += misses
        if last_use is not None:
            info.last_use = max(info.last_use or 0, last_use)
        self.put("nsinfo", ns, info)
        return info

    def _count(self, ns: bytes, d_bytes: int, d_entries: int, last_use: int | None = None) -> None:
        info = self.add_ns(ns, d_bytes=d_bytes, d_entries=d_entries, last_use=last_use)
        if info is not None and info.tenant_id is not None:
            self.add_tenant(info.tenant_id, d_bytes, d_entries)
        self.add_totals(d_bytes, d_entries)

    # --- tenants (format 1.1) ----------------------------------------------------------------------
    def tenant_totals(self, tenant_id: bytes) -> Totals:
        """A labelled tenant's counters (the sums over its namespaces); zero when it holds nothing."""
        value = self.get("meta", tenant_key(tenant_id))
        return Totals() if value is None else Totals.from_dict(value)

    def add_tenant(self, tenant_id: bytes, d_bytes: int, d_entries: int) -> None:
        """Add to a labelled tenant's counters; the row goes when they reach zero (invariant 6)."""
        totals = self.tenant_totals(tenant_id)
        totals.bytes += d_bytes
        totals.entries += d_entries
        if totals.bytes or totals.entries:
            self.put("meta", tenant_key(tenant_id), totals)
        else:
            self.delete("meta", tenant_key(tenant_id))

    def tenant_table(self) -> dict[bytes, Totals]:
        """Counters of every tenant holding something: labelled ones from their rows, the default tenant
        (``b""``: namespaces without a label) as what the store-wide totals leave. One row per tenant."""
        out: dict[bytes, Totals] = {}
        cursor = self.txn.cursor(db=self.dbs["meta"])
        more = cursor.set_range(TENANT_KEY_PREFIX)
        while more and bytes(cursor.key()).startswith(TENANT_KEY_PREFIX):
            key = bytes(cursor.key())
            try:
                out[key[len(TENANT_KEY_PREFIX):]] = Totals.from_dict(decode("meta", cursor.value(), key))
            except CorruptIndex:  # a damaged row: its bytes count as the default tenant's until gc rebuilds it
                pass
            more = cursor.next()
        totals = self.totals()
        rest = Totals(totals.bytes - sum(t.bytes for t in out.values()),
                      totals.entries - sum(t.entries for t in out.values()))
        if rest.bytes > 0 or rest.entries > 0:
            out[b""] = rest
        return out

    # --- namespaces --------------------------------------------------------------------------------
    def register_namespace(self, ns: bytes, *, target: str, prefix_namespace: str, tenant: bool,
                           tenant_id: bytes | None = None) -> None:
        """Create the namespace row; a row ``gc`` rebuilt learns again what it stands for. Idempotent.

        ``tenant_id`` (``keys.tenant_id``; None: the default tenant) labels the row for per-tenant accounting; a
        row written without one (a 1.0 store) takes the label at its next registration. The first label
        written marks the store format 1.1 (``TENANT_MINOR``).
        """
        if tenant_id is not None and (type(tenant_id) is not bytes or len(tenant_id) != TENANT_ID_BYTES):
            raise InvalidInput(f"tenant_id must be {TENANT_ID_BYTES} bytes (keys.tenant_id) or None")
        info = self.namespace(ns)
        if info is None:
            self.put("nsinfo", ns, NamespaceInfo(target, prefix_namespace, bool(tenant), now_ns(), 0, 0, 0, 0,
                                                 None, [], tenant_id=tenant_id))
        elif info.rebuilt or (tenant_id is not None and info.tenant_id != tenant_id):
            if info.rebuilt:
                info.target, info.prefix_namespace, info.tenant = target, prefix_namespace, bool(tenant)
                info.rebuilt = False
            if tenant_id is not None and info.tenant_id != tenant_id:  # its bytes move to the new label
                if info.tenant_id is not None:
                    self.add_tenant(info.tenant_id, -info.bytes, -info.entries)
                self.add_tenant(tenant_id, info.bytes, info.entries)
                info.tenant_id = tenant_id
            self.put("nsinfo", ns, info)
        if tenant_id is not None:
            self.mark_format_minor(TENANT_MINOR)

    def forget_namespace(self, ns: bytes) -> bool:
        """Delete the namespace row of ``ns`` if it holds nothing (no entries, no bytes, no chain roots); True if
        the row is gone (or was never there). A row with a damaged value is left for ``gc``."""
        try:
            info = self.namespace(ns)
        except CorruptIndex:
            return False
        if info is None:
            return True
        if info.entries or info.bytes or info.signatures:
            return False
        self.delete("nsinfo", ns)
        return True

    def format_minor(self) -> int:
        """The minor store format the ``format`` row states (0 when it is missing or unreadable)."""
        try:
            meta = unpack(self.txn.get(FORMAT_KEY, db=self.dbs["meta"]), "meta", FORMAT_KEY)
        except CorruptIndex:
            return 0
        minor = meta.get("minor", 0) if isinstance(meta, dict) else 0
        return minor if type(minor) is int else 0

    def mark_format_minor(self, minor: int) -> None:
        """Raise the ``format`` row's minor to ``minor`` (never lower it): the store now uses what it adds."""
        raw = self.txn.get(FORMAT_KEY, db=self.dbs["meta"])
        meta = unpack(raw, "meta", FORMAT_KEY) if raw is not None else None
        if isinstance(meta, dict) and self.format_minor() < minor:
            meta["minor"] = minor
            self.txn.put(FORMAT_KEY, msgpack.packb(meta), db=self.dbs["meta"])

    def require_namespace(self, ns: bytes) -> NamespaceInfo:
        """The namespace row; raises ``NamespaceNotRegistered`` if there is none."""
        info = self.namespace(ns)
        if info is None:
            raise NamespaceNotRegistered("namespace key is not registered: call register_namespace first")
        return info

    # --- adding a checkpoint -----------------------------------------------------------------------
    def extend_chain(self, ns: bytes, signature: bytes, chain: list[bytes], *, complete: bool,
                     minimum_reusable: int, chunk_record: Callable[[int], object]) -> ChainWrite:
        """Make sure every node of ``chain`` (root, chunk 1..K) stands with its chunk record.

        Existing nodes are refreshed (``complete`` and-ed in, ``minimum_reusable`` max-ed in); missing ones are
        created with ``chunk_record(k)`` (an encoded record) and a reference from their parent; a broken one
        (its record was dropped as corrupt) is rewritten in place, keeping its references. The bytes of
        records written are counted here.
        """
        info = self.require_namespace(ns)
        if signature not in info.signatures:
            info.signatures.append(signature)
            self.put("nsinfo", ns, info)
        written = new_chunks = reclaimed = chain_bytes = 0
        for k, key in enumerate(chain):
            node = self.node(key)
            if node is not None and not node.broken:
                refreshed = max(node.minimum_reusable, minimum_reusable)
                # a chunk boundary is usable only if every checkpoint through it was fully chunked
                still_complete = node.complete and complete
                if (refreshed, still_complete) != (node.minimum_reusable, node.complete):
                    # only a changed node is written: every put copies each b-tree page it touches (node keys
                    # are hashes, one leaf page each), so rewriting the whole chain cost ~4 KiB per chunk per put
                    node.minimum_reusable, node.complete = refreshed, still_complete
                    self.put("nodes", key, node)
                chain_bytes += node.chunk_bytes
                continue
            old_spans: list[bytes] = []
            if node is not None:  # a broken chunk is rewritten in place; its references stay
                reclaimed += node.chunk_bytes  # its old bytes are still counted in the totals
                old_spans = _spans_or_none(node)
                node = Node(ns, node.parent, k, node.refs, node.tails, 0, node.complete and complete,
                            max(node.minimum_reusable, minimum_reusable), signature if k == 0 else b"")
            else:
                node = Node(ns, chain[k - 1] if k else None, k, 0, {}, 0, complete, minimum_reusable,
                            signature if k == 0 else b"")
                if k > 0:
                    parent = self.node(chain[k - 1])
                    parent.refs += 1
                    self.put("nodes", chain[k - 1], parent)
            node.parent = chain[k - 1] if k else None
            if k > 0:
                record, spans = _with_spans(chunk_record(k))
                self.txn.put(key, record, db=self.dbs["chunks"])
                node.chunk_bytes = record.nbytes
                written += record.nbytes
                chain_bytes += record.nbytes
                new_chunks += 1
                if spans:  # format 1.3: the chunk names target pieces earlier tails wrote (``spans.py``)
                    written += self.ref_pieces(ns, [s.piece for s in spans], SPANS_MINOR)
                    node.extra["pcs"] = [s.row() for s in spans]
                reclaimed += self.release_pieces(old_spans)
            self.put("nodes", key, node)
        if written - reclaimed:
            self._count(ns, written - reclaimed, 0)
        return ChainWrite(new_chunks, written, chain_bytes)

    def add_entry(self, key: bytes, entry: Entry, record, drafter_part: tuple | None = None,
                  spans: list | None = None) -> int:
        """Store entry ``key``: its record, optionally one drafter's record (``(drafter namespace, record)`` or
        ``(drafter namespace, record, pieces)`` with the shared pieces it refers to, format 1.2), its row and LRU
        row, a reference and tail count on ``entry.node``; counted. An entry already under ``key`` (an exact
        duplicate) is replaced: its other drafters' parts and its pin stay.

        ``spans`` (format 1.3, ``spans.SpanPiece``): the target pieces the entry record's tail is cut into.
        ``entry.entry_bytes`` and ``entry.drafters`` are filled in here. Returns the bytes written.
        """
        old = self.entry(key)
        drafters: dict[str, int] = {}
        pcs: dict[str, list[bytes]] = {}
        released: list[bytes] = []
        if old is not None:
            self.delete("lru", lru_key(old.last_use, key))
            drafters = dict(old.drafters)
            pcs = dict(entry_pieces(old))
            if drafter_part is not None:
                drafters.pop(drafter_part[0], None)
                released = pcs.pop(drafter_part[0], [])
            freed = old.entry_bytes - sum(drafters.values())
            released += _spans_or_none(old)
            self._count(entry.namespace, -freed, -1)
            entry.pinned = entry.pinned or old.pinned
        else:
            node = self.node(entry.node)
            tail = str(entry.tail)
            node.tails[tail] = node.tails.get(tail, 0) + 1
            node.refs += 1
            self.put("nodes", entry.node, node)
        self.txn.put(key, record, db=self.dbs["edata"])
        written = record.nbytes
        if drafter_part is not None:
            dns, draft_record = drafter_part[0], drafter_part[1]
            pieces = drafter_part[2] if len(drafter_part) > 2 else ()
            self.txn.put(draft_key(key, dns), draft_record, db=self.dbs["drafts"])
            drafters[dns] = draft_record.nbytes
            written += draft_record.nbytes
            if pieces:
                written += self.ref_pieces(entry.namespace, pieces)
                pcs[dns] = [p.key for p in pieces]
        if spans:
            written += self.ref_pieces(entry.namespace, [s.piece for s in spans], SPANS_MINOR)
            entry.extra["tpc"] = [s.row() for s in spans]
        entry.drafters = drafters
        entry.entry_bytes = record.nbytes + sum(drafters.values())
        set_entry_pieces(entry, pcs)
        self.put("entries", key, entry)
        self.put("lru", lru_key(entry.last_use, key), b"")
        self._count(entry.namespace, written, 1, last_use=entry.last_use)
        freed = self.release_pieces(released)  # after the new references: a piece both name stays
        if freed:
            self._count(entry.namespace, -freed, 0)
        return written

    # --- shared pieces (format 1.2, ``pieces.py``) -------------------------------------------------
    def piece_row(self, key: bytes) -> dict | None:
        """The ``{ns, refs, bytes}`` row of piece ``key`` (None if absent); a damaged one raises ``CorruptIndex``."""
        value = unpack(self.txn.get(piece_row_key(key), db=self.dbs["meta"]), "meta", piece_row_key(key))
        if value is not None and not piece_row_ok(value):
            raise CorruptIndex("piece row is malformed; the store is damaged: run 'spec-cache gc'", "meta",
                               piece_row_key(key))
        return value

    def ref_pieces(self, ns: bytes, pieces, minor: int = PIECES_MINOR) -> int:
        """One reference to each of ``pieces`` (``pieces.Piece``), writing those the store lacks; bytes written."""
        written = 0
        for piece in pieces:
            row = self.piece_row(piece.key)
            if row is None or self.txn.get(piece.key, db=self.dbs["drafts"]) is None:  # new, or its record lost
                record = piece.encode()
                self.txn.put(piece.key, record, db=self.dbs["drafts"])
                if row is not None:  # the lost record's bytes were still counted: count the new one instead
                    self._count(ns, record.nbytes - row["bytes"], 0)
                row = {"ns": ns, "refs": row["refs"] if row is not None else 0, "bytes": record.nbytes}
                written += record.nbytes if row["refs"] == 0 else 0
            row["refs"] += 1
            self.put("meta", piece_row_key(piece.key), row)
        if pieces:
            self.mark_format_minor(minor)
        return written

    def drop_piece_record(self, key: bytes) -> None:
        """Delete a damaged piece's record, keeping its row (the entries and chunks naming it are dropped as they
        are read; ``ref_pieces`` writes the record again and recounts its bytes; ``gc`` settles the rest)."""
        if self.txn.get(key, db=self.dbs["drafts"]) is not None:
            self.delete("drafts", key)

    def release_pieces(self, keys) -> int:
        """Drop one reference to each piece in ``keys``; a piece at zero goes with its record. Bytes freed."""
        freed = 0
        for key in keys:
            try:
                row = self.piece_row(key)
            except CorruptIndex:  # gc's to rebuild
                continue
            if row is None:
                continue
            row["refs"] -= 1
            if row["refs"] > 0:
                self.put("meta", piece_row_key(key), row)
                continue
            self.delete("meta", piece_row_key(key))
            if self.txn.get(key, db=self.dbs["drafts"]) is not None:
                self.delete("drafts", key)
            freed += row["bytes"]
        return freed

    # --- removing ----------------------------------------------------------------------------------
    def remove_entry(self, key: bytes, entry: Entry | None = None) -> int:
        """Remove an entry with its records, LRU row and node references; returns bytes freed (chunks too)."""
        entry = entry or self.entry(key)
        if entry is None:
            return 0
        self.delete("edata", key)
        for dns in entry.drafters:
            self.delete("drafts", draft_key(key, dns))
        pieces = [k for keys in _pieces_or_none(entry).values() for k in keys] + _spans_or_none(entry)
        self.delete("lru", lru_key(entry.last_use, key))
        self.delete("entries", key)
        node = self.node(entry.node)
        if node is not None:
            tail = str(entry.tail)
            node.tails[tail] = node.tails.get(tail, 1) - 1
            if node.tails[tail] <= 0:
                del node.tails[tail]
            self.put("nodes", entry.node, node)
        freed = entry.entry_bytes + self._release_node(entry.node) + self.release_pieces(pieces)
        self._count(entry.namespace, -freed, -1)
        return freed

    def _release_node(self, key: bytes | None) -> int:
        """Drop one reference to node ``key``; delete it (and cascade) at zero. Returns chunk bytes freed."""
        freed = 0
        while key is not None:
            node = self.node(key)
            if node is None:
                return freed
            node.refs -= 1
            if node.refs > 0:
                self.put("nodes", key, node)
                return freed
            self.delete("nodes", key)
            if node.depth > 0:
                self.delete("chunks", key)
                freed += node.chunk_bytes + self.release_pieces(_spans_or_none(node))
            else:
                self._forget_signature(node.namespace, node.signature)
            key = node.parent
        return freed

    def _forget_signature(self, ns: bytes, signature: bytes) -> None:
        info = self.namespace(ns)
        if info is not None and signature in info.signatures:
            info.signatures.remove(signature)
            self.put("nsinfo", ns, info)

    def drop_drafter(self, key: bytes, entry: Entry, drafter_namespace: str) -> int:
        """Remove one drafter's part of entry ``key`` (the target state stays); returns bytes freed."""
        nbytes = entry.drafters.pop(drafter_namespace, None)
        if nbytes is None:
            return 0
        self.delete("drafts", draft_key(key, drafter_namespace))
        pcs = dict(_pieces_or_none(entry))
        released = pcs.pop(drafter_namespace, [])
        set_entry_pieces(entry, pcs)
        entry.entry_bytes -= nbytes
        self.put("entries", key, entry)
        nbytes += self.release_pieces(released)
        self._count(entry.namespace, -nbytes, 0)
        return nbytes

    def drop_corrupt(self, key: bytes) -> None:
        """Forget a record found corrupt: an entry goes whole; a chunk's node is marked broken (lookups stop
        above it, the next put through it rewrites it, gc removes the subtree); a drafter part goes alone."""
        if self.entry(key) is not None:
            self.remove_entry(key)
            return
        node = self.node(key)
        if node is not None:
            self.delete("chunks", key)
            node.broken = True
            self.put("nodes", key, node)
            return
        if len(key) == 48:
            entry = self.entry(key[:32])
            if entry is not None:
                for dns in list(entry.drafters):
                    if draft_key(key[:32], dns) == key:
                        self.drop_drafter(key[:32], entry, dns)

    # --- use, pins and eviction --------------------------------------------------------------------
    def touch(self, key: bytes, when: int) -> None:
        """Move entry ``key`` up the LRU order to ``when`` (never back)."""
        entry = self.entry(key)
        if entry is None or entry.last_use >= when:
            return
        self.delete("lru", lru_key(entry.last_use, key))
        entry.last_use = when
        self.put("lru", lru_key(when, key), b"")
        self.put("entries", key, entry)

    def set_pinned(self, key: bytes, pinned: bool) -> bool:
        """Pin or unpin entry ``key``; False if there is no such entry."""
        entry = self.entry(key)
        if entry is None:
            return False
        entry.pinned = bool(pinned)
        self.put("entries", key, entry)
        return True

    # which entries go first (and which never) is ``eviction.py``'s; these are the rows it reads
    def lru_rows(self, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(LRU row, entry key), least recently used first, from row ``start`` on (inclusive; None: the first)."""
        cursor = self.txn.cursor(db=self.dbs["lru"])
        more = cursor.set_range(start) if start is not None else cursor.first()
        while more:
            row = bytes(cursor.key())
            yield row, row[8:]
            more = cursor.next()

    def entries(self) -> Iterator[tuple[bytes, Entry]]:
        """Every entry as (key, entry), in key order; a damaged one raises ``CorruptIndex``."""
        for key, raw in self.txn.cursor(db=self.dbs["entries"]):
            key = bytes(key)
            yield key, Entry.from_dict(decode("entries", raw, key))


@dataclass
class Bookkeeping:
    """What the counters must say for a set of nodes and entries (``expected_bookkeeping``)."""

    refs: dict[bytes, int] = field(default_factory=dict)               # node -> child nodes + entries
    tails: dict[bytes, dict[str, int]] = field(default_factory=dict)   # node -> tail length -> entries
    ns_bytes: dict[bytes, int] = field(default_factory=dict)           # namespace -> bytes
    ns_entries: dict[bytes, int] = field(default_factory=dict)         # namespace -> entries
    ns_signatures: dict[bytes, list[bytes]] = field(default_factory=dict)  # namespace -> root signatures
    lru: set[bytes] = field(default_factory=set)                       # LRU rows
    totals: Totals = field(default_factory=Totals)
    piece_refs: dict[bytes, int] = field(default_factory=dict)         # piece -> drafter parts, tails, chunks


def expected_piece_refs(entries: Mapping[bytes, Entry], nodes: Mapping[bytes, Node] | None = None
                        ) -> dict[bytes, int]:
    """How many times the drafter parts of ``entries`` (format 1.2), their tails and the chunks of ``nodes``
    (format 1.3) name each piece."""
    refs: dict[bytes, int] = {}
    named = [k for entry in entries.values() for keys in _pieces_or_none(entry).values() for k in keys]
    named += [k for entry in entries.values() for k in _spans_or_none(entry)]
    named += [k for node in (nodes or {}).values() for k in _spans_or_none(node)]
    for k in named:
        refs[k] = refs.get(k, 0) + 1
    return refs


def piece_owners(entries: Mapping[bytes, Entry], nodes: Mapping[bytes, Node]) -> dict[bytes, bytes]:
    """Piece key -> the namespace of a row naming it (a piece is keyed in one namespace)."""
    owner = {k: e.namespace for e in entries.values() for ks in _pieces_or_none(e).values() for k in ks}
    owner.update((k, e.namespace) for e in entries.values() for k in _spans_or_none(e))
    owner.update((k, n.namespace) for n in nodes.values() for k in _spans_or_none(n))
    return owner


def expected_bookkeeping(nodes: Mapping[bytes, Node], entries: Mapping[bytes, Entry],
                         pieces: Mapping[bytes, dict] | None = None) -> Bookkeeping:
    """The counters ``Index``'s invariants demand for these nodes and entries (a pure function).

    Counts a child node toward its parent only if the parent is in ``nodes``, and an entry toward its node
    only if the node is; byte counters use the records' sizes as the nodes and entries state them.
    """
    out = Bookkeeping(refs=dict.fromkeys(nodes, 0), tails={k: {} for k in nodes})
    for key, node in nodes.items():
        if node.depth > 0:
            if node.parent in out.refs:
                out.refs[node.parent] += 1
            out.ns_bytes[node.namespace] = out.ns_bytes.get(node.namespace, 0) + node.chunk_bytes
        else:
            out.ns_signatures.setdefault(node.namespace, []).append(node.signature)
    for key, entry in entries.items():
        if entry.node in out.refs:
            out.refs[entry.node] += 1
            tails = out.tails[entry.node]
            tails[str(entry.tail)] = tails.get(str(entry.tail), 0) + 1
        out.ns_bytes[entry.namespace] = out.ns_bytes.get(entry.namespace, 0) + entry.entry_bytes
        out.ns_entries[entry.namespace] = out.ns_entries.get(entry.namespace, 0) + 1
        out.lru.add(lru_key(entry.last_use, key))
    out.piece_refs = expected_piece_refs(entries, nodes)
    for row in (pieces or {}).values():  # a shared piece counts once, toward the namespace it is keyed in
        out.ns_bytes[row["ns"]] = out.ns_bytes.get(row["ns"], 0) + row["bytes"]
    out.totals = Totals(sum(out.ns_bytes.values()), len(entries))
    return out

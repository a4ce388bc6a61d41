"""Salvage: copy every checkpoint of a damaged store that still reads back whole into a fresh store.

``gc`` repairs damaged values and bookkeeping inside a store whose LMDB pages are sound. When LMDB's own page
structure is damaged (a torn or overwritten branch page, a truncated file) nothing can be fixed in place: this
reads a private copy of ``data.mdb`` (extended with zero pages if it was truncated, so every page read is a
read of the file and never a SIGBUS), walks the entries, rebuilds each one's tokens from its chunk chain,
fetches it through the normal verified read path and puts it into the new store. What does not read back
whole is counted as lost, never copied half. The source directory is never written.

It is a cache: deleting the store loses nothing but warm state. Salvage is for keeping that warm state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .codec import CorruptRecord
from .errors import CorruptIndex, StoreError, StoreOpenError
from .read import verified_record
from .store import Store
from .structure import check_structure
from .values import Entry, NamespaceInfo, decode_typed

Progress = Callable[[int, int], None]


@dataclass
class RepairReport:
    source: str
    destination: str
    structure_problems: list[str] = field(default_factory=list)
    truncated_bytes: int = 0
    entries_seen: int = 0
    entries_copied: int = 0
    entries_lost: int = 0
    drafter_parts_copied: int = 0
    drafter_parts_lost: int = 0
    namespaces: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"source": self.source, "destination": self.destination,
                "structure_problems": len(self.structure_problems), "structure_details": self.structure_problems[:20],
                "truncated_bytes": self.truncated_bytes, "entries_seen": self.entries_seen,
                "entries_copied": self.entries_copied, "entries_lost": self.entries_lost,
                "drafter_parts_copied": self.drafter_parts_copied, "drafter_parts_lost": self.drafter_parts_lost,
                "namespaces": self.namespaces, "errors": self.errors[:20]}


def _private_copy(src: str, work: str, report: RepairReport) -> str:
    """``src``/data.mdb copied into ``work``, zero-extended to the size its committed meta needs."""
    data = os.path.join(src, "data.mdb")
    if not os.path.isfile(data):
        raise StoreOpenError(f"no spec-cache store at {src}")
    copy = os.path.join(work, "source")
    os.makedirs(copy, mode=0o700)
    shutil.copyfile(data, os.path.join(copy, "data.mdb"))
    needed = _needed_bytes(os.path.join(copy, "data.mdb"))
    size = os.path.getsize(os.path.join(copy, "data.mdb"))
    if needed is not None and size < needed:
        report.truncated_bytes = needed - size
        with open(os.path.join(copy, "data.mdb"), "r+b") as f:
            f.truncate(needed)
    return copy


def _needed_bytes(data_path: str) -> int | None:
    """(last page + 1) * page size of the newer meta page, read with plain file reads (None if unreadable)."""
    import struct

    # LMDB 0.9, 64-bit: page header 16 bytes, then MDB_meta {magic u32, version u32, address u64, mapsize u64,
    # dbs[2] of 48 bytes (the free DB's md_pad holds the page size), last_pg u64, txnid u64}; meta 1 is page 1.
    with open(data_path, "rb") as f:
        metas = []
        for page in (0, 1):
            f.seek(page * (metas[0][2] if metas else 0))
            raw = f.read(16 + 136)
            try:
                magic, = struct.unpack_from("<I", raw, 16)
                psize, = struct.unpack_from("<I", raw, 16 + 24)
                last_pg, txnid = struct.unpack_from("<QQ", raw, 16 + 120)
            except struct.error:
                return None
            if magic != 0xBEEFC0DE or psize < 256 or psize & (psize - 1):
                return None
            metas.append((txnid, last_pg, psize))
    txnid, last_pg, psize = max(metas)
    return (last_pg + 1) * psize


def repair(src: str, dst: str, progress: Progress | None = None, on_copied: Callable[[int], None] | None = None,
           ) -> RepairReport:
    """Copy what reads back whole from the store at ``src`` into a new store at ``dst`` (which must not exist or
    be empty). Raises ``StoreError`` when nothing can be read at all (no format record, unreadable meta)."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise StoreOpenError(f"destination {dst} exists and is not empty")
    report = RepairReport(src, dst)
    with tempfile.TemporaryDirectory(prefix="spec-cache-repair-", dir=os.path.dirname(dst) or None) as work:
        copy = _private_copy(src, work, report)
        try:
            report.structure_problems = check_structure(copy) or []
            source = Store.open(copy, readonly=True)
            try:
                with Store.open(dst, chunk_tokens=source.chunk_tokens) as target:
                    _copy_entries(source, target, report, progress, on_copied)
            finally:
                source.close()
        except StoreError as exc:  # messages name the source, never the private copy they came from
            raise type(exc)(_unmask(str(exc), copy, src)) from None
        report.structure_problems = [_unmask(p, copy, src) for p in report.structure_problems]
        report.errors = [_unmask(e, copy, src) for e in report.errors]
    return report


def _unmask(message: str, copy: str, src: str) -> str:
    """``message`` with the private copy's path (an internal temporary directory) replaced by the source's."""
    return message.replace(os.path.join(copy, "data.mdb"), os.path.join(src, "data.mdb")).replace(copy, src)


def _copy_entries(source: Store, target: Store, report: RepairReport, progress, on_copied) -> None:
    dbs = source.env.dbs
    entries: list[tuple[bytes, Entry]] = []
    namespaces: dict[bytes, NamespaceInfo] = {}
    try:
        with source.env.read() as txn:
            for key, raw in txn.cursor(db=dbs["entries"]):
                try:
                    entries.append((bytes(key), decode_typed("entries", raw, bytes(key))))
                except CorruptIndex as exc:
                    report.entries_lost += 1
                    _note(report, str(exc))
            for key, raw in txn.cursor(db=dbs["nsinfo"]):
                try:
                    namespaces[bytes(key)] = decode_typed("nsinfo", raw, bytes(key))
                except CorruptIndex as exc:
                    _note(report, str(exc))
    except StoreError as exc:  # the walk itself hit a damaged page: keep what was listed before it
        _note(report, f"listing entries stopped: {exc}")
    entries.sort(key=lambda item: item[1].last_use)  # oldest first: the copy keeps the LRU order
    registered: set[bytes] = set()
    total = len(entries)
    report.entries_seen = total
    for done, (key, entry) in enumerate(entries, 1):
        try:
            tokens = _tokens_of(source, key, entry)
            ns = entry.namespace
            if ns not in registered:
                info = namespaces.get(ns)
                if info is None:
                    raise CorruptIndex("its namespace record is lost")
                target.register_namespace(ns, target=info.target, prefix_namespace=info.prefix_namespace,
                                          tenant=info.tenant, tenant_id=info.tenant_id)
                registered.add(ns)
            copied_parts = _copy_one(source, target, ns, tokens, entry, report)
            report.entries_copied += 1
            report.drafter_parts_copied += copied_parts
            if on_copied:
                on_copied(report.entries_copied)
        except (StoreError, ValueError) as exc:
            report.entries_lost += 1
            report.drafter_parts_lost += len(entry.drafters)
            _note(report, f"entry {key.hex()[:16]}: {exc}")
        if progress:
            progress(done, total)
    report.namespaces = len(registered)


def _copy_one(source: Store, target: Store, ns: bytes, tokens: np.ndarray, entry: Entry, report) -> int:
    drafters = sorted(entry.drafters) or [None]
    parts = 0
    for i, dns in enumerate(drafters):
        notes: list[str] = []
        restored = source.fetch(ns, tokens, drafter=dns, warnings=notes)
        if restored is None or restored.length != entry.length or restored.entry is None:
            if i == 0:
                raise CorruptRecord(f"does not read back whole ({'; '.join(notes) or 'a shorter prefix or a miss'})")
            report.drafter_parts_lost += 1
            continue
        drafter = (dns, restored.attachment) if restored.attachment is not None else None
        if dns is not None and drafter is None:
            report.drafter_parts_lost += 1
            if i > 0:
                continue
        target.put(ns, tokens, restored.layers, drafter=drafter, minimum_reusable=entry.minimum_reusable,
                   pin=entry.pinned)
        parts += drafter is not None
    return parts


def _tokens_of(source: Store, key: bytes, entry: Entry) -> np.ndarray:
    """The full token list of an entry: its chunk chain's tokens (root to leaf) and its own tail tokens."""
    dbs = source.env.dbs
    pieces = []
    with source.reading() as txn:
        node_key = entry.node
        node = decode_typed("nodes", txn.get(node_key, db=dbs["nodes"]), node_key)
        seen = 0
        while node is not None and node.depth > 0 and seen < 1 << 20:
            raw = txn.get(node_key, db=dbs["chunks"])
            if raw is None:
                raise CorruptRecord("a chunk of its prefix is missing")
            pieces.append(bytes(verified_record(raw, "chunk", node_key).tensors["tokens"].data))
            node_key = node.parent
            node = decode_typed("nodes", txn.get(node_key, db=dbs["nodes"]), node_key)
            seen += 1
        if node is None:
            raise CorruptIndex("its chunk chain is broken")
        raw = txn.get(key, db=dbs["edata"])
        if raw is None:
            raise CorruptRecord("its record is missing")
        pieces.reverse()
        pieces.append(bytes(verified_record(raw, "entry", key).tensors["tokens"].data))
    tokens = np.frombuffer(b"".join(pieces), dtype="<u4")
    if len(tokens) != entry.length:
        raise CorruptIndex(f"its chain holds {len(tokens)} tokens, the entry says {entry.length}")
    return tokens


def _note(report: RepairReport, message: str) -> None:
    if len(report.errors) < 100:
        report.errors.append(message)

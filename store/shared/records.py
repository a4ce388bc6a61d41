"""Checkpoint records between LMDB and the shared tier, verified at both ends.

Outgoing: a committed local checkpoint read back from LMDB as its exact codec bytes (entry record, drafter
records, the chain's chunk keys and, on demand, chunk records), each verified before it leaves the host, so a
local bit flip is never spread to the fleet. Incoming: records fetched from the server are decoded and verified
(checksum, structure, kind, the key the record names, and the tokens it holds against the tokens asked
for) and assembled into ``LayerState`` lists by the store's one read path (``store/read.py``); promotion into
LMDB goes through ``Store.put``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from spec_cache.schemas import CheckpointAttachment

from ..codec import CHECKSUM_OFFSET, PREFIX_SIZE
from ..errors import CorruptRecord
from ..index import Index, draft_key
from ..read import piece_reader, read_attachment, read_layers, verified_record, whole_draft_record, whole_target_record
from ..store import Store
from ..tensors import LayerState


def record_checksum(raw) -> bytes:
    """The 32-byte checksum field a record carries in its prefix (what manifests pin)."""
    return bytes(memoryview(raw)[CHECKSUM_OFFSET:PREFIX_SIZE])


@dataclass
class Outgoing:
    """One local checkpoint ready to publish (chunk records are read separately: most are often already there)."""

    ns: bytes
    entry_key: bytes
    length: int
    tail: int
    minr: int
    complete: bool
    sig: bytes
    chain: list[bytes]                 # root, chunk_1 .. chunk_j (the root has no record)
    entry_record: bytes
    drafts: list[tuple[str, bytes, bytes]] = field(default_factory=list)  # (drafter ns, draft key, record)

    @property
    def nbytes(self) -> int:
        return len(self.entry_record) + sum(len(r) for _, _, r in self.drafts)


def read_outgoing(store: Store, entry_key: bytes, drafters: Iterable[str]) -> Outgoing | None:
    """The committed checkpoint ``entry_key`` with the given drafters' parts; None if it is gone (evicted).

    Raises ``CorruptRecord`` if a record fails verification (it is then not published).
    """
    with store.reading() as txn:
        index = Index(txn, store.env.dbs)
        entry = index.entry(entry_key)
        if entry is None:
            return None
        chain = [entry.node]
        node = index.node(chain[0])
        while node is not None and node.depth > 0:
            if node.broken:
                return None
            chain.append(node.parent)
            node = index.node(node.parent)
        if node is None:
            return None
        chain.reverse()
        raw = txn.get(entry_key, db=store.env.dbs["edata"])
        if raw is None:
            return None
        pieces = store.env.dbs["drafts"]
        entry_record = whole_target_record(raw, "entry", entry_key, lambda k: txn.get(k, db=pieces))  # 1.3: whole
        drafts = []
        for dns in drafters:
            if dns in entry.drafters:
                dkey = draft_key(entry_key, dns)
                raw = txn.get(dkey, db=store.env.dbs["drafts"])
                if raw is not None:  # pieces (format 1.2) copied in: the shared tier ships whole records
                    drafts.append((dns, dkey, whole_draft_record(raw, dkey, piece_reader(
                        lambda _kind, k: txn.get(k, db=store.env.dbs["drafts"])))))
    rec = verified_record(entry_record, "entry", entry_key)
    complete = all(row[3] is not None for row in rec.meta.get("layers", []))
    for _dns, dkey, record in drafts:
        verified_record(record, "draft", dkey)
    return Outgoing(entry.namespace, entry_key, entry.length, entry.tail, entry.minimum_reusable, complete,
                    node.signature, chain, entry_record, drafts)


def read_chunks(store: Store, keys: list[bytes]) -> dict[bytes, bytes] | None:
    """Verified chunk records for ``keys``; None if any is gone from LMDB. Raises ``CorruptRecord``."""
    out = {}
    with store.reading() as txn:
        for key in keys:
            raw = txn.get(key, db=store.env.dbs["chunks"])
            if raw is None:
                return None
            # pieces (format 1.3) copied in: the shared tier ships whole records; verified on the way
            out[key] = whole_target_record(raw, "chunk", key, lambda k: txn.get(k, db=store.env.dbs["drafts"]))
    return out


def local_chunks(store: Store, keys: list[bytes]) -> dict[bytes, bytes]:
    """The chunk records of ``keys`` the local store holds (unverified: ``assemble`` verifies every record), so a
    fetch from the shared tier skips them. Raises ``StoreError`` if the store cannot be read."""
    out = {}
    with store.reading() as txn:
        for key in keys:
            raw = txn.get(key, db=store.env.dbs["chunks"])
            if raw is not None:
                try:  # pieces (format 1.3) copied in: ``assemble`` reads whole chunk records
                    out[key] = whole_target_record(raw, "chunk", key, lambda k: txn.get(k, db=store.env.dbs["drafts"]))
                except CorruptRecord:
                    continue  # fetched from the shared tier instead
    return out


def assemble(*, packed: np.ndarray, length: int, chunk_tokens: int, chain: tuple[bytes, ...],
             records: dict[bytes, bytes], entry: bytes | None) -> list[LayerState]:
    """Verify fetched target records and rebuild the target layers of ``packed[:length]`` (``read.read_layers``).

    ``chain`` is root .. the node the prefix ends in or hangs off, ``records`` the fetched chunk records of
    ``chain[1:]`` and the entry record ``entry`` (None for a chunk-boundary prefix) by key. Raises
    ``CorruptRecord`` naming the bad record's key.
    """
    return read_layers(lambda _kind, key: records.get(key), packed=packed, length=length,
                       chunk_tokens=chunk_tokens, chain=chain, entry=entry)


def attachment_of(key: bytes, raw, length: int, warnings: list[str]) -> CheckpointAttachment | None:
    """The drafter attachment in a fetched draft record; None (with a warning) for an unknown or invalid schema.

    Raises ``CorruptRecord`` if the record itself is damaged.
    """
    return read_attachment(raw, key, length, warnings, source="shared ")

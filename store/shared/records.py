"""Checkpoint records between LMDB and the shared tier, verified at both ends.

Outgoing: a committed local checkpoint read back from LMDB as its exact codec bytes (entry record, drafter
records, the chain's chunk keys and, on demand, chunk records), each verified before it leaves the host, so a
local bit flip is never spread to the fleet. Incoming: records fetched from the server are decoded and verified
(blake3 checksum, structure, kind, the key the record names, and the tokens it holds against the tokens asked
for), then assembled into ``LayerState`` lists with the store's own assembler; promotion into LMDB goes through
``Store.put``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from spec_cache.schemas import CheckpointAttachment, SchemaError, validate_attachment
from spec_cache.schemas.errors import UnknownSchemaError

from ..codec import CHECKSUM_OFFSET, PREFIX_SIZE, Record, check_key, copy_out, decode_record
from ..errors import CorruptRecord
from ..index import Index, draft_key
from ..store import Store
from ..tensors import LayerState, Tensor


def record_checksum(raw) -> bytes:
    """The 32-byte blake3 checksum a record carries in its prefix (what manifests pin)."""
    return bytes(memoryview(raw)[CHECKSUM_OFFSET:PREFIX_SIZE])


@contextlib.contextmanager
def _reading(store: Store):
    # The store's lock keeps LMDB map growth (which needs no transaction open in this process) away from this read.
    with store._lock, store.env.read() as txn:
        yield txn


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
    with _reading(store) as txn:
        ix = Index(txn, store.env.dbs)
        entry = ix.get("entries", entry_key)
        if entry is None:
            return None
        chain = [entry["node"]]
        node = ix.get("nodes", chain[0])
        while node is not None and node["depth"] > 0:
            if node.get("broken"):
                return None
            chain.append(node["parent"])
            node = ix.get("nodes", node["parent"])
        if node is None:
            return None
        sig = node.get("sig", b"")
        chain.reverse()
        raw = txn.get(entry_key, db=store.env.dbs["edata"])
        if raw is None:
            return None
        entry_record = bytes(raw)
        drafts = []
        for dns in drafters:
            if dns in entry["drafters"]:
                dkey = draft_key(entry_key, dns)
                raw = txn.get(dkey, db=store.env.dbs["drafts"])
                if raw is not None:
                    drafts.append((dns, dkey, bytes(raw)))
    rec = _verified(entry_record, "entry", entry_key)
    complete = all(row[3] is not None for row in rec.meta.get("layers", []))
    for _dns, dkey, record in drafts:
        _verified(record, "draft", dkey)
    return Outgoing(entry["ns"], entry_key, entry["len"], entry["tail"], entry["minr"], complete, sig, chain,
                    entry_record, drafts)


def read_chunks(store: Store, keys: list[bytes]) -> dict[bytes, bytes] | None:
    """Verified chunk records for ``keys``; None if any is gone from LMDB. Raises ``CorruptRecord``."""
    out = {}
    with _reading(store) as txn:
        for key in keys:
            raw = txn.get(key, db=store.env.dbs["chunks"])
            if raw is None:
                return None
            out[key] = bytes(raw)
    for key, raw in out.items():
        _verified(raw, "chunk", key)
    return out


def _verified(raw, kind: str, key: bytes, expect_tokens: np.ndarray | None = None) -> Record:
    try:
        rec = decode_record(raw)
    except CorruptRecord as exc:
        raise CorruptRecord(f"{kind} record: {exc}", key) from None
    if rec.kind != kind:
        raise CorruptRecord(f"{kind} record holds a {rec.kind!r} record", key)
    check_key(rec, key, kind)  # a record names the key it was written under
    if expect_tokens is not None:
        stored = rec.tensors.get("tokens")
        if stored is None or stored.shape != (len(expect_tokens),) or bytes(stored.data) != expect_tokens.tobytes():
            raise CorruptRecord(f"{kind} record holds other tokens than its key says", key)
    return rec


@dataclass(frozen=True)
class _Span:
    """What ``Store._assemble`` needs to know about the prefix being rebuilt."""

    length: int
    entry: bytes | None


def assemble(*, packed: np.ndarray, length: int, chunk_tokens: int, chunks: list[tuple[bytes, bytes]],
             entry: tuple[bytes, bytes] | None) -> list[LayerState]:
    """Verify fetched target records and rebuild the target layers of ``packed[:length]``.

    ``chunks`` are ``(key, record)`` for chunk 1..j, ``entry`` ``(key, record)`` or None for a chunk-boundary
    prefix. Raises ``CorruptRecord`` naming the bad record's key.
    """
    C = chunk_tokens
    decoded = [_verified(raw, "chunk", key, packed[k * C:(k + 1) * C]) for k, (key, raw) in enumerate(chunks)]
    entry_rec = None
    if entry is not None:
        base = len(chunks) * C
        entry_rec = _verified(entry[1], "entry", entry[0], packed[base:length])
        meta = entry_rec.meta
        if meta.get("length") != length or meta.get("chunk_tokens") != C:
            raise CorruptRecord(f"entry record covers {meta.get('length')} tokens in chunks of "
                                f"{meta.get('chunk_tokens')}, expected {length} in chunks of {C}", entry[0])
        table = meta.get("layers")
    else:
        table = decoded[0].meta.get("layers") if decoded else None
    bad_key = entry[0] if entry is not None else (chunks[-1][0] if chunks else None)
    if table is None:
        raise CorruptRecord("fetched records carry no layer table", bad_key)
    try:
        return Store._assemble(table, decoded, entry_rec, _Span(length, bad_key))
    except CorruptRecord as exc:
        raise CorruptRecord(str(exc), bad_key) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptRecord(f"fetched layer table does not match its tensors ({exc})", bad_key) from None


def attachment_of(key: bytes, raw, length: int, warnings: list[str]) -> CheckpointAttachment | None:
    """The drafter attachment in a fetched draft record; None (with a warning) for an unknown or invalid schema.

    Raises ``CorruptRecord`` if the record itself is damaged.
    """
    rec = _verified(raw, "draft", key)
    try:
        tensors = tuple(Tensor(t.dtype, t.shape, copy_out(t)) for t in rec.tensors.values())
        attachment = CheckpointAttachment(rec.schema, rec.meta.get("metadata", {}), tensors)
        validate_attachment(attachment, length)
    except UnknownSchemaError as exc:
        warnings.append(f"shared drafter part skipped: {exc}")
        return None
    except SchemaError as exc:
        warnings.append(f"shared drafter part skipped: stored attachment is invalid: {exc}")
        return None
    return attachment

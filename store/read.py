"""Verified reads: records checked and assembled into layers; one path for the local store and the shared tier.

Whatever a record comes from (an LMDB read transaction, a Redis MULTI), it is returned only after:

* its checksum (XXH3-128, or blake3 in format-1 records) and structure pass (``codec.decode_record``), a large
  record's checksum on the verifier's threads from the moment it is decoded, while the rest is read and copied
  out (``BackgroundVerifier``; the hash releases the GIL, ``xxh3.py``), or, when the caller passes a
  ``fill.Sink``, in the same pass that copies its tensors into the sink's buffers (``fill.py``); nothing is
  returned before every checksum passed;
* it is of the kind asked for (chunk, entry, draft) and names the key it is stored under (``codec.check_key``);
* it holds the prompt's tokens for the span its key stands for;
* an entry record covers the length asked for in chunks of the store's size, a chunk-boundary prefix comes
  from a fully chunked checkpoint, and every layer's pieces add up to the prefix length.

Any failure raises ``CorruptRecord`` naming the key of the record to drop (a miss plus a warning for the
caller). A drafter part with an unknown or invalid schema is not damage: it is skipped with a warning.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from spec_cache.schemas import CheckpointAttachment, SchemaError, validate_attachment
from spec_cache.schemas.errors import UnknownSchemaError

from .codec import Record, check_key, decode_record, encode_record, verify_checksum
from .errors import CorruptRecord
from .fill import fill_layers, idle_lanes, is_sink, layers_from_plan
from .pieces import resolve_tensors, self_contained
from .spans import span_segments, whole_record
from .tensors import LayerState, numpy_dtype

__all__ = ["ASYNC_VERIFY_BYTES", "BackgroundVerifier", "Concat", "Deferred", "RawRecords", "verified_record",
           "read_layers", "read_attachment", "assemble_layers", "plan_layers", "piece_reader", "whole_draft_record",
           "whole_target_record"]

log = logging.getLogger("spec_cache.store")
ASYNC_VERIFY_BYTES = 1 << 20  # records at least this big are checksummed on other threads during a read
VERIFY_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads checksumming (and, into a sink, copying) records

RawRecords = Callable[[str, bytes], Any]
"""``raw(kind, key)``: the stored bytes of the ``kind`` record under ``key`` (a buffer), or None if absent."""

Concat = Callable[[list, int, str], Any]
"""``concat(pieces, axis, dtype)``: build a token-sliceable tensor from numpy views of its pieces (valid only
during the call: copy them) and return what ``Tensor.data`` should hold."""


class Deferred(NamedTuple):
    """A record whose checksum is checked after decoding: its kind, the key a failure names, its bytes, the
    piece key (``CorruptRecord.piece``) and the decoded record."""

    kind: str
    key: bytes
    raw: Any
    piece: bytes | None
    record: Record

    def mismatch(self) -> CorruptRecord:
        """The error a failed checksum of this record raises."""
        return CorruptRecord(f"{self.kind} record: record checksum mismatch (bit flip or truncation)", self.key,
                             self.piece)


def _check(d: Deferred) -> bool:
    try:
        return verify_checksum(d.raw)
    except Exception:  # anything unexpected while checking bytes: not served
        return False


class Pending:
    """Checksums under way: ``append(deferred)`` starts one on the verifier's threads at once, so hashing
    overlaps the decoding of the records after it; ``BackgroundVerifier.wait`` collects them."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.items: list[tuple[Deferred, Future]] = []

    def append(self, d: Deferred) -> None:
        self.items.append((d, self.pool.submit(_check, d)))

    def __len__(self) -> int:
        return len(self.items)

    def settle(self) -> Deferred | None:
        """Wait for every checksum (none may still read a record when the read transaction ends); the first
        failing record in read order, or None."""
        results = [f.result() for _d, f in self.items]
        return next((d for (d, _f), ok in zip(self.items, results) if not ok), None)


class BackgroundVerifier:
    """Checksums large records on worker threads while their tensors are copied out. The hash releases the GIL
    (``xxh3``), so with ``threads`` workers several records are checked at once on several cores, and a restore
    costs about one pass over its bytes instead of two. Created lazily; ``close()`` ends the threads."""

    def __init__(self, min_bytes: int = ASYNC_VERIFY_BYTES, threads: int | None = None):
        self.min_bytes = min_bytes
        self.threads = max(1, threads if threads is not None else VERIFY_THREADS)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def defers(self, raw) -> bool:
        return len(raw) >= self.min_bytes

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="spec-cache-verify")
            return self._pool

    def pending(self) -> Pending:
        """A list for ``verified_record(deferred=...)`` whose records are checked as soon as they are added."""
        return Pending(self.pool())

    def start(self, deferred) -> Pending | None:
        """Checksum ``deferred`` (``Deferred`` records, or a ``Pending`` already under way); None when empty."""
        if not deferred:
            return None
        if isinstance(deferred, Pending):
            return deferred
        pending = self.pending()
        for d in deferred:
            pending.append(d)
        return pending

    @staticmethod
    def wait(pending: Pending | None) -> None:
        """Wait for background checksums; raise ``CorruptRecord`` for the first record that failed."""
        if pending is None:
            return
        bad = pending.settle()
        if bad is not None:
            raise bad.mismatch()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def verified_record(raw, kind: str, key: bytes, expect_tokens: np.ndarray | None = None, *,
                    deferred: list | None = None, verifier: BackgroundVerifier | None = None,
                    owner: bytes | None = None) -> Record:
    """Decode the ``kind`` record ``raw`` stored under ``key`` and check it (see the module docstring).

    With ``verifier`` and ``deferred`` a large record's checksum is left for ``verifier.start(deferred)``.
    ``owner``: the key a failure names instead of ``key`` (a piece's failure drops the record that names it;
    ``CorruptRecord.piece`` is then ``key``, so the damaged piece goes too and the next put writes it again).
    """
    bad, piece = (key, None) if owner is None else (owner, key)
    if raw is None:
        raise CorruptRecord(f"{kind} record missing under an indexed key", bad, piece)
    defer = deferred is not None and verifier is not None and verifier.defers(raw)
    try:
        rec = decode_record(raw, verify=not defer)
    except CorruptRecord as exc:
        raise CorruptRecord(f"{kind} record: {exc}", bad, piece) from None
    if defer:
        deferred.append(Deferred(kind, bad, raw, piece, rec))
    if rec.kind != kind:
        raise CorruptRecord(f"{kind} record holds a {rec.kind!r} record", bad, piece)
    try:
        check_key(rec, key, kind)  # a record names the key it was written under
    except CorruptRecord as exc:
        raise CorruptRecord(str(exc), bad, piece) from None
    if expect_tokens is not None:
        stored = rec.tensors.get("tokens")
        if stored is None or stored.shape != (len(expect_tokens),) or bytes(stored.data) != expect_tokens.tobytes():
            raise CorruptRecord(f"{kind} record holds other tokens than its key says", bad, piece)
    return rec


def read_layers(raw: RawRecords, *, packed: np.ndarray, length: int, chunk_tokens: int, chain: Sequence[bytes],
                entry: bytes | None, concat: Concat | None = None,
                verifier: BackgroundVerifier | None = None) -> list[LayerState]:
    """The target layers of ``packed[:length]`` from the chunk records of ``chain[1:]`` and, unless ``entry`` is
    None (a chunk-boundary prefix), the entry record ``entry``. Raises ``CorruptRecord``.

    Large records are checksummed on the verifier's threads from the moment they are decoded while the rest is
    read and assembled; with a ``fill.Sink`` as ``concat`` each record is instead checksummed in the pass that
    copies its tensors into the sink's buffers (``fill.py``). Either way nothing is returned before every record
    it came from passed, and no thread reads a record after this returns or raises."""
    fused = verifier is not None and is_sink(concat)
    deferred: Any = [] if fused or verifier is None else verifier.pending()
    records: list[Record] = []
    try:
        return _read_layers(raw, packed, length, chunk_tokens, chain, entry, concat, verifier, deferred, records,
                            fused)
    finally:
        if isinstance(deferred, Pending):
            deferred.settle()  # normally settled already; on an error, wait before the transaction ends


def _read_layers(raw, packed, length, chunk_tokens, chain, entry, concat, verifier, deferred, records, fused):
    chunks, segments = [], []

    def verified(raw_rec, kind, key, expect, owner=None) -> Record:
        rec = verified_record(raw_rec, kind, key, expect, deferred=deferred, verifier=verifier, owner=owner)
        records.append(rec)
        return rec

    def get_piece(key: bytes, owner: bytes, lo: int, hi: int) -> Record:  # format 1.3 (``spans.py``)
        return verified(raw("piece", key), "piece", key, packed[lo:hi], owner=owner)
    for k, key in enumerate(chain[1:], 1):
        expect = packed[(k - 1) * chunk_tokens:k * chunk_tokens]
        chunks.append(verified(raw("chunk", key), "chunk", key, expect))
        segments += span_segments(chunks[-1], key, (k - 1) * chunk_tokens, chunk_tokens, get_piece)
    entry_rec = None
    if entry is None:
        bad_key = chain[-1] if len(chain) > 1 else None
        table = chunks[0].meta.get("layers") if chunks else None
        if chunks and chunks[-1].meta.get("complete") is False:  # the node's flag disagrees: index damage
            raise CorruptRecord("chunk-boundary prefix of a checkpoint with untrimmable layers (damaged index)",
                                bad_key)
    else:
        bad_key = entry
        base = (len(chain) - 1) * chunk_tokens
        entry_rec = verified(raw("entry", entry), "entry", entry, packed[base:length])
        meta = entry_rec.meta
        if meta.get("length") != length or meta.get("chunk_tokens") != chunk_tokens:
            raise CorruptRecord(f"entry record covers {meta.get('length')} tokens in chunks of "
                                f"{meta.get('chunk_tokens')}, expected {length} in chunks of {chunk_tokens}", entry)
        table = meta.get("layers")
        if entry_rec.meta.get("pieces") is not None:  # the tail's chunked tensors are in pieces (format 1.3)
            segments += span_segments(entry_rec, entry, base, length - base, get_piece)
    pending = verifier.start(deferred) if verifier is not None and not fused else None

    def settle() -> None:  # a checksum failure explains a broken table best: report that first
        BackgroundVerifier.wait(verifier.start(deferred) if fused else pending)
    entry_tails = entry_rec is not None and entry_rec.meta.get("pieces") is None
    try:
        if table is None:
            raise CorruptRecord("records carry no layer table", bad_key)
        plan = plan_layers(table, segments, entry_rec, length, entry_tails=entry_tails)
        if not fused:
            layers = _assembled(plan, concat)
    except CorruptRecord as exc:
        settle()
        raise CorruptRecord(str(exc), bad_key) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        settle()
        raise CorruptRecord(f"stored layer table does not match its tensors ({exc})", bad_key) from None
    if fused:  # copies and checksums in one pass per record, on the verifier's threads
        by_id = {id(d.record): d for d in deferred}
        try:
            return fill_layers(plan, [(rec, by_id.get(id(rec))) for rec in records], concat, verifier.pool(),
                               idle_lanes(verifier.threads))
        except CorruptRecord as exc:
            if exc.key is None:
                raise CorruptRecord(str(exc), bad_key) from None
            raise
    BackgroundVerifier.wait(pending)  # nothing is returned before every record it came from passed its checksum
    return layers


def plan_layers(layer_table, chunks: list[Record], entry_rec: Record | None, length: int, *,
                entry_tails: bool = True) -> list:
    """Where each layer's tensors come from: ``[(i, kind, meta, axis, [(dtype, axis or None, full shape,
    [(record, tensor name), ...]), ...]), ...]``. A chunked tensor's pieces come from ``chunks`` in order (chunk
    records, target pieces), then from the entry record when ``entry_tails`` (it holds its tail unless it is
    pieced); an untrimmable layer's tensors come whole from the entry record. Raises ``CorruptRecord`` (without
    a key) when the pieces do not add up or do not have the table's dtype, KeyError/TypeError/... for a table
    that does not fit the tensors."""
    plan = []
    for i, kind, meta, axis, tensor_specs in layer_table:
        out = []
        for j, (dtype, shape) in enumerate(tensor_specs):
            name = f"L{i}.{j}"
            if axis is None:
                whole = entry_rec.tensors[name]
                if whole.dtype != dtype or list(whole.shape) != list(shape):
                    raise CorruptRecord(f"layer {i} tensor {j} does not match the stored layer table")
                out.append((dtype, None, tuple(shape), [(entry_rec, name)]))
                continue
            recs = list(chunks) + ([entry_rec] if entry_rec is not None and entry_tails else [])
            pieces = [r.tensors[name] for r in recs]
            full = list(shape)
            full[axis] = sum(p.shape[axis] for p in pieces)
            if any(len(p.shape) != len(full) or p.dtype != dtype
                   or any(d != f for a, (d, f) in enumerate(zip(p.shape, full)) if a != axis) for p in pieces):
                raise CorruptRecord(f"layer {i} pieces do not match the stored layer table")
            if full[axis] != length:
                raise CorruptRecord(f"layer {i} pieces cover {full[axis]} tokens, expected {length}")
            out.append((dtype, axis, tuple(full), [(r, name) for r in recs]))
        plan.append((i, kind, meta, axis, out))
    return plan


def _assembled(plan: list, concat: Concat | None) -> list[LayerState]:
    def joined(dtype, axis, shape, parts):
        return _concatenate([rec.tensors[name] for rec, name in parts], axis, dtype, list(shape), concat)
    return layers_from_plan(plan, joined)


def assemble_layers(layer_table, chunks: list[Record], entry_rec: Record | None, length: int, *,
                    concat: Concat | None = None, entry_tails: bool = True) -> list[LayerState]:
    """Concatenate each chunked layer's pieces along its token axis (one copy out of the map, or ``concat``'s
    result); untrimmable layers come whole from the entry record (``plan_layers`` says where each comes from and
    what raises)."""
    return _assembled(plan_layers(layer_table, chunks, entry_rec, length, entry_tails=entry_tails), concat)


def _concatenate(pieces, axis: int, dtype: str, full: list[int], concat: Concat | None):
    if concat is not None:
        return concat([p.array() for p in pieces], axis, dtype)
    arr = np.empty(full, dtype=numpy_dtype(dtype))
    index: list = [slice(None)] * arr.ndim
    at = 0
    for p in pieces:
        step = p.shape[axis]
        index[axis] = slice(at, at + step)
        arr[tuple(index)] = p.array()
        at += step
    return arr


def piece_reader(raw: RawRecords) -> Callable[[bytes], Record]:
    """``get_piece(key)``: the verified piece record under ``key`` (store format 1.2; ``pieces.py``)."""
    return lambda key: verified_record(raw("piece", key), "piece", key)


def _no_pieces(key: bytes) -> Record:
    raise CorruptRecord(f"piece {key.hex()[:16]} asked for where no pieces are stored")


def read_attachment(raw, key: bytes, length: int, warnings: list[str], *, source: str = "",
                    get_piece: Callable[[bytes], Record] | None = None) -> CheckpointAttachment | None:
    """The drafter attachment in the draft record ``raw`` under ``key``, validated for ``length`` tokens; None
    (with a warning, ``source`` naming where it came from) for an unknown or invalid schema. A pieced record
    (store format 1.2) is assembled from its pieces through ``get_piece`` (``piece_reader``).

    Raises ``CorruptRecord`` (naming ``key``) if the record or a piece it names is damaged or missing.
    """
    rec = verified_record(raw, "draft", key)
    tensors = tuple(resolve_tensors(rec, key, get_piece or _no_pieces))
    try:
        attachment = CheckpointAttachment(rec.schema, rec.meta.get("metadata", {}), tensors)
        validate_attachment(attachment, length)
    except UnknownSchemaError as exc:
        message = f"{source}drafter part skipped: {exc}"
    except SchemaError as exc:
        message = f"{source}drafter part skipped: stored attachment is invalid: {exc}"
    else:
        return attachment
    warnings.append(message)
    log.warning(message)
    return None


def whole_target_record(raw, kind: str, key: bytes, raw_piece: Callable[[bytes], Any]) -> bytes:
    """Entry or chunk record ``raw`` as one self-contained record (the pre-1.3 layout), its target pieces copied
    in (``spans.py``): what the shared tier publishes. A whole record comes back as it is. Raises
    ``CorruptRecord`` naming ``key`` if it or a piece it names is damaged or missing."""
    rec = verified_record(raw, kind, key)
    if rec.meta.get("pieces") is None:
        return bytes(raw)
    tokens = rec.tensors["tokens"].array()

    def get_piece(k: bytes, owner: bytes, lo: int, hi: int) -> Record:
        return verified_record(raw_piece(k), "piece", k, tokens[lo:hi], owner=owner)
    segments = span_segments(rec, key, 0, len(tokens), get_piece)
    return bytes(whole_record(rec, kind, key, segments))


def whole_draft_record(raw, key: bytes, get_piece: Callable[[bytes], Record]) -> bytes:
    """Draft record ``raw`` as one self-contained record (the pre-1.2 layout), its pieces copied in: what the
    shared tier publishes, so readers elsewhere need no pieces. A whole record comes back as it is."""
    rec = verified_record(raw, "draft", key)
    if rec.meta.get("pieced") is None:
        return bytes(raw)
    fields = self_contained(rec, resolve_tensors(rec, key, get_piece))
    return bytes(encode_record("draft", fields["tensors"], schema=fields["schema"], meta=fields["meta"]))

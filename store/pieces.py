"""Shared drafter pieces (store format 1.2): drafter records split into content-addressed, reference-counted parts.

Before 1.2 every drafter record held its whole attachment, so N conversations that share a system prompt stored
the drafter's state of that prompt N times. From 1.2 a drafter record is written *pieced* when that saves bytes:

* token-sliceable tensors (the per-token KV of a draft model or a projected drafter: every tensor of a ``kv`` /
  ``qkv`` layer in ``metadata.cacheHeaders``, a Qwen MTP head's K and V, an n-gram history) are cut at multiples
  of the store's ``chunk_tokens`` along their token axis; chunk ``k`` of every such tensor goes into one *chunk
  piece*; what is past the last full chunk stays in the drafter record;
* a tensor that cannot be sliced (a ring buffer, a recurrent state, a hidden vector) becomes a *whole piece*
  of its own when it holds at least ``PIECE_MIN_BYTES``, else it stays in the drafter record.

A piece's key is a keyed blake3 (the namespace key is the blake3 key) of its tensor table and bytes: identical
bytes in one namespace are stored once, whichever entry wrote them first, and a piece is never shared across
namespaces (no tenant learns what another stored). Correctness never rests on token positions: only equal bytes
are shared. Piece records (kind ``piece``, ``{"key": key}``) live in the ``drafts`` sub-database (32-byte keys;
drafter records have 48); each has a row ``meta`` ``piece/`` + key -> msgpack ``{ns, refs, bytes}``, ``refs``
being how many times drafter parts of entries name it (``Entry.extra["pcs"]``: drafter namespace -> piece keys).
A piece goes with its last reference, in the same transaction; ``verify`` checks the counts, ``gc`` rebuilds them.

A pieced drafter record carries ``meta["pieced"]`` = ``{"v": 1, "span": chunk tokens, "tensors": [[dtype, shape,
axis], ...] (the full tensors, axis None when not sliced), "chunks": [key, ...], "whole": [[j, key], ...]}``;
its own tensors ``t{j}`` are the tails of sliced tensors and the unsliced tensors kept inline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import blake3
import msgpack
import numpy as np

from .codec import Record, encode_record
from .errors import CorruptRecord
from .tensors import Tensor, numpy_dtype

__all__ = ["PIECES_MINOR", "PIECE_MIN_BYTES", "PIECE_ROW_PREFIX", "Piece", "piece_row_key", "is_piece_row",
           "token_axes", "split_tensors", "resolve_tensors", "pieced", "manifest_keys"]

PIECES_MINOR = 2             # store format 1.2: drafter records may reference shared pieces
PIECE_MIN_BYTES = 4096       # an unsliced tensor smaller than this stays inline (a piece costs ~300 bytes)
PIECE_ROW_PREFIX = b"piece/"  # meta: piece/ + 32-byte piece key -> {ns, refs, bytes}
MANIFEST_VERSION = 1
WRITE_PIECES = True  # False: write whole drafter records (the pre-1.2 layout; benchmarks measure "before" so)
_SLICED_KINDS = ("kv", "qkv")  # cache-header kinds whose tensors are [1, heads, offset, ...] (token axis 2)


def piece_row_key(key: bytes) -> bytes:
    return PIECE_ROW_PREFIX + key


def is_piece_row(key) -> bool:
    return key is not None and len(key) == len(PIECE_ROW_PREFIX) + 32 and bytes(key).startswith(PIECE_ROW_PREFIX)


def token_axes(schema: str, metadata: dict, shapes: Sequence[tuple[int, ...]]) -> list[int | None]:
    """The token axis of each attachment tensor (None: not sliced). Only a layout the schema states is sliced;
    anything unexpected stays whole (slicing is a saving, never a requirement)."""
    axes: list[int | None] = [None] * len(shapes)
    headers = metadata.get("cacheHeaders")
    if isinstance(headers, str):
        try:
            decoded = json.loads(headers)
        except ValueError:
            decoded = None
        for header in decoded if isinstance(decoded, list) else ():
            if not isinstance(header, dict) or header.get("kind") not in _SLICED_KINDS:
                continue
            offset = header.get("offset")
            for j in header.get("tensors") or ():
                if isinstance(j, int) and 0 <= j < len(shapes) and len(shapes[j]) == 4 and shapes[j][2] == offset:
                    axes[j] = 2
    elif schema.startswith("ngram-history-") and len(shapes) == 1 and len(shapes[0]) == 1:
        axes[0] = 0
    elif schema.startswith("qwen-mtp-") and len(shapes) == 3 and all(len(s) == 4 for s in shapes[:2]):
        axes[0] = axes[1] = 2
    return axes


@dataclass
class Piece:
    """A piece a drafter record refers to: its key, a size estimate (raw bytes) and its encoder (called only
    when the store does not hold it yet)."""

    key: bytes
    nbytes: int
    encode: Callable[[], np.ndarray]


def _slice(arr: np.ndarray, axis: int, lo: int, hi: int) -> np.ndarray:
    index: list = [slice(None)] * arr.ndim
    index[axis] = slice(lo, hi)
    return arr[tuple(index)]


def _piece(ns_key: bytes, tensors: list[tuple[str, str, np.ndarray]]) -> Piece:
    """A piece of ``tensors`` keyed by blake3(key=ns_key) over its table and bytes."""
    h = blake3.blake3(msgpack.packb([[n, d, list(a.shape)] for n, d, a in tensors]), key=ns_key)
    for _n, _d, arr in tensors:
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
    key = h.digest()
    nbytes = sum(a.nbytes for _n, _d, a in tensors)
    return Piece(key, nbytes, lambda: encode_record("piece", tensors, meta={"key": key}))


def split_tensors(ns_key: bytes, tensors: Sequence[tuple[str, np.ndarray]], axes: Sequence[int | None],
                  span: int) -> tuple[list[tuple[str, str, np.ndarray]], dict | None, list[Piece]]:
    """Cut a drafter record's tensors (``(dtype, array)`` each) into inline tensors, a manifest and pieces.

    Returns ``(inline, None, [])`` (the pre-1.2 layout: ``t{j}`` whole) when nothing would be shared."""
    if not WRITE_PIECES:
        return [(f"t{j}", d, a) for j, (d, a) in enumerate(tensors)], None, []
    sliced = [j for j, a in enumerate(axes) if a is not None]
    full = min((tensors[j][1].shape[axes[j]] for j in sliced), default=0) // span
    whole = [j for j, a in enumerate(axes) if a is None and tensors[j][1].nbytes >= PIECE_MIN_BYTES]
    if not full and not whole:
        return [(f"t{j}", d, a) for j, (d, a) in enumerate(tensors)], None, []
    chunks = [_piece(ns_key, [(f"t{j}", tensors[j][0], _slice(tensors[j][1], axes[j], (k - 1) * span, k * span))
                              for j in sliced]) for k in range(1, full + 1)]
    wholes = {j: _piece(ns_key, [(f"t{j}", tensors[j][0], tensors[j][1])]) for j in whole}
    inline = []
    for j, (dtype, arr) in enumerate(tensors):
        if axes[j] is not None:
            inline.append((f"t{j}", dtype, _slice(arr, axes[j], full * span, arr.shape[axes[j]])))
        elif j not in wholes:
            inline.append((f"t{j}", dtype, arr))
    manifest = {"v": MANIFEST_VERSION, "span": span,
                "tensors": [[d, list(a.shape), axes[j]] for j, (d, a) in enumerate(tensors)],
                "chunks": [p.key for p in chunks], "whole": [[j, p.key] for j, p in wholes.items()]}
    return inline, manifest, chunks + list(wholes.values())


def pieced(rec: Record) -> dict | None:
    """The piece manifest of a drafter record (None: a whole record, the pre-1.2 layout)."""
    return rec.meta.get("pieced")


def manifest_keys(manifest: dict) -> list[bytes]:
    """Every piece key a manifest names, with repeats (a reference each)."""
    return list(manifest.get("chunks") or []) + [key for _j, key in manifest.get("whole") or []]


def resolve_tensors(rec: Record, key: bytes, get_piece: Callable[[bytes], Record | None]) -> list[Tensor]:
    """The full tensors of drafter record ``rec`` (stored under ``key``), owned copies, in attachment order.

    ``get_piece(k)`` returns the verified piece record ``k`` or None when it is gone. Raises ``CorruptRecord``
    naming ``key`` (the drafter part is dropped) for a missing piece or pieces that do not add up."""
    manifest = pieced(rec)
    if manifest is None:
        return [Tensor(t.dtype, t.shape, np.array(t.array(), copy=True)) for t in rec.tensors.values()]
    try:
        return _assemble(rec, manifest, get_piece)
    except CorruptRecord as exc:
        raise CorruptRecord(f"draft record: {exc}", key) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptRecord(f"draft record: piece manifest does not fit its pieces ({exc})", key) from None


def _assemble(rec: Record, manifest: dict, get_piece: Callable[[bytes], Record | None]) -> list[Tensor]:
    if manifest.get("v") != MANIFEST_VERSION or not isinstance(manifest.get("span"), int):
        raise CorruptRecord(f"unknown piece manifest version {manifest.get('v')!r}")
    span = manifest["span"]

    def piece(k: bytes) -> Record:
        got = get_piece(bytes(k))
        if got is None:
            raise CorruptRecord(f"piece {bytes(k).hex()[:16]} is missing")
        return got
    chunks = [piece(k) for k in manifest["chunks"]]
    whole = {j: piece(k) for j, k in manifest["whole"]}
    out = []
    for j, (dtype, shape, axis) in enumerate(manifest["tensors"]):
        name = f"t{j}"
        if axis is None:
            src = (whole[j] if j in whole else rec).tensors[name]
            if src.dtype != dtype or list(src.shape) != list(shape):
                raise CorruptRecord(f"tensor {j} does not match its manifest")
            out.append(Tensor(dtype, tuple(shape), np.array(src.array(), copy=True)))
            continue
        parts = [c.tensors[name] for c in chunks] + [rec.tensors[name]]
        arr = np.empty(shape, dtype=numpy_dtype(dtype))
        at = 0
        for k, p in enumerate(parts):
            step = p.shape[axis]
            if p.dtype != dtype or (k < len(chunks) and step != span) or at + step > shape[axis]:
                raise CorruptRecord(f"tensor {j}: pieces do not add up to its shape")
            target = _slice(arr, axis, at, at + step)
            if target.shape != p.shape:
                raise CorruptRecord(f"tensor {j}: a piece has the wrong shape")
            target[...] = p.array()
            at += step
        if at != shape[axis]:
            raise CorruptRecord(f"tensor {j}: pieces cover {at} of {shape[axis]} positions")
        out.append(Tensor(dtype, tuple(shape), arr))
    return out


def self_contained(rec: Record, tensors: list[Tensor]) -> dict[str, Any]:
    """Header fields to re-encode a pieced record whole (the shared tier ships whole drafter records)."""
    meta = {k: v for k, v in rec.meta.items() if k != "pieced"}
    return {"kind": rec.kind, "schema": rec.schema, "meta": meta,
            "tensors": [(f"t{j}", t.dtype, t.array()) for j, t in enumerate(tensors)]}

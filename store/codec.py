"""The record codec: how one stored value becomes bytes and back (the store's ``Disk``).

Layout of a record (all integers little-endian; documented in the README, a public contract)::

    0   4  magic  b"SPCR"
    4   1  format major (2)      5  1  format minor (0)      6  2  reserved (0)
    8   4  header length H       12 4  reserved (0)
    16 32  checksum of bytes 0..15 followed by every byte from offset 48 to the end (header, padding,
           payload): the checksum covers every byte of the record except itself
             format 2.0 (written since 2026-12): XXH3-128 (canonical big-endian digest, 16 bytes) then 16
                        zero bytes (checked: any other value is corruption)
             format 1.0 (older stores, still read and verified): blake3, 32 bytes
    48  H  msgpack header: {"kind", "schema", "meta", "tensors": [[name, dtype, shape, offset, nbytes], ...],
                            "payload": payload length, "data": data offset inside the payload}
    ..     zero padding to a 64-byte boundary
    P      payload: a complete safetensors blob (u64 JSON length, JSON table padded with spaces so the tensor
           data starts 64-byte aligned, then the raw tensor bytes back to back), so any safetensors reader can
           read a record's tensors: ``safetensors.numpy.load(bytes(record[P:]))``.

Formats 1 and 2 differ only in the checksum. The per-read checksum guards against corruption (bit flips, torn
or misdirected writes), not against someone who can rewrite the checksum too, so it need not be cryptographic:
XXH3 (what RocksDB verifies its blocks with) runs ~4.7x faster per core than blake3 here (11.8 vs 2.5 GB/s),
and verifying every byte read bounded restores on small machines. Large records are hashed by ``xxh3.py``
(python-xxhash's own compiled XXH3 called without the GIL: the same digests, so several records are checked at
once), and a restore into a ``fill.Sink`` feeds each record's hash tensor by tensor as it copies them out.
blake3 stays where collision resistance matters (artifact identity, content-addressed keys). A spec-cache that
knows only format 1 refuses a format 2 record as unreadable (a miss), never misreads it.

Every read verifies the checksum before anything is returned (a large record's header is parsed first, under
the hard limits below, so its tensors can be copied out while it is hashed); a mismatch, a truncation, or a
header that breaks any structural rule raises ``CorruptRecord``. The header is at most 256 KiB and msgpack is
decoded with hard limits, so a crafted header cannot allocate more than about 20 MiB (an empty container costs
64 bytes per header byte). No pickle anywhere.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Iterable

import blake3
import msgpack
import numpy as np

from spec_cache.schemas.dtypes import DTYPE_ITEMSIZE, SAFETENSORS_DTYPE

from .errors import CorruptRecord, InvalidInput
from .tensors import Tensor, as_numpy, numpy_dtype
from .xxh3 import Hasher, xxh3_128_digest

MAGIC = b"SPCR"
FORMAT_MAJOR = 2  # what new records are written as (XXH3-128 checksum)
FORMAT_MINOR = 0
FORMAT_BLAKE3 = 1  # the first format (blake3 checksum): still read and verified, written only on request
READABLE_MAJORS = (FORMAT_BLAKE3, FORMAT_MAJOR)
WRITE_MAJOR = FORMAT_MAJOR  # the format ``encode_record`` writes when not told (tests set 1 to build old stores)
PREFIX = struct.Struct("<4sBBHII32s")  # magic, major, minor, reserved, header len, reserved, checksum
PREFIX_SIZE = PREFIX.size  # 48
CHECKSUM_OFFSET = 16
ALIGN = 64
MAX_HEADER_BYTES = 256 << 10
MAX_DIMS = 16
KINDS = ("chunk", "entry", "draft", "piece")  # piece: store format 1.2 (``pieces.py``)
_PARALLEL_HASH_BYTES = 4 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checksum(view, major: int | None = None) -> bytes:
    """The 32-byte checksum field of a record: over the prefix's first 16 bytes then everything after the field.

    ``view`` is the whole record (at least ``PREFIX_SIZE`` bytes); ``major`` defaults to the format byte it
    carries. Format 2: XXH3-128 + 16 zero bytes. Format 1: blake3, multithreaded for large values.
    """
    if major is None:
        major = view[4]
    if major == FORMAT_BLAKE3:
        threads = blake3.blake3.AUTO if len(view) >= _PARALLEL_HASH_BYTES else 1
        h = blake3.blake3(max_threads=threads)
        h.update(view[:CHECKSUM_OFFSET])
        h.update(view[PREFIX_SIZE:])
        return h.digest()
    return xxh3_128_digest(view[:CHECKSUM_OFFSET], view[PREFIX_SIZE:]) + _ZERO16  # large: without the GIL


_ZERO16 = bytes(16)


@dataclass(frozen=True)
class Record:
    """A decoded record: its header fields and zero-copy views of its tensors (valid while the buffer is)."""

    kind: str
    schema: str | None
    meta: dict
    tensors: dict[str, Tensor]
    size: int
    data_at: int = 0  # where the first tensor's bytes start in the record (``fill`` hashes up to it, then tensors)


def encode_record(kind: str, tensors: Iterable[tuple[str, str, Any]], *, schema: str | None = None,
                  meta: dict | None = None, format_major: int | None = None) -> np.ndarray:
    """Encode a record into one freshly allocated uint8 array (pass it straight to ``txn.put``).

    ``tensors`` yields ``(name, dtype name, data)`` where data is a numpy array (any strides: slices of a
    larger state are gathered here, so a chunk costs exactly one copy) or a ``Tensor``. ``format_major``
    picks the checksum (2: XXH3-128; 1: blake3, for tests and for stores read by older versions; None:
    ``WRITE_MAJOR``, i.e. 2).

    The safetensors payload is written by hand rather than with ``safetensors.numpy.save``: that would need
    each strided slice made contiguous, then build its own ``bytes`` blob, then a copy of it into the record
    (three copies of every byte against one here, on the request path); numpy cannot hold bfloat16; and the
    table here pads the tensor data to 64-byte alignment and keeps our tensor order (the golden bytes pin it).
    The tests prove both directions against the library: it reads what we write and we read what it writes
    (``wrap_safetensors``).
    """
    format_major = _checked_kind_and_format(kind, format_major)
    arrays = _checked_arrays(tensors)
    table, st_json, data_start, payload_len = _layout(kind, arrays)
    header = msgpack.packb({"kind": kind, "schema": schema, "meta": meta or {}, "tensors": table,
                            "payload": payload_len, "data": data_start}, use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:
        raise InvalidInput(f"record header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    payload_at = _align(PREFIX_SIZE + len(header))
    out = np.empty(payload_at + payload_len, dtype=np.uint8)
    out[:PREFIX_SIZE] = np.frombuffer(
        PREFIX.pack(MAGIC, format_major, FORMAT_MINOR, 0, len(header), 0, bytes(32)), dtype=np.uint8)
    out[PREFIX_SIZE:PREFIX_SIZE + len(header)] = np.frombuffer(header, dtype=np.uint8)
    out[PREFIX_SIZE + len(header):payload_at] = 0
    out[payload_at:payload_at + 8] = np.frombuffer(struct.pack("<Q", len(st_json)), dtype=np.uint8)
    out[payload_at + 8:payload_at + data_start] = np.frombuffer(st_json, dtype=np.uint8)
    digest = _copy_tensors(out, payload_at + data_start, arrays, table, format_major)
    out[CHECKSUM_OFFSET:PREFIX_SIZE] = np.frombuffer(digest, dtype=np.uint8)
    return out


def _checked_kind_and_format(kind: str, format_major: int | None) -> int:
    """The record format to write (``WRITE_MAJOR`` when None); ``InvalidInput`` for an unknown kind or format."""
    if kind not in KINDS:
        raise InvalidInput(f"record kind must be one of {KINDS}, got {kind!r}")
    if format_major is None:
        format_major = WRITE_MAJOR
    if format_major not in READABLE_MAJORS:
        raise InvalidInput(f"record format major must be one of {READABLE_MAJORS}, got {format_major!r}")
    return format_major


def _checked_arrays(tensors) -> list[tuple[str, str, np.ndarray]]:
    """``(name, dtype, little-endian numpy array)`` per tensor, each name, dtype and shape checked."""
    arrays: list[tuple[str, str, np.ndarray]] = []
    names: set[str] = set()
    for name, dtype, data in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidInput(f"tensor name must be a non-empty str other than '__metadata__', got {name!r}")
        if name in names:
            raise InvalidInput(f"duplicate tensor name {name!r} in one record")
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise InvalidInput(f"tensor {name!r}: unknown dtype {dtype!r}")
        names.add(name)
        arr = data.array() if isinstance(data, Tensor) else data
        if isinstance(arr, np.generic):  # a numpy scalar: a 0-d tensor
            arr = np.asarray(arr)
        if not isinstance(arr, np.ndarray):
            raise InvalidInput(f"tensor {name!r}: expected a numpy array or Tensor")
        if arr.dtype.kind not in "biufc" or arr.dtype.itemsize != DTYPE_ITEMSIZE[dtype]:
            raise InvalidInput(f"tensor {name!r}: data of dtype {arr.dtype} does not fit dtype {dtype}")
        if arr.ndim > MAX_DIMS:
            raise InvalidInput(f"tensor {name!r}: {arr.ndim} dimensions, at most {MAX_DIMS} are stored")
        if not arr.dtype.isnative and arr.dtype.byteorder != "|":  # big-endian data: swap the values, not bits
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arrays.append((name, dtype, arr))
    return arrays


def _layout(kind: str, arrays) -> tuple[list, bytes, int, int]:
    """Our tensor table, the safetensors JSON header (padded to 64-byte alignment), where the tensor data
    starts in the payload and the payload's length."""
    table, st_table, offset = [], {}, 0
    for name, dtype, arr in arrays:
        nbytes = arr.size * arr.dtype.itemsize
        table.append([name, dtype, list(arr.shape), offset, nbytes])
        st_table[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(arr.shape),
                          "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    st_table["__metadata__"] = {"format": "spec-cache-record", "kind": kind}
    st_json = json.dumps(st_table, separators=(",", ":")).encode()
    st_json += b" " * ((-(8 + len(st_json))) % ALIGN)
    data_start = 8 + len(st_json)
    return table, st_json, data_start, data_start + offset


def _copy_tensors(out: np.ndarray, base: int, arrays, table, format_major: int) -> bytes:
    """Copy every tensor into ``out`` from ``base`` on; returns the record's checksum field.

    Format 2 hashes each tensor's bytes right after copying them, while they are still in cache: the same
    digest as one pass over the finished record (tests check it), without reading the record again. The hash
    releases the GIL (``xxh3.Hasher``; numpy's copy does too): a checkpoint encoded on the write-behind thread
    (hundreds of MiB for an 8B-shaped model) must not stall the thread that runs the decode rounds.
    """
    h = Hasher() if format_major == FORMAT_MAJOR else None
    try:
        if h is not None:
            h.update_bytes(out[:CHECKSUM_OFFSET])
            h.update_bytes(out[PREFIX_SIZE:base])
        for (name, dtype, arr), row in zip(arrays, table):
            start, nbytes = base + row[3], row[4]
            if nbytes:
                dst = out[start:start + nbytes].view(numpy_dtype(dtype)).reshape(arr.shape)
                np.copyto(dst, arr.view(numpy_dtype(dtype)) if arr.dtype != numpy_dtype(dtype) else arr,
                          casting="no")
                if h is not None:
                    h.update_bytes(out[start:start + nbytes])
        return h.digest() + _ZERO16 if h is not None else checksum(memoryview(out), format_major)
    finally:
        if h is not None:
            h.close()


def wrap_safetensors(kind: str, blob, *, schema: str | None = None, meta: dict | None = None,
                     format_major: int | None = None) -> np.ndarray:
    """Our record envelope around a safetensors blob written by any writer (e.g. ``safetensors.numpy.save``).

    The blob is kept byte for byte as the record's payload (its own table, order and alignment); the msgpack
    header lists its tensors in data order, as ``decode_record`` requires. Raises ``InvalidInput`` for a blob
    that is not a well-formed safetensors file.
    """
    format_major = _checked_kind_and_format(kind, format_major)
    blob = _bytes_view(blob)
    if len(blob) < 8:
        raise InvalidInput("safetensors blob shorter than its length prefix")
    (json_len,) = struct.unpack_from("<Q", blob, 0)
    if json_len > MAX_HEADER_BYTES or 8 + json_len > len(blob):
        raise InvalidInput("safetensors JSON table length is out of range")
    try:
        st_table = json.loads(bytes(blob[8:8 + json_len]))
    except ValueError:
        raise InvalidInput("safetensors JSON table is not valid JSON") from None
    if not isinstance(st_table, dict):
        raise InvalidInput("safetensors JSON table is not an object")
    from_code = {code: name for name, code in SAFETENSORS_DTYPE.items()}
    rows = []
    for name, info in st_table.items():
        if name == "__metadata__":
            continue
        try:
            dtype = from_code[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InvalidInput(f"safetensors tensor {name!r} has a bad table entry") from None
        rows.append([name, dtype, shape, lo, hi - lo])
    rows.sort(key=lambda r: r[3])
    data_start = 8 + json_len
    header = msgpack.packb({"kind": kind, "schema": schema, "meta": meta or {}, "tensors": rows,
                            "payload": len(blob), "data": data_start}, use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:
        raise InvalidInput(f"record header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    payload_at = _align(PREFIX_SIZE + len(header))
    out = np.zeros(payload_at + len(blob), dtype=np.uint8)
    out[:PREFIX_SIZE] = np.frombuffer(
        PREFIX.pack(MAGIC, format_major, FORMAT_MINOR, 0, len(header), 0, bytes(32)), dtype=np.uint8)
    out[PREFIX_SIZE:PREFIX_SIZE + len(header)] = np.frombuffer(header, dtype=np.uint8)
    out[payload_at:] = np.frombuffer(blob, dtype=np.uint8)
    out[CHECKSUM_OFFSET:PREFIX_SIZE] = np.frombuffer(checksum(memoryview(out), format_major), dtype=np.uint8)
    try:
        decode_record(out)  # the blob's own table must agree with itself (sizes, no gaps or overlaps)
    except CorruptRecord as exc:
        raise InvalidInput(f"safetensors blob does not fit the record format: {exc}") from None
    return out


def _unpack_header(raw) -> dict:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                                 max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
                                 max_array_len=MAX_HEADER_BYTES, max_map_len=MAX_HEADER_BYTES, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on crafted input
        raise CorruptRecord(f"record header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise CorruptRecord("record header is not a map")
    return header


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_prefix(buf) -> tuple[int, int, int, bytes]:
    """Parse and sanity-check the fixed prefix; returns (major, minor, header length, checksum)."""
    if len(buf) < PREFIX_SIZE:
        raise CorruptRecord(f"record of {len(buf)} bytes is shorter than its {PREFIX_SIZE}-byte prefix")
    magic, major, minor, _r1, header_len, _r2, digest = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptRecord("record has a bad magic number")
    if major not in READABLE_MAJORS:
        raise CorruptRecord(f"record format {major}.{minor} is not readable by format {FORMAT_MAJOR}")
    if major == FORMAT_MAJOR and digest[16:] != _ZERO16:  # format 2: the field's second half is zero
        raise CorruptRecord("record checksum field is damaged (bit flip)")
    if header_len > MAX_HEADER_BYTES or PREFIX_SIZE + header_len > len(buf):
        raise CorruptRecord("record header length is out of range")
    return major, minor, header_len, digest


def verify_checksum(buf) -> bool:
    """Whether a record's stored checksum matches its bytes (False for anything too short to hold one)."""
    view = _bytes_view(buf)
    if len(view) < PREFIX_SIZE or view[4] not in READABLE_MAJORS:
        return False
    return checksum(view) == bytes(view[CHECKSUM_OFFSET:PREFIX_SIZE])


def decode_record(buf, *, verify: bool = True) -> Record:
    """Decode ``buf`` (bytes or a memoryview into LMDB's map); raises ``CorruptRecord`` on any defect.

    The returned tensors are views of ``buf``: copy them out before the read transaction ends.
    """
    view = _bytes_view(buf)
    major, _minor, header_len, digest = read_prefix(view)
    if verify and checksum(view, major) != digest:
        raise CorruptRecord("record checksum mismatch (bit flip or truncation)")
    header = _unpack_header(view[PREFIX_SIZE:PREFIX_SIZE + header_len])
    kind, schema, meta = header.get("kind"), header.get("schema"), header.get("meta")
    table, payload_len, data_start = header.get("tensors"), header.get("payload"), header.get("data")
    if kind not in KINDS or not (schema is None or isinstance(schema, str)) or not isinstance(meta, dict):
        raise CorruptRecord("record header has a bad kind, schema or meta field")
    if not isinstance(table, list) or not (_is_int(payload_len) and _is_int(data_start)):
        raise CorruptRecord("record header has a bad tensor table")
    payload_at = _align(PREFIX_SIZE + header_len)
    if payload_at + payload_len != len(view) or not (8 <= data_start <= payload_len):
        raise CorruptRecord("record length does not match its header (truncated or extended)")
    data_len = payload_len - data_start
    base = payload_at + data_start
    tensors: dict[str, Tensor] = {}
    expect_offset = 0
    for row in table:
        if not (isinstance(row, list) and len(row) == 5):
            raise CorruptRecord("record tensor table row is malformed")
        name, dtype, shape, offset, nbytes = row
        if (not isinstance(name, str) or name in tensors or not isinstance(dtype, str)
                or dtype not in DTYPE_ITEMSIZE or not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)
                or not _is_int(offset) or offset != expect_offset or not _is_int(nbytes)):
            raise CorruptRecord(f"record tensor table row for {name!r} is malformed")
        count = 1
        for d in shape:
            count *= d
        if count * DTYPE_ITEMSIZE[dtype] != nbytes or offset + nbytes > data_len:
            raise CorruptRecord(f"record tensor {name!r} does not fit its declared shape or the payload")
        expect_offset = offset + nbytes
        tensors[name] = Tensor.checked(dtype, tuple(shape), view[base + offset:base + offset + nbytes])
    if expect_offset != data_len:
        raise CorruptRecord("record payload holds bytes no tensor accounts for")
    return Record(kind, schema, meta, tensors, len(view), base)


def check_key(rec: Record, key: bytes, what: str = "record") -> None:
    """Refuse a record stored under another key than the one it names (a misdirected write, a page mix-up:
    its checksum and even its tokens can be right while it belongs to another prefix or namespace).

    Records the store writes carry their key in ``meta["key"]``; records without one (written before this
    check existed) pass.
    """
    named = rec.meta.get("key")
    if named is not None and named != bytes(key):
        raise CorruptRecord(f"{what} record belongs to another key (stored under the wrong one)", bytes(key))


def payload_view(buf) -> memoryview:
    """The safetensors blob inside a record (for external readers and format dumps)."""
    view = _bytes_view(buf)
    _major, _minor, header_len, _digest = read_prefix(view)
    return view[_align(PREFIX_SIZE + header_len):]


def _bytes_view(buf) -> memoryview:
    """``buf`` as a flat unsigned-byte memoryview (no copy)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise CorruptRecord("record buffer is not contiguous")
        view = view.cast("B")
    return view


def copy_out(tensor: Tensor) -> np.ndarray:
    """An owned numpy copy of a record tensor (bfloat16 as uint16 words)."""
    return as_numpy(tensor.data, tensor.dtype, tensor.shape).copy()

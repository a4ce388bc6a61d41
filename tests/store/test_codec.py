"""Tests for ``store.codec``: the record format (a public contract), round trips, and corruption detection.

Every layout and corruption test runs on both record formats: 2 (XXH3-128 checksum, written today) and 1
(blake3, written by earlier versions and still read).
"""

from __future__ import annotations

import json
import re
import struct
import time
import tracemalloc
from pathlib import Path

import blake3
import msgpack
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.schemas import DTYPE_ITEMSIZE, DTYPE_NAMES, SAFETENSORS_DTYPE
from spec_cache.store import CorruptRecord, InvalidInput, Tensor
from spec_cache.store.codec import (
    ALIGN,
    FORMAT_MAJOR,
    KINDS,
    MAX_HEADER_BYTES,
    PREFIX_SIZE,
    copy_out,
    decode_record,
    encode_record,
    payload_view,
    verify_checksum,
)
from spec_cache.store.tensors import numpy_dtype

REPO = Path(__file__).resolve().parents[2]
FORMATS = (1, 2)
assert FORMAT_MAJOR == 2

# --- helpers -------------------------------------------------------------------------------------------------


def random_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random contents of ``dtype`` (bfloat16 as uint16 words); bool holds only 0/1."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64)) * DTYPE_ITEMSIZE[dtype]
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return raw.view(numpy_dtype(dtype)).reshape(shape)


def doc_checksum(buf: bytes, fmt: int | None = None) -> bytes:
    """The checksum field as the README documents it, over bytes 0..15 then everything after byte 48:
    format 2 XXH3-128 (big-endian digest) + 16 zero bytes, format 1 blake3."""
    fmt = buf[4] if fmt is None else fmt
    if fmt == 1:
        return blake3.blake3(buf[:16] + buf[48:]).digest()
    return xxhash.xxh3_128(buf[:16] + buf[48:]).digest() + bytes(16)


def header_of(buf: bytes) -> dict:
    (length,) = struct.unpack_from("<I", buf, 8)
    return msgpack.unpackb(buf[PREFIX_SIZE:PREFIX_SIZE + length], raw=False)


def craft(header, payload: bytes, *, header_len: int | None = None, major: int = 2,
          magic: bytes = b"SPCR", fmt: int | None = None) -> bytes:
    """A record laid out as documented, with a *valid* checksum (of format ``fmt``, default: ``major``'s)
    over an arbitrary (malicious) header."""
    raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    hlen = len(raw) if header_len is None else header_len
    pad = (-(PREFIX_SIZE + len(raw))) % ALIGN
    body = raw + bytes(pad) + payload
    first16 = magic + struct.pack("<BBHII", major, 0, 0, hlen, 0)
    return first16 + doc_checksum(first16 + bytes(32) + body, fmt if fmt is not None else major) + body


def assert_same_tensors(record, expected: list[tuple[str, str, np.ndarray]]) -> None:
    assert list(record.tensors) == [name for name, _, _ in expected]
    for name, dtype, arr in expected:
        t = record.tensors[name]
        assert t.dtype == dtype
        assert t.shape == tuple(arr.shape)
        assert bytes(t.data) == np.ascontiguousarray(arr).tobytes()
        assert copy_out(t).tobytes() == np.ascontiguousarray(arr).tobytes()


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
tensor_specs = st.lists(st.tuples(st.sampled_from(DTYPE_NAMES), shapes, st.integers(0, 2**32 - 1)),
                        min_size=0, max_size=8)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.text(max_size=20),
                    st.floats(allow_nan=False), st.binary(max_size=20))
metas = st.dictionaries(st.text(max_size=10), scalars, max_size=5)


def build(specs) -> list[tuple[str, str, np.ndarray]]:
    return [(f"t{i}", dtype, random_array(dtype, shape, seed)) for i, (dtype, shape, seed) in enumerate(specs)]


def sample_record(fmt: int = FORMAT_MAJOR) -> tuple[bytes, list]:
    tensors = [("k", "bfloat16", random_array("bfloat16", (1, 2, 3, 4), 1)),
               ("q", "uint32", random_array("uint32", (1, 2, 3, 2), 2)),
               ("s", "float16", random_array("float16", (1, 2, 3, 1), 3)),
               ("empty", "float32", np.zeros((2, 0), np.float32)),
               ("scalar", "int64", np.array(-7, np.int64))]
    return bytes(encode_record("entry", tensors, schema=None, meta={"length": 3, "x": [1, "a"]},
                               format_major=fmt)), tensors


# --- round trips ---------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_specs, st.sampled_from(KINDS), st.one_of(st.none(), st.text(min_size=1, max_size=30)), metas,
       st.sampled_from(FORMATS))
def test_round_trip_any_dtype_shape_and_count(specs, kind, schema, meta, fmt):
    tensors = build(specs)
    rec = encode_record(kind, tensors, schema=schema, meta=meta, format_major=fmt)
    assert rec[4] == fmt and verify_checksum(rec)
    assert rec.dtype == np.uint8 and rec.ndim == 1
    for buf in (rec, bytes(rec), memoryview(bytes(rec)), bytearray(rec)):
        out = decode_record(buf)
        assert out.kind == kind and out.schema == schema and out.meta == meta and out.size == len(rec)
        assert_same_tensors(out, tensors)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_dtype_including_bfloat16_words(dtype):
    arr = random_array(dtype, (3, 5), 11)
    out = decode_record(encode_record("chunk", [("x", dtype, arr), ("z", dtype, arr[:0]), ("s", dtype, arr[0, 0])]))
    assert_same_tensors(out, [("x", dtype, arr), ("z", dtype, arr[:0]), ("s", dtype, arr[0, 0])])
    restored = out.tensors["x"].array()
    assert restored.dtype == numpy_dtype(dtype)
    assert restored.tobytes() == arr.tobytes()


def test_tensor_inputs_strided_slices_big_endian_and_tensor_objects():
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    strided = base[:, 1:3, ::2]  # not contiguous: gathered by the encoder
    big = np.arange(6, dtype=">i4")  # big-endian values are stored as little-endian values
    words = Tensor("bfloat16", (2, 2), np.array([[0x3F80, 0x4000], [0xC040, 0x0000]], np.uint16))
    tensors = [("s", "float32", strided), ("b", "int32", big), ("w", "bfloat16", words)]
    out = decode_record(encode_record("draft", tensors, schema="ngram-history-v1"))
    np.testing.assert_array_equal(out.tensors["s"].array(), strided)
    np.testing.assert_array_equal(out.tensors["b"].array(), np.arange(6, dtype=np.int32))
    assert out.tensors["w"].array().tolist() == [[0x3F80, 0x4000], [0xC040, 0x0000]]


@settings(max_examples=60, deadline=None)
@given(tensor_specs)
def test_payload_is_a_safetensors_blob(specs):
    tensors = build(specs)
    rec = encode_record("chunk", tensors)
    payload = payload_view(rec)
    start = len(rec) - len(payload)
    assert start % ALIGN == 0
    (json_len,) = struct.unpack_from("<Q", rec, start)
    assert (8 + json_len) % ALIGN == 0  # tensor data starts 64-byte aligned
    blob = bytes(payload)
    # every dtype numpy can hold: equal arrays through safetensors' own numpy reader
    if all(dtype != "bfloat16" for _, dtype, _ in tensors):
        loaded = safetensors.numpy.load(blob)
        assert sorted(loaded) == sorted(n for n, _, _ in tensors)
        for name, dtype, arr in tensors:
            assert loaded[name].dtype == np.dtype(numpy_dtype(dtype))
            assert loaded[name].shape == arr.shape
            assert loaded[name].tobytes() == arr.tobytes()
    # every dtype, bfloat16 included: safetensors' deserializer gives dtype codes and raw bytes
    table = dict(safetensors.deserialize(blob))
    assert sorted(table) == sorted(n for n, _, _ in tensors)
    for name, dtype, arr in tensors:
        assert table[name]["dtype"] == SAFETENSORS_DTYPE[dtype]
        assert list(table[name]["shape"]) == list(arr.shape)
        assert bytes(table[name]["data"]) == arr.tobytes()


def test_bfloat16_readable_by_safe_open(tmp_path):
    words = random_array("bfloat16", (4, 3), 5)
    rec = encode_record("chunk", [("k", "bfloat16", words), ("f", "float32", random_array("float32", (2,), 6))])
    path = tmp_path / "rec.safetensors"
    path.write_bytes(bytes(payload_view(rec)))
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == {"k", "f"}
        assert f.metadata() == {"format": "spec-cache-record", "kind": "chunk"}
        np.testing.assert_array_equal(f.get_tensor("f"), random_array("float32", (2,), 6))
        sliced = f.get_slice("k")
        assert sliced.get_dtype() == "BF16" and list(sliced.get_shape()) == [4, 3]


@pytest.mark.parametrize("fmt", FORMATS)
def test_documented_layout(fmt):
    buf, tensors = sample_record(fmt)
    magic, major, minor, reserved, hlen, reserved2 = struct.unpack_from("<4sBBHII", buf, 0)
    assert (magic, major, minor, reserved, reserved2) == (b"SPCR", fmt, 0, 0, 0)
    assert buf[16:48] == doc_checksum(buf, fmt)
    if fmt == 2:
        assert buf[32:48] == bytes(16)
    header = header_of(buf)
    assert set(header) == {"kind", "schema", "meta", "tensors", "payload", "data"}
    assert header["kind"] == "entry" and header["schema"] is None
    assert buf[PREFIX_SIZE + hlen:] [:(-(PREFIX_SIZE + hlen)) % ALIGN] == bytes((-(PREFIX_SIZE + hlen)) % ALIGN)
    payload_at = len(buf) - header["payload"]
    assert payload_at == PREFIX_SIZE + hlen + (-(PREFIX_SIZE + hlen)) % ALIGN
    offset = 0
    for (name, dtype, shape, off, nbytes), (ename, edtype, arr) in zip(header["tensors"], tensors):
        assert (name, dtype, shape, off, nbytes) == (ename, edtype, list(arr.shape), offset, arr.nbytes)
        start = payload_at + header["data"] + off
        assert buf[start:start + nbytes] == arr.tobytes()
        offset += nbytes
    assert payload_at + header["data"] + offset == len(buf)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoding_is_deterministic_and_pinned(fmt):
    """Formats 1.0 and 2.0 are public contracts: the same input gives the same bytes, in this version and later
    ones (format 1's pin predates format 2: a format 1 record is still written byte for byte as before)."""
    tensors = [("tokens", "uint32", np.arange(4, dtype=np.uint32)),
               ("L0.0", "bfloat16", np.arange(8, dtype=np.uint16).reshape(1, 2, 4)),
               ("L0.1", "float32", np.array([-1, -0.5, 0, 0.25, 0.5, 1], np.float32).reshape(1, 2, 3))]
    a = bytes(encode_record("chunk", tensors, meta={"depth": 1, "start": 0}, format_major=fmt))
    b = bytes(encode_record("chunk", tensors, meta={"depth": 1, "start": 0}, format_major=fmt))
    assert a == b
    assert blake3.blake3(a).hexdigest() == GOLDEN_CHUNK_RECORD[fmt]
    if fmt == FORMAT_MAJOR:
        assert bytes(encode_record("chunk", tensors, meta={"depth": 1, "start": 0})) == a


GOLDEN_CHUNK_RECORD = {1: "853d6f176a7637fde7bd6c4c25f20166d6303a00c4cc85472796c01efd3afcd1",
                       2: "a0b4e2cfe55f4b3914154e0b6e625c3507afbb44174503fadae55efb2a7cb80a"}


def test_encode_refuses_bad_input():
    ok = np.zeros(2, np.float32)
    with pytest.raises(InvalidInput):
        encode_record("other", [])
    with pytest.raises(InvalidInput):
        encode_record("chunk", [("a", "float32", ok), ("a", "float32", ok)])
    with pytest.raises(InvalidInput):
        encode_record("chunk", [("a", "float128", ok)])
    with pytest.raises(InvalidInput):
        encode_record("chunk", [("a", "float64", ok)])  # itemsize does not fit
    with pytest.raises(InvalidInput):
        encode_record("chunk", [("__metadata__", "float32", ok)])  # would hide the table from safetensors
    with pytest.raises(InvalidInput):
        encode_record("chunk", [("a", "float32", [1.0, 2.0])])
    with pytest.raises(InvalidInput):
        encode_record("chunk", [("a", "int64", np.array([object(), object()]))])
    with pytest.raises(InvalidInput):
        encode_record("chunk", [], meta={"big": "x" * MAX_HEADER_BYTES})


def test_no_pickle_in_the_store():
    for path in (REPO / "store").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"\bimport\s+pickle\b|\bfrom\s+pickle\b|allow_pickle\s*=\s*True", text), path


# --- corruption ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_single_bit_flip_is_detected(fmt):
    buf, tensors = sample_record(fmt)
    for pos in range(len(buf)):
        for bit in range(8):
            damaged = bytearray(buf)
            damaged[pos] ^= 1 << bit
            with pytest.raises(CorruptRecord):
                decode_record(bytes(damaged))
            assert not verify_checksum(bytes(damaged))  # what the store's deferred check relies on


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_truncation_and_extension_is_detected(fmt):
    buf, _ = sample_record(fmt)
    for cut in range(len(buf)):
        with pytest.raises(CorruptRecord):
            decode_record(buf[:cut])
    for extra in (b"\0", bytes(64), b"x" * 100):
        with pytest.raises(CorruptRecord):
            decode_record(buf + extra)


@settings(max_examples=150, deadline=None)
@given(tensor_specs, st.data(), st.sampled_from(FORMATS))
def test_random_damage_is_detected(specs, data, fmt):
    buf = bytes(encode_record("chunk", build(specs), meta={"depth": 1}, format_major=fmt))
    how = data.draw(st.sampled_from(["flip", "truncate", "byte"]))
    damaged = bytearray(buf)
    if how == "truncate":
        damaged = damaged[:data.draw(st.integers(0, len(buf) - 1))]
    else:
        pos = data.draw(st.integers(0, len(buf) - 1))
        if how == "flip":
            damaged[pos] ^= 1 << data.draw(st.integers(0, 7))
        else:
            damaged[pos] = data.draw(st.integers(0, 255).filter(lambda v: v != buf[pos]))
    try:
        decode_record(bytes(damaged))
    except CorruptRecord:
        return
    pytest.fail(f"{how} damage was not detected")


def _good_header_and_payload(fmt: int = FORMAT_MAJOR):
    buf, _ = sample_record(fmt)
    header = header_of(buf)
    return header, buf[len(buf) - header["payload"]:]


def _with(header, **changes):
    h = json.loads(json.dumps(header))
    h.update(changes)
    return h


def _row(header, index, **changes):
    h = json.loads(json.dumps(header))
    names = ["name", "dtype", "shape", "offset", "nbytes"]
    for key, value in changes.items():
        h["tensors"][index][names.index(key)] = value
    return h


def _crafted_cases(fmt: int):
    header, payload = _good_header_and_payload(fmt)
    big = 10**12

    def craft(*args, **kwargs):
        kwargs.setdefault("major", fmt)
        return globals()["craft"](*args, **kwargs)

    cases = {
        "huge payload length": craft(_with(header, payload=2**63 - 1), payload),
        "negative payload length": craft(_with(header, payload=-5), payload),
        "data offset before json": craft(_with(header, data=0), payload),
        "data offset past payload": craft(_with(header, data=header["payload"] + 64), payload),
        "huge nbytes": craft(_row(header, 0, nbytes=2**62), payload),
        "negative nbytes": craft(_row(header, 0, nbytes=-1), payload),
        "negative dim": craft(_row(header, 0, shape=[1, -2, 3, 4]), payload),
        "10^12-element shape": craft(_row(header, 0, shape=[big], nbytes=2 * big), payload),
        "10^12 elements across dims": craft(_row(header, 0, shape=[10**6, 10**6], nbytes=2 * big), payload),
        "17 dimensions": craft(_row(header, 3, shape=[1] * 16 + [0]), payload),
        "overlapping offsets": craft(_row(header, 1, offset=0), payload),
        "gap between tensors": craft(_row(header, 1, offset=header["tensors"][1][3] + 2), payload),
        "unaccounted payload bytes": craft(_with(header, tensors=header["tensors"][:-1]), payload),
        "wrong kind": craft(_with(header, kind="bogus"), payload),
        "kind is a list": craft(_with(header, kind=["chunk"]), payload),
        "schema is an int": craft(_with(header, schema=5), payload),
        "meta is a list": craft(_with(header, meta=[1, 2]), payload),
        "tensors is a map": craft(_with(header, tensors={"a": 1}), payload),
        "row too short": craft(_with(header, tensors=[r[:4] for r in header["tensors"]]), payload),
        "row is a string": craft(_with(header, tensors=["abcde"]), payload),
        "name is an int": craft(_row(header, 0, name=7), payload),
        "duplicate names": craft(_row(header, 1, name=header["tensors"][0][0]), payload),
        "dtype is a list": craft(_row(header, 0, dtype=["bfloat16"]), payload),
        "dtype is a map": craft(_row(header, 0, dtype={"a": 1}), payload),
        "unknown dtype": craft(_row(header, 0, dtype="float128"), payload),
        "shape is a string": craft(_row(header, 0, shape="1234"), payload),
        "shape holds a bool": craft(_row(header, 4, shape=[True]), payload),
        "shape holds a float": craft(_row(header, 0, shape=[1.0, 2, 3, 4]), payload),
        "offset is a float": craft(_row(header, 0, offset=0.0), payload),
        "payload is a string": craft(_with(header, payload="12"), payload),
        "payload is a bool": craft(_with(header, payload=True), payload),
        "header is a list": craft([1, 2, 3], payload),
        "header is an int": craft(5, payload),
        "header is not msgpack": craft(b"\xc1\xc1\xc1", payload),
        "header with trailing bytes": craft(msgpack.packb(header) + b"\xc0", payload),
        "int map keys": craft({1: 2}, payload),
        "ext type": craft(msgpack.packb({"kind": msgpack.ExtType(5, b"x" * 10)}), payload),
        "deep nesting": craft(b"\x81\xa4meta" + b"\x91" * 200_000 + b"\xc0", payload),
        "bin32 declaring 4 GiB": craft(b"\x81\xa4meta\xc6\xff\xff\xff\xff" + b"x" * 8, payload),
        "str32 declaring 4 GiB": craft(b"\x81\xa4meta\xdb\xff\xff\xff\xff" + b"x" * 8, payload),
        "array32 declaring 4G items": craft(b"\x81\xa4meta\xdd\xff\xff\xff\xff\xc0", payload),
        "map32 declaring 4G items": craft(b"\x81\xa4meta\xdf\xff\xff\xff\xff\xc0\xc0", payload),
        "header length past the end": craft(header, payload, header_len=10**6),
        "header length 4 GiB": craft(header, payload, header_len=2**32 - 1),
        "header length too short": craft(header, payload, header_len=10),
        "header length zero": craft(header, payload, header_len=0),
        "major 3": craft(header, payload, major=3, fmt=fmt),
        "major 0": craft(header, payload, major=0, fmt=fmt),
        "other format's checksum": craft(header, payload, fmt=3 - fmt),
        "bad magic": craft(header, payload, magic=b"SPCX"),
    }
    if fmt == 2:
        good = craft(header, payload)
        cases["nonzero second half of the checksum field"] = good[:40] + b"\x01" + good[41:]
    return cases


CRAFTED = {f"{case} (format {fmt})": buf for fmt in FORMATS for case, buf in _crafted_cases(fmt).items()}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_headers_are_refused_quickly_and_cheaply(case):
    buf = CRAFTED[case]
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CorruptRecord):
            decode_record(buf)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5, f"{case}: {elapsed:.3f}s"
    assert peak < len(buf) + (1 << 20), f"{case}: peak {peak} bytes"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_sample_crafting_is_itself_valid(fmt):
    """The crafted cases above differ from a valid record only in what each names."""
    header, payload = _good_header_and_payload(fmt)
    buf, tensors = sample_record(fmt)
    assert craft(header, payload, major=fmt) == buf
    assert_same_tensors(decode_record(craft(header, payload, major=fmt)), tensors)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unit", [b"\x90", b"\x80", b"\xa2ab", b"\xc0"])
def test_largest_allowed_header_bomb_allocates_boundedly(unit, fmt):
    """A header of the largest allowed size full of tiny containers or strings stays within ~20 MiB."""
    count = (MAX_HEADER_BYTES - 5) // len(unit)
    raw = b"\xdd" + struct.pack(">I", count) + unit * count
    buf = craft(raw, b"", major=fmt)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecord):
            decode_record(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20
    with pytest.raises(CorruptRecord):  # one byte more than allowed: refused before parsing
        decode_record(craft(raw + b"\xc0" * (MAX_HEADER_BYTES - len(raw) + 1), b"", major=fmt))

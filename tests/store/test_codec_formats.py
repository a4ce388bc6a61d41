"""Record formats across versions, and the safetensors payload against the safetensors library itself.

* Format 1 (blake3 checksum) records written by earlier versions still decode and verify: a golden record that
  the format-1 encoder produced (before format 2 existed) is pinned here byte for byte, and a store holding
  format-1 records (written through today's encoder asked for format 1) serves them beside format-2 ones.
* Format 2 (XXH3-128 checksum, written today): the digest the encoder computes while copying equals the
  documented one-pass digest.
* safetensors: ``safetensors.numpy.load`` reads the payload we write, and we read a payload written by
  ``safetensors.numpy.save`` once it is wrapped in our record envelope (``wrap_safetensors``).
"""

from __future__ import annotations

import struct

import blake3
import numpy as np
import pytest
import safetensors.numpy
import xxhash

from spec_cache.store import CorruptRecord, InvalidInput, LayerState, Store, Tensor, codec
from spec_cache.store.codec import (
    FORMAT_MAJOR,
    PREFIX_SIZE,
    decode_record,
    encode_record,
    payload_view,
    verify_checksum,
    wrap_safetensors,
)

# Written by store/codec.py at format 1.0 (commit 9bb3edd, before format 2 existed) from:
#   encode_record("chunk", [("tokens", "uint32", np.arange(4, dtype=np.uint32)),
#                           ("L0.0", "float16", np.arange(12, dtype=np.float16).reshape(1, 1, 4, 3)),
#                           ("L0.1", "bfloat16", np.arange(12, dtype=np.uint16).reshape(1, 1, 4, 3) + 16256)],
#                 schema=None, meta={"depth": 1, "start": 0, "key": b"\x01" * 32})
GOLDEN_FORMAT1_RECORD = bytes.fromhex("""
5350435201000000a800000000000000b728c19652b9092f0f3bbcc0ac4dab2adc584117c58fe86b071fa6c8e8cab564
86a46b696e64a56368756e6ba6736368656d61c0a46d65746183a5646570746801a5737461727400a36b6579c4200101
010101010101010101010101010101010101010101010101010101010101a774656e736f72739395a6746f6b656e73a6
75696e7433329104001095a44c302e30a7666c6f617431369401010403101895a44c302e31a862666c6f617431369401
0104032818a77061796c6f6164cd0180a464617461cd0140000000000000000000000000000000000000000000000000
0000000000000000000000000000000038010000000000007b22746f6b656e73223a7b226474797065223a2255333222
2c227368617065223a5b345d2c22646174615f6f666673657473223a5b302c31365d7d2c224c302e30223a7b22647479
7065223a22463136222c227368617065223a5b312c312c342c335d2c22646174615f6f666673657473223a5b31362c34
305d7d2c224c302e31223a7b226474797065223a2242463136222c227368617065223a5b312c312c342c335d2c226461
74615f6f666673657473223a5b34302c36345d7d2c225f5f6d657461646174615f5f223a7b22666f726d6174223a2273
7065632d63616368652d7265636f7264222c226b696e64223a226368756e6b227d7d2020202020202020202020202020
202020202020202020202020202020202020202020202020202020202020202020202020202020202020202020202020
000000000100000002000000030000000000003c0040004200440045004600470048804800498049803f813f823f833f
843f853f863f873f883f893f8a3f8b3f
""".replace("\n", ""))


def golden_inputs():
    return [("tokens", "uint32", np.arange(4, dtype=np.uint32)),
            ("L0.0", "float16", np.arange(12, dtype=np.float16).reshape(1, 1, 4, 3)),
            ("L0.1", "bfloat16", np.arange(12, dtype=np.uint16).reshape(1, 1, 4, 3) + 16256)]


GOLDEN_META = {"depth": 1, "start": 0, "key": b"\x01" * 32}


# --- format 1 (blake3) still reads ------------------------------------------------------------------------------


def test_golden_format1_record_decodes_and_verifies():
    buf = GOLDEN_FORMAT1_RECORD
    assert len(buf) == 640 and buf[4] == 1
    assert buf[16:48] == blake3.blake3(buf[:16] + buf[48:]).digest()
    assert verify_checksum(buf)
    rec = decode_record(buf)
    assert rec.kind == "chunk" and rec.schema is None and rec.meta == GOLDEN_META and rec.size == 640
    for name, dtype, arr in golden_inputs():
        t = rec.tensors[name]
        assert (t.dtype, t.shape) == (dtype, arr.shape)
        assert bytes(t.data) == arr.tobytes()


def test_format1_encoder_still_writes_the_golden_bytes():
    assert bytes(encode_record("chunk", golden_inputs(), meta=GOLDEN_META, format_major=1)) == GOLDEN_FORMAT1_RECORD


def test_golden_format1_record_damage_is_detected():
    for pos in range(len(GOLDEN_FORMAT1_RECORD)):
        damaged = bytearray(GOLDEN_FORMAT1_RECORD)
        damaged[pos] ^= 0x10
        assert not verify_checksum(bytes(damaged))
        with pytest.raises(CorruptRecord):
            decode_record(bytes(damaged))


def test_format2_differs_from_format1_only_in_the_checksum_field():
    new = bytes(encode_record("chunk", golden_inputs(), meta=GOLDEN_META))
    assert new[4] == FORMAT_MAJOR == 2 and len(new) == len(GOLDEN_FORMAT1_RECORD)
    assert new[:4] + new[5:16] == GOLDEN_FORMAT1_RECORD[:4] + GOLDEN_FORMAT1_RECORD[5:16]
    assert new[48:] == GOLDEN_FORMAT1_RECORD[48:]
    assert new[16:32] == xxhash.xxh3_128(new[:16] + new[48:]).digest() and new[32:48] == bytes(16)
    assert decode_record(new).meta == decode_record(GOLDEN_FORMAT1_RECORD).meta


@pytest.mark.parametrize("size", [0, 1, 63, 4096, 3 << 20])
def test_format2_streamed_digest_equals_the_one_pass_digest(size):
    """The encoder hashes tensor by tensor while copying; the result is the documented one-pass digest."""
    rng = np.random.default_rng(size)
    tensors = [(f"t{i}", "uint8", rng.integers(0, 256, size // (i + 1), dtype=np.uint8)) for i in range(3)]
    buf = bytes(encode_record("entry", tensors, meta={"n": size}))
    assert buf[16:32] == xxhash.xxh3_128(buf[:16] + buf[48:]).digest()
    assert verify_checksum(buf)


def test_unknown_format_is_refused_on_write():
    with pytest.raises(InvalidInput):
        encode_record("chunk", [], format_major=3)


def test_a_store_of_format1_records_still_serves_them(tmp_path, monkeypatch):
    """A store written by the format-1 encoder, then reopened by today's code: hits, bit-identical, verified;
    new puts into it write format 2 and both kinds serve side by side."""
    ns = bytes(32)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 10, 4)).astype(np.float16)
    v = rng.standard_normal((1, 2, 10, 4)).astype(np.float16)
    layers = [LayerState("kv", {}, [Tensor.from_numpy(k), Tensor.from_numpy(v)], token_axis=2)]
    old_tokens, new_tokens = list(range(10)), list(range(100, 110))
    monkeypatch.setattr(codec, "WRITE_MAJOR", 1)  # what the store wrote before format 2 existed
    with Store.open(tmp_path / "s", chunk_tokens=4) as store:
        store.register_namespace(ns, target="a" * 64, prefix_namespace="p")
        store.put(ns, old_tokens, layers)
    monkeypatch.undo()
    with Store.open(tmp_path / "s") as store:
        with store.env.read() as txn:
            majors = {bytes(raw)[4] for db in ("chunks", "edata") for _, raw in txn.cursor(db=store.env.dbs[db])}
        assert majors == {1}
        store.put(ns, new_tokens, layers)
        with store.env.read() as txn:
            majors = {bytes(raw)[4] for db in ("chunks", "edata") for _, raw in txn.cursor(db=store.env.dbs[db])}
        assert majors == {1, 2}
        for tokens in (old_tokens, new_tokens):
            restored = store.fetch(ns, tokens)
            assert restored is not None and restored.length == 10
            got = restored.layers[0].tensors
            assert got[0].array().tobytes() == k.tobytes() and got[1].array().tobytes() == v.tobytes()


# --- safetensors, both ways ------------------------------------------------------------------------------------


NUMPY_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int16": np.int16, "uint32": np.uint32, "int64": np.int64,
                "float16": np.float16, "float32": np.float32, "float64": np.float64}


def library_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (name, dt) in enumerate(NUMPY_DTYPES.items()):
        shape = [(1, 3, 5), (7,), (2, 0, 3), (), (4, 4)][i % 5]
        raw = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize, dtype=np.uint8)
        if dt is np.bool_:
            raw &= 1
        out[f"{name}_{i}"] = raw.view(dt).reshape(shape)
    return out


@pytest.mark.parametrize("fmt", [1, 2])
def test_safetensors_library_reads_our_payload(fmt):
    arrays = library_tensors(1)
    strided = np.arange(120, dtype=np.float32).reshape(4, 5, 6)[:, 1:4, ::2]  # gathered by our encoder
    tensors = [(name, np.dtype(a.dtype).name, a) for name, a in arrays.items()] + [("strided", "float32", strided)]
    rec = encode_record("chunk", tensors, meta={"x": 1}, format_major=fmt)
    loaded = safetensors.numpy.load(bytes(payload_view(rec)))
    assert sorted(loaded) == sorted(name for name, _, _ in tensors)
    for name, _, a in tensors:
        assert loaded[name].dtype == a.dtype and loaded[name].shape == a.shape
        np.testing.assert_array_equal(loaded[name], a)


@pytest.mark.parametrize("fmt", [1, 2])
def test_we_read_a_payload_written_by_the_safetensors_library(fmt):
    arrays = library_tensors(2)
    blob = safetensors.numpy.save(arrays, metadata={"origin": "safetensors.numpy.save"})
    rec = wrap_safetensors("entry", blob, schema=None, meta={"length": 3}, format_major=fmt)
    buf = bytes(rec)
    assert buf[4] == fmt and verify_checksum(buf)
    assert bytes(payload_view(buf)) == blob  # the library's bytes, kept byte for byte
    out = decode_record(buf)
    assert out.kind == "entry" and out.meta == {"length": 3}
    assert sorted(out.tensors) == sorted(arrays)
    for name, a in arrays.items():
        t = out.tensors[name]
        assert t.dtype == np.dtype(a.dtype).name and t.shape == a.shape
        np.testing.assert_array_equal(t.array(), a)
    # and it is a record like any other: every bit flip in it is detected
    for pos in range(0, len(buf), 7):
        damaged = bytearray(buf)
        damaged[pos] ^= 0x04
        with pytest.raises(CorruptRecord):
            decode_record(bytes(damaged))


def test_wrap_refuses_what_is_not_safetensors():
    blob = safetensors.numpy.save({"a": np.ones(4, np.float32)})
    for bad in (b"", b"\x05\x00", struct.pack("<Q", 10**9) + b"{}", struct.pack("<Q", 2) + b"[]",
                struct.pack("<Q", 5) + b"{nope", blob[:-1]):
        with pytest.raises(InvalidInput):
            wrap_safetensors("chunk", bad)
    assert PREFIX_SIZE == 48

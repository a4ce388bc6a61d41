"""The fused route (``store/fill.py``): records copied straight into a sink's buffers and checksummed in the same
pass. It must give back exactly the stored bytes, and a record damaged in any byte must never be served by it,
in either record format and with or without worker lanes."""

import lmdb
import numpy as np
import pytest

from spec_cache.store import LayerState, Store, Tensor, codec
from spec_cache.store.errors import CorruptRecord
from spec_cache.store.fill import _RecordPass
from spec_cache.store.read import BackgroundVerifier, Deferred, read_layers
from spec_cache.store.store import _RECORD_DB

NS = bytes(range(32))


class NumpySink:
    """A sink handing out plain numpy buffers (the store's contract, without MLX)."""

    def __init__(self):
        self.made = []

    def allocate(self, specs):
        out = []
        for dtype, shape in specs:
            arr = np.empty(shape, dtype=codec.numpy_dtype(dtype))
            arr[...] = np.frombuffer(b"\xa5" * arr.nbytes, dtype=arr.dtype).reshape(shape)  # never left as is
            self.made.append(arr)
            out.append((arr, arr))
        return out

    def __call__(self, pieces, axis, dtype):
        return np.concatenate([np.asarray(p) for p in pieces], axis=axis)


def layers(n, seed, dtypes=("float16", "bfloat16", "float32", "uint8")):
    """A KV layer per dtype (bfloat16 as uint16 words) and one untrimmable layer."""
    rng = np.random.default_rng(seed)
    out = []
    for dtype in dtypes:
        npd = codec.numpy_dtype(dtype)
        raw = rng.integers(0, 256, 2 * 3 * n * 5 * npd.itemsize, dtype=np.uint8).view(npd).reshape(2, 3, n, 5)
        out.append(LayerState("kv", {"i": dtype}, [Tensor(dtype, raw[:1].shape, np.ascontiguousarray(raw[:1])),
                                                  Tensor(dtype, raw[1:].shape, np.ascontiguousarray(raw[1:]))],
                              token_axis=2))
    ring = rng.standard_normal((1, 2, 7, 4)).astype(np.float32)
    out.append(LayerState("rotating", {"keep": 1}, [Tensor.from_numpy(ring)]))
    return out


def same_layers(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.kind == y.kind and x.meta == y.meta and x.token_axis == y.token_axis
        for s, t in zip(x.tensors, y.tensors):
            assert s.dtype == t.dtype and s.shape == t.shape
            assert np.asarray(s.data).tobytes() == t.array().tobytes()


def build(path, fmt, monkeypatch, puts=((0, 45), (0, 61), (0, 70))):
    """A store holding checkpoints of one growing prompt (pieced tails and chunks: format 1.3), in record
    format ``fmt``; returns the tokens and the layers of the longest put."""
    monkeypatch.setattr(codec, "WRITE_MAJOR", fmt)
    tokens = list(range(5, 5 + 70))
    full = layers(70, 1)
    with Store.open(path, chunk_tokens=16, durable=False) as store:
        store.register_namespace(NS, target="0" * 64, prefix_namespace="p")
        for lo, hi in puts:
            cut = [LayerState(x.kind, x.meta, [Tensor(t.dtype, t.array()[:, :, :hi].shape,
                                                      np.ascontiguousarray(t.array()[:, :, :hi]))
                                               for t in x.tensors], x.token_axis) if x.token_axis else x
                   for x in full]
            store.put(NS, tokens[lo:hi], cut)
    monkeypatch.setattr(codec, "WRITE_MAJOR", codec.FORMAT_MAJOR)
    return tokens, full


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("lanes", ["0", "2"])
def test_fill_gives_back_the_stored_bytes(tmp_path, monkeypatch, fmt, lanes):
    monkeypatch.setenv("SPEC_CACHE_FILL_LANES", lanes)
    tokens, full = build(tmp_path / "s", fmt, monkeypatch)
    with Store.open(tmp_path / "s") as store:
        store._verifier.min_bytes = 0  # every record through the fused checksum
        sink = NumpySink()
        got = store.fetch(NS, tokens + [1], concat=sink)
        plain = store.fetch(NS, tokens + [1])
    assert got.length == plain.length == 70
    assert len(sink.made) == 8  # every token-sliceable tensor went into the sink
    same_layers(got.layers, plain.layers)
    want = [LayerState(x.kind, x.meta, x.tensors, x.token_axis) for x in full]
    same_layers(got.layers, want)


def records(path):
    """Every record in the store: ``{(kind, key): bytes}``."""
    env = lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    out = {}
    with env.begin() as txn:
        for kind in ("chunk", "entry", "piece"):
            db = env.open_db(_RECORD_DB[kind].encode(), txn=txn, create=False)
            for key, value in txn.cursor(db=db):
                out[(kind, bytes(key))] = bytes(value)
    env.close()
    return out


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_record_damaged_in_any_byte_is_never_served_by_the_fused_route(tmp_path, monkeypatch, fmt):
    """Every byte of every record the restore reads, flipped one at a time (every byte of the prefix and header,
    every 3rd of the payload and the last), read through the fused route with every record deferred: each one
    raises ``CorruptRecord``; the intact records give the stored bytes."""
    tokens, _full = build(tmp_path / "s", fmt, monkeypatch, puts=((0, 40),))
    with Store.open(tmp_path / "s") as store:
        hit = store.lookup(NS, tokens[:40])
        packed, chunk_tokens = np.asarray(tokens[:40], dtype=np.uint32), store.chunk_tokens
    blobs = records(tmp_path / "s")
    verifier = BackgroundVerifier(min_bytes=0, threads=2)

    def read(raw_of):
        return read_layers(raw_of, packed=packed, length=40, chunk_tokens=chunk_tokens, chain=hit.chain,
                           entry=hit.entry, concat=NumpySink(), verifier=verifier)
    try:
        plain = read(lambda kind, key: blobs.get((kind, bytes(key))))
        assert len(plain) == 5
        flips = 0
        for victim in blobs:  # one checkpoint: the restore reads every record in the store
            blob = blobs[victim]
            header_end = codec.PREFIX_SIZE + int.from_bytes(blob[8:12], "little")
            positions = list(range(header_end)) + list(range(header_end, len(blob), 3)) + [len(blob) - 1]
            for i in positions:
                bad = bytearray(blob)
                bad[i] ^= 1 << (i % 8)
                damaged = dict(blobs)
                damaged[victim] = bytes(bad)
                with pytest.raises(CorruptRecord):
                    read(lambda kind, key: damaged.get((kind, bytes(key))))
                flips += 1
        assert flips > 1000
    finally:
        verifier.close()


def test_tensors_met_out_of_order_are_checked_whole():
    """A record whose tensors reach the fused pass in another order than stored is checksummed whole at the end:
    the verdict is still right, for an intact and for a damaged record."""
    a = np.arange(600, dtype=np.float32).reshape(1, 600)
    b = np.arange(600, 1200, dtype=np.float32).reshape(1, 600)
    blob = codec.encode_record("chunk", [("tokens", "uint32", np.arange(3, dtype=np.uint32)), ("L0.0", "float32", a),
                                         ("L0.1", "float32", b)], meta={})
    for damage in (None, len(blob) - 5):
        raw = bytearray(blob.tobytes())
        if damage is not None:
            raw[damage] ^= 4
        raw = bytes(raw)
        rec = codec.decode_record(raw, verify=False)
        p = _RecordPass(rec, Deferred("chunk", b"k" * 32, raw, None, rec))
        da, db = np.empty_like(a), np.empty_like(b)
        p.copy("L0.1", db)
        p.copy("L0.0", da)  # out of record order
        assert p.finish() is (damage is None)
        if damage is None:
            assert da.tobytes() == a.tobytes() and db.tobytes() == b.tobytes()

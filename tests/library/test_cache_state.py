"""mlx-lm caches survive store round trips bit-identically, and SpecCache turns failures into misses."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from spec_cache.schemas import NGRAM_HISTORY_V1, CheckpointAttachment, DraftRowCheckpoint
from spec_cache.state.cache_state import from_layer_state, layer_state
from spec_cache.tiers.cache import CacheWarning, SpecCache

TARGET = "ab" * 32


def kv(n, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 64)).astype(dtype), mx.random.normal((1, 2, n, 64)).astype(dtype))
    return c


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kv_round_trip_slices_padding_away(dtype):
    c = kv(10, dtype)
    layer = layer_state(c)
    assert layer.kind == "kv" and layer.tensors[0].shape == (1, 2, 10, 64)  # not the 256-step buffer
    r = from_layer_state(layer)
    assert r.offset == 10 and same(r.keys, c.keys[..., :10, :]) and same(r.values, c.values[..., :10, :])


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_round_trip(bits):
    q = kv(7).to_quantized(group_size=64, bits=bits)
    r = from_layer_state(layer_state(q))
    assert (r.bits, r.group_size, r.offset) == (bits, 64, 7)
    for a, b in zip((*q.keys, *q.values), (*r.keys, *r.values)):
        assert same(a[..., :7, :], b)


def test_rotating_and_arrays_round_trip():
    rot = RotatingKVCache(max_size=8, keep=2)
    for i in range(12):
        rot.update_and_fetch(mx.full((1, 2, 1, 64), float(i)), mx.full((1, 2, 1, 64), -float(i)))
    r = from_layer_state(layer_state(rot))
    assert r.state[2:] == rot.state[2:] and same(r.keys, rot.keys)
    arr = ArraysCache(3)
    arr[0] = mx.arange(6, dtype=mx.float32).reshape(1, 2, 3)
    arr[2] = mx.ones((1, 4))
    r = from_layer_state(layer_state(arr))
    assert r.cache[1] is None and same(r.cache[0], arr.cache[0]) and same(r.cache[2], arr.cache[2])


def test_spec_cache_save_restore_with_drafter(tmp_path):
    tokens = list(range(40))
    caches = [kv(40, seed=i) for i in range(3)]
    history = CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1}, (mx.array(tokens, dtype=mx.int32),))
    cp = DraftRowCheckpoint(40, history)
    with SpecCache.open(tmp_path / "c", chunk_tokens=16) as cache:
        ns = cache.namespace(TARGET, '{"adapters":""}')
        assert cache.save(ns, tokens, caches, drafter_namespace="ngram-history-v1:3:1", draft_checkpoint=cp)
    with SpecCache.open(tmp_path / "c") as cache:
        ns = cache.namespace(TARGET, '{"adapters":""}')
        hit = cache.restore(ns, tokens + [7, 8], drafter_namespace="ngram-history-v1:3:1")
        assert hit.length == 40 and hit.draft_checkpoint.processed_tokens == 40
        assert same(hit.draft_checkpoint.attachment.tensors[0], history.tensors[0])
        for a, b in zip(caches, hit.caches):
            assert same(a.keys[..., :40, :], b.keys) and same(a.values[..., :40, :], b.values)
        other = cache.namespace(TARGET, '{"adapters":"x@1"}')
        assert cache.restore(other, tokens + [1]) is None


def test_spec_cache_failures_are_warnings_not_crashes(tmp_path):
    with SpecCache.open(tmp_path / "c", max_bytes=1000) as cache:
        ns = cache.namespace(TARGET, "p")
        with pytest.warns(CacheWarning, match="not stored"):
            assert cache.save(ns, list(range(40)), [kv(40)]) is None  # over the byte budget
        bad = DraftRowCheckpoint(3, CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1},
                                                         (mx.array([1, 2, 3], dtype=mx.int32),)))
        with pytest.warns(CacheWarning, match="covers 3 tokens"):
            assert cache.save(ns, [1, 2], [kv(2)], drafter_namespace="n", draft_checkpoint=bad) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cache.restore(ns, [1, 2, 3]) is None


def test_quantized_states_converted_at_different_offsets_never_share_chunks(tmp_path):
    """The K/V after a conversion point depend on where it was, so ``converted_at`` is part of the layer
    signature: two states of the same prefix converted at 20 and at 39 keep their own chunks."""
    tokens = list(range(40))
    first, second = kv(41, seed=1).to_quantized(bits=4), kv(41, seed=2).to_quantized(bits=4)
    first.converted_at, second.converted_at = 39, 20
    assert layer_state(first).meta == {"group_size": 64, "bits": 4, "converted_at": 39}
    assert from_layer_state(layer_state(second)).converted_at == 20
    assert not hasattr(from_layer_state(layer_state(kv(3).to_quantized(bits=4))), "converted_at")
    with SpecCache.open(tmp_path / "c", chunk_tokens=16) as cache:
        ns = cache.namespace(TARGET, "quantized")
        assert cache.save(ns, tokens + [1], [first], minimum_reusable=39)
        assert cache.save(ns, tokens + [2], [second], minimum_reusable=20)
        hit = cache.restore(ns, tokens + [2, 9])
        assert hit.length == 41 and hit.caches[0].converted_at == 20
        for a, b in zip((*second.keys, *second.values), (*hit.caches[0].keys, *hit.caches[0].values)):
            assert same(a[..., :41, :], b)
        assert cache.store.lookup(ns, tokens[:35]).minimum_reusable == 20  # chunk 32: only the state converted at 20
        assert cache.store.lookup(ns, tokens[:18]) is None  # chunk 16 is below both conversion points


def test_save_re_registers_a_namespace_dropped_behind_its_back(tmp_path):
    with SpecCache.open(tmp_path / "c") as cache:
        ns = cache.namespace(TARGET, "p")
        with cache.store.env.env.begin(write=True) as txn:  # as if gc had dropped the namespace row
            txn.delete(ns, db=cache.store.env.dbs["nsinfo"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cache.save(ns, [1, 2, 3], [kv(3)]) is not None
        assert cache.restore(ns, [1, 2, 3, 4]).length == 3


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mx_concat_restores_bit_identically(tmp_path, dtype):
    """The GPU restore path (pieces copied into MLX once, joined in MLX), exercised here on the CPU."""
    from spec_cache.state.cache_state import from_layer_state, mx_concat, to_mx

    caches = [kv(70, dtype, seed=3), kv(70, dtype, seed=4).to_quantized(group_size=64, bits=4)]
    with SpecCache.open(tmp_path / "c", chunk_tokens=16) as cache:
        ns = cache.namespace(TARGET, "p")
        cache.save(ns, list(range(70)), caches)
        restored = cache.store.fetch(ns, list(range(70)) + [1], concat=mx_concat)
    assert restored.length == 70
    assert all(isinstance(t.data, mx.array) for layer in restored.layers for t in layer.tensors)
    a, q = (from_layer_state(layer) for layer in restored.layers)
    assert same(a.keys, caches[0].keys[..., :70, :]) and same(a.values, caches[0].values[..., :70, :])
    for x, y in zip((*caches[1].keys, *caches[1].values), (*q.keys, *q.values)):
        assert same(x[..., :70, :], y)
    assert same(to_mx(restored.layers[0].tensors[0]), a.keys)


# --- the host -> MLX copy routes (spec_cache.state.device_copy), exercised here on the CPU ---------------------------
_ROUTE_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "float16", "bfloat16", "uint32", "int32", "float32",
                 "uint64", "int64", "complex64"]


def _raw(dtype, shape, seed):
    """Random bytes of ``dtype`` (bool: 0/1), with signed zeros and NaN payloads among the floats."""
    from spec_cache.state.device_copy import _np_dtype

    npd = _np_dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    raw = rng.integers(0, 256, n * npd.itemsize, dtype=np.uint8).view(npd).reshape(shape)
    if dtype in ("float16", "float32") and n >= 2:
        flat = raw.reshape(-1)
        flat[0] = -0.0
        flat[1] = np.array(0xFFFF if dtype == "float16" else 0x7FC00001, dtype=np.uint32).astype(
            np.uint16 if dtype == "float16" else np.uint32).view(flat.dtype)
    return raw


def _bytes_of(x):
    x = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
    return np.array(x).tobytes()


def _pieces(whole, axis, cuts):
    edges = [0] + cuts
    idx = [slice(None)] * whole.ndim
    out = []
    for a, b in zip(edges, edges[1:]):
        idx[axis] = slice(a, b)
        out.append(whole[tuple(idx)])
    return out


@pytest.mark.parametrize("dtype", _ROUTE_DTYPES)
@pytest.mark.parametrize("route", ["staging", "fresh"])
def test_copy_routes_are_bit_identical(dtype, route):
    """Every dtype, pieces of several sizes (one token, odd counts, one piece, a large piece split over
    threads): the staging loader and the CPU single-copy route give back exactly the stored bytes."""
    from spec_cache.state import device_copy
    from spec_cache.state.cache_state import _MX_DTYPES

    loader = device_copy.StagingLoader(capacity=1 << 20, threads=3, advise=False) if route == "staging" else None
    concat = loader if loader is not None else device_copy.fresh_concat
    try:
        for seed, (shape, axis, cuts) in enumerate([((1, 2, 37, 8), 2, [1, 5, 20, 37]),
                                                    ((3, 5), 1, [5]),
                                                    ((1, 1, 3, 1), 2, [1, 2, 3]),
                                                    ((1, 4, 1500, 96), 2, [256, 512, 1499, 1500]),
                                                    ((2, 3, 700), 0, [1, 2])]):
            whole = _raw(dtype, shape, seed)
            out = concat(_pieces(whole, axis, cuts), axis, dtype)
            assert out.dtype == _MX_DTYPES[dtype] and tuple(out.shape) == shape
            assert _bytes_of(out) == whole.tobytes(), (dtype, shape)
    finally:
        if loader is not None:
            loader.close()


def test_staging_loader_reuses_its_buffer_without_changing_returned_arrays():
    """Regions are reused (ring) and the buffer grows for a large tensor; arrays already returned never change."""
    from spec_cache.state import device_copy
    loader = device_copy.StagingLoader(capacity=4096, threads=2, advise=False)
    kept = []
    try:
        for seed in range(40):
            n = 1 + (seed * 37) % 300 if seed != 20 else 20000  # seed 20 outgrows the buffer
            whole = _raw("float32", (1, 2, n, 4), seed)
            kept.append((whole, loader(_pieces(whole, 2, [n // 2, n] if n > 1 else [1]), 2, "float32")))
        assert loader.capacity > 4096
        for whole, out in kept:
            assert _bytes_of(out) == whole.tobytes()
        device_copy.self_test(loader)
    finally:
        loader.close()


def test_copier_splits_large_copies_over_threads():
    from spec_cache.state import device_copy
    copier = device_copy.Copier(threads=4)
    try:
        whole = _raw("uint16", (1, 8, 4096, 128), 9)
        dst = np.zeros_like(whole)
        copier.copy(dst, _pieces(whole, 2, [1024, 2048, 4000, 4096]), 2)
        assert dst.tobytes() == whole.tobytes()
    finally:
        copier.close()


@pytest.mark.parametrize("route", ["staging", "fresh", "numpy", "join", "fill"])
def test_store_fetch_through_each_route(tmp_path, route, monkeypatch):
    """``Store.fetch(concat=...)`` with each route gives the same caches (bfloat16 KV and a quantized layer)."""
    from spec_cache.state import device_copy
    from spec_cache.state.cache_state import restore_concat

    caches = [kv(70, mx.bfloat16, seed=3), kv(70, mx.float16, seed=4).to_quantized(group_size=64, bits=4)]
    if route == "staging":
        concat = device_copy.StagingLoader(capacity=1 << 16, threads=2, advise=False)
    else:
        monkeypatch.setenv("SPEC_CACHE_COPY_ROUTE", route)
        concat = restore_concat()
    with SpecCache.open(tmp_path / "c", chunk_tokens=16) as cache:
        ns = cache.namespace(TARGET, "p")
        cache.save(ns, list(range(70)), caches)
        restored = cache.store.fetch(ns, list(range(70)) + [1], concat=concat)
    assert restored.length == 70
    a, q = (from_layer_state(layer) for layer in restored.layers)
    assert _bytes_of(a.keys) == _bytes_of(caches[0].keys[..., :70, :])
    assert _bytes_of(a.values) == _bytes_of(caches[0].values[..., :70, :])
    for x, y in zip((*caches[1].keys, *caches[1].values), (*q.keys, *q.values)):
        assert _bytes_of(x[..., :70, :]) == _bytes_of(y)


def test_restore_concat_on_this_machine_and_route_status(monkeypatch):
    """On a CPU build: the single-copy sink by default, no staging loader offered, and the status says why."""
    from spec_cache.state import device_copy
    from spec_cache.state.cache_state import restore_concat

    monkeypatch.delenv("SPEC_CACHE_COPY_ROUTE", raising=False)
    if device_copy.is_cuda():
        pytest.skip("CUDA build: the staging route is exercised by tools/device")
    assert device_copy.staging_loader() is None
    assert "CUDA" in device_copy.status()
    if not device_copy.is_gpu():
        assert restore_concat() is device_copy.HOST_ARRAYS

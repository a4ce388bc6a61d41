"""mlx-lm caches survive store round trips bit-identically, and SpecCache turns failures into misses."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint, NGRAM_HISTORY_V1
from spec_cache.cache import CacheWarning, SpecCache
from spec_cache.cache_state import from_layer_state, layer_state

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
    from spec_cache.cache_state import from_layer_state, mx_concat, to_mx

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

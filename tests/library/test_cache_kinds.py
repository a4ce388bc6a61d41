"""The table of cache kinds (``spec_cache.state.cache_kinds``): every kind comes back bit-identical through the store
route (``cache_state`` and LMDB) and the memory-tier route, an unknown cache class or stored kind is refused by a
named error, stored records keep their format, and the table is the only place that checks cache classes."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from spec_cache.errors import InvalidRequest, RestoreRefused, UnsupportedCombination
from spec_cache.state import cache_kinds
from spec_cache.state.cache_kinds import KINDS, UnknownCacheType, UnknownLayerKind, kind_named, kind_of
from spec_cache.state.cache_state import from_layer_state, layer_state, to_mx
from spec_cache.store import LayerState, Tensor
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.memory_tier import MemoryTier

ROOT = Path(__file__).resolve().parents[2]
N = 12  # tokens every sample covers


def _kv_arrays(n: int, dtype=mx.float32, seed: int = 0):
    """Keys and values with the values a float compare would blur: NaN, -0.0 and +0.0, infinities."""
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((1, 2, n, 64)).astype(np.float32) for _ in range(2))
    k[0, 0, 0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    v[0, 1, -1, :2] = [-0.0, np.nan]
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def make_kv(n: int = N) -> KVCache:
    c = KVCache()
    c.update_and_fetch(*_kv_arrays(n, mx.bfloat16))  # a 256-step padded buffer, offset n
    return c


def make_qkv(n: int = N) -> QuantizedKVCache:
    c = QuantizedKVCache(group_size=32, bits=4)
    c.update_and_fetch(*_kv_arrays(n, mx.float16, seed=1))
    c.converted_at = 5
    return c


def make_rotating(n: int = N) -> RotatingKVCache:
    c = RotatingKVCache(max_size=8, keep=2)
    for i in range(n):  # wraps the ring: idx != offset
        k, v = _kv_arrays(1, seed=10 + i)
        c.update_and_fetch(k, v)
    return c


def make_arrays(n: int = N) -> ArraysCache:
    c = ArraysCache(3)
    c[0] = mx.array(np.array([[np.nan, -0.0, 1.5]], dtype=np.float32)).astype(mx.bfloat16)
    c[2] = mx.arange(n * 2, dtype=mx.int32).reshape(1, 2, n)
    return c


SAMPLES = {"kv": make_kv, "qkv": make_qkv, "rotating": make_rotating, "arrays": make_arrays}


def bits(a) -> tuple:
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return str(a.dtype), tuple(a.shape), np.array(raw).tobytes()


def snapshot(cache) -> tuple:
    """Everything a row continues from, arrays as bytes: the class, the scalars, the arrays up to the offset."""
    if isinstance(cache, ArraysCache):
        return "arrays", [None if a is None else bits(a) for a in cache.cache]
    if isinstance(cache, RotatingKVCache):
        keys, values, *scalars = cache.state
        return "rotating", scalars, bits(keys), bits(values)
    n = cache.offset
    if isinstance(cache, QuantizedKVCache):
        parts = [bits(a[..., :n, :]) for a in (*cache.keys, *cache.values)]
        return "qkv", n, cache.group_size, cache.bits, getattr(cache, "converted_at", None), parts
    return "kv", n, bits(cache.keys[..., :n, :]), bits(cache.values[..., :n, :])


def test_the_samples_cover_the_table():
    """A kind added to the table without a sample here fails this test (and so gets its round trips)."""
    assert set(SAMPLES) == {kind.name for kind in KINDS}
    for name, make in SAMPLES.items():
        assert kind_of(make()) is kind_named(name)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_store_route_is_bit_identical(name):
    cache = SAMPLES[name]()
    layer = layer_state(cache)
    assert layer.kind == name
    back = from_layer_state(layer)
    assert type(back) is type(cache) and snapshot(back) == snapshot(cache)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_memory_route_is_bit_identical(name):
    cache = SAMPLES[name]()
    tier = MemoryTier(1 << 30, idle_seconds=None)
    tokens = list(range(N))
    assert tier.put(b"ns", tokens, [cache]) is not None
    hit = tier.lookup(b"ns", tokens)
    assert hit is not None and hit.length == N
    (back,), _ = tier.take(hit)
    assert type(back) is type(cache) and snapshot(back) == snapshot(cache)


def test_every_kind_through_lmdb_in_one_checkpoint(tmp_path):
    """All kinds side by side (as a hybrid or sliding-window model has them), written to LMDB and read back
    with the memory tier off: every layer bit-identical."""
    caches = [make() for make in SAMPLES.values()]
    tokens = list(range(N))
    with SpecCache.open(tmp_path / "c", memory_bytes=0) as cache:
        ns = cache.namespace("ab" * 32, "kinds")
        assert cache.save(ns, tokens, caches)
    with SpecCache.open(tmp_path / "c", memory_bytes=0) as cache:
        ns = cache.namespace("ab" * 32, "kinds")
        hit = cache.restore(ns, tokens + [99])
        assert hit is not None and hit.length == N
        assert [snapshot(c) for c in hit.caches] == [snapshot(c) for c in caches]


@pytest.mark.parametrize("name", ["kv", "qkv"])
def test_trimmable_kinds_serve_a_shorter_prefix_from_memory(name):
    cache = SAMPLES[name]()
    tier = MemoryTier(1 << 30, idle_seconds=None)
    tier.put(b"ns", list(range(N)), [cache])
    hit = tier.lookup(b"ns", list(range(7)) + [500])
    assert hit is not None and hit.length == 7
    (back,), _ = tier.take(hit)
    cache.offset = 7  # the original's first 7 tokens (the tier holds its arrays, not this object)
    assert back.offset == 7 and snapshot(back) == snapshot(cache)


@pytest.mark.parametrize("name", ["rotating", "arrays"])
def test_whole_kinds_are_exact_length(name):
    cache = SAMPLES[name]()
    kind = kind_of(cache)
    assert not kind.trimmable and layer_state(cache).token_axis is None
    _meta, arrays = kind.capture(cache)
    with pytest.raises(ValueError, match=f"a {name} layer is exact-length"):
        kind.prefix(arrays, N - 1, N)
    tier = MemoryTier(1 << 30, idle_seconds=None)
    tier.put(b"ns", list(range(N)), [cache])
    assert tier.lookup(b"ns", list(range(N - 1)) + [500]) is None  # never cut: no shorter hit


def test_stored_records_keep_their_format():
    """The kind names and each meta's keys (in order) are what stored records carry: a public format."""
    got = {name: layer_state(make()) for name, make in SAMPLES.items()}
    assert {n: (list(layer.meta), layer.token_axis, len(layer.tensors)) for n, layer in got.items()} == {
        "kv": ([], 2, 2), "qkv": (["group_size", "bits", "converted_at"], 2, 6),
        "rotating": (["offset", "keep", "max_size", "idx"], None, 2), "arrays": (["size", "present"], None, 2)}
    assert got["arrays"].meta == {"size": 3, "present": [True, False, True]}
    assert got["rotating"].meta == {"offset": N, "keep": 2, "max_size": 8, "idx": 6}
    plain = make_qkv()
    del plain.converted_at
    assert "converted_at" not in layer_state(plain).meta  # absent, not null, when the runtime recorded none
    assert got["kv"].tensors[0].shape == (1, 2, N, 64)      # the offset, not the 256-step buffer
    with pytest.raises(InvalidRequest, match="empty KVCache"):
        layer_state(KVCache())


def test_subclasses_are_their_nearest_listed_kind():
    class Watched(KVCache):
        pass

    class Tagged(QuantizedKVCache):
        pass

    assert kind_of(Watched()).name == "kv" and kind_of(Tagged()).name == "qkv"
    watched = Watched()
    watched.update_and_fetch(*_kv_arrays(3))
    assert snapshot(from_layer_state(layer_state(watched))) == snapshot(watched)


@pytest.mark.parametrize("odd", [ChunkedKVCache(16), object()], ids=["ChunkedKVCache", "object"])
def test_an_unknown_cache_class_is_a_named_error(odd):
    name = type(odd).__name__
    with pytest.raises(UnknownCacheType, match=f"cache class {name} is not a kind spec-cache can keep"):
        layer_state(odd)
    with pytest.raises(UnknownCacheType, match=name):
        MemoryTier(1 << 30).put(b"ns", [1, 2], [odd])
    assert issubclass(UnknownCacheType, TypeError)  # callers that caught the old TypeError still do
    assert issubclass(UnknownCacheType, UnsupportedCombination)


def test_an_unknown_stored_kind_is_a_named_error():
    layer = LayerState("paged", {}, [Tensor.from_numpy(np.zeros((1, 2, 3, 4), np.float32))], token_axis=2)
    with pytest.raises(UnknownLayerKind, match="unknown stored layer kind 'paged' .*known: kv, qkv, rotating"):
        from_layer_state(layer)
    assert issubclass(UnknownLayerKind, RestoreRefused)  # a miss: SpecCache and the scheduler run it cold


def test_the_table_is_the_only_place_that_checks_cache_classes():
    """cache_state and the memory tier name no mlx-lm cache class: they look kinds up in the table."""
    for rel in ("spec_cache/state/cache_state.py", "spec_cache/tiers/memory_tier.py"):
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "mlx_lm.models.cache", f"{rel}:{node.lineno} imports mlx-lm's cache classes"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                assert not any(n.endswith("Cache") for n in names), f"{rel}:{node.lineno} checks a cache class"
            if isinstance(node, ast.Compare):  # no ladder over kind names either
                consts = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                assert not consts & set(SAMPLES), f"{rel}:{node.lineno} compares with a kind name"
    from spec_cache.convert.mlx_lm_cache import _storable_classes

    assert set(_storable_classes()) == set(cache_kinds.cache_types()) == {
        KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache}


def test_one_to_mx():
    from spec_cache.rows import protocol as rows
    assert rows.to_mx is to_mx
    a = mx.array([1.5, -0.0], dtype=mx.bfloat16)
    assert to_mx(a) is a
    assert bits(to_mx(np.array([3, 4], dtype=np.int16))) == bits(mx.array([3, 4], dtype=mx.int16))
    stored = Tensor("bfloat16", (2,), np.array(a.view(mx.uint16)))
    assert bits(to_mx(stored)) == bits(a)

"""Every restore route (``SPEC_CACHE_COPY_ROUTE``: the CPU default ``fill``, ``numpy``, ``fresh``, ``join``)
gives back bit-identical mlx-lm caches through the public API (``SpecCache.restore`` from a reopened store,
memory tier empty), for every KV dtype, a quantized layer and an untrimmable one; and a damaged record is never
served by the default route: the restore is shorter or a miss, never different bytes."""

import lmdb
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from spec_cache.state import device_copy
from spec_cache.state.cache_state import restore_concat
from spec_cache.tiers.cache import SpecCache

TARGET = "cd" * 32
N = 75


def kv(n, dtype, seed):
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 32)).astype(dtype), mx.random.normal((1, 2, n, 32)).astype(dtype))
    return c


def caches():
    ring = RotatingKVCache(max_size=16, keep=2)
    mx.random.seed(9)
    ring.update_and_fetch(mx.random.normal((1, 2, N, 32)), mx.random.normal((1, 2, N, 32)))
    return [kv(N, mx.bfloat16, 1), kv(N, mx.float16, 2), kv(N, mx.float32, 3),
            kv(N, mx.float16, 4).to_quantized(group_size=32, bits=4), ring]


def words(x):
    return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).tobytes()


def arrays(c):
    """The cache's arrays (a quantized cache's keys and values are lists of three) and its scalars."""
    out = []
    for x in c.state:
        out.extend(x if isinstance(x, (list, tuple)) else [x])
    return out


@pytest.mark.parametrize("route", ["", "fill", "numpy", "fresh", "join"])
@pytest.mark.parametrize("lanes", ["0", "1"])
def test_every_route_restores_bit_identically(tmp_path, monkeypatch, route, lanes):
    if route:
        monkeypatch.setenv("SPEC_CACHE_COPY_ROUTE", route)
    else:
        monkeypatch.delenv("SPEC_CACHE_COPY_ROUTE", raising=False)
    monkeypatch.setenv("SPEC_CACHE_FILL_LANES", lanes)
    if not route and not device_copy.is_gpu():
        assert restore_concat() is device_copy.HOST_ARRAYS
    tokens = list(range(100, 100 + N))
    saved = caches()
    with SpecCache.open(tmp_path / "c", chunk_tokens=16) as cache:
        ns = cache.namespace(TARGET, "p")
        assert cache.save(ns, tokens, saved)
    with SpecCache.open(tmp_path / "c") as cache:
        cache.store._verifier.min_bytes = 0  # every record through the deferred (fused, on "fill") checksum
        hit = cache.restore(cache.namespace(TARGET, "p"), tokens + [1, 2])
    assert hit is not None and hit.length == N and hit.tier == "local"
    for want, got in zip(saved, hit.caches):
        assert type(want) is type(got)
        for a, b in zip(arrays(want), arrays(got)):
            if not isinstance(a, mx.array):
                assert a == b
            elif isinstance(want, RotatingKVCache):
                assert a.dtype == b.dtype and words(a) == words(b)
            else:
                assert a.dtype == b.dtype and words(a[..., :N, :]) == words(b)


def test_a_damaged_record_is_never_served_by_the_default_route(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEC_CACHE_COPY_ROUTE", raising=False)
    tokens = list(range(100, 100 + N))
    saved = caches()
    with SpecCache.open(tmp_path / "c", chunk_tokens=16) as cache:
        ns = cache.namespace(TARGET, "p")
        assert cache.save(ns, tokens, saved)
        hit = cache.store.lookup(ns, tokens)
        victim = hit.chain[3]  # the third chunk: tokens 32..47
    env = lmdb.open(str(tmp_path / "c"), max_dbs=16)
    db = env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        bad = bytearray(txn.get(victim, db=db))
        bad[len(bad) - 100] ^= 0x40  # in the last layer's tensor bytes
        txn.put(victim, bytes(bad), db=db)
    env.close()
    with SpecCache.open(tmp_path / "c") as cache:
        cache.store._verifier.min_bytes = 0
        with pytest.warns(Warning, match="corrupt"):
            hit = cache.restore(cache.namespace(TARGET, "p"), tokens + [1])
    assert hit is None or hit.length <= 32

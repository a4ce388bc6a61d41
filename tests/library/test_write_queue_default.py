"""The write-behind queue's default cap follows the memory tier's budget (half of it, at least
``write_behind.DEFAULT_QUEUE_BYTES``): a server's checkpoints wait for LMDB in the queue instead of being written on
the scheduler's thread once a fixed 1 GiB fills (on the H200 at 4 clients that stalled every row)."""

from __future__ import annotations

from spec_cache.tiers import cache as cache_module
from spec_cache.tiers import write_behind
from spec_cache.tiers.cache import SpecCache
from tests.library.test_memory_tier import kv


def _save_four(cache: SpecCache) -> dict:
    ns = cache.namespace("cd" * 32, "prefix")
    tokens = list(range(10, 400))
    for n, seed in ((100, 1), (180, 2), (260, 3), (390, 4)):  # 2 layers x 2 x 2 heads x 4 x n float32
        cache.save(ns, tokens[:n], [kv(n, seed=seed), kv(n, seed=seed + 10)], background=True)
    assert cache.drain(60)
    return cache.memory_stats()["writes"]


def test_default_queue_is_half_the_memory_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "DEFAULT_QUEUE_BYTES", 1024)
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)  # every save is still queued when the next one comes
    with SpecCache.open(tmp_path / "a", memory_bytes=64 << 20) as cache:
        assert cache.write_queue_bytes == 32 << 20
        writes = _save_four(cache)
    assert writes["inline"] == 0 and writes["queued"] == 4 and writes["written"] == 4


def test_an_explicit_small_queue_still_writes_inline_when_full(tmp_path, monkeypatch):
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)
    with SpecCache.open(tmp_path / "b", memory_bytes=64 << 20, write_queue_bytes=20_000) as cache:
        assert cache.write_queue_bytes == 20_000
        writes = _save_four(cache)
    assert writes["inline"] >= 1 and writes["written"] == 4


def test_default_queue_never_below_the_floor(tmp_path):
    with SpecCache.open(tmp_path / "c", memory_bytes=0) as cache:
        assert cache.write_queue_bytes == write_behind.DEFAULT_QUEUE_BYTES

"""The write-behind queue's default cap follows the memory tier's budget (half of it, at least
``write_behind.DEFAULT_QUEUE_BYTES``): a server's checkpoints wait for LMDB in the queue instead of being written on
the scheduler's thread once a fixed 1 GiB fills (on the H200 at 4 clients that stalled every row)."""

from __future__ import annotations

from spec_cache.tiers import cache as cache_module
from spec_cache.tiers import write_behind
from spec_cache.tiers.cache import SpecCache
from tests.library.test_memory_tier import kv


def _save_four(cache: SpecCache, *, nested: bool = True) -> dict:
    """Four checkpoints: of one conversation (``nested``: each a prefix of the next, as a request's phases are),
    or of four different ones (none serves another; each holds its own state until LMDB holds it)."""
    ns = cache.namespace("cd" * 32, "prefix")
    for n, seed in ((100, 1), (180, 2), (260, 3), (390, 4)):  # 2 layers x 2 x 2 heads x 4 x n float32
        tokens = list(range(10, 10 + n)) if nested else [seed] * n
        cache.save(ns, tokens, [kv(n, seed=seed), kv(n, seed=seed + 10)], background=True)
    assert cache.drain(60)
    return cache.memory_stats()["writes"]


def test_default_queue_is_half_the_memory_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "DEFAULT_QUEUE_BYTES", 1024)
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)  # every save is still queued when the next one comes
    with SpecCache.open(tmp_path / "a", memory_bytes=64 << 20) as cache:
        assert cache.write_queue_bytes == 32 << 20
        writes = _save_four(cache)
    assert writes["inline"] == 0 and writes["queued"] == 4 and writes["written"] == 4


def test_a_full_queue_waits_past_its_cap_while_the_memory_tier_holds_on(tmp_path, monkeypatch):
    """A checkpoint that does not fit the queue is not written on the caller's thread while the memory tier holds
    it and the tier's checkpoints fit its budget: it waits past the cap (issue 35: the scheduler thread wrote)."""
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)
    with SpecCache.open(tmp_path / "b", memory_bytes=64 << 20, write_queue_bytes=20_000) as cache:
        assert cache.write_queue_bytes == 20_000
        writes = _save_four(cache)
    assert writes["inline"] == 0 and writes["waited"] >= 1 and writes["written"] == 4


def test_a_full_queue_writes_inline_once_the_memory_tier_is_over_its_budget(tmp_path, monkeypatch):
    """Back-pressure: when the checkpoints waiting for LMDB no longer fit the memory tier (none of them can be
    evicted before LMDB holds it), a checkpoint that does not fit the queue is written on the caller's thread."""
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)
    # each checkpoint alone fits the tier (12.8-50 KB), the four together (119 KB) do not; four conversations: a
    # later checkpoint of the same one would supersede the earlier (one state held, ``MemoryTier._supersede``)
    with SpecCache.open(tmp_path / "b", memory_bytes=60_000, write_queue_bytes=20_000) as cache:
        writes = _save_four(cache, nested=False)
    assert writes["inline"] >= 1 and writes["written"] == 4


def test_checkpoints_of_one_conversation_hold_one_state_and_write_nothing_inline(tmp_path, monkeypatch):
    """The same tier and queue as above, the four checkpoints of one conversation: each supersedes (and lends its
    arrays to) the one before, so the tier holds the last one only and nothing is written on the caller's thread."""
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)
    with SpecCache.open(tmp_path / "b", memory_bytes=60_000, write_queue_bytes=20_000) as cache:
        writes = _save_four(cache)
        assert cache.memory.stats()["superseded"] == 3
    assert writes["inline"] == 0 and writes["lent"] == 1 + 2 + 3 and writes["written"] == 4


def test_a_checkpoint_counts_only_what_the_store_lacks(tmp_path, monkeypatch):
    """A checkpoint extending a stored prefix counts against the queue as the tokens after the stored chunks
    (the writer copies and writes only those), not its whole state: a warm turn of a long conversation no longer
    fills the queue by itself."""
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)
    with SpecCache.open(tmp_path / "d", memory_bytes=64 << 20, chunk_tokens=64) as cache:
        ns = cache.namespace("cd" * 32, "prefix")
        tokens = list(range(10, 1200))
        assert cache.save(ns, tokens[:1024], [kv(1024, seed=1)], background=False) is not None
        cache.save(ns, tokens[:1090], [kv(1090, seed=2)], background=True)
        jobs, queued = cache.memory_stats()["writes"]["pending"], cache.memory_stats()["writes"]["pending_bytes"]
        whole = 2 * 2 * 4 * 1090 * 4  # keys and values: 2 heads x 4 x 1090 tokens float32
        assert jobs == 1 and queued == whole * (1090 - 1024) // 1090
        # a third checkpoint sharing the queued one's first 1088 tokens counts from there (17 chunks of 64)
        cache.save(ns, tokens[:1100], [kv(1100, seed=3)], background=True)
        assert cache.memory_stats()["writes"]["pending_bytes"] == queued + (2 * 2 * 4 * 1100 * 4) * 12 // 1100
        assert cache.drain(60)
        assert cache.memory_stats()["writes"]["written"] == 2


def test_default_queue_never_below_the_floor(tmp_path):
    with SpecCache.open(tmp_path / "c", memory_bytes=0) as cache:
        assert cache.write_queue_bytes == write_behind.DEFAULT_QUEUE_BYTES

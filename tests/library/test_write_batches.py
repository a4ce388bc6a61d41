"""The write-behind writer puts the checkpoints queued meanwhile in one LMDB transaction (``Store.put_many``;
issue 21's write amplification): fewer commits, every checkpoint stored and restored bit for bit; it lingers for
company only while nobody waits for the queue."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from spec_cache.store import WriteBehind
from spec_cache.tiers import write_behind
from spec_cache.tiers.cache import SpecCache
from tests.library.test_memory_tier import kv


def _prefix(full: KVCache, n: int) -> KVCache:
    """The first ``n`` tokens of ``full``: the states of one conversation at several lengths agree on their
    common prefix, as a real model's do (the store shares chunks by tokens)."""
    c = KVCache()
    c.keys, c.values, c.offset = full.keys[..., :n, :], full.values[..., :n, :], n
    mx.eval(c.keys, c.values)
    return c


def test_checkpoints_queued_while_the_writer_lingers_go_in_one_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)  # a loaded machine's pauses between saves stay inside it
    full = [kv(390, seed=1), kv(390, seed=2)]
    states = {n: [_prefix(c, n) for c in full] for n in (100, 180, 260, 390)}
    with SpecCache.open(tmp_path / "store") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        tokens = list(range(10, 400))
        commits = counted_commits(cache)
        for n, caches in states.items():  # within the writer's linger: one batch
            cache.save(ns, tokens[:n], caches, background=True)
        started = time.monotonic()
        assert cache.drain(60)
        assert time.monotonic() - started < 25  # the drain cut the 30 s linger short
        assert len(commits) == 1, len(commits)
        writes = cache.memory_stats()["writes"]
        assert writes["batches"] == 1 and writes["written"] == 4
    assert_restored_from_lmdb(tmp_path / "store", ns, tokens, states)


def counted_commits(cache) -> list:
    """A list that gets one item per LMDB write transaction ``cache``'s store commits from now on."""
    commits = []
    original = cache.store.env._transaction

    def counted(fn, attempt):
        commits.append(fn)
        return original(fn, attempt)

    cache.store.env._transaction = counted
    return commits


def assert_restored_from_lmdb(path, ns, tokens, states) -> None:
    """Each ``states[n]`` (the caches saved for ``tokens[:n]``) restores from LMDB alone (memory tier off), bit for
    bit."""
    with SpecCache.open(path, memory_bytes=0) as cache:
        for n, caches in states.items():
            got = cache.restore(ns, tokens[:n] + [1])
            assert got is not None and got.length == n
            for want, have in zip(caches, got.caches):
                assert np.array_equal(np.array(want.keys), np.array(have.keys[..., :n, :]))
                assert np.array_equal(np.array(want.values), np.array(have.values[..., :n, :]))


def test_the_queue_lingers_for_company_but_never_while_drained():
    batches: list[list] = []
    queue = WriteBehind(1 << 20, lambda job: batches.append([job]), batch_handler=batches.append, linger_s=30.0)
    try:
        for job in range(3):
            assert queue.offer(job, 10)
        time.sleep(0.05)
        assert batches == []  # lingering: 30 s allowed, nobody waiting
        waited = threading.Thread(target=queue.drain, args=(60.0,))
        started = time.monotonic()
        waited.start()
        waited.join(20)
        assert not waited.is_alive() and time.monotonic() - started < 20  # a drain cuts the linger short
        assert batches == [[0, 1, 2]]  # the three in one batch
    finally:
        queue.close(5)


def test_a_checkpoint_whose_copy_fails_in_a_batch_is_released_and_the_others_stored(tmp_path, monkeypatch):
    """A batch member whose device-to-host copy fails goes alone through the one-checkpoint path (which reports it
    and lets the memory tier evict it); the rest of the batch is stored."""
    from spec_cache.tiers import cache as cache_module
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)
    real = cache_module.host_layers

    def flaky(layers, *rest):
        if any(t.shape[2] == 180 for layer in layers for t in layer.tensors):
            raise RuntimeError("simulated device copy failure")
        return real(layers, *rest)

    monkeypatch.setattr(cache_module, "host_layers", flaky)
    full = [kv(390, seed=1)]
    with SpecCache.open(tmp_path / "store") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        tokens = list(range(10, 400))
        for n in (100, 180, 260):
            cache.save(ns, tokens[:n], [_prefix(c, n) for c in full], background=True)
        assert cache.drain(60)
        writes = cache.memory_stats()["writes"]
        assert writes["failed"] == 1 and writes["written"] == 2, writes  # the lone retry failed again, counted
        assert cache.memory.stats()["not_durable"] == 0  # none held back from eviction
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        assert cache.restore(ns, tokens[:260] + [1]).length == 260
        assert cache.restore(ns, tokens[:181]).length == 100  # 180 was never stored

"""Commits per turn of the write-behind writer (issue 21's write amplification): a request's checkpoints (prefill
phases, end of prompt, finish) arrive a few hundred ms apart, longer than ``LINGER_S``; a small batch waits on while
they keep coming (``QUIET_S``, at most ``LINGER_MAX_S``) and its continuation records ride in the same transaction,
so a turn is one LMDB commit (it was a commit per checkpoint group plus one per continuation record). A large batch
goes after ``LINGER_S`` as before."""

from __future__ import annotations

import threading
import time

from spec_cache.store import WriteBehind
from spec_cache.store.continuations import Continuation
from spec_cache.tiers import write_behind
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.continuations import Continuations
from tests.library.test_memory_tier import kv
from tests.library.test_write_batches import _prefix, assert_restored_from_lmdb, counted_commits


def _wait(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_turns_checkpoints_and_their_continuation_records_are_one_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(write_behind, "QUIET_S", 20.0)  # a loaded machine's pauses between saves stay inside it
    monkeypatch.setattr(write_behind, "LINGER_MAX_S", 60.0)
    full = [kv(390, seed=1), kv(390, seed=2)]
    states = {n: [_prefix(c, n) for c in full] for n in (128, 256, 300, 331)}  # phases, end of prompt, finish
    tokens = list(range(10, 400))
    with SpecCache.open(tmp_path / "store") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        conts = Continuations.of(cache)
        records = {n: Continuation(bytes([7]) * 32, ns, 300, tuple(tokens[300:n + 1]), finished=n == 331)
                   for n in (300, 331)}
        commits = counted_commits(cache)
        for n, caches in states.items():
            rider = conts.rider(records[n]) if n in records else None
            cache.save(ns, tokens[:n], caches, background=True, rider=rider)
            time.sleep(2 * write_behind.LINGER_S)  # past the first linger: before, each save went alone
        assert cache.drain(60)
        assert len(commits) == 1, len(commits)  # before: 4 checkpoint commits + 2 continuation records'
        assert cache.memory_stats()["writes"]["batches"] == 1
        got = conts.table.get(bytes([7]) * 32)
        assert got is not None and got.finished and got.tokens == records[331].tokens
    assert_restored_from_lmdb(tmp_path / "store", ns, tokens, states)  # from LMDB alone, bit for bit


def test_a_small_batch_waits_while_jobs_keep_coming_a_large_one_does_not():
    batches: list[list] = []
    lock = threading.Lock()

    def take(jobs):
        with lock:
            batches.append(list(jobs))
    small = WriteBehind(1 << 20, lambda job: take([job]), batch_handler=take, linger_s=0.05, quiet_s=5.0,
                        linger_max_s=60.0, small_bytes=1000)
    try:
        for name in "abc":
            assert small.offer(name, 10)
            time.sleep(0.3)  # past linger_s, inside quiet_s: the batch stays open
        assert _wait(lambda: sum(map(len, batches)) == 3)
        assert batches == [["a", "b", "c"]]  # before: linger_s alone, ["a"] went by itself
    finally:
        small.close(10)
    batches.clear()
    large = WriteBehind(1 << 20, lambda job: take([job]), batch_handler=take, linger_s=0.05, quiet_s=300.0,
                        linger_max_s=600.0, small_bytes=1000)
    try:
        assert large.offer("big", 5000)  # over small_bytes: goes after linger_s, not after quiet_s
        assert _wait(lambda: batches == [["big"]], timeout=120)
    finally:
        large.close(10)


def test_a_small_batch_goes_at_linger_max_while_jobs_keep_coming():
    batches: list[list] = []
    queue = WriteBehind(1 << 20, lambda job: batches.append([job]), batch_handler=batches.append, linger_s=0.05,
                        quiet_s=30.0, linger_max_s=0.5, small_bytes=1000)
    try:
        for i in range(10):
            assert queue.offer(i, 10)
            time.sleep(0.2)
        assert _wait(lambda: sum(map(len, batches)) == 10, timeout=120)
        assert len(batches) >= 2 and [j for b in batches for j in b] == list(range(10))
    finally:
        queue.close(10)

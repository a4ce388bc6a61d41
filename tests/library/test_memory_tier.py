"""The memory tier and write-behind: hits equal cold runs, the tier's arrays never change under a row that
continues from them, budget / pinning / pressure / demotion / supersession rules, and durability of queued
checkpoints (drain, close, SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from spec_cache.decode.generator import Generator
from spec_cache.drafters import METHODS as DRAFTER_METHODS
from spec_cache.store import Store
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.memory_tier import HitView, MemoryTier
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

METHODS = list(DRAFTER_METHODS)
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9, 10], list(range(60, 110))]
MAX = 8


def load(tiny, cache, method):
    drafter = None if method is None else tiny.drafter_dir(method)
    return Generator.load(tiny.root / "target", drafter, cache=cache)


def kv(n: int, seed: int = 0, heads: int = 2, dim: int = 4) -> KVCache:
    rng = np.random.default_rng(seed)
    c = KVCache()
    c.keys = mx.array(rng.standard_normal((1, heads, n, dim)).astype(np.float32))
    c.values = mx.array(rng.standard_normal((1, heads, n, dim)).astype(np.float32))
    c.offset = n
    mx.eval(c.keys, c.values)
    return c


# --- end to end: memory hits are exact --------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 3])
def test_memory_tier_hits_equal_cold(tiny, tmp_path, method, batch):
    prompts = PROMPTS[:batch]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, method)
        cold = gen.generate(prompts, max_tokens=MAX)
        def no_lmdb(*a, **k):
            raise AssertionError("a memory-tier hit read LMDB")
        cache.store.fetch = cache.store.lookup = no_lmdb  # the LMDB store must not be read for these hits
        before = cache.memory_stats()["hits"]
        warm = gen.generate(prompts, max_tokens=MAX)
        assert cache.memory_stats()["hits"] - before == batch
        for p, c, w in zip(prompts, cold, warm):
            assert w.tokens == c.tokens == plain_greedy(tiny.target, p, MAX)
            assert w.cached_tokens == len(p) - 1
        del cache.store.fetch, cache.store.lookup


def test_mixed_tiers_in_one_batch(tiny, tmp_path):
    """One row from the memory tier, one from LMDB, one cold, one batch: every row equals plain greedy."""
    a, b, c = PROMPTS
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, "assistant")
        gen.generate([b], max_tokens=MAX)
        assert cache.drain()
        cache.memory.clear()                      # b now lives only in LMDB
        gen.generate([a], max_tokens=MAX)        # a in both tiers
        out = gen.generate([a, b, c], max_tokens=MAX)
        for p, r in zip((a, b, c), out):
            assert r.tokens == plain_greedy(tiny.target, p, MAX)
        assert [r.cached_tokens for r in out] == [len(a) - 1, len(b) - 1, 0]
        # b came back from LMDB and entered the memory tier: the next request is a memory hit
        hits = cache.memory_stats()["hits"]
        (again,) = gen.generate([b], max_tokens=MAX)
        assert cache.memory_stats()["hits"] == hits + 1 and again.tokens == out[1].tokens


def test_extending_a_restored_row_never_changes_the_tier(tiny, tmp_path):
    prompt = PROMPTS[2]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, "assistant")
        gen.generate([prompt], max_tokens=MAX)
        entries = list(cache.memory._entries.values())
        snapshot = [[np.array(a) for layer in e.layers for a in layer.arrays] for e in entries]
        longer = prompt + [7, 8, 9, 10, 11]
        gen.generate([longer, prompt[:30] + [1, 2, 3]], max_tokens=MAX)  # full hit + trimmed hit, both extended
        for e, snap in zip(entries, snapshot):
            now = [np.array(a) for layer in e.layers for a in layer.arrays]
            assert all(np.array_equal(x, y) for x, y in zip(snap, now))


def test_tier_arrays_survive_in_place_updates_of_handed_out_caches():
    """A row's cache written in place (trim, then update inside its buffer) never reaches the tier's arrays."""
    tier = MemoryTier(1 << 20, idle_seconds=None)
    entry = tier.put(b"n" * 32, list(range(10)), [kv(10)], durable=True)
    held = np.array(entry.layers[0].arrays[0])
    hit = tier.lookup(b"n" * 32, list(range(10)))
    (cache,), _ = tier.take(hit)
    cache.trim(3)
    cache.update_and_fetch(mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    cache.keys[..., 0:1, :] = mx.full((1, 2, 1, 4), 7.0)
    mx.eval(cache.keys)
    assert np.array_equal(np.array(entry.layers[0].arrays[0]), held)


# --- rules ------------------------------------------------------------------------------------------
NS = b"k" * 32


def test_longest_usable_prefix_trimming_and_exact_length_rules():
    tier = MemoryTier(1 << 20, idle_seconds=None)
    tier.put(NS, list(range(20)), [kv(20)], durable=True)
    ring = RotatingKVCache(max_size=8, keep=0)
    ring.update_and_fetch(mx.zeros((1, 2, 12, 4)), mx.zeros((1, 2, 12, 4)))
    tier.put(b"r" * 32, list(range(12)), [ring], durable=True)
    hit = tier.lookup(NS, list(range(15)) + [99])          # trimmable: served to the common prefix
    assert hit.length == 15 and not hit.has_drafter
    (c,), _ = tier.take(hit)
    assert c.offset == 15 and c.keys.shape[2] == 15
    assert tier.lookup(NS, list(range(30))).length == 20    # the whole entry, a prefix of the request
    assert tier.lookup(b"r" * 32, list(range(10)) + [99]) is None  # a ring buffer is exact-length
    assert tier.lookup(b"r" * 32, list(range(12)) + [99]).length == 12
    assert tier.lookup(NS, list(range(15)), usable=lambda c: c.length <= 10) is None  # predicate refuses all
    assert tier.lookup(NS, [5, 6]) is None


def test_drafter_parts_are_exact_length_and_minimum_reusable_bounds_trimming():
    from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint

    tier = MemoryTier(1 << 20, idle_seconds=None)
    cp = DraftRowCheckpoint(20, CheckpointAttachment("ngram-history-v1", {"n": 3}, (mx.arange(20),)))
    tier.put(NS, list(range(20)), [kv(20)], drafter_namespace="d", draft_checkpoint=cp, minimum_reusable=12,
             durable=True)
    full = tier.lookup(NS, list(range(25)), drafter_namespace="d")
    assert (full.length, full.has_drafter) == (20, True)
    _, got = tier.take(full, "d")
    assert got.processed_tokens == 20 and got.attachment.tensors[0] is not cp.attachment.tensors[0]
    trimmed = tier.lookup(NS, list(range(15)), drafter_namespace="d")
    assert (trimmed.length, trimmed.has_drafter) == (15, False)
    assert tier.lookup(NS, list(range(11))) is None        # below the conversion point: never
    seen = []
    tier.lookup(NS, list(range(25)), usable=lambda c: seen.append(c) or False)
    assert seen == [HitView(20, False, 12)]


def test_budget_lru_pinning_and_durability():
    one = kv(10).keys.nbytes * 2
    tier = MemoryTier(3 * one, idle_seconds=None)
    a = tier.put(NS, [1] * 10, [kv(10)], durable=True)
    tier.put(NS, [2] * 10, [kv(10)], durable=True)
    tier.put(NS, [3] * 10, [kv(10)], durable=False)     # not yet in LMDB: must stay
    tier.pin(NS, [2] * 10)
    tier.lookup(NS, [1] * 10)                            # a is now the most recently used
    tier.put(NS, [4] * 10, [kv(10)], durable=True)       # over budget: evict LRU evictable -> ... a (only one)
    keys = {e.tokens[0] for e in tier._entries.values()}
    assert keys == {2, 3, 4} and tier.bytes <= 3 * one
    assert tier.stats()["evicted"] == 1 and a.key not in tier._entries
    tier.put(NS, [5] * 10, [kv(10)], durable=True)
    assert {e.tokens[0] for e in tier._entries.values()} == {2, 3, 5}  # 4 evicted; pinned 2, pending 3 stay
    assert tier.put(NS, [6] * 40, [kv(40)]) is None       # over the whole budget: not held
    pending = tier._entries[(NS, np.full(10, 3, np.uint32).tobytes())]
    tier.put(NS, [7] * 10, [kv(10)], durable=True)
    assert pending.key in tier._entries
    tier.mark_durable(pending)
    tier.put(NS, [8] * 10, [kv(10)], durable=True)
    assert pending.key not in tier._entries              # evictable once durable


def test_pressure_reclaim_and_idle_demotion():
    one = kv(10).keys.nbytes * 2
    pressure = {"active": 0, "limit": 10 ** 12}
    tier = MemoryTier(10 * one, idle_seconds=None, memory_probe=lambda: (pressure["active"], pressure["limit"]))
    for i in range(4):
        tier.put(NS, [i] * 10, [kv(10)], durable=True)
    pressure.update(active=5 * one, limit=3 * one)       # 2 entries' worth over the limit
    tier.reclaim_if_pressed()
    assert len(tier._entries) == 2 and tier.stats()["reclaimed"] == 2
    tier.idle_seconds = 0.0
    time.sleep(0.01)
    assert tier.lookup(NS, [3] * 10) is None and tier.stats()["demoted"] == 2


def test_replacement_and_supersession():
    tier = MemoryTier(1 << 20, idle_seconds=None)
    tier.put(NS, list(range(10)), [kv(10)], durable=True)
    tier.put(NS, list(range(10)), [kv(10, seed=1)], durable=True)   # exact duplicate replaces
    assert len(tier._entries) == 1
    tier.put(NS, list(range(16)), [kv(16)], durable=True)           # a trimmable descendant supersedes
    assert len(tier._entries) == 1 and tier.stats()["superseded"] == 1
    assert tier.lookup(NS, list(range(10)) + [77]).length == 10
    pending = tier.put(NS, [9] * 8, [kv(8)], durable=False)          # an ancestor whose LMDB write is pending
    tier.put(NS, [9] * 12, [kv(12)], durable=True)
    assert pending.key in tier._entries and tier.stats()["superseded"] == 1  # kept, as eviction would keep it


def test_a_pending_descendant_supersedes_a_pending_ancestor():
    """Both waiting for LMDB: the ancestor's write still runs (its queued job), the descendant holds its state here
    until after it (issue 35: one ~2 GB snapshot per message boundary stayed on the device)."""
    tier = MemoryTier(1 << 20, idle_seconds=None)
    first = tier.put(NS, [9] * 8, [kv(8)], durable=False)
    second = tier.put(NS, [9] * 12, [kv(12)], durable=False)
    assert list(tier._entries.values()) == [second] and tier.stats()["superseded"] == 1
    assert tier.bytes == second.nbytes
    hit = tier.lookup(NS, [9] * 8 + [3])
    assert hit.length == 8 and hit.entry is second                    # served by trimming the descendant
    tier.mark_durable(first)                                           # its write done later: nothing changes
    assert list(tier._entries.values()) == [second] and tier.bytes == second.nbytes
    again = tier.put(NS, [9] * 12, [kv(12, seed=2)], durable=False)   # the same tokens put anew
    tier.mark_durable(second)                                          # the replaced object's write lands
    assert tier._entries[again.key] is again and tier.bytes == again.nbytes  # the new one stays, counted once


def test_memory_bytes_zero_turns_the_tier_off_and_bad_values_are_refused(tiny, tmp_path):
    with SpecCache.open(tmp_path / "s", memory_bytes=0) as cache:
        gen = load(tiny, cache, "ngram")
        gen.generate([PROMPTS[0]], max_tokens=4)
        (r,) = gen.generate([PROMPTS[0]], max_tokens=4)
        assert r.cached_tokens == len(PROMPTS[0]) - 1 and cache.memory_stats()["entries"] == 0
    from spec_cache.store import StoreError

    for bad in (-1, 1.5, True):
        with pytest.raises(StoreError, match="memory_bytes"):
            SpecCache.open(tmp_path / "t", memory_bytes=bad)


# --- write-behind -------------------------------------------------------------------------------------
def test_drain_makes_every_queued_checkpoint_durable(tmp_path):
    with SpecCache.open(tmp_path / "s", durable=True) as cache:
        ns = cache.namespace("ab" * 32, "{}")
        for i in range(12):
            assert cache.save(ns, [i] * 8 + [1, 2, 3], [kv(11, seed=i)], background=True) is None
        assert cache.drain()
        assert cache.memory_stats()["writes"]["written"] == 12
        assert cache.memory_stats()["not_durable"] == 0
        # a second handle sees every one of them in LMDB
        other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from spec_cache.store import Store
            s = Store.open({str(tmp_path / 's')!r}, readonly=True)
            ns = {ns!r}
            print(sum(s.lookup(ns, [i] * 8 + [1, 2, 3]) is not None for i in range(12)))
        """)], capture_output=True, text=True, timeout=120)
        assert other.stdout.strip() == "12", other.stderr


KILL_SCRIPT = """
import sys, time
from spec_cache.tiers.cache import SpecCache
from spec_cache.drafters import METHODS as DRAFTER_METHODS
from spec_cache.decode.generator import Generator
cache = SpecCache.open(sys.argv[1])
gen = Generator.load(sys.argv[2], None, method="ngram", cache=cache)
prompts = [list(range(3, 3 + n)) for n in (40, 70, 100)]
gen.generate(prompts, max_tokens=6)
print("answered", flush=True)
time.sleep(60)
"""


def test_a_checkpoint_is_durable_soon_after_its_request_even_if_killed(tiny, tmp_path):
    """The process is SIGKILLed 2 s after answering (never closed, never drained): the next process resumes."""
    store_dir = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(store_dir), str(tiny.root / "target")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "answered", proc.stderr.read()
        time.sleep(2.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    from spec_cache.store import maintenance

    with Store.open(store_dir) as store:
        report = maintenance.verify(store)
        assert not report.damaged and report.ok > 0, report.as_dict()
    with SpecCache.open(store_dir, memory_bytes=0) as cache:
        gen = Generator.load(tiny.root / "target", None, method="ngram", cache=cache)
        out = gen.generate([list(range(3, 3 + n)) for n in (40, 70, 100)], max_tokens=6)
        assert [r.cached_tokens for r in out] == [39, 69, 99]


STORM_SCRIPT = """
import sys
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import KVCache
from spec_cache.tiers.cache import SpecCache
cache = SpecCache.open(sys.argv[1])
ns = cache.namespace("ab" * 32, "{}")
rng = np.random.default_rng(0)
i = 0
while True:
    n = 16 + i % 300
    c = KVCache(); c.keys = mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32))
    c.values = c.keys * 2; c.offset = n; mx.eval(c.keys, c.values)
    cache.save(ns, [i % 251] * 3 + list(range(n - 3)), [c], background=True)
    i += 1
    if i == 20: print("running", flush=True)
"""


def test_sigkill_during_write_behind_leaves_no_torn_checkpoint(tmp_path):
    store_dir = tmp_path / "store"
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, "-c", STORM_SCRIPT, str(store_dir)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "running", proc.stderr.read()
            time.sleep(0.3 + 0.4 * trial)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        from spec_cache.store import maintenance

        with Store.open(store_dir) as store:
            report = maintenance.verify(store)
            assert not report.damaged and report.ok > 0, report.as_dict()


def test_write_behind_copies_bytes_to_the_host_on_the_writer_thread(tmp_path, monkeypatch):
    """Behind the request the caller's thread only evaluates MLX views; the device-to-host copy (and encode and
    put) happen on the writer thread, and the stored bytes equal the arrays."""
    import threading

    from spec_cache.state import cache_state
    seen, real = [], cache_state._host_tensor

    def watched(t, *rest):
        if isinstance(t.data, mx.array):
            seen.append(threading.current_thread().name)
        return real(t, *rest)
    monkeypatch.setattr(cache_state, "_host_tensor", watched)
    c = kv(12, seed=3)
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "{}")
        cache.save(ns, list(range(12)), [c], background=True)
        assert cache.drain()
        assert seen and set(seen) == {"spec-cache-write-behind"}
        cache.memory.clear()
        got = cache.restore(ns, list(range(12)))
        assert got.tier == "local"
        assert np.array_equal(np.array(got.caches[0].keys), np.array(c.keys))
        assert np.array_equal(np.array(got.caches[0].values), np.array(c.values))


def test_a_row_restored_to_its_whole_boundary_is_not_copied_for_a_boundary_checkpoint(tiny, tmp_path, monkeypatch):
    """The boundary checkpoint of a row that restored exactly ``prompt[:-1]`` (drafter row included) would repeat
    what it restored: the engine neither extracts (copies) nor offers it; the finish checkpoint still comes."""
    from spec_cache.rows.target import TargetRows

    calls = []
    real = TargetRows.extract
    monkeypatch.setattr(TargetRows, "extract", lambda self, row, **k: calls.append(row) or real(self, row, **k))
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, "assistant")
        gen.generate([PROMPTS[0]], max_tokens=3)
        cold_calls = len(calls)
        calls.clear()
        (warm,) = gen.generate([PROMPTS[0]], max_tokens=3)
        assert warm.cached_tokens == len(PROMPTS[0]) - 1 and warm.restored_drafter
        assert cold_calls == 2 and len(calls) == 1  # cold: boundary + finish; warm: finish only


def test_common_prefix_reads_the_namespace_latest_entries():
    """``MemoryTier.common_prefix`` (the write queue's estimate of what LMDB holds, issue 35 item 3): the longest
    common prefix with an entry of the namespace, another namespace's entries unseen, and only the latest
    ``COMMON_PREFIX_SCAN`` puts compared (a namespace of thousands of small entries costs a save no more)."""
    from spec_cache.tiers.memory_tier import COMMON_PREFIX_SCAN

    tier = MemoryTier(1 << 30)
    base = list(range(1000, 1100))
    tier.put(b"n" * 32, base, [kv(100, seed=1)])
    tier.put(b"m" * 32, base + [5, 6, 7], [kv(103, seed=2)])
    assert tier.common_prefix(b"n" * 32, base[:60] + [9, 9]) == 60
    assert tier.common_prefix(b"n" * 32, base + [5, 6, 7, 8]) == 100  # not the other namespace's 103
    assert tier.common_prefix(b"x" * 32, base) == 0
    for i in range(COMMON_PREFIX_SCAN):  # newer entries sharing nothing with ``base``
        tier.put(b"n" * 32, [i + 1, 2, 3], [kv(3, seed=i)])
    assert tier.common_prefix(b"n" * 32, base) == 0  # the old entry is past the scan: a low estimate, never high
    assert tier.common_prefix(b"n" * 32, [COMMON_PREFIX_SCAN, 2, 3, 4]) == 3

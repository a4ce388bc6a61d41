"""A queued checkpoint takes a later checkpoint's arrays instead of holding its own snapshot (issue 35's agent run
on an H100: a row checkpointed at each message boundary while the writer was behind kept one ~2 GB snapshot per
boundary, in the write queue and in the memory tier; device memory climbed 14 -> 76 GiB and every step then freed
and reallocated MLX's buffers).

Checked here: the earlier jobs hold the later snapshot's arrays (``lent``), the memory tier keeps one entry for the
row, MLX's active memory holds one snapshot, and every checkpoint still comes back from LMDB bit for bit. The GPU
path runs over the stand-in libcuda of ``test_capture_queued`` (the real ``DeviceToHost``, ``ctypes.memmove``)."""

from __future__ import annotations

import gc
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from spec_cache.state import cache_state, device_copy
from spec_cache.state.cache_state import capture_caches, lendable, mark_queued, on_loan, shapes_only
from spec_cache.tiers import write_behind
from spec_cache.tiers.cache import SpecCache
from tests.library.test_capture_queued import _words, gpu  # noqa: F401
from tests.library.test_d2h_stream import FakeAdvice, FakeDriver
from tests.library.test_write_batches import assert_restored_from_lmdb

LENGTHS = (100, 180, 260, 390)


def _row(n: int, layers: int = 2) -> list[np.ndarray]:
    """One row's K and V per layer over ``n`` tokens (numpy, so each snapshot below is a fresh MLX copy)."""
    rng = np.random.default_rng(n)
    return [rng.standard_normal((1, 4, 400, 64)).astype(np.float32) for _ in range(2 * layers)]


def _snapshot(row: list[np.ndarray], n: int, dtype=mx.bfloat16) -> list[KVCache]:
    """What ``TargetRows.extract`` hands over at ``n`` tokens: owned, contiguous, queued single-row caches whose
    first positions agree with every other snapshot of the row."""
    caches = []
    for k, v in zip(row[::2], row[1::2]):
        c = KVCache()
        c.keys = mx.array(k[..., :n, :]).astype(dtype)
        c.values = mx.array(v[..., :n, :]).astype(dtype)
        c.offset = n
        mx.eval(c.keys, c.values)
        caches.append(c)
    mark_queued(caches)
    return caches


def _save_boundaries(cache: SpecCache, ns: bytes, tokens: list[int], row, dtype=mx.bfloat16) -> dict:
    """Checkpoints of ``row`` at each of ``LENGTHS`` (the writer lingering: none is started), the states' words."""
    words = {}
    for n in LENGTHS:
        caches = _snapshot(row, n, dtype)
        words[n] = [(_words(c.keys), _words(c.values)) for c in caches]
        cache.save(ns, tokens[:n], caches, background=True)
        del caches
    return words


@pytest.fixture
def lingering(monkeypatch):
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)  # the writer waits for company: the jobs stay queued


def test_queued_boundary_checkpoints_hold_one_snapshot_and_store_every_one(tmp_path, gpu, lingering):  # noqa: F811
    row = _row(400)
    tokens = list(range(10, 410))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        gc.collect()
        before = mx.get_active_memory()
        words = _save_boundaries(cache, ns, tokens, row)
        gc.collect()
        held = mx.get_active_memory() - before
        last = sum(w.nbytes for pair in words[LENGTHS[-1]] for w in pair)
        queued = cache._queued[ns]
        assert [len(job.tokens) for job in queued] == list(LENGTHS)
        assert cache.memory_stats()["writes"]["lent"] == 1 + 2 + 3  # each new snapshot lends to every earlier one
        newest = queued[-1]
        assert newest.loan.layers is newest.layers  # the newest reads its own arrays
        for job in queued[:-1]:  # every earlier job reads the newest one's, only its shapes kept of its own
            assert job.loan is newest.loan
            assert all(t.data is None and t.shape[2] == len(job.tokens) for layer in job.layers for t in layer.tensors)
            lent = on_loan(job.layers, newest.layers)
            assert all(t.data is u.data for a, b in zip(lent, newest.layers) for t, u in zip(a.tensors, b.tensors))
        stats = cache.memory.stats()
        assert stats["entries"] == 1 and stats["bytes"] == last  # the ancestors are served by trimming the newest
        assert held <= last * 1.25, (held, last)  # one snapshot; without lending all four (2.4x the last)
        for n in LENGTHS[:-1]:  # the memory tier serves each boundary by trimming the newest entry
            got = cache.restore(ns, tokens[:n] + [1])
            assert got is not None and got.length == n
        assert cache.drain(60)
    _assert_lmdb_words(tmp_path / "s", ns, tokens, words)


def _assert_lmdb_words(path, ns, tokens, words) -> None:
    with SpecCache.open(path, memory_bytes=0) as cache:
        for n, layers in words.items():
            got = cache.restore(ns, tokens[:n] + [1])
            assert got is not None and got.length == n
            for (k, v), c in zip(layers, got.caches):
                assert np.array_equal(_words(c.keys[..., :n, :]), k)
                assert np.array_equal(_words(c.values[..., :n, :]), v)


def test_on_unified_memory_a_lent_checkpoint_is_a_strided_view_stored_bit_for_bit(tmp_path, lingering):
    """Off CUDA (a CPU, Apple silicon) the snapshot is RAM the same way: lent, the earlier checkpoint's tensors are
    strided host views of the later arrays (no copy), and the store gets the same bytes."""
    row = _row(400)
    tokens = list(range(10, 410))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        states = {}
        for n in LENGTHS:
            caches = _snapshot(row, n, mx.float32)
            states[n] = caches
            cache.save(ns, tokens[:n], caches, background=True)
        assert cache.memory_stats()["writes"]["lent"] == 1 + 2 + 3
        job = cache._queued[ns][0]
        (layer,) = cache_state.host_layers(on_loan(job.layers, job.loan.layers)[:1])
        assert not layer.tensors[0].data.flags.c_contiguous  # a view of the 390-token array, not a copy
        assert cache.drain(60)
    assert_restored_from_lmdb(tmp_path / "s", ns, tokens, states)


def test_only_a_queued_checkpoint_of_the_same_tokens_borrows(tmp_path, gpu, lingering):  # noqa: F811
    row = _row(400)
    tokens = list(range(10, 410))
    other = list(range(10, 150)) + [7] * 260  # shares 140 tokens, then differs: not a prefix of it
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        first = _snapshot(row, 180)
        cache.save(ns, tokens[:180], first, background=True)
        cache.save(ns, other[:390], _snapshot(row, 390), background=True)
        (job, _) = cache._queued[ns]
        assert cache.memory_stats()["writes"]["lent"] == 0
        assert job.loan.layers is job.layers
        assert all(t.data is a for t, a in zip(job.layers[0].tensors, (first[0].keys, first[0].values)))
        assert cache.memory.stats()["entries"] == 2
        assert cache.drain(60)


def test_a_started_checkpoint_keeps_its_own_arrays(tmp_path, gpu):  # noqa: F811
    row = _row(400)
    tokens = list(range(10, 410))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        first = _snapshot(row, 180)
        cache.save(ns, tokens[:180], first, background=True)
        (job,) = cache._queued[ns]
        cache._to_host(job)  # the writer began its copy: from here its layers are its own
        assert job.started
        cache.save(ns, tokens[:390], _snapshot(row, 390), background=True)
        assert cache.memory_stats()["writes"]["lent"] == 0
        assert cache.drain(60)


def test_lendable_refuses_what_cannot_stand_in(gpu):  # noqa: F811
    row = _row(400)
    short, long = _snapshot(row, 100), _snapshot(row, 200)
    a, b = capture_caches(short, defer_copy=True), capture_caches(long, defer_copy=True)
    assert lendable(a, b, 100) and lendable(shapes_only(a), b, 100)  # its own arrays, or only its shapes
    lent = on_loan(shapes_only(a), b)
    assert all(t.data is u.data and t.shape == s.shape for la, lb, ls in zip(lent, b, a)
               for t, u, s in zip(la.tensors, lb.tensors, ls.tensors))
    assert not lendable(a, b, 99)                                         # the length must be the earlier's
    assert not lendable(a, b[:1], 100)                                    # another layer count
    assert not lendable(a, capture_caches(_snapshot(row, 200, mx.float16), defer_copy=True), 100)
    q8, q4 = QuantizedKVCache(group_size=32, bits=8), QuantizedKVCache(group_size=32, bits=4)
    for q in (q8, q4):
        q.update_and_fetch(mx.zeros((1, 2, 100, 32)), mx.zeros((1, 2, 100, 32)))
    assert lendable(capture_caches([q8], defer_copy=True), capture_caches([q8], defer_copy=True), 100)
    assert not lendable(capture_caches([q8], defer_copy=True), capture_caches([q4], defer_copy=True), 100)
    ring = RotatingKVCache(max_size=64)                                   # no positions: never lent
    ring.update_and_fetch(mx.zeros((1, 4, 100, 64)), mx.zeros((1, 4, 100, 64)))
    assert not lendable(capture_caches([ring], defer_copy=True), capture_caches([ring], defer_copy=True), 100)
    host = capture_caches(short, defer_copy=False)                        # bytes on the host already
    assert not lendable(host, b, 100)


def test_the_copier_reads_a_lent_arrays_first_positions(gpu):  # noqa: F811
    x = mx.arange(2 * 3 * 10 * 4, dtype=mx.float32).astype(mx.bfloat16).reshape(2, 3, 10, 4)
    mx.eval(x)
    out = gpu.copy_from(x, 2, 2, stop=6)
    assert out.shape == (2, 3, 6, 4)
    assert np.array_equal(out[..., 2:, :], _words(x)[..., 2:6, :])
    with pytest.raises(ValueError, match="positions"):
        device_copy.copy_token_range(0, 0, (1, 1, 8, 1), 2, 2, 0, lambda *a: None, src_length=6)


def test_a_checkpoint_that_branches_off_takes_over_only_the_prefixes_it_shares(tmp_path, gpu, lingering):  # noqa: F811
    """The 100- and 180-token checkpoints read the 390-token one's arrays; a 300-token one that shares only the first
    180 tokens takes those two over and leaves the 390-token one its own; every one is stored bit for bit."""
    row, other = _row(400), _row(401)
    tokens = list(range(10, 410))
    branch = tokens[:180] + [5] * 120
    twig = [np.concatenate([a[..., :180, :], b[..., 180:, :]], axis=2) for a, b in zip(row, other)]
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        words = {}
        for n in (100, 180, 390):
            caches = _snapshot(row, n)
            words[tuple(tokens[:n])] = [(_words(c.keys), _words(c.values)) for c in caches]
            cache.save(ns, tokens[:n], caches, background=True)
        caches = _snapshot(twig, 300)
        words[tuple(branch)] = [(_words(c.keys), _words(c.values)) for c in caches]
        cache.save(ns, branch, caches, background=True)
        del caches
        p100, p180, whole, twig_job = cache._queued[ns]
        assert p100.loan is p180.loan is twig_job.loan and whole.loan is not twig_job.loan
        assert whole.loan.layers is whole.layers  # its own arrays, still held
        assert cache.memory_stats()["writes"]["lent"] == 1 + 2 + 2
        assert cache.drain(60)
    with SpecCache.open(tmp_path / "s", memory_bytes=0) as cache:
        for toks, layers in words.items():
            got = cache.restore(ns, list(toks) + [1])
            assert got is not None and got.length == len(toks)
            for (k, v), c in zip(layers, got.caches):
                assert np.array_equal(_words(c.keys[..., :len(toks), :]), k)
                assert np.array_equal(_words(c.values[..., :len(toks), :]), v)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_checkpoints_saved_while_the_writer_runs_all_come_back_bit_for_bit(tmp_path, monkeypatch, on_gpu):
    """Lending races the writer here (no linger: it starts on jobs while later ones are saved): two rows' growing
    prefixes and a branch of each, interleaved; every checkpoint restores from LMDB with its own bytes."""
    if on_gpu:
        monkeypatch.setattr(device_copy, "is_gpu", lambda: True)
        d2h = device_copy.DeviceToHost(FakeAdvice(FakeDriver()), threads=1)
        monkeypatch.setattr(cache_state, "_device_to_host", lambda: d2h)
    monkeypatch.setattr(write_behind, "LINGER_S", 0.0)
    monkeypatch.setattr(write_behind, "QUIET_S", 0.0)
    rng = np.random.default_rng(7)
    rows = {"a": _row(400), "b": _row(402)}
    streams = {"a": list(range(10, 410)), "b": list(range(1000, 1400))}
    plan = []
    for name in ("a", "b"):
        lengths = sorted(rng.choice(np.arange(20, 400), size=8, replace=False).tolist())
        plan += [(name, n, False) for n in lengths] + [(name, lengths[3] + 5, True)]
    order = sorted(range(len(plan)), key=lambda i: (plan[i][1], rng.random()))  # each row's prefixes grow
    words = {}
    with SpecCache.open(tmp_path / "s", chunk_tokens=64) as cache:
        ns = cache.namespace("ab" * 32, "prefix")
        slow_put, slow_many = cache.store.put, cache.store.put_many

        def put(*args, **kwargs):  # a writer a little behind: later saves find jobs queued and one in flight
            time.sleep(0.01)
            return slow_put(*args, **kwargs)

        def put_many(*args, **kwargs):
            time.sleep(0.01)
            return slow_many(*args, **kwargs)

        monkeypatch.setattr(cache.store, "put", put)
        monkeypatch.setattr(cache.store, "put_many", put_many)
        for i in order:
            name, n, branch = plan[i]
            row, toks = rows[name], list(streams[name][:n])
            if branch:  # the last 5 tokens differ, and so do their K/V
                toks[-5:] = [7, 7, 7, 7, 7]
                row = [np.concatenate([x[..., :n - 5, :], -x[..., n - 5:, :]], axis=2) for x in row]
            caches = _snapshot(row, n)
            words[tuple(toks)] = [(_words(c.keys), _words(c.values)) for c in caches]
            cache.save(ns, toks, caches, background=True)
            del caches
        assert cache.drain(60)
        writes = cache.memory_stats()["writes"]
        assert writes["failed"] == 0 and writes["written"] == len(plan)
    with SpecCache.open(tmp_path / "s", memory_bytes=0) as cache:
        for toks, layers in words.items():
            got = cache.restore(ns, list(toks) + [1])
            assert got is not None and got.length == len(toks), len(toks)
            for (k, v), c in zip(layers, got.caches):
                assert np.array_equal(_words(c.keys[..., :len(toks), :]), k)
                assert np.array_equal(_words(c.values[..., :len(toks), :]), v)

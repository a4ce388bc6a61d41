"""What ``save()`` accepted survives the end of the process: a script that never closes its ``SpecCache`` and
ends normally or by an uncaught exception (the exit drain), a SIGKILL right after a save in ``durability="sync"``
mode, and an exit drain that cannot finish (bounded, and it says what was left). Real child processes; the parent
is the second process that restores."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

from spec_cache.decode.generator import Generator
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny  # noqa: F401  (fixtures)

PROMPTS = [list(range(3, 3 + n)) for n in (12, 20, 31, 45)]
HANG_GUARD_S = 240  # generous: a child that takes longer is hung, not slow

# The child: generate through a cache it never closes. ``store.put`` is slowed down (a slow disk) so that the
# writes are still queued when the script ends, whatever the machine's speed.
CHILD = """
import os, sys, time
from spec_cache.tiers.cache import SpecCache
from spec_cache.decode.generator import Generator
store_dir, target_dir, how = sys.argv[1:4]
prompts = [list(range(3, 3 + n)) for n in (12, 20, 31, 45)]
options = {"durability": "sync"} if how == "sync" else {}
cache = SpecCache.open(store_dir, **options)
real_put, real_many = cache.store.put, cache.store.put_many
def slow_put(*args, **kwargs):
    time.sleep(0.15)
    return real_put(*args, **kwargs)
def slow_many(puts):
    time.sleep(0.15 * len(puts))
    return real_many(puts)
cache.store.put, cache.store.put_many = slow_put, slow_many
gen = Generator.load(target_dir, None, method="ngram", cache=cache)
gen.generate(prompts, max_tokens=4)
print("answered", flush=True)
if how == "raise":
    raise RuntimeError("the script fails after its requests")
if how in ("sync", "kill"):
    os.kill(os.getpid(), 9)
"""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-durability"), drafters={}).root / "target"


def run_child(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


def assert_clean(store_dir, records: int | None = None) -> None:
    """``verify`` finds nothing damaged (and ``records`` records, when given)."""
    from spec_cache.store import Store, maintenance

    with Store.open(store_dir) as store:
        report = maintenance.verify(store)
    assert not report.damaged, report.as_dict()
    assert records is None or report.records == records, report.as_dict()


def restored_tokens(store_dir, target_dir) -> list[int]:
    """Prompt tokens each of ``PROMPTS`` restores from LMDB, in this (second) process."""
    with SpecCache.open(store_dir, memory_bytes=0) as cache:
        gen = Generator.load(target_dir, None, method="ngram", cache=cache)
        return [r.cached_tokens for r in gen.generate(PROMPTS, max_tokens=4)]


def test_a_script_that_never_closes_its_cache_keeps_every_checkpoint(target_dir, tmp_path):
    done = run_child(CHILD, tmp_path / "store", target_dir, "exit")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "answered"
    assert "Traceback" not in done.stderr, done.stderr
    assert_clean(tmp_path / "store")
    assert restored_tokens(tmp_path / "store", target_dir) == [len(p) - 1 for p in PROMPTS]


def test_a_script_ended_by_an_uncaught_exception_keeps_every_checkpoint(target_dir, tmp_path):
    done = run_child(CHILD, tmp_path / "store", target_dir, "raise")
    assert done.returncode == 1
    assert "RuntimeError: the script fails after its requests" in done.stderr
    assert restored_tokens(tmp_path / "store", target_dir) == [len(p) - 1 for p in PROMPTS]


def test_sync_durability_survives_a_sigkill_right_after_the_request(target_dir, tmp_path):
    """``durability="sync"``: every checkpoint is in LMDB when ``generate`` returns; the process then kills itself
    (no exit hook runs) and the next process restores every prompt. The same kill in the default write-behind mode
    loses what was still queued: the window ``durability="sync"`` closes."""
    done = run_child(CHILD, tmp_path / "sync", target_dir, "sync")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.strip() == "answered"
    assert restored_tokens(tmp_path / "sync", target_dir) == [len(p) - 1 for p in PROMPTS]

    done = run_child(CHILD, tmp_path / "behind", target_dir, "kill")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert restored_tokens(tmp_path / "behind", target_dir) != [len(p) - 1 for p in PROMPTS]


# The child: the first LMDB put never returns (a hung disk); three more checkpoints are queued behind it.
BLOCKED = """
import sys, threading, time
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from spec_cache.tiers.cache import SpecCache
cache = SpecCache.open(sys.argv[1], exit_timeout_s=1.0)
ns = cache.namespace("ab" * 32, "{}")
cache.store.put = cache.store.put_many = lambda *a, **k: threading.Event().wait()
for i in range(4):
    c = KVCache(); c.keys = mx.ones((1, 2, 16, 8)) * i; c.values = c.keys + 1; c.offset = 16
    mx.eval(c.keys, c.values)
    cache.save(ns, [i] * 16, [c], background=True)
    while i == 0 and cache.memory_stats()["writes"]["pending"]:  # the writer took the first (it is stuck in it)
        time.sleep(0.01)
print("queued", flush=True)
"""


def test_the_exit_wait_is_bounded_and_says_what_was_left(tmp_path):
    done = run_child(BLOCKED, tmp_path / "store")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "queued"
    # one checkpoint stuck in its write, three queued behind it: none written, every one accounted for
    assert "0 written" in done.stderr, done.stderr
    assert "1 still being written" in done.stderr, done.stderr
    assert "3 queued checkpoints (6144 bytes) not written" in done.stderr, done.stderr
    assert_clean(tmp_path / "store", records=0)  # the store left open at exit opens and verifies clean


# The child: a host of a shared tier whose checkpoints are still queued (for LMDB, then for publishing) at exit.
SHARED_HOST = """
import sys, time
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from spec_cache.tiers.cache import SpecCache
cache = SpecCache.open(sys.argv[1], shared=sys.argv[2], chunk_tokens=16,
                       shared_options={"timeout_s": 2.0, "connect_timeout_s": 2.0})
ns = cache.namespace("ab" * 32, "{}")
real_put, real_many = cache.store.put, cache.store.put_many
def slow_put(*args, **kwargs):
    time.sleep(0.15)
    return real_put(*args, **kwargs)
def slow_many(puts):
    time.sleep(0.15 * len(puts))
    return real_many(puts)
cache.store.put, cache.store.put_many = slow_put, slow_many
for i in range(3):
    c = KVCache(); c.keys = mx.ones((1, 2, 32, 8)) * i; c.values = c.keys + 1; c.offset = 32
    mx.eval(c.keys, c.values)
    cache.save(ns, [3 + i] * 32, [c], background=True)
print("queued", flush=True)
"""


def test_the_exit_drain_publishes_to_the_shared_tier(redis_server, tmp_path, monkeypatch):
    """Queued checkpoints of a never-closed host reach its LMDB and then the shared tier before the process ends:
    another host, with an empty LMDB of its own, restores each of them from the shared tier."""
    monkeypatch.setenv("SPEC_CACHE_SHARED_TRUSTED", "1")  # a server on 127.0.0.1 of this test alone; child too
    done = run_child(SHARED_HOST, tmp_path / "a", redis_server.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "queued"
    with SpecCache.open(tmp_path / "b", shared=redis_server.url, chunk_tokens=16, memory_bytes=0,
                        shared_options={"timeout_s": 2.0, "connect_timeout_s": 2.0,
                                        "lookup_budget_s": 10.0}) as other:
        ns = other.namespace("ab" * 32, "{}")
        for i in range(3):
            hit = other.restore(ns, [3 + i] * 32 + [1])
            assert hit is not None and (hit.tier, hit.length) == ("shared", 32)
            assert np.array_equal(np.asarray(hit.caches[0].keys), np.full((1, 2, 32, 8), i, np.float32))


def test_the_exit_registry_holds_caches_weakly_and_close_leaves_it(tmp_path):
    """Registering for the exit drain keeps no cache alive, and a closed cache is not closed again at exit."""
    import gc
    import weakref

    from spec_cache.tiers import exit_drain
    cache = SpecCache.open(tmp_path / "a")
    assert cache in exit_drain._open
    cache.close()
    assert cache not in exit_drain._open
    sync = SpecCache.open(tmp_path / "b", durability="sync")  # no writer thread: nothing else holds it
    ref = weakref.ref(sync)
    assert sync in exit_drain._open
    sync.store.close()
    del sync
    gc.collect()
    assert ref() is None


# The child: the main script ends at once; a (non-daemon) worker thread saves its checkpoints after that.
LATE_WORKER = """
import sys, threading, time
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from spec_cache.tiers.cache import SpecCache
cache = SpecCache.open(sys.argv[1])
ns = cache.namespace("ab" * 32, "{}")
def worker():
    time.sleep(0.5)  # the main thread has finished its script by now
    for i in range(3):
        c = KVCache(); c.keys = mx.ones((1, 2, 16, 8)) * i; c.values = c.keys + 1; c.offset = 16
        mx.eval(c.keys, c.values)
        cache.save(ns, [3 + i] * 16, [c], background=True)
threading.Thread(target=worker).start()
print("main done", flush=True)
"""


def test_the_exit_drain_runs_after_worker_threads_finished(tmp_path):
    """The hook is an ``atexit`` one: it runs after CPython joined the non-daemon threads, so a worker's saves
    made after the main script ended are written too (a ``threading._register_atexit`` hook would have run first
    and closed the cache under the worker)."""
    done = run_child(LATE_WORKER, tmp_path / "store")
    assert done.returncode == 0, done.stderr
    assert "not stored" not in done.stderr and "gave up" not in done.stderr, done.stderr
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        ns = cache.namespace("ab" * 32, "{}")
        assert [cache.store.lookup(ns, [3 + i] * 16) is not None for i in range(3)] == [True] * 3

"""The launcher's prompt-cache hooks stay off LMDB on the request thread (issue 27 item 4).

``mlx_lm.server`` calls ``insert_cache`` after a reply and ``fetch_nearest_cache`` for the next request on the same
thread. The checkpoint's LMDB write runs on the write-behind thread and holds the store's lock for its whole commit;
a fetch the memory tier answers must not wait for it. Here a store commit is held open (an event the test releases):
the insert and the next turn's fetch both return while it is still open, the next turn's tokens equal a cold run's,
and after release the checkpoint is durable in LMDB (a fresh process-side store finds it).
"""

from __future__ import annotations

import threading

from spec_cache.convert.mlx_lm_cache import SpecCachePromptCache
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_mlx_lm_server import _greedy, _prompt_text, _serve, loaded, model_dir  # noqa: F401


def _held_commits(cache: SpecCache):
    """Make every LMDB commit of ``cache`` wait (inside the store's lock) until ``release`` is set (or 20 s pass);
    ``committed`` is set once one has gone through."""
    release, entered, committed = threading.Event(), threading.Event(), threading.Event()
    original = cache.store._commit

    def slow_commit(txn, checkpoint, pin):
        entered.set()
        release.wait(20)
        result = original(txn, checkpoint, pin)
        committed.set()
        return result

    cache.store._commit = slow_commit
    return release, entered, committed


def test_fetch_and_insert_never_wait_for_the_lmdb_write(loaded, model_dir, tmp_path):  # noqa: F811
    _, tok = loaded
    key = (str(model_dir), None, None)
    cache = SpecCache.open(tmp_path / "store", memory_bytes=64 << 20)
    pc = SpecCachePromptCache(cache=cache)
    release, entered, committed = _held_commits(cache)
    try:
        turn1 = tok.encode(_prompt_text(120))
        out1, cached1 = _serve(pc, loaded, key, turn1)  # fetch, generate, insert (the write goes behind)
        assert cached1 == 0
        assert entered.wait(30), "the checkpoint's LMDB write never started"
        assert not committed.is_set(), "insert_cache waited for the LMDB commit"
        turn2 = turn1 + out1 + tok.encode(_prompt_text(40, salt=3))
        restored, rest = pc.fetch_nearest_cache(key, list(turn2))
        assert not committed.is_set(), "turn 2's fetch waited for turn 1's LMDB commit (the store's lock)"
        assert restored is not None and len(turn2) - len(rest) == len(turn1) + len(out1)
        assert cache.memory_stats()["not_durable"] >= 1  # the write is still behind the request
    finally:
        release.set()
    out2, cached2 = _serve(pc, loaded, key, turn2)  # exactness: the memory tier's state gives a cold run's tokens
    assert cached2 == len(turn1) + len(out1)
    assert out2 == _greedy(loaded, turn2)
    assert pc.drain(30) and committed.is_set()
    ns = pc.namespace_for(key)
    pc.close()
    cache.close()
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as reopened:  # durable: LMDB alone serves both turns
        hit = reopened.store.lookup(ns, turn2 + out2)
        assert hit is not None and hit.length == len(turn2) + len(out2)
        pc2 = SpecCachePromptCache(cache=reopened)
        restored, rest = pc2.fetch_nearest_cache(key, turn2 + out2 + [5])
        assert restored is not None and rest == [5]

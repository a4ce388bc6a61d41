"""The launcher's ``insert_cache`` / ``fetch_nearest_cache`` never wait on the request thread (issue 27 item 4).

``mlx_lm.server`` calls ``insert_cache`` after a reply and ``fetch_nearest_cache`` for the next request on its one
generation thread. Here the device is made slow on purpose: any MLX evaluation spec-cache's capture waits for on
the request thread is held until the test releases it, and the write-behind thread's device-to-host copy is held
too. The insert must return while both are held, the next turn's fetch must see the whole previous turn at once,
replies must equal a cold greedy run, and once released the checkpoints must be durable in LMDB (the exit drain).
After a restart (LMDB already holds the namespace) a warm turn's fetch must not wait for the previous turn's LMDB
commit, and a partial hit (another conversation's shared system prompt) must still get the longer LMDB prefix.
"""

from __future__ import annotations

import threading

import mlx.core as mx

import spec_cache.state.cache_state as cache_state
import spec_cache.tiers.cache as cache_module
from spec_cache.convert.mlx_lm_cache import SpecCachePromptCache
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_mlx_lm_server import _greedy, _prompt_text, _serve, loaded, model_dir  # noqa: F401

HOLD_S = 20  # a held wait gives up after this (the old code then fails its assertion instead of hanging)


class _SlowDevice:
    """``mlx.core`` as ``spec_cache.state.cache_state`` sees it, except that ``eval`` (a wait for the device) blocks on
    ``thread`` until ``release`` is set; ``waited`` records that it was asked to."""

    def __init__(self, thread: threading.Thread):
        self.thread, self.release, self.waited = thread, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *args, **kwargs):
        if threading.current_thread() is self.thread:
            self.waited.set()
            self.release.wait(HOLD_S)
        return mx.eval(*args, **kwargs)


def _slow_copies(monkeypatch):
    """Hold the write-behind thread's device-to-host copies until ``release`` is set; ``entered``: one started."""
    release, entered = threading.Event(), threading.Event()
    original = cache_module.host_layers

    def slow_host_layers(layers, *rest):
        entered.set()
        release.wait(HOLD_S)
        return original(layers, *rest)

    monkeypatch.setattr(cache_module, "host_layers", slow_host_layers)
    return release, entered


def _held_commits(cache: SpecCache):
    """Hold every LMDB commit of ``cache`` (inside the store's lock) until ``release`` is set."""
    release, entered, committed = threading.Event(), threading.Event(), threading.Event()
    original = cache.store._commit

    def slow_commit(txn, checkpoint, pin):
        entered.set()
        release.wait(HOLD_S)
        result = original(txn, checkpoint, pin)
        committed.set()
        return result

    cache.store._commit = slow_commit
    return release, entered, committed


def test_insert_returns_before_a_slow_capture_and_copy(loaded, model_dir, tmp_path, monkeypatch):  # noqa: F811
    _, tok = loaded
    key = (str(model_dir), None, None)
    device = _SlowDevice(threading.current_thread())
    monkeypatch.setattr(cache_state, "mx", device)
    copy_release, copy_entered = _slow_copies(monkeypatch)
    cache = SpecCache.open(tmp_path / "store", memory_bytes=64 << 20)
    pc = SpecCachePromptCache(cache=cache)
    try:
        turn1 = tok.encode(_prompt_text(150))
        out1, cached1 = _serve(pc, loaded, key, turn1)  # fetch, generate, insert
        assert cached1 == 0
        assert not device.waited.is_set(), "insert_cache waited on the request thread for the capture's evaluation"
        assert copy_entered.wait(30), "the write-behind thread never started the checkpoint's copy"
        # the next request, at once: the whole previous turn from the memory tier, the copy still held
        turn2 = turn1 + out1 + tok.encode(_prompt_text(40, salt=5))
        out2, cached2 = _serve(pc, loaded, key, turn2)
        assert cached2 == len(turn1) + len(out1)
        assert cache.memory_stats()["not_durable"] >= 1  # nothing written yet: the copies are still held
        turn3 = turn2 + out2 + tok.encode(_prompt_text(30, salt=9))
        out3, cached3 = _serve(pc, loaded, key, turn3)
        assert cached3 == len(turn2) + len(out2)
        assert not device.waited.is_set(), "a hook waited on the request thread for an evaluation"
    finally:
        device.release.set()
        copy_release.set()
    # exactness: each reply equals a cold greedy run of its prompt
    assert [out1, out2, out3] == [_greedy(loaded, t) for t in (turn1, turn2, turn3)]
    ns = pc.namespace_for(key)
    cache.close()  # the exit drain: every queued checkpoint is written
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as reopened:  # LMDB alone serves every turn
        for tokens in (turn1 + out1, turn2 + out2, turn3 + out3):
            hit = reopened.store.lookup(ns, tokens)
            assert hit is not None and hit.length == len(tokens)


def test_after_a_restart_a_warm_fetch_never_waits_for_the_commit(loaded, model_dir, tmp_path):  # noqa: F811
    _, tok = loaded
    key = (str(model_dir), None, None)
    system = tok.encode(_prompt_text(120))
    convs = [system + tok.encode(_prompt_text(30, salt=s)) for s in (11, 13)]
    with SpecCache.open(tmp_path / "store", memory_bytes=64 << 20) as first:  # the process before the restart
        pc = SpecCachePromptCache(cache=first)
        outs = [_serve(pc, loaded, key, c)[0] for c in convs]
        assert pc.drain(30)
    cache = SpecCache.open(tmp_path / "store", memory_bytes=64 << 20)  # restarted: LMDB holds the namespace
    pc = SpecCachePromptCache(cache=cache)
    try:
        turn2 = convs[0] + outs[0] + tok.encode(_prompt_text(25, salt=17))
        out2, cached2 = _serve(pc, loaded, key, turn2)
        assert cached2 == len(convs[0]) + len(outs[0])  # restored from LMDB (the restart win)
        release, entered, committed = _held_commits(cache)  # turn 2's checkpoint: its commit held open
        try:
            assert entered.wait(30), "turn 2's LMDB write never started"
            turn3 = turn2 + out2 + tok.encode(_prompt_text(20, salt=19))
            restored, rest = pc.fetch_nearest_cache(key, list(turn3))
            assert not committed.is_set(), "a warm turn's fetch waited for the previous turn's LMDB commit"
            assert len(turn3) - len(rest) == len(turn2) + len(out2)  # the whole previous turn, from memory
            # another conversation: the memory tier shares only the system prompt with it, LMDB holds its turn
            other = convs[1] + outs[1] + tok.encode(_prompt_text(20, salt=23))
            threading.Timer(0.3, release.set).start()
            restored_other, rest_other = pc.fetch_nearest_cache(key, list(other))
            assert len(other) - len(rest_other) == len(convs[1]) + len(outs[1]), "a partial hit skipped LMDB"
        finally:
            release.set()
        assert _greedy(loaded, rest, cache=restored) == _greedy(loaded, turn3)
        assert _greedy(loaded, rest_other, cache=restored_other) == _greedy(loaded, other)
    finally:
        pc.close()
        cache.close()

"""The write-behind thread waits while its owner says latency-critical work runs (``WriteBehind.hold``): a
server's admissions never share the machine with the writer's copies and puts. Bounded by ``hold_max_s``; a drain
or close ends the wait at once; a broken hook never stops the writer."""

from __future__ import annotations

import threading
import time

from spec_cache.store.shared.queue import WriteBehind


def _queue(**options):
    done = []
    event = threading.Event()

    def handle(job):
        done.append(job)
        event.set()

    return WriteBehind(1 << 20, handle, name="test-hold", **options), done, event


def test_the_writer_waits_while_held_and_goes_on_once_released():
    q, done, event = _queue()
    busy = threading.Event()
    busy.set()
    q.hold, q.hold_max_s = busy.is_set, 60.0
    try:
        assert q.offer("a", 1)
        assert not event.wait(0.3) and done == []  # held: nothing written yet
        busy.clear()
        assert event.wait(10) and done == ["a"]
        assert q.held_s >= 0.3
    finally:
        q.close(10)


def test_the_wait_is_bounded():
    q, done, event = _queue()
    q.hold, q.hold_max_s = (lambda: True), 0.2
    try:
        assert q.offer("a", 1)
        assert event.wait(10) and done == ["a"]  # written after at most hold_max_s although always busy
    finally:
        q.close(10)


def test_a_drain_ends_the_wait_at_once():
    q, done, _ = _queue()
    q.hold, q.hold_max_s = (lambda: True), 60.0
    try:
        assert q.offer("a", 1)
        time.sleep(0.05)
        began = time.monotonic()
        assert q.drain(30) and done == ["a"]
        assert time.monotonic() - began < 30
    finally:
        q.close(10)


def test_a_broken_hook_never_stops_the_writer():
    q, done, event = _queue()

    def broken():
        raise RuntimeError("hook bug")

    q.hold, q.hold_max_s = broken, 60.0
    try:
        assert q.offer("a", 1)
        assert event.wait(10) and done == ["a"]
    finally:
        q.close(10)

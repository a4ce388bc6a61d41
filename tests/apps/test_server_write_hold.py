"""``spec-cache serve``'s LMDB writer waits while requests are admitted (``Scheduler.admitting`` is the cache
writer's hold): a burst of requests never shares the machine with the writer's copies and puts."""

from __future__ import annotations

import threading

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.cache import SpecCache
from spec_cache.generator import Generator
from spec_cache.sampling import RowSampling
from tests.apps.test_server_scheduler import Events
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)


def test_the_writer_holds_while_a_request_is_admitted(tiny, tmp_path):
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    entered, release = threading.Event(), threading.Event()
    prepare = generator.prepare

    def slow_prepare(*a, **k):
        entered.set()
        assert release.wait(60)
        return prepare(*a, **k)

    generator.prepare = slow_prepare
    sched = Scheduler(generator, max_rows=2)
    assert cache._writer._queue.hold == sched.admitting  # wired at construction
    sched.start()
    try:
        assert not sched.admitting()
        events = Events()
        prompt = list(range(3, 40))
        sched.submit(Job(prompt=prompt, max_tokens=4, sampling=RowSampling(), deliver=events))
        assert entered.wait(60)
        assert sched.admitting()  # its restore is running: the writer waits
        release.set()
        assert events.done.wait(60)
        assert events.tokens == plain_greedy(tiny.target, prompt, 4)
        assert cache.drain(30)  # what it checkpointed is written once nothing is admitted
        assert not sched.admitting()
        assert cache.memory_stats()["writes"]["written"] >= 1
    finally:
        release.set()
        sched.stop(5)
        cache.close()

"""Requests that arrive together sharing a long uncached prefix forward it once (``Scheduler._prefix_waits`` /
``_sibling_offsets``): the first one's prefill checkpoints the shared prefix, the others wait for that checkpoint
and restore it, with the tokens of a cold run."""

from __future__ import annotations

import threading

import pytest

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

SHARED = [3 + (i * 37) % 250 for i in range(300)]


class Events:
    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.done = threading.Event()

    def __call__(self, event: tuple) -> None:
        self.items.append(event)
        if event[0] in ("done", "error"):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.items if e[0] == "tokens" for t in e[1]]

    @property
    def cached(self) -> int:
        return next(e[1] for e in self.items if e[0] == "start")


def _together(sched: Scheduler, generator, jobs: list[Job]) -> None:
    """Submit ``jobs`` so that the scheduler meets them in one admission: its thread is held inside the
    ``prepare`` of a small job of another tenant while they are queued."""
    entered, release = threading.Event(), threading.Event()
    prepare = generator.prepare

    def held(*args, **kwargs):
        if not release.is_set():
            entered.set()
            release.wait(30)
        return prepare(*args, **kwargs)

    generator.prepare = held
    blocker = Job(prompt=[5, 6, 7], max_tokens=1, sampling=RowSampling(), deliver=Events(), tenant="other")
    sched.submit(blocker)
    assert entered.wait(30)
    for job in jobs:
        sched.submit(job)
    generator.prepare = prepare
    release.set()


@pytest.mark.parametrize("memory", [None, 0], ids=["memory-tier", "lmdb-only"])
@pytest.mark.parametrize("seam", [True, False], ids=["message-boundary", "no-boundary"])
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "off"])
def test_requests_arriving_together_forward_their_shared_prefix_once(tiny, tmp_path, monkeypatch, memory, seam,
                                                                     waits):
    if not waits:  # the control: with the rule off, the two later requests forward the shared prefix too
        monkeypatch.setattr(Scheduler, "SHARED_WAIT_TOKENS", 10**9)
    cache = SpecCache.open(tmp_path / "store", memory_bytes=memory)
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    assert generator.engine.prefill_checkpoints  # checkpoints from the prefill chunks (no phases)
    sched = Scheduler(generator, max_rows=4)
    sched.start()
    try:
        # a chat's system message (its boundary a checkpoint offset, as the template seam gives) then a few
        # shared template tokens; without a boundary (a completion's few-shot prefix) the rows share 303 tokens
        prompts = [SHARED + [200, 201, 202] + [10 + 7 * n + i for i in range(30 + n)] for n in range(3)]
        events = [Events() for _ in prompts]
        jobs = [Job(prompt=p, max_tokens=6, sampling=RowSampling(), deliver=e,
                    checkpoint_at=(len(SHARED),) if seam else ()) for p, e in zip(prompts, events)]
        _together(sched, generator, jobs)
        for e in events:
            assert e.done.wait(60)
        for p, e in zip(prompts, events):
            assert e.tokens == plain_greedy(tiny.target, p, 6)
        assert events[0].cached == 0
        if waits:
            want = len(SHARED) if seam else len(SHARED) + 3
            assert [e.cached for e in events[1:]] == [want, want]
            assert sched.shared_waits == 2
        else:
            assert [e.cached for e in events[1:]] == [0, 0]
            assert sched.shared_waits == 0
    finally:
        sched.stop(5)
        cache.close()


def test_a_request_waits_only_while_the_row_it_waits_for_prefills(tiny, tmp_path):
    """The wait is bounded by the other row's prefill: a request that shares a prefix with a row already decoding
    (first token delivered) is admitted at once, and one of another tenant never waits."""
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    sched = Scheduler(generator, max_rows=4)
    sched.start()
    try:
        first = SHARED + [200, 201, 202, 40, 41]
        e1 = Events()
        sched.submit(Job(prompt=first, max_tokens=30, sampling=RowSampling(), deliver=e1))
        while not e1.tokens:
            assert not e1.done.wait(0.01)
        e2, e3 = Events(), Events()
        second = SHARED + [200, 201, 202, 50, 51]
        sched.submit(Job(prompt=second, max_tokens=4, sampling=RowSampling(), deliver=e2, tenant="b"))
        sched.submit(Job(prompt=second, max_tokens=4, sampling=RowSampling(), deliver=e3))
        for e in (e1, e2, e3):
            assert e.done.wait(60)
        assert sched.shared_waits == 0
        assert e2.tokens == e3.tokens == plain_greedy(tiny.target, second, 4)
    finally:
        sched.stop(5)
        cache.close()

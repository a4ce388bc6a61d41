"""A restore that reads records (LMDB, the shared tier) ends the scheduler's admission pass (``_read_records``):
the restored row's prefill starts in the next step before the next such restore, so requests arriving together
after a restart each get their first token after their own restore and prefill, not after every request's restore
(issue 35, the H100 agent restart at 2 clients: two ~360 ms LMDB restores, then both prefills)."""

from __future__ import annotations

import pytest

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.engine import GPU_JOIN_BUDGET
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server_scheduler import Events
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)


def _prompt(n: int) -> list[int]:
    return [3 + (i * 29 + 11 * n) % 250 for i in range(60 + n)]


@pytest.fixture
def scheduler(tiny, tmp_path):
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    generator.engine.join_budget = GPU_JOIN_BUDGET
    sched = Scheduler(generator, max_rows=4)
    sched.start()
    yield sched, generator
    sched.stop(drain_timeout=10)
    cache.close()


def _passes(sched, monkeypatch) -> list[list[tuple[list[int], str | None]]]:
    """Each admission pass that admitted something: (prompt, tier its row was restored from) per job."""
    passes: list = []
    admit = sched._admit

    def watched():
        before = set(sched._rows)
        admit()
        new = [(sched._rows[r].prompt, sched._rows[r].prepared.tier) for r in sched._rows if r not in before]
        if new:
            passes.append(new)
    monkeypatch.setattr(sched, "_admit", watched)
    return passes


def _run_together(sched, monkeypatch, prompts: list[list[int]]) -> list[Events]:
    """Submit ``prompts`` so that one admission pass sees them all (held by an arrival until the last is in)."""
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    arrival = sched.arrival()
    events = []
    try:
        for prompt in prompts:
            events.append(Events())
            sched.submit(Job(prompt=prompt, max_tokens=3, sampling=RowSampling(), deliver=events[-1]))
    finally:
        arrival.done()
    assert all(e.done.wait(60) for e in events)
    return events


def test_lmdb_restores_are_admitted_one_pass_each_with_cold_run_tokens(scheduler, monkeypatch):
    sched, generator = scheduler
    firsts = [_prompt(1), _prompt(2)]
    for prompt in firsts:
        done = Events()
        sched.submit(Job(prompt=prompt, max_tokens=3, sampling=RowSampling(), deliver=done))
        assert done.done.wait(60)
    assert generator.cache.drain()
    generator.cache.memory.clear()  # as after a restart: LMDB holds the prefixes, the memory tier nothing
    passes = _passes(sched, monkeypatch)
    nexts = [prompt + [7, 8, 9] for prompt in firsts]
    events = _run_together(sched, monkeypatch, nexts)
    assert passes == [[(nexts[0], "local")], [(nexts[1], "local")]]
    for prompt, got in zip(nexts, events):
        assert got.tokens == plain_greedy(generator.engine.target, prompt, 3)


def test_memory_tier_hits_are_admitted_in_one_pass(scheduler, monkeypatch):
    sched, generator = scheduler
    firsts = [_prompt(3), _prompt(4)]
    for prompt in firsts:
        done = Events()
        sched.submit(Job(prompt=prompt, max_tokens=3, sampling=RowSampling(), deliver=done))
        assert done.done.wait(60)
    passes = _passes(sched, monkeypatch)
    nexts = [prompt + [5, 6] for prompt in firsts]
    events = _run_together(sched, monkeypatch, nexts)
    assert passes == [[(nexts[0], "memory"), (nexts[1], "memory")]]
    for prompt, got in zip(nexts, events):
        assert got.tokens == plain_greedy(generator.engine.target, prompt, 3)

"""A restore that reads records (LMDB, the shared tier) ends the scheduler's admission pass (``_read_records``):
the restored row's prefill starts in the next step before the next such restore, so requests arriving together
after a restart each get their first token after their own restore and prefill, not after every request's restore
(issue 35, the H100 agent restart at 2 clients: two ~360 ms LMDB restores, then both prefills)."""

from __future__ import annotations

from spec_cache.apps.server.scheduler import Job
from spec_cache.rows.sampling import RowSampling
from tests.apps.test_server_arrivals import (
    admission_passes,
    scheduler,  # noqa: F401  (fixture: rows join one step, as on a GPU)
)
from tests.apps.test_server_scheduler import Events
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)


def _prompt(n: int) -> list[int]:
    return [3 + (i * 29 + 11 * n) % 250 for i in range(60 + n)]


def _answered_one_by_one(sched, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt answered alone (its checkpoints in the memory tier, LMDB behind); returns ``prompts``."""
    for prompt in prompts:
        done = Events()
        sched.submit(Job(prompt=prompt, max_tokens=3, sampling=RowSampling(), deliver=done))
        assert done.done.wait(60)
    return prompts


def _assert_cold_run_tokens(generator, prompts: list[list[int]], events: list[Events]) -> None:
    for prompt, got in zip(prompts, events):
        assert got.tokens == plain_greedy(generator.engine.target, prompt, 3)


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
    firsts = _answered_one_by_one(sched, [_prompt(1), _prompt(2)])
    assert generator.cache.drain()
    generator.cache.memory.clear()  # as after a restart: LMDB holds the prefixes, the memory tier nothing
    passes = admission_passes(sched, monkeypatch)
    nexts = [prompt + [7, 8, 9] for prompt in firsts]
    events = _run_together(sched, monkeypatch, nexts)
    assert passes == [[(nexts[0], "local")], [(nexts[1], "local")]]
    _assert_cold_run_tokens(generator, nexts, events)


def test_memory_tier_hits_are_admitted_in_one_pass(scheduler, monkeypatch):
    sched, generator = scheduler
    firsts = _answered_one_by_one(sched, [_prompt(3), _prompt(4)])
    passes = admission_passes(sched, monkeypatch)
    nexts = [prompt + [5, 6] for prompt in firsts]
    events = _run_together(sched, monkeypatch, nexts)
    assert passes == [[(nexts[0], "memory"), (nexts[1], "memory")]]
    _assert_cold_run_tokens(generator, nexts, events)


def test_a_restore_that_reads_records_waits_for_a_row_due_its_first_token(scheduler, monkeypatch):
    """Two sessions after a restart, the first one's prefill in two chunks (a message boundary to checkpoint in
    its new tokens): the second's LMDB restore used to run at the start of the step that finished the first one's
    prefill, and the second's prefill in it, both before the first one's first token (issue 35's H200 agent
    restart: both first tokens at once, 1490 / 1840 ms). Now it waits that one step: the first one's first token
    comes before the second is admitted, and both answers are the cold run's."""
    sched, generator = scheduler
    firsts = _answered_one_by_one(sched, [_prompt(5), _prompt(6)])
    assert generator.cache.drain()
    generator.cache.memory.clear()  # as after a restart
    nexts = [prompt + [3 + (i * 7) % 200 for i in range(40)] for prompt in firsts]
    log: list[tuple[int, str]] = []
    events = []
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    arrival = sched.arrival()
    try:
        for i, prompt in enumerate(nexts):
            got = Events()
            events.append(got)
            # a breakpoint in its new tokens (pinned, as a cache_control block's end): two chunks, stopping there
            boundary = (len(firsts[i]) + 20,) if i == 0 else ()

            def deliver(event, i=i, got=got):
                log.append((i, event[0]))
                got(event)
            sched.submit(Job(prompt=prompt, max_tokens=3, sampling=RowSampling(), deliver=deliver,
                             checkpoint_at=boundary, pinned_at=boundary))
    finally:
        arrival.done()
    assert all(e.done.wait(60) for e in events)
    assert log.index((0, "tokens")) < log.index((1, "start"))
    assert sched.first_token_waits == 1
    assert [e.cached for e in events] == [len(p) - 1 for p in firsts]  # both restored from LMDB (prompt[:-1])
    _assert_cold_run_tokens(generator, nexts, events)

"""Fault isolation in the server's batch (issue 37 item 1): a row whose engine step fails is failed alone, with its
own error; every other row of the batch goes on, token-identically; the poisoned prefix it restored is dropped
from the memory tier and LMDB, so the next request of it prefills cold and succeeds.

The poisoned entry is planted through the library (``SpecCache.save`` of values with half the model's head size:
what an import that checked only the keys let in); the scheduler runs in-process on the tiny llama target."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

GREEDY = RowSampling()
POISON = list(range(100, 124))  # the poisoned prefix (tenant "mallory")


class Events:
    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, event: tuple) -> None:
        self.items.append(event)
        if event[0] == "tokens":
            self.first.set()
        if event[0] in ("done", "error"):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.items if e[0] == "tokens" for t in e[1]]

    @property
    def last(self) -> tuple:
        return self.items[-1]


def job(prompt, max_tokens, tenant=None, sampling=GREEDY) -> tuple[Job, Events]:
    events = Events()
    return Job(prompt=list(prompt), max_tokens=max_tokens, sampling=sampling, deliver=events, tenant=tenant), events


@pytest.fixture(params=[(None, None), (0, None), (None, 8)], ids=["memory-tier", "lmdb-only", "checkpoint-every-8"])
def served(tiny, tmp_path, request):
    memory_bytes, every = request.param
    cache = SpecCache.open(tmp_path / "store", memory_bytes=memory_bytes)
    generator = Generator.load(tiny.root / "target", cache=cache)
    sched = Scheduler(generator, max_rows=4, checkpoint_every=every)
    sched.start()
    yield sched, generator, cache
    sched.stop(5)
    cache.close()


def plant_poison(tiny, generator, cache, tenant: str = "mallory") -> bytes:
    """A checkpoint of ``POISON`` whose values have half the model's head size (keys are right), written now."""
    ns_key = generator.namespace_key(tenant)
    caches = []
    for layer in range(tiny.target.num_layers):
        heads, dim = tiny.target.kv_geometry(layer)
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, heads, len(POISON), dim)), mx.zeros((1, heads, len(POISON), dim // 2)))
        caches.append(c)
    assert cache.save(ns_key, POISON, caches) is not None
    return ns_key


def submit_together(sched, jobs) -> None:
    """Submit every ``(job, events)`` while the scheduler thread is held, so they are admitted in one batch."""
    gate = threading.Event()
    sched.call(gate.wait)
    for j, _ in jobs:
        sched.submit(j)
    gate.set()


def held(cache, ns_key) -> tuple[bool, bool]:
    """Whether the memory tier / LMDB still hold the poisoned entry."""
    return (cache.memory.serving(ns_key, POISON) is not None, cache.store.entry_key(ns_key, POISON) is not None)


def test_a_poisoned_restore_fails_its_row_alone_and_is_dropped(tiny, served):
    sched, generator, cache = served
    ns_key = plant_poison(tiny, generator, cache)
    victim_prompt = list(range(5, 25))
    victim, victim_events = job(victim_prompt, 160, tenant="alice")
    sched.submit(victim)
    while len(victim_events.tokens) < 20 and not victim_events.done.is_set():  # decoding when the bad row joins
        threading.Event().wait(0.002)
    bad, bad_events = job(POISON + [7, 8, 9], 6, tenant="mallory")
    sched.submit(bad)
    assert bad_events.done.wait(60) and victim_events.done.wait(60)
    # the other tenant's stream goes on, exactly as without the bad row
    assert victim_events.last[:2] == ("done", "length"), victim_events.items
    assert victim_events.tokens == plain_greedy(tiny.target, victim_prompt, 160)
    kind, error = bad_events.last
    assert kind == "error" and error.status == 500 and error.code == "engine_error", bad_events.items
    assert "\n" not in error.message and f"the {len(POISON)}-token prefix it restored was dropped" in error.message
    assert held(cache, ns_key) == (False, False)  # dropped from every tier
    again, again_events = job(POISON + [7, 8, 9], 6, tenant="mallory")
    sched.submit(again)
    assert again_events.done.wait(60) and again_events.last[:2] == ("done", "length"), again_events.items
    assert again_events.tokens == plain_greedy(tiny.target, POISON + [7, 8, 9], 6)
    assert sched.queue_depth == 0 and sched.active_rows == 0


def test_rows_joining_with_the_poisoned_one_go_on(tiny, served):
    """Several rows new in the failed step: they are readmitted one suspect at a time; the poisoned one fails
    alone, the clean ones (greedy and seeded sampling) answer what they answer without it."""
    sched, generator, cache = served
    ns_key = plant_poison(tiny, generator, cache)
    sampled = RowSampling(temperature=0.9, top_p=0.95, seed=1234)
    prompts = {"greedy": list(range(30, 45)), "sampled": list(range(60, 70))}
    # the clean rows alone first: what a run without the bad row answers
    alone = {}
    for name, prompt in prompts.items():
        j, events = job(prompt, 24, tenant="bob", sampling=sampled if name == "sampled" else GREEDY)
        sched.submit(j)
        assert events.done.wait(60)
        alone[name] = events.tokens
    assert alone["greedy"] == plain_greedy(tiny.target, prompts["greedy"], 24)
    # every row joins in one step (nothing decoding): nobody is proven when it fails
    rows = {name: job(prompt + [1], 24, tenant="carol", sampling=sampled if name == "sampled" else GREEDY)
            for name, prompt in prompts.items()}
    bad, bad_events = job(POISON + [3], 5, tenant="mallory")
    with_bad = dict(rows)
    with_bad["bad"] = (bad, bad_events)
    submit_together(sched, with_bad.values())
    for _, events in with_bad.values():
        assert events.done.wait(60)
    assert bad_events.last[0] == "error" and bad_events.last[1].code == "engine_error"
    for name, prompt in prompts.items():
        want_events = job(prompt + [1], 24, tenant="dave", sampling=sampled if name == "sampled" else GREEDY)
        sched.submit(want_events[0])
        assert want_events[1].done.wait(60)
        _, events = rows[name]
        assert events.last[:2] == ("done", "length"), (name, events.items)
        assert events.tokens == want_events[1].tokens, name
    assert held(cache, ns_key) == (False, False)
    assert sched.queue_depth == 0 and sched.active_rows == 0


def test_a_failed_step_that_names_no_culprit_fails_nobody(tiny, served, monkeypatch):
    """A step fails once while every row of the batch is decoding (none new, no poisoned entry): no row can be
    blamed, so none is failed; each is readmitted (one suspect at a time) and answers exactly what it would have."""
    from spec_cache.decode.engine import DecodeSession

    sched, _, _ = served
    prompts = [list(range(5 + 7 * i, 17 + 7 * i)) for i in range(3)]
    jobs = [job(p, 40, tenant=f"t{i}") for i, p in enumerate(prompts)]
    step, armed = DecodeSession.step, threading.Event()
    armed.set()

    def failing_once(session):  # once every row has delivered a few tokens
        if armed.is_set() and session.active_count == len(jobs) and all(
                len(row.generated) >= 12 for row in session.active):
            armed.clear()
            raise RuntimeError("injected fault")
        return step(session)
    monkeypatch.setattr(DecodeSession, "step", failing_once)
    submit_together(sched, jobs)
    for (j, events), prompt in zip(jobs, prompts):
        assert events.done.wait(60)
        assert events.last[:2] == ("done", "length"), events.items
        assert events.tokens == plain_greedy(tiny.target, prompt, 40)
    assert not armed.is_set()  # the fault did happen
    assert sched.queue_depth == 0 and sched.active_rows == 0


def test_a_row_that_fails_later_is_found_and_failed_alone(tiny, served, monkeypatch):
    """A row that fails the step only after decoding a while (as a rotating cache past its window would): the
    first failure names nobody (every row is proven), the rows are readmitted one suspect at a time, and the next
    failure has the bad row alone to blame. The others answer exactly."""
    from spec_cache.decode.engine import DecodeSession

    sched, _, _ = served
    prompts = [list(range(5 + 7 * i, 17 + 7 * i)) for i in range(3)]
    bad_prompt = prompts[1]
    jobs = [job(p, 30, tenant=f"t{i}") for i, p in enumerate(prompts)]
    step = DecodeSession.step

    def failing(session):
        if any(row.request.prompt[: len(bad_prompt)] == bad_prompt and len(row.generated) >= 6
               for row in session.active):
            raise RuntimeError("injected fault of one row")
        return step(session)
    monkeypatch.setattr(DecodeSession, "step", failing)
    submit_together(sched, jobs)
    for (j, events), prompt in zip(jobs, prompts):
        assert events.done.wait(60)
        if prompt is bad_prompt:
            assert events.last[0] == "error" and events.last[1].code == "engine_error", events.items
            assert "injected fault of one row" in events.last[1].message
        else:
            assert events.last[:2] == ("done", "length"), events.items
            assert events.tokens == plain_greedy(tiny.target, prompt, 30)
    assert sched.queue_depth == 0 and sched.active_rows == 0

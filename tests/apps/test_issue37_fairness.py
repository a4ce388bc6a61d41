"""Issue 37, attacker's pass: one tenant can never take every admission slot (``Scheduler(tenants=...)``).

Before: admission was one FIFO queue capped at ``max_rows + max_queue``; a tenant's ``n=16`` requests filled every
slot, another tenant got 429 or waited behind all of them. Now, with several API keys, a key holds at most its
share of the slots (its next job is 429 while the others are admitted) and waiting jobs are admitted round-robin
across keys. One tenant is served exactly as before. These tests hold the scheduler thread between rounds (a
``call`` that waits) while jobs are submitted, so the order of admission is deterministic; no clock is read.
"""

from __future__ import annotations

import threading

import pytest

from spec_cache.apps.server.protocol import APIError
from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server import model  # noqa: F401  (a fixture)
from tests.runtime_fixtures import _identity_memo, tiny  # noqa: F401  (fixtures)

A, B, C = "key:aaaaaaaa", "key:bbbbbbbb", "key:cccccccc"


@pytest.fixture
def make(tiny, tmp_path):
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", tiny.drafter_dir("assistant"), cache=cache)
    made = []

    def build(**options) -> Scheduler:
        sched = Scheduler(generator, **options)
        sched.start()
        made.append(sched)
        return sched

    yield build
    for sched in made:
        sched.stop(5)
    cache.close()


class Admissions:
    """Jobs in the order they were admitted ("start"), and every job's end."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.ended: list[threading.Event] = []

    def job(self, name: str, tenant: str | None, max_tokens: int = 2) -> Job:
        ended = threading.Event()
        self.ended.append(ended)

        def deliver(event: tuple) -> None:
            if event[0] == "start":
                self.order.append(name)
            elif event[0] in ("done", "error"):
                ended.set()
        return Job(prompt=[5, 6, 7, 8 + len(self.ended)], max_tokens=max_tokens, sampling=RowSampling(),
                   deliver=deliver, tenant=tenant)

    def wait(self) -> None:
        for ended in self.ended:
            assert ended.wait(60)


def held(sched: Scheduler) -> threading.Event:
    """Hold the scheduler thread between rounds until the returned event is set."""
    gate = threading.Event()
    sched.call(lambda: gate.wait(30))
    return gate


def refused(sched: Scheduler, job: Job) -> APIError:
    with pytest.raises(APIError) as info:
        sched.submit(job)
    assert info.value.status == 429 and info.value.code == "overloaded"
    job.deliver(("error", info.value))  # never submitted: nothing to wait for
    return info.value


def test_a_tenant_holds_at_most_its_share_and_waiting_jobs_go_round_robin(make):
    sched = make(max_rows=1, max_queue=7, tenants=2)  # 8 slots: a key's share is 4 (half, two keys or more)
    seen = Admissions()
    gate = held(sched)
    for i in range(4):  # A's request with n=4 (or 4 requests); a cache_salt does not make another tenant
        sched.submit(seen.job(f"A{i}", A if i % 2 else A + "|salt:0123"))
    error = refused(sched, seen.job("A4", A))
    assert "share" in error.message
    sched.submit(seen.job("B0", B))  # the other key is admitted while A is refused
    sched.submit(seen.job("B1", B))
    gate.set()
    seen.wait()
    # round-robin: B's first job joins right after A's first (the first in the queue), not after all of A's
    assert seen.order == ["A0", "B0", "A1", "B1", "A2", "A3"]
    assert sched.queue_depth == 0 and sched.active_rows == 0


def test_the_share_shrinks_as_more_tenants_hold_slots_and_comes_back_when_they_end(make):
    sched = make(max_rows=1, max_queue=11, tenants=3)  # 12 slots
    seen = Admissions()
    gate = held(sched)
    for i in range(6):
        sched.submit(seen.job(f"A{i}", A))
    refused(sched, seen.job("A6", A))  # A alone holds slots: 12 // 2 = 6
    for i in range(3):
        sched.submit(seen.job(f"B{i}", B))
    sched.submit(seen.job("C0", C))  # three keys hold slots now: the share is 12 // 3 = 4
    sched.submit(seen.job("B3", B))
    refused(sched, seen.job("B4", B))  # B holds its 4 (11 of 12 slots taken: the share refused it)
    refused(sched, seen.job("A7", A))  # A holds more than its share: refused until it drops below
    gate.set()
    seen.wait()
    assert seen.order == ["A0", "B0", "C0", "A1", "B1", "A2", "B2", "A3", "B3", "A4", "A5"]
    # every slot came back: A alone gets half of them again
    more = Admissions()
    gate = held(sched)
    for i in range(6):
        sched.submit(more.job(f"A{i}", A))
    refused(sched, more.job("A6", A))
    gate.set()
    more.wait()
    assert more.order == [f"A{i}" for i in range(6)]


def test_one_tenant_is_served_first_come_first_served_up_to_the_global_cap(make):
    sched = make(max_rows=1, max_queue=5)  # no keys, or one key: no share, FIFO, 6 slots
    seen = Admissions()
    gate = held(sched)
    names = ["x0", "x1", "x2", "x3", "x4", "x5"]
    for i, name in enumerate(names):  # salted namespaces of the one tenant, and another tenant string
        sched.submit(seen.job(name, [None, "open|salt:1", None, "key:zz", None, None][i]))
    error = refused(sched, seen.job("x6", None))
    assert "share" not in error.message
    gate.set()
    seen.wait()
    assert seen.order == names


def test_serve_gives_each_api_key_a_share_of_the_slots(model, tmp_path):  # noqa: F811  (model: a fixture)
    """Through ``serve``: the API keys are the tenants. 1 row + 3 waiting = 4 slots, a key's share is 2: one
    request asking for ``n=3`` is 429 (before: accepted, all 4 slots were anyone's); ``n=2`` is served to both keys.
    With one key, ``n=4`` still fits (exactly as before)."""
    import httpx

    from tests.apps.test_server import KEY_A, KEY_B, Server

    def ask(srv, key: str, n: int):
        return httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                          json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "n": n,
                                "temperature": 0.7, "seed": 1})

    _, target, _ = model
    srv = Server(target, tmp_path / "two", tmp_path, "--max-rows", "1", "--max-queue", "3")
    try:
        over = ask(srv, KEY_A, 3)
        assert over.status_code == 429 and "share" in over.json()["error"]["message"], over.text
        assert over.headers.get("retry-after") == "1"
        for key in (KEY_A, KEY_B):
            r = ask(srv, key, 2)
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    finally:
        srv.stop()
    one = Server(target, tmp_path / "one", tmp_path, "--max-rows", "1", "--max-queue", "3", keys=(KEY_A,))
    try:
        r = ask(one, KEY_A, 4)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    finally:
        one.stop()


def test_a_tenant_leaves_a_row_for_another_key_while_its_long_generations_run(make):
    """Second attacker pass: A's rows took every decode row and B waited ~400x its solo time for one of A's
    4000-token generations to end. Now a key decodes in at most ``row_cap`` rows (``max_rows`` less one per other
    key): B's request joins the next round while A's generations go on."""
    import time

    sched = make(max_rows=2, max_queue=6, tenants=2)
    assert sched.row_cap == 1
    seen = Admissions()
    sched.submit(seen.job("A0", A, max_tokens=300))
    sched.submit(seen.job("A1", A, max_tokens=300))
    deadline = time.monotonic() + 60
    while "A0" not in seen.order and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.submit(seen.job("B0", B, max_tokens=2))
    seen.wait()
    assert seen.order == ["A0", "B0", "A1"]  # before: A0 and A1 in both rows, B0 after one of them ended

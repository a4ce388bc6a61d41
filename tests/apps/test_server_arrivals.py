"""Requests sent together prefill together (``scheduler.Arrival``): a new job waits while other generation requests
are still being read and tokenized, at most ``Scheduler.coalesce_s``, so that their prefills run in one step rather
than the first alone and the rest behind it (issue 35, the H100 run at 4 clients)."""

from __future__ import annotations

import time

import httpx
import pytest

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.engine import GPU_JOIN_BUDGET, join_budget_by_default
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server import Server, stopped, user, words
from tests.apps.test_server_scheduler import Events
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)


def _started(events: Events) -> bool:
    """Whether the job was admitted (its ``start`` event came)."""
    return any(e[0] == "start" for e in events.items)


def _prompt(n: int) -> list[int]:
    return [3 + (i * 31 + 7 * n) % 250 for i in range(40 + n)]


def admission_passes(sched, monkeypatch) -> list[list[tuple[list[int], str | None]]]:
    """Each admission pass that admitted something, in order: (prompt, tier its row was restored from) per job."""
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


@pytest.fixture
def scheduler(tiny, tmp_path):
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    generator.engine.join_budget = GPU_JOIN_BUDGET  # rows join one step as on a GPU (the CPU: one a step)
    sched = Scheduler(generator, max_rows=4)
    sched.start()
    yield sched, generator
    sched.stop(drain_timeout=10)
    cache.close()


def test_a_job_waits_for_a_request_still_arriving_then_both_are_admitted_together(scheduler, monkeypatch):
    sched, generator = scheduler
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    passes = admission_passes(sched, monkeypatch)
    arrival = sched.arrival()  # a request being tokenized
    assert sched.arriving == 1
    first = Events()
    sched.submit(Job(prompt=_prompt(1), max_tokens=4, sampling=RowSampling(), deliver=first))
    time.sleep(0.3)
    assert not _started(first) and sched.arrival_waits == 1  # held while the other one arrives
    second = Events()
    sched.submit(Job(prompt=_prompt(2), max_tokens=4, sampling=RowSampling(), deliver=second))
    arrival.done()
    arrival.done()  # idempotent
    assert sched.arriving == 0
    assert first.done.wait(60) and second.done.wait(60)
    assert [prompt for prompt, _ in passes[0]] == [_prompt(1), _prompt(2)]  # one pass: their prefills in one step
    # the tokens of a cold run of each prompt
    assert first.tokens == plain_greedy(generator.engine.target, _prompt(1), 4)
    assert second.tokens == plain_greedy(generator.engine.target, _prompt(2), 4)


def test_an_arrival_that_never_submits_releases_the_hold(scheduler, monkeypatch):
    sched, _ = scheduler
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    arrival = sched.arrival()
    job = Events()
    sched.submit(Job(prompt=_prompt(3), max_tokens=2, sampling=RowSampling(), deliver=job))
    time.sleep(0.2)
    assert not _started(job)
    arrival.done()  # the request failed before its submit (a 400): no message of its own reaches the scheduler
    assert job.done.wait(20)  # well before the 30 s hold


def test_the_hold_ends_after_coalesce_s(scheduler, monkeypatch):
    sched, _ = scheduler
    monkeypatch.setattr(sched, "coalesce_s", 0.3)
    arrival = sched.arrival()  # a request whose tokenizing outlasts the hold
    try:
        job = Events()
        began = time.perf_counter()
        sched.submit(Job(prompt=_prompt(4), max_tokens=2, sampling=RowSampling(), deliver=job))
        assert job.done.wait(30)
        assert time.perf_counter() - began >= 0.3 - 0.05  # it did wait, and then went without the other
        assert sched.arrival_waits == 1
    finally:
        arrival.done()


def test_nothing_arriving_means_no_wait(scheduler, monkeypatch):
    sched, _ = scheduler
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    job = Events()
    sched.submit(Job(prompt=_prompt(5), max_tokens=2, sampling=RowSampling(), deliver=job))
    assert job.done.wait(20)
    assert sched.arrival_waits == 0


@pytest.mark.parametrize("long_words", [30, 22])  # 70 new tokens (past the budget), 62 (more than half of it)
def test_a_job_that_leaves_no_room_for_a_partner_like_it_is_not_held(scheduler, monkeypatch, long_words):
    """A job is held for arriving requests only while a partner of its own size would fit its step's
    ``join_budget``: past that it prefills alone whatever arrives (past the budget itself a prefill is bound by
    compute and a partner only makes both wait; issue 35, H100 agent run at 2 clients), so it is admitted at once
    though a request is arriving; one of at most half the budget is held."""
    sched, generator = scheduler
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    monkeypatch.setattr(generator.engine, "join_budget", 120)
    arrival = sched.arrival()
    try:
        long, short = Events(), Events()
        prompt = _prompt(long_words)
        sched.submit(Job(prompt=prompt, max_tokens=2, sampling=RowSampling(), deliver=long))
        assert long.done.wait(20) and sched.arrival_waits == 0
        assert long.tokens == plain_greedy(generator.engine.target, prompt, 2)
        sched.submit(Job(prompt=_prompt(6), max_tokens=2, sampling=RowSampling(), deliver=short))  # 46: room left
        time.sleep(0.3)
        assert not _started(short) and sched.arrival_waits == 1
    finally:
        arrival.done()
    assert short.done.wait(20)


def test_the_room_counts_only_what_the_memory_tier_lacks(scheduler, monkeypatch):
    """A warm turn whose prompt the memory tier holds all but a few tokens of leaves room, however long its
    prompt: it is held for the arriving request, then answered with a cold run's tokens."""
    sched, generator = scheduler
    prompt = _prompt(60)  # 100 tokens, over the budget below when cold
    first = Events()
    sched.submit(Job(prompt=prompt, max_tokens=2, sampling=RowSampling(), deliver=first))
    assert first.done.wait(30)
    generator.cache.drain()
    monkeypatch.setattr(sched, "coalesce_s", 30.0)
    monkeypatch.setattr(generator.engine, "join_budget", 64)
    assert sched.held_prefix(None, prompt + [5, 6]) >= 64
    arrival = sched.arrival()
    warm = Events()
    try:
        sched.submit(Job(prompt=prompt + [5, 6], max_tokens=2, sampling=RowSampling(), deliver=warm))
        time.sleep(0.3)
        assert not _started(warm) and sched.arrival_waits == 1
    finally:
        arrival.done()
    assert warm.done.wait(20)
    assert warm.tokens == plain_greedy(generator.engine.target, prompt + [5, 6], 2)


def test_a_gpu_joins_at_most_1280_new_tokens_a_step(monkeypatch):
    """The join budget on a GPU is two chat turns' worth (``join_budget_by_default``), at most a prefill chunk;
    none on the CPU."""
    import mlx.core as mx

    from spec_cache.decode import engine as engine_module

    class _Device:
        type = mx.DeviceType.gpu
    monkeypatch.setattr(engine_module.mx, "default_device", lambda: _Device())
    assert join_budget_by_default(2048) == GPU_JOIN_BUDGET == 1280
    assert join_budget_by_default(1024) == 1024
    assert join_budget_by_default(256) == 256
    monkeypatch.undo()
    if mx.default_device().type == mx.DeviceType.cpu:
        assert join_budget_by_default(2048) == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("arrivals-model") / "tiny", seed=7)


def test_the_routes_close_every_arrival_they_open(tiny_model, tmp_path):
    """Every generation route opens an arrival and closes it, answered or refused (a leak would hold every later
    request for ``coalesce_s``): ``spec_cache_requests_arriving`` is back to 0 after each kind of answer."""
    srv = Server(tiny_model, tmp_path / "store", tmp_path)
    try:
        client = srv.client()
        client.chat.completions.create(model="tiny", messages=[user(words(10, 10))], max_tokens=2, temperature=0)
        stream = client.chat.completions.create(model="tiny", messages=[user(words(20, 10))], max_tokens=2,
                                                temperature=0, stream=True)
        assert list(stream)
        client.completions.create(model="tiny", prompt=words(30, 8), max_tokens=2, temperature=0, n=2)
        headers = srv.headers()
        bad = httpx.post(srv.url + "/v1/chat/completions", headers=headers, content=b"{not json", timeout=10)
        assert bad.status_code == 400
        refused = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=10,
                             json={"model": "tiny", "messages": [], "max_tokens": 2})
        assert refused.status_code == 400
        messages = httpx.post(srv.url + "/v1/messages", headers=headers, timeout=30,
                              json={"model": "tiny", "max_tokens": 2, "messages": [user(words(40, 6))]})
        assert messages.status_code == 200, messages.text
        counted = httpx.post(srv.url + "/v1/messages/count_tokens", headers=headers, timeout=10,
                             json={"model": "tiny", "messages": [user(words(50, 6))]})
        assert counted.status_code == 200, counted.text
        unauthorized = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "wrong"}, timeout=10,
                                  json={"model": "tiny", "max_tokens": 2, "messages": [user(words(40, 6))]})
        assert unauthorized.status_code == 401
        assert srv.metric("spec_cache_requests_arriving") == 0
    finally:
        stopped(srv)


def test_the_hold_is_on_only_where_rows_prefill_together(tiny, tmp_path):
    """A GPU's engine lets short rows join one step (``join_budget``): the hold is on there; on the CPU each row's
    forward costs its own tokens whatever the batch, and the hold would only make the first wait for the others."""
    from spec_cache.apps.server.scheduler import COALESCE_S

    generator = Generator.load(tiny.root / "target", None, cache=None)
    assert Scheduler(generator).coalesce_s == (COALESCE_S if generator.engine.join_budget > 0 else 0.0)
    generator.engine.join_budget = 2048
    assert Scheduler(generator).coalesce_s == COALESCE_S
    generator.engine.join_budget = 0
    assert Scheduler(generator).coalesce_s == 0.0


def test_arrival_wait_ms_sets_the_hold_and_refuses_a_negative_value(tiny_model, tmp_path):
    from spec_cache.apps.cli import build_parser
    from spec_cache.apps.cli.common import CliError
    from spec_cache.apps.server.cli import build_state

    for given, expected in (("250", 0.25), ("0", 0.0)):
        args = build_parser().parse_args(["--cache", str(tmp_path / f"store-{given}"), "serve", "--model",
                                          str(tiny_model), "--arrival-wait-ms", given])
        state = build_state(args)
        try:
            assert state.scheduler.coalesce_s == expected
        finally:
            state.cache.close()
    with pytest.raises(CliError, match=r"--arrival-wait-ms: must be >= 0: '-5'"):
        build_parser().parse_args(["serve", "--model", str(tiny_model), "--arrival-wait-ms", "-5"])


def test_join_budget_sets_the_engines_budget_capped_at_a_chunk_and_refuses_a_negative_value(tiny_model, tmp_path):
    from spec_cache.apps.cli import build_parser
    from spec_cache.apps.cli.common import CliError
    from spec_cache.apps.server.cli import build_state
    from spec_cache.apps.server.scheduler import COALESCE_S

    for given, step, expected in (("1280", "2048", 1280), ("4096", "1024", 1024), ("0", "512", 0)):
        args = build_parser().parse_args(["--cache", str(tmp_path / f"store-{given}"), "serve", "--model",
                                          str(tiny_model), "--join-budget", given, "--prefill-step-size", step])
        state = build_state(args)
        try:
            assert state.scheduler.generator.engine.join_budget == expected
            assert state.scheduler.coalesce_s == (COALESCE_S if expected else 0.0)  # the hold follows the budget
        finally:
            state.cache.close()
    with pytest.raises(CliError, match=r"--join-budget: must be >= 0: '-1'"):
        build_parser().parse_args(["serve", "--model", str(tiny_model), "--join-budget", "-1"])

"""The server's scheduler in-process (no HTTP): exactness of rows that join while others decode, checkpoints
every N tokens of a long prefill and of a long generation, cancellation, and 429 accounting."""

from __future__ import annotations

import threading

import pytest

from spec_cache.apps.server.protocol import APIError
from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

GREEDY = RowSampling()


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


def job(prompt, max_tokens, tenant=None, sampling=GREEDY, replayable=False) -> tuple[Job, Events]:
    events = Events()
    return Job(prompt=list(prompt), max_tokens=max_tokens, sampling=sampling, deliver=events, tenant=tenant,
               replayable=replayable), events


@pytest.fixture(params=[None, 0], ids=["memory-tier", "lmdb-only"])
def scheduler(tiny, tmp_path, request):
    cache = SpecCache.open(tmp_path / "store", memory_bytes=request.param)
    generator = Generator.load(tiny.root / "target", tiny.drafter_dir("assistant"), cache=cache)
    made = []

    def make(**options):
        make.memory = request.param != 0
        sched = Scheduler(generator, **options)
        sched.start()
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.stop(5)
    cache.close()


def test_checkpoints_every_n_tokens_of_prefill_and_generation(tiny, scheduler):
    sched = scheduler(max_rows=4, checkpoint_every=8)
    prompt = list(range(3, 40))  # 37 tokens: phases end at 8, 16, 24, 32
    first, events = job(prompt, 20)
    sched.submit(first)
    assert events.done.wait(60)
    want = plain_greedy(tiny.target, prompt, 20)
    assert events.tokens == want and events.cached == 0 and events.items[-1][:2] == ("done", "length")
    # a request sharing only the first 26 tokens resumes from the phase checkpoint at 24 (the memory tier trims
    # a longer entry to the exact 26)
    head, head_events = job(prompt[:26] + [250, 251, 252], 6)
    sched.submit(head)
    assert head_events.done.wait(60)
    assert head_events.cached == (26 if scheduler.memory else 24)
    assert head_events.tokens == plain_greedy(tiny.target, head.prompt, 6)
    # one sharing the prompt and the first 14 generated tokens resumes from the checkpoint taken once 8 (or a
    # few more: a round emits up to depth + 1) were generated
    follow, follow_events = job(prompt + want[:14] + [200, 201], 5)
    sched.submit(follow)
    assert follow_events.done.wait(60)
    if scheduler.memory:
        assert follow_events.cached == len(prompt) + 14
    else:
        assert len(prompt) + 7 <= follow_events.cached <= len(prompt) + 12
    assert follow_events.tokens == plain_greedy(tiny.target, follow.prompt, 5)


def test_prefill_phases_and_generation_checkpoints_have_their_own_intervals(tiny, scheduler):
    """``prefill_checkpoint_every`` splits a long prompt, ``checkpoint_every`` counts generated tokens only: the
    server's defaults (4096 / 256) keep a GPU's long prompts whole while a retry loses at most 256 tokens."""
    sched = scheduler(max_rows=4, checkpoint_every=8, prefill_checkpoint_every=None)
    prompt = list(range(3, 40))  # 37 tokens: no phases now
    first, events = job(prompt, 20)
    sched.submit(first)
    assert events.done.wait(60)
    want = plain_greedy(tiny.target, prompt, 20)
    assert events.tokens == want
    head, head_events = job(prompt[:26] + [250, 251, 252], 6)  # no phase checkpoint at 24 to resume from
    sched.submit(head)
    assert head_events.done.wait(60)
    if not scheduler.memory:  # (the memory tier trims the prompt-boundary entry to 26 either way)
        assert head_events.cached < 24
    follow, follow_events = job(prompt + want[:14] + [200, 201], 5)  # generation checkpoints are still taken
    sched.submit(follow)
    assert follow_events.done.wait(60)
    assert follow_events.cached >= len(prompt) + 7
    assert follow_events.tokens == plain_greedy(tiny.target, follow.prompt, 5)
    assert sched.checkpoint_every == 8 and sched.prefill_checkpoint_every is None
    with pytest.raises(ValueError):
        Scheduler(sched.generator, prefill_checkpoint_every=0)


def test_the_servers_defaults_keep_prefill_phases_long():
    import argparse

    from spec_cache.apps.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert args.prefill_checkpoint_every == cli.DEFAULT_PREFILL_CHECKPOINT_EVERY == 4096
    assert args.checkpoint_every == cli.DEFAULT_CHECKPOINT_EVERY
    assert args.prefill_step_size is None  # resolved per device when the model loads:
    from spec_cache.decode.engine import CPU_PREFILL_STEP, GPU_PREFILL_STEP, prefill_step_by_default

    assert GPU_PREFILL_STEP == 2048  # mlx_lm.server's and generate_step's
    assert prefill_step_by_default() == CPU_PREFILL_STEP == 512  # the tests run on the CPU
    assert parser.parse_args(["--model", "m", "--prefill-step-size", "2048"]).prefill_step_size == 2048


def test_rows_joining_and_cancelled_while_others_decode(tiny, scheduler):
    sched = scheduler(max_rows=2, max_queue=1)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)]
    jobs = [job(p, 24) for p in prompts]
    long_job, long_events = job(list(range(60, 80)), 3000)
    sched.submit(long_job)
    for j, _ in jobs[:2]:
        sched.submit(j)
    with pytest.raises(APIError) as info:  # 2 decoding + 1 waiting: full
        sched.submit(jobs[2][0])
    assert info.value.status == 429
    while not long_events.tokens:
        threading.Event().wait(0.01)
    sched.cancel(long_job)
    assert long_events.done.wait(30) and long_events.items[-1][1] == "cancelled"
    sched.submit(jobs[2][0])
    for (j, events), prompt in zip(jobs, prompts):
        assert events.done.wait(60)
        assert events.tokens == plain_greedy(tiny.target, prompt, 24)
    assert sched.queue_depth == 0 and sched.active_rows == 0


def test_a_retried_request_resumes_the_earlier_generation(tiny, scheduler):
    """Greedy, or sampled with an explicit seed: a retry replays what the earlier request generated (also one
    whose client went away) and continues from its checkpoint, token-identically."""
    sched = scheduler(max_rows=4)
    prompt = list(range(50, 70))
    want = plain_greedy(tiny.target, prompt, 40)
    first, events = job(prompt, 40, replayable=True)
    sched.submit(first)
    while len(events.tokens) < 5:
        threading.Event().wait(0.005)
    sched.cancel(first)  # the client went away: a replayable row is finished (checkpointed), not dropped
    assert events.done.wait(30)
    got = events.tokens
    assert 5 <= len(got) < 40 and got == want[: len(got)]
    retry, retry_events = job(prompt, 40, replayable=True)
    sched.submit(retry)
    assert retry_events.done.wait(30)
    tokens = [e for e in retry_events.items if e[0] == "tokens"]
    assert tokens[0][1] == got  # replayed at once, in one piece
    assert retry_events.tokens == want and retry_events.items[-1][1] == "length"
    shorter, shorter_events = job(prompt, 3, replayable=True)  # answered from the table alone
    sched.submit(shorter)
    assert shorter_events.done.wait(30) and shorter_events.tokens == want[:3]
    # sampled with a seed: the retry with a larger budget continues exactly as a fresh run would
    sampling = RowSampling(temperature=0.9, seed=5)
    seeded, seeded_events = job(prompt, 12, sampling=sampling, replayable=True)
    sched.submit(seeded)
    assert seeded_events.done.wait(30)
    again, again_events = job(prompt, 25, sampling=sampling, replayable=True)
    fresh, fresh_events = job(prompt, 25, tenant="another", sampling=sampling, replayable=True)
    sched.submit(again)
    sched.submit(fresh)
    assert again_events.done.wait(30) and fresh_events.done.wait(30)
    assert again_events.tokens[:12] == seeded_events.tokens
    assert again_events.tokens == fresh_events.tokens and len(fresh_events.tokens) == 25

"""A warm turn's path to its first token in ``spec-cache serve`` (issue 27 item 4): nothing on it that
``mlx_lm.server`` does not do.

* The end-of-prompt checkpoint (where the next turn continues) comes from the job's own row after its first
  token: no second row, restore or round per request (before: a one-token side row restored the prompt boundary
  and forwarded the last prompt token again). The next turn still restores exactly ``prompt``, drafter row
  included, from the memory tier and from LMDB; tokens are the target's own greedy ones.
* The template seam renders only the message heads past what the memory tier holds (one head on a warm turn,
  before: up to ``2 * RENDERED_PREFIXES``); the offsets that can still become checkpoints are the same.
* A memory-tier hit hands the row its arrays without a copy, and the row extending them never changes the entry.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.apps.bench import agentic
from spec_cache.apps.server.openai_routes import _Prompts
from spec_cache.apps.server.scheduler import MIN_CHECKPOINT_GAP, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.rows.target import TargetRows
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.memory_tier import MemoryTier
from tests.apps.test_template_seam import _run_job
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)


@pytest.mark.parametrize("memory", [None, 0], ids=["memory-tier", "lmdb-only"])
@pytest.mark.parametrize("drafter", [None, "draft-model"])
def test_end_of_prompt_checkpoint_comes_from_the_jobs_own_row(tiny, tmp_path, drafter, memory):
    cache = SpecCache.open(tmp_path / "store", memory_bytes=memory)
    generator = Generator.load(tiny.root / "target", tiny.drafter_dir(drafter) if drafter else None, cache=cache)
    log: list[tuple] = []
    prepare, save = generator.prepare, generator.save_checkpoint

    def counted_prepare(*a, **k):
        log.append(("prepare", len(a[0])))
        return prepare(*a, **k)

    def logged_save(tokens, *a, **k):
        log.append(("save", len(tokens)))
        return save(tokens, *a, **k)
    generator.prepare, generator.save_checkpoint = counted_prepare, logged_save
    sched = Scheduler(generator, max_rows=4)
    sched.start()
    try:
        first = list(range(3, 53))
        _, events = _run_job(sched, first, 5, (len(first),), log)
        assert events.tokens == plain_greedy(tiny.target, first, 5)
        # one row per request: the old side row made it two (a restore of prompt[:-1], a one-token round)
        assert [e for e in log if e[0] == "prepare"] == [("prepare", len(first))]
        saves = [e[1] for e in log if e[0] == "save"]
        assert len(first) in saves  # exactly the prompt: where the next turn continues
        first_token = log.index(("event", "tokens"))
        assert log.index(("save", len(first))) > first_token  # never before the first token
        cache.drain()
        second = first + [200, 201, 202, 90, 91]  # the reply re-rendered as other tokens, then a new message
        assert events.tokens[0] != 200
        job2, events2 = _run_job(sched, second, 4, (len(second),), log)
        assert events2.cached == len(first)
        assert job2.prepared.restored_drafter == (drafter is not None)  # the exact-length drafter row too
        assert events2.tokens == plain_greedy(tiny.target, second, 4)
    finally:
        sched.stop(5)
        cache.close()


def test_a_warm_turns_short_tail_is_not_split_at_its_offsets(tiny, tmp_path):
    """A message boundary inside a warm turn's new tokens (the previous reply re-tokenized differently, then a new
    message) is not checkpointed at all: one restore and one row, the first token after one prefill; a cold
    prompt's offsets still are (its prefixes are worth storing), from its prefill chunks: one row, no phase."""
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    log: list[tuple] = []
    prepare, save = generator.prepare, generator.save_checkpoint

    def counted_prepare(*a, **k):
        log.append(("prepare", len(a[0])))
        return prepare(*a, **k)

    def logged_save(tokens, *a, **k):
        log.append(("save", len(tokens)))
        return save(tokens, *a, **k)
    generator.prepare, generator.save_checkpoint = counted_prepare, logged_save
    sched = Scheduler(generator, max_rows=4)
    sched.start()
    try:
        first = list(range(3, 63))
        _run_job(sched, first, 4, (30, len(first)), log)
        # cold: the offset 30 is checkpointed as the prefill passes it (before: a phase row up to 30, restored)
        assert [e for e in log if e[0] == "prepare"] == [("prepare", 60)]
        # taken mid-prefill, written with the step's other checkpoints (after the first token is out, not before)
        assert ("save", 30) in log and log.index(("save", 30)) < log.index(("save", 60))
        log.clear()
        second = first + [200, 201, 202] + list(range(100, 140))  # the reply as other tokens, a new message
        _, events = _run_job(sched, second, 4, (len(first) + 3, len(first) + 22, len(second)), log)
        assert events.cached == len(first)
        assert [e for e in log if e[0] == "prepare"] == [("prepare", len(second))]  # before: a phase at 82 first
        assert not [e for e in log if e[0] == "save" and e[1] < len(second)]  # no offset inside the short tail
        assert events.tokens == plain_greedy(tiny.target, second, 4)
        assert sched.splits_prompt(0, 5) and not sched.splits_prompt(60, 40)
        assert sched.splits_prompt(60, generator.engine.prefill_step_size)  # a long tail still is
    finally:
        sched.stop(5)
        cache.close()


class _Held:
    """A scheduler as ``_Prompts`` sees it: what the memory tier (and LMDB) hold, and the split rule."""

    def __init__(self, covered: int, step: int = 512) -> None:
        self.covered, self.step = covered, step

    def held_prefix(self, tenant, tokens) -> int:
        return min(self.covered, len(tokens))

    def splits_prompt(self, cached: int, left: int) -> bool:
        return cached == 0 or left >= self.step

    def stored_prefix(self, tenant, tokens) -> int:  # LMDB holds nothing more
        return 0

    seam_floor = Scheduler.seam_floor  # the rule under test, over this fake's answers


def test_a_warm_turn_renders_no_message_head(smollm2_tokenizer):
    messages = [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "one " * 30},
                {"role": "assistant", "content": "two " * 30}, {"role": "user", "content": "three " * 30}]
    warm = _Prompts(smollm2_tokenizer, _Held(covered=100))
    prompt = warm.chat(messages)
    assert warm.seams(messages, prompt, None, None) == [len(prompt)] and warm.renders == 0
    cold = _Prompts(smollm2_tokenizer, _Held(covered=0))
    assert cold.seams(messages, prompt, None, None) == cold.boundaries(messages, prompt) and cold.renders == 8
    assert cold.tokenized == 0  # every head found in the prompt's own tokenization (``seam.TextLocator``)
    long_tail = _Prompts(smollm2_tokenizer, _Held(covered=100, step=16))  # a tail of a chunk or more: rendered
    assert long_tail.seams(messages, prompt, None, None)[-1] == len(prompt) and long_tail.renders >= 1


def test_a_row_ending_with_its_first_token_writes_the_prompt_once(tiny, tmp_path):
    """``max_tokens=1``: the finish checkpoint is the end-of-prompt state; no second copy is taken for it."""
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    saved: list[int] = []
    save = generator.save_checkpoint

    def logged_save(tokens, *a, **k):
        saved.append(len(tokens))
        return save(tokens, *a, **k)
    generator.save_checkpoint = logged_save
    sched = Scheduler(generator, max_rows=2)
    sched.start()
    try:
        prompt = list(range(5, 45))
        _, events = _run_job(sched, prompt, 1, (len(prompt),), [])
        assert events.tokens == plain_greedy(tiny.target, prompt, 1)
        assert saved.count(len(prompt)) == 1
    finally:
        sched.stop(5)
        cache.close()


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    root = tmp_path_factory.mktemp("smollm2-tokenizer")
    agentic.write_tokenizer(root)
    return load_tokenizer(root)


def test_seam_renders_only_heads_past_the_held_prefix(smollm2_tokenizer):
    words = " ".join(f"w{i % 97}" for i in range(300))
    messages = [{"role": "system", "content": words},
                {"role": "user", "content": "first question " + words[:200]},
                {"role": "assistant", "content": "an answer " + words[:400]},
                {"role": "user", "content": "second question " + words[:300]}]
    prompts = _Prompts(smollm2_tokenizer)
    prompt = prompts.chat(messages)
    everything = prompts.boundaries(messages, prompt)
    full_renders, prompts.renders = prompts.renders, 0
    assert full_renders == 4  # heads of 3 (no generation prompt), 2 (both ways), 1 messages
    history = prompts.tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=False, tokenize=True)
    covered = len(history) - 2  # the previous finish checkpoint: its last generated token is not forwarded
    warm = prompts.boundaries(messages, prompt, floor=covered + MIN_CHECKPOINT_GAP - 1)
    assert prompts.renders == 1  # the history up to the new message; the shorter heads are covered
    assert prompts.tokenized == 0
    useful = covered + MIN_CHECKPOINT_GAP - 1  # the scheduler skips offsets at or below this
    assert [k for k in warm if k > useful] == [k for k in everything if k > useful] == [len(prompt)]
    prompts.renders = 0
    assert prompts.boundaries(messages, prompt, floor=0) == everything and prompts.renders == 4  # a cold turn


def _kv(values: np.ndarray):
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.keys = mx.array(values)
    cache.values = mx.array(values + 1)
    cache.offset = values.shape[2]
    return cache


def test_held_prefix_reads_without_counting_a_hit():
    tier = MemoryTier(1 << 24, idle_seconds=None)
    ns = b"n" * 16
    tier.put(ns, list(range(10)), [_kv(np.zeros((1, 1, 10, 4), np.float32))], durable=True)
    tier.put(ns, [50, 51, 52], [_kv(np.zeros((1, 1, 3, 4), np.float32))], durable=True)
    before = dict(tier.counters)
    assert tier.held_prefix(ns, list(range(20))) == 10  # a held prefix: its whole length
    assert tier.held_prefix(ns, list(range(6)) + [99]) == 6  # trimmable KV: the common prefix
    assert tier.held_prefix(ns, [50, 51, 52, 53]) == 3
    assert tier.held_prefix(ns, [7, 7]) == 0 and tier.held_prefix(b"o" * 16, list(range(20))) == 0
    assert tier.counters == before  # a planning read: no hit, no miss


def test_a_memory_hit_is_not_copied_and_extending_it_leaves_the_entry_unchanged(tiny):
    """The held arrays reach the row's batch cache as views (no new buffer); the row's prefill and decode write
    new arrays, so the held entry keeps its values bit for bit."""
    target = tiny.target
    prompt = list(range(3, 203))
    rows = TargetRows.from_row_caches(target, [None])
    rows.prefill([prompt])
    tier = MemoryTier(1 << 28, idle_seconds=None)
    ns = b"k" * 16
    tier.put(ns, prompt, rows.extract(0), durable=True)
    rows.dispose()
    held = [np.array(a) for layer in tier.lookup(ns, prompt).entry.layers for a in layer.arrays]
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    hit = tier.lookup(ns, prompt + [9])
    caches, _ = tier.take(hit)
    row = TargetRows.from_row_caches(target, [caches])
    mx.eval(row._arrays(row._caches))
    assert mx.get_active_memory() - before < 4096  # views of the held buffers, not copies of the KV
    row.prefill([[9, 10, 11]])
    row.append_ids(mx.array([[12]], dtype=mx.uint32))
    row.materialize()
    after = [np.array(a) for layer in hit.entry.layers for a in layer.arrays]
    assert all(np.array_equal(a, b) for a, b in zip(held, after))
    assert row.offsets == (len(prompt) + 4,)


def test_after_a_restart_the_seam_floor_comes_from_lmdb(tiny, tmp_path):
    """Issue 35 (the H100 agent run): after a restart the memory tier is empty, so every message head of a 16k-token
    prompt was rendered and tokenized (~12 tokenizations) before a restore that covers all but its last turn.
    ``Scheduler.seam_floor`` asks LMDB's index when the memory tier falls a prefill chunk short: a short tail past
    what LMDB holds renders no head; a long one renders only past it; an unknown prompt, everything."""
    cache = SpecCache.open(tmp_path / "store")
    generator = Generator.load(tiny.root / "target", None, cache=cache)
    sched = Scheduler(generator, max_rows=2)
    sched.start()
    try:
        stored = list(range(3, 63))
        _run_job(sched, stored, 2, (len(stored),))
        assert cache.drain(30)
        cache.memory.clear()  # what a restart leaves: LMDB only
        step = generator.engine.prefill_step_size
        short = stored + list(range(100, 110))
        assert sched.held_prefix(None, short[:-1]) == 0 and sched.stored_prefix(None, short[:-1]) == len(stored)
        assert sched.seam_floor(None, short) is None
        long_tail = stored + [(7 * i) % 90 + 5 for i in range(step + 10)]
        assert sched.seam_floor(None, long_tail) == len(stored) + MIN_CHECKPOINT_GAP - 1
        assert sched.seam_floor(None, [201, 202] + long_tail) == 0  # nothing stored of it
        assert sched.stored_prefix("another-tenant", short[:-1]) == 0  # another tenant's namespace holds nothing
    finally:
        sched.stop(5)
        cache.close()

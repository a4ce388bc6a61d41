"""Deferred feeding of the draft-model rows: rounds at depth 0 feed nothing, the backlog is fed in one batched
prefill when the draft KV is next needed. Tokens are exactly those of feeding every round; checkpoints carry the
same coverage, metadata and shapes and the same values up to float rounding (MLX's CPU matmul may round differently
for a different number of tokens per forward: bit-identical on this tiny model here, ~1e-6 on SmolLM2 float32)."""

from __future__ import annotations

import numpy as np
import pytest

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.drafters.draft_model import DraftModelRows
from spec_cache.rows.protocol import RoundContext
from spec_cache.rows.target import TargetRows
from tests.library.test_adaptive_depth import timed_engine
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

MAX = 20
#: per round the depth asked of the group: drafting, plain rounds, drafting again, plain rounds at the end
SCHEDULE = [2, 0, 0, 3, 1, 0, 2, 0, 0, 0]


def same_checkpoint(a, b) -> None:
    """Coverage, metadata, dtype and shape exactly; values up to float rounding (a wrong or missing token in the
    catch-up changes K/V by far more)."""
    assert a.processed_tokens == b.processed_tokens
    assert a.attachment.schema == b.attachment.schema
    assert a.attachment.metadata == b.attachment.metadata
    assert len(a.attachment.tensors) == len(b.attachment.tensors)
    for x, y in zip(a.attachment.tensors, b.attachment.tensors):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(np.array(x), np.array(y), rtol=0, atol=1e-5)


class CountingForwards:
    """Counts the draft model's forwards (each one a pass over its layers)."""

    def __init__(self, monkeypatch, model) -> None:
        self.calls = 0
        forward = model.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)


def open_rows(tiny, provider) -> DraftModelRows:  # noqa: F811
    """Three draft rows tail-split-prefilled with ``PROMPTS[:-1]``."""
    target = TargetRows.from_row_caches(tiny.target, [None] * len(PROMPTS))
    group = provider.open(target, [None] * len(PROMPTS))
    group.prefill([p[:-1] for p in PROMPTS], None)
    return group


def drive(group: DraftModelRows, schedule, eager: bool, pending=None) -> None:
    """Rounds at the scheduled depths; row ``r`` keeps ``(round + r) % (depth + 1)`` drafts and the target's
    token is a fixed function of the round. ``eager``: feed each plain round at once (the behaviour before
    deferral), by catching up after every commit."""
    pending = [p[-1] for p in PROMPTS] if pending is None else pending
    for index, depth in enumerate(schedule):
        drafts = group.draft(pending, depth)
        assert all(len(d) == depth for d in drafts)
        kept = [(index + row) % (depth + 1) for row in range(len(pending))]
        window = [[p] + d for p, d in zip(pending, drafts)]
        group.commit(kept, RoundContext(window, None, {}))
        if eager:
            group.catch_up()
        pending = [(7 * index + 3 * row + 1) % 60 for row in range(len(pending))]


def test_capture_after_catch_up_equals_feeding_every_round(tiny, monkeypatch):  # noqa: F811
    provider = tiny.provider("draft-model")
    deferred, eager = open_rows(tiny, provider), open_rows(tiny, provider)
    counter = CountingForwards(monkeypatch, provider.model)
    drive(eager, SCHEDULE, eager=True)
    eager_forwards, counter.calls = counter.calls, 0
    drive(deferred, SCHEDULE, eager=False)
    assert deferred.processed == eager.processed
    # plain rounds ran no draft forward: the drafting rounds' and nothing for the three trailing plain rounds
    assert counter.calls == eager_forwards - 6
    for row in range(len(PROMPTS)):
        same_checkpoint(deferred.capture(row), eager.capture(row))
    assert counter.calls == eager_forwards - 6 + 1  # the first capture fed the whole backlog in one forward


def test_filter_and_append_with_a_backlog_stay_exact(tiny):  # noqa: F811
    provider = tiny.provider("draft-model")
    deferred, eager = open_rows(tiny, provider), open_rows(tiny, provider)
    for group, is_eager in ((deferred, False), (eager, True)):
        drive(group, SCHEDULE[:3], eager=is_eager)
    joining = eager.capture(1)
    for group in (deferred, eager):
        group.filter_rows([2, 0])
    for group, is_eager in ((deferred, False), (eager, True)):
        drive(group, [0, 0], eager=is_eager, pending=[9, 10])  # a backlog again before the append
    deferred.append([joining, None])
    eager.append([joining, None])
    assert deferred.processed == eager.processed
    for row in range(3):
        same_checkpoint(deferred.capture(row), eager.capture(row))


def test_a_plain_round_must_keep_no_draft(tiny):  # noqa: F811
    group = open_rows(tiny, tiny.provider("draft-model"))
    window = [[p[-1]] for p in PROMPTS]
    assert group.draft([p[-1] for p in PROMPTS], 0) == [[], [], []]
    with pytest.raises(ValueError, match="row 1: 1 accepted but nothing was drafted"):
        group.commit([0, 1, 0], RoundContext(window, None, {}))


@pytest.mark.parametrize("adaptive", [True, False])
def test_speculative_equals_plain_greedy(tiny, monkeypatch, adaptive):  # noqa: F811
    # a compute-bound cost (a window of w tokens costs w steps): adaptive depth decodes plainly after the first
    # rounds; fixed depth drafts every round but the first-token one
    engine, _ = timed_engine(tiny, monkeypatch, "draft-model", float, adaptive=adaptive)
    results = engine.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, MAX)
    if adaptive:
        # two exploring rounds at depth 1: a width's first (warm-up) cost is measured once more before it is
        # trusted (spec_cache/decode/depth.py; tests/library/test_adaptive_depth.py holds the same bound)
        rounds = engine.depth.rounds_at_depth
        assert rounds[0] >= sum(rounds.values()) - 2 and rounds.get(1, 0) <= 2, dict(rounds)
    else:
        assert sum(r.drafted for r in results) > 0


class DepthLog:
    """Records the depth of every ``draft`` call and each checkpoint's draft state."""

    def __init__(self, monkeypatch, eager: bool) -> None:
        self.depths: list[int] = []
        self.checkpoints: list = []
        draft, commit = DraftModelRows.draft, DraftModelRows.commit

        def logged(group, pending, depth):
            self.depths.append(depth)
            return draft(group, pending, depth)

        def committed(group, accepted, context):
            commit(group, accepted, context)
            if eager:
                group.catch_up()

        monkeypatch.setattr(DraftModelRows, "draft", logged)
        monkeypatch.setattr(DraftModelRows, "commit", committed)

    def __call__(self, row, tokens, caches, draft) -> None:
        self.checkpoints.append((row, list(tokens), draft))


def staggered_run(tiny, monkeypatch, eager: bool):  # noqa: F811
    """Two places for three rows under a flat verify cost with a drafter the target always agrees with: the
    third row's admission forces a plain round (its first token) between rounds at the maximum depth."""
    log = DepthLog(monkeypatch, eager)
    engine, _ = timed_engine(tiny, monkeypatch, "draft-model-full", lambda width: 1.0)
    engine.max_rows = 2
    results = engine.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=log)
    monkeypatch.undo()
    return results, log


def test_fake_clock_run_where_depth_drops_to_zero_and_back(tiny, monkeypatch):  # noqa: F811
    results, log = staggered_run(tiny, monkeypatch, eager=False)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, MAX)
    drafting = [i for i, depth in enumerate(log.depths) if depth > 0]
    assert drafting and any(log.depths[i] == 0 for i in range(drafting[0], drafting[-1]))  # 0, then back up
    assert sum(r.accepted for r in results) > 0
    _, eager = staggered_run(tiny, monkeypatch, eager=True)
    assert eager.depths == log.depths
    assert [(row, tokens) for row, tokens, _ in eager.checkpoints] == [(r, t) for r, t, _ in log.checkpoints]
    for (_, _, mine), (_, _, theirs) in zip(log.checkpoints, eager.checkpoints):
        same_checkpoint(mine, theirs)


def test_restored_equals_cold_after_plain_rounds(tiny, monkeypatch):  # noqa: F811
    # compute-bound costs: the rows end after plain rounds, so their finish checkpoints are captured from a backlog
    engine, _ = timed_engine(tiny, monkeypatch, "draft-model", float)
    log = []
    engine.run([RowRequest(p, max_tokens=8) for p in PROMPTS], on_checkpoint=lambda *call: log.append(call))
    monkeypatch.undo()
    requests, cold = [], []
    for index, prompt in enumerate(PROMPTS):
        _, tokens, caches, draft = [call for call in log if call[0] == index][-1]
        assert draft is not None and draft.processed_tokens == len(tokens) == len(prompt) + 7
        longer = list(tokens) + [3, 4, 5]
        requests.append(RowRequest(longer, caches, len(tokens), draft, max_tokens=MAX))
        cold.append(RowRequest(longer, max_tokens=MAX))
    restored = SpeculativeEngine(tiny.target, tiny.provider("draft-model"), adaptive=False).run(requests)
    again = SpeculativeEngine(tiny.target, tiny.provider("draft-model"), adaptive=False).run(cold)
    for request, mine, theirs in zip(requests, restored, again):
        assert mine.tokens == theirs.tokens == plain_greedy(tiny.target, request.prompt, MAX)
        assert mine.cached_tokens == request.restored_tokens
    assert sum(r.accepted for r in restored) > 0

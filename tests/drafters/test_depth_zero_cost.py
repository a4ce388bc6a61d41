"""Issue 39 item 3, "never slower": a round at depth 0 costs the drafter nothing, and an exploration that found
nothing does not restart the probe schedule.

Deterministic (counts of forwards and of chosen depths, never a timing): the controller is fed costs directly, the
draft model's forwards are counted.
"""

from __future__ import annotations

from spec_cache.decode.depth import DepthController, RowAcceptance
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.drafters.draft_model import DraftModelRows
from tests.drafters.test_draft_model_deferred import CountingForwards, drive, open_rows, same_checkpoint
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401


# -- the draft model at depth 0 ------------------------------------------------------------------------------------
def test_plain_rounds_never_forward_the_draft_model(tiny, monkeypatch):  # noqa: F811
    """Before: the backlog was fed every 32 plain rounds (1-2% of a run that never drafted, on the CPU)."""
    assert DraftModelRows.backlog_cap is None
    group = open_rows(tiny, tiny.provider("draft-model"))
    forwards = CountingForwards(monkeypatch, group.provider.model)
    drive(group, [0] * 80, eager=False)
    assert forwards.calls == 0 and min(map(len, group._backlog)) == 80


def test_rows_that_leave_feed_nothing_and_the_kept_rows_keep_their_backlog(tiny, monkeypatch):  # noqa: F811
    provider = tiny.provider("draft-model")
    lazy, eager = open_rows(tiny, provider), open_rows(tiny, provider)
    forwards = CountingForwards(monkeypatch, provider.model)
    drive(lazy, [0] * 6, eager=False)
    lazy.filter_rows([2, 0])
    assert forwards.calls == 0 and [len(b) for b in lazy._backlog] == [6, 6]
    drive(eager, [0] * 6, eager=True)
    eager.filter_rows([2, 0])
    for row in range(2):  # the backlog fed at capture: the same draft KV as feeding every round
        same_checkpoint(lazy.capture(row), eager.capture(row))


def test_the_engine_keeps_plain_greedy_tokens_with_an_unbounded_backlog(tiny):  # noqa: F811
    prompts = [list(p) for p in PROMPTS]
    controller = DepthController(4, probe_every=5, probe_limit=5, probe_budget=None)  # probes every 5 rounds
    engine = SpeculativeEngine(tiny.target, tiny.provider("draft-model"), draft_depth=4, max_rows=2)
    engine.depth = controller
    results = engine.run([RowRequest(p, max_tokens=24, stop_at_eos=False) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, 24)
    assert controller.rounds_at_depth[0] > 0 and sum(r.drafted for r in results) > 0


# -- the probe schedule after an exploration -----------------------------------------------------------------------
def explored(controller: DepthController, rows: list, accepted: int, cost=lambda width: 1.0 + 0.9 * (width - 1)):
    """Plain rounds until the controller explores on the prior (width 2 unmeasured: the prior slope prices it at
    1.25 plain rounds), one drafting round accepting ``accepted`` per row, then the chosen depths of 200 rounds."""
    for _ in range(3):  # the first-token rounds: plain
        controller.observe_round(len(rows), 0, 0.0, 1, cost(1))
    chosen = []
    for _ in range(200):
        depth = controller.choose(rows, [500] * len(rows))
        controller.observe_round(len(rows), depth, 0.0, depth + 1, cost(depth + 1))
        if depth:
            for row in rows:
                controller.observe_row(row, depth, accepted if not chosen or not any(chosen) else 0)
        chosen.append(depth)
    return chosen


def test_an_exploration_that_found_nothing_counts_as_a_probe():
    """A draft model that accepts nothing (SmolLM2's first 4 layers on the CPU, issue 39): before, the schedule
    started over after its first exploration (probes after 16 more plain rounds, then 32: 2-4% of a 96-token run)."""
    chosen = explored(DepthController(4, probe_budget=None), [RowAcceptance(), RowAcceptance()], accepted=0)
    drafting = [i for i, depth in enumerate(chosen) if depth]
    assert drafting[0] <= 3  # explored once, on the prior
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert gaps[0] >= 32, drafting  # the next probe after a doubled interval (32 plain rounds), not 16
    assert all(later >= earlier for earlier, later in zip(gaps, gaps[1:]))


def test_a_stretch_that_accepted_restarts_the_probe_schedule():
    controller = DepthController(4, probe_budget=None)
    chosen = explored(controller, [RowAcceptance(), RowAcceptance()], accepted=1)
    drafting = [i for i, depth in enumerate(chosen) if depth]
    first_plain = next(i for i in range(drafting[0], len(chosen)) if chosen[i] == 0)
    later = [i for i in drafting if i > first_plain]
    assert later and later[0] - first_plain <= 16, drafting  # probing starts over: after probe_every plain rounds


# -- probe pricing: a plausible width reading counts ---------------------------------------------------------------
def test_a_probe_is_priced_at_least_at_its_widths_plausible_first_reading():
    def due(width2: float) -> int:
        controller = DepthController(4)
        for _ in range(3):
            controller.observe_round(8, 0, 0.0, 1, 1.0)
        controller.observe_round(8, 1, 0.0, 2, width2)  # the exploration's width-2 round: one reading
        rows = [RowAcceptance() for _ in range(8)]
        for row in rows:
            controller.observe_row(row, 1, 0)
        return controller._probe_due(rows, [50] * 8, 1)

    prior = due(1.25)  # the prior slope's estimate: no excess
    assert due(2.0) > 3 * prior  # a compute-bound reading (2 plain rounds): the probe costs 4x more extra
    assert due(40.0) == prior  # a spike (a kernel compile) is left out, as the estimates leave it out


# -- probe pricing: the drafter's upkeep ---------------------------------------------------------------------------
def test_a_probe_pays_for_the_backlog_it_feeds():
    """The draft model's probe after n plain rounds feeds their n tokens per row first (issue 39: SmolLM2's first 4
    layers at B=8 on the CPU, a probe after ~77 plain rounds read 3.5-4.3 plain rounds, most of it that feed, and
    with the exploration cost the 96-token run 5-6%). Its first draft call after plain rounds prices that upkeep
    per plain round; where the upkeep alone exceeds a probe's share, the next probe waits ``4 * probe_limit``."""
    def next_probe(draft_seconds: float) -> list:
        controller = DepthController(4)
        rows = [RowAcceptance() for _ in range(8)]
        for _ in range(3):
            controller.observe_round(8, 0, 0.0, 1, 1.0)
        chosen = []
        for _ in range(600):
            depth = controller.choose(rows, [500] * 8)
            controller.observe_round(8, depth, draft_seconds if depth else 0.0, depth + 1, 1.0 + 0.95 * depth)
            for row in rows:
                if depth:
                    controller.observe_row(row, 1, 0)
            chosen.append(depth)
        return [i for i, depth in enumerate(chosen) if depth]

    free = next_probe(0.0)  # a drafter without upkeep (prompt lookup's cost): probes as before
    assert len(free) >= 4 and free[1] - free[0] < 96
    dear = next_probe(0.45)  # the draft model: its exploration's draft call after 2 plain rounds cost 0.45 of one
    assert dear[0] == free[0] and dear[1] - dear[0] >= 4 * 128 - 1, dear

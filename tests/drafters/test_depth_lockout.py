"""Issue 28 item 4: one terrible cost measurement must never lock a draft depth out for good.

The GPU case (H200, B=4 copy workload: adaptive ngram at 0.025x plain, 4 tokens drafted) was a 36.5 s kernel
compile landing on one round at a new window width. Warm-ups are handled elsewhere (tests/drafters/
test_copy_drafting.py: a width's first measurement is a warm-up). Here the terrible round lands on a width the
controller already trusts (a compile at a new KV length class, another process taking the device): its estimate
rises, the controller stops choosing that width, and a width is only re-measured by choosing it. Costs are scripted
(a clock advanced per target forward, or fed to the controller directly), never wall-clock.
"""

from __future__ import annotations

import pytest

from spec_cache.decode.depth import CostTable, DepthController, RowAcceptance
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401


def accepting_row(controller: DepthController, depth: int) -> RowAcceptance:
    row = RowAcceptance()
    for _ in range(20):
        controller.observe_row(row, depth, depth)
    return row


def test_one_terrible_round_at_the_best_width_does_not_lock_its_depth_out():
    """Flat costs (a GPU: every width costs one step), rows accepting everything: depth 6. One round at width 7
    costs 40 steps; the old controller's estimate of width 7 rose to 1.3 steps, depth 5 won from then on, and width
    7 was never measured again (depth 5 for the other 299 rounds)."""
    controller = DepthController(6)
    row = accepting_row(controller, 6)
    for width in range(1, 8):
        for _ in range(2):
            controller.observe_round(4, width - 1, 0.0, width, 1.0)
    depths = []
    for round_ in range(300):
        depth = controller.choose([row] * 4, [50] * 4)
        depths.append(depth)
        controller.observe_round(4, depth, 0.0, depth + 1, 40.0 if round_ == 5 else 1.0)
        controller.observe_row(row, depth, depth)
    assert depths[:5] == [6] * 5
    # back at the deepest width for good (a plain round re-measures the stale plain estimate now and then)
    assert depths[-50:].count(6) >= 48, depths
    assert sum(1 for d in depths if d == 6) >= 200, depths


def test_a_burst_of_slow_rounds_does_not_keep_a_useless_drafter_drafting():
    """The mirror case: plain rounds measured slow in a burst (other processes) while the drafter still accepted;
    then it stops accepting. Width 1 is re-measured (a row without a draft, or a plain round), and the controller
    returns to plain decoding instead of drafting at depth 1 on a stale, inflated plain estimate."""
    controller = DepthController(4)
    cost = {1: 1.0, 2: 1.6, 3: 2.2, 4: 2.8, 5: 3.4}  # a compute-bound CPU
    for width in cost:
        for _ in range(2):
            controller.observe_round(2, width - 1, 0.0, width, cost[width])
    for _ in range(6):
        controller.observe_round(2, 0, 0.0, 1, 4.0)  # the burst, counted at most 2x each time: 1.0 -> ~2.9
    row = RowAcceptance()
    depths = []
    for _ in range(200):
        depth = controller.choose([row] * 2, [50] * 2)
        depths.append(depth)
        controller.observe_round(2, depth, 0.0, depth + 1, cost[depth + 1])
        if depth:
            controller.observe_row(row, depth, 0)  # the drafter stopped agreeing
    assert depths[-100:].count(0) >= 95, depths


def test_a_stale_estimate_is_re_measured_as_a_second_measurement():
    table = CostTable(smoothing=0.3)
    for _ in range(2):
        table.observe(4, 1, 1.0)
        table.observe(4, 7, 1.0)
    table.observe(4, 7, 40.0)  # trusted width: counted up to twice the estimate
    assert table.estimate(4, 7) == 1.3
    for _ in range(64):
        table.observe(4, 1, 1.0)
    assert table.estimate(4, 7) == pytest.approx(1.3)  # 64 observations without it: still fresh
    table.observe(4, 1, 1.0)
    assert table.estimate(4, 7) == pytest.approx(1.0 + 0.25 * 6)  # stale: from the fresh width 1 (prior slope)
    table.observe(4, 7, 1.1)
    assert table.estimate(4, 7) == pytest.approx(1.1)  # its next measurement: the lower of the old and the new
    assert table.estimate(4, 4) == pytest.approx(1.05)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_engine_batch_of_four_recovers_from_terrible_rounds_at_a_trusted_width(tiny, monkeypatch):
    """The 0.025x case through the engine: B=4, a drafter whose drafts are all accepted, GPU-like flat costs, and
    six 730-step rounds (a 36.5 s compile over 50 ms steps; the device taken meanwhile) from the eighth forward at
    the deepest width on. The old controller went to plain decoding, probed width 2 and drafted at depth 1 for the
    rest of the run (width 5 never measured again: 13 forwards at width 5 in all). Every row's tokens stay plain
    greedy's, and the run ends drafting at full depth."""
    clock, seen = Clock(), {}
    forward = tiny.target.forward

    def billed(ids, caches, **kwargs):
        width = int(ids.shape[1])
        seen[width] = seen.get(width, 0) + 1
        clock.now += 730.0 if (width == 5 and 8 <= seen[width] <= 13) else 1.0
        return forward(ids, caches, **kwargs)

    prompts = [list(p) for p in PROMPTS] + [list(PROMPTS[0][:3])]
    monkeypatch.setattr(tiny.target, "forward", billed)
    engine = SpeculativeEngine(tiny.target, tiny.provider("draft-model-full"), draft_depth=4, clock=clock)
    session = engine.session()
    results = {}
    for prompt in prompts:
        session.submit(RowRequest(prompt, max_tokens=400, stop_at_eos=False),
                       on_finish=lambda i, r: results.__setitem__(i, r))
    depths = []
    while session.step():
        depths.append(engine.depth.last_depth)
    session.close()
    monkeypatch.undo()
    for i, prompt in enumerate(prompts):
        assert results[i].tokens == plain_greedy(tiny.target, prompt, 400)
    assert seen[5] > 13 + 10, (seen, engine.depth.rounds_at_depth)  # width 5 chosen again after the terrible round
    assert depths[-10:].count(4) >= 8, depths  # (a plain round re-measures a stale plain estimate)


def test_a_probe_for_rows_that_rejected_waits_until_its_cost_is_a_small_share():
    """The draft model on chat at B=8 (CPU): rows accepted nothing in the exploring rounds, and a probe costs a
    width-2 verify (1.7 plain rounds) plus the draft model's backlog feed (0.4): probes after 16 and 48 plain
    rounds cost 10% of a 96-token run before. Now at most one, and rows that accepted well are probed sooner."""

    def probes_in(rounds: int, agreed: int, explored: int = 2) -> list[int]:
        controller = DepthController(4)
        for _ in range(2):
            controller.observe_round(8, 0, 0.0, 1, 1.0)
        for _ in range(explored):  # one exploring round: its costs are a warm-up to the estimates
            controller.observe_round(8, 1, 0.4, 2, 1.7)
        rows = [RowAcceptance() for _ in range(8)]
        for row in rows:
            for _ in range(explored):
                controller.observe_row(row, 1, agreed)
        chosen = []
        for _ in range(rounds):
            depth = controller.choose(rows, [50] * 8)
            chosen.append(depth)
            controller.observe_round(8, depth, 0.4 if depth else 0.0, depth + 1, 1.0 + 0.7 * depth)
        return [i for i, depth in enumerate(chosen) if depth]

    assert len(probes_in(96, agreed=0)) <= 1
    assert probes_in(96, agreed=0, explored=1)[0] >= 30  # one exploring round (a warm-up to the estimates)
    rejected, accepted = probes_in(300, agreed=0), probes_in(300, agreed=1)
    assert rejected and accepted and accepted[0] < rejected[0]  # never locked out; a good drafter sooner

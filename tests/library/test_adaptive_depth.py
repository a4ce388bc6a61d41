"""Adaptive draft depth: the controller's decisions under injected costs, and the engine's tokens, which the
depth must never change (greedy and seeded sampling)."""

from __future__ import annotations

import pytest

from spec_cache.decode.depth import CostTable, DepthController, RowAcceptance, expected_accepted
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.rows.sampling import RowSampling
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

MAX = 20


# -- the pieces ------------------------------------------------------------------------------------------------
def test_row_acceptance_counts_geometric_trials():
    row = RowAcceptance()
    row.observe(4, 2, decay=1.0)  # two accepted, the third rejected: 3 trials
    row.observe(4, 4, decay=1.0)  # all four accepted: 4 trials
    row.observe(0, 0, decay=1.0)  # asked, nothing offered
    assert (row.hits, row.trials, row.offered, row.asked) == (6, 7, 2, 3)
    assert row.acceptance(prior=0.5, weight=1.0) == pytest.approx(6.5 / 8)
    assert row.availability() == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="agreed"):
        row.observe(2, 3, decay=1.0)


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)
    assert expected_accepted([0.5, 1.0, 0.5], 3) == pytest.approx(0.5 + 0.5 + 0.25)  # per-position acceptances
    assert expected_accepted(1.0, 4) == 4 and expected_accepted(0.9, 0) == 0


def test_cost_table_interpolates_extrapolates_and_borrows_batch_sizes():
    table = CostTable(smoothing=1.0, prior_slope=0.25)
    assert table.estimate(2, 1) is None
    table.observe(2, 1, 1.0)
    assert table.estimate(2, 3) == pytest.approx(1.5)  # one width known: the prior slope
    table.observe(2, 3, 2.0)
    assert table.estimate(2, 2) == pytest.approx(1.5)  # between measured widths
    assert table.estimate(2, 5) == pytest.approx(3.0)  # beyond: the measured slope
    assert table.estimate(4, 1) == pytest.approx(1.0)  # batch size 4 borrows size 2's table
    table.observe(2, 1, 3.0)
    assert table.estimate(2, 1) == 1.0  # the second measurement: the lower of the two (a spike is never low)
    table.observe(2, 1, 3.0)
    assert table.estimate(2, 1) == 2.0  # smoothing 1: the newest measurement, counted up to twice the estimate
    with pytest.raises(ValueError):
        table.observe(0, 1, 1.0)
    with pytest.raises(ValueError):
        CostTable(smoothing=0.0)


def measured(controller: DepthController, rows: int, cost, depths: int = 5, draft=lambda depth: 0.0):
    """Feed the controller one measurement per width 1..depths + 1 (``cost(width)`` seconds)."""
    for depth in range(depths + 1):
        controller.observe_round(rows, depth, draft(depth), depth + 1, cost(depth + 1))


def rejecting_row(rounds: int = 40) -> RowAcceptance:
    row = RowAcceptance()
    for _ in range(rounds):
        row.observe(4, 0, decay=0.9)
    return row


def accepting_row(rounds: int = 40) -> RowAcceptance:
    row = RowAcceptance()
    for _ in range(rounds):
        row.observe(4, 4, decay=0.9)
    return row


# -- the controller's decisions ----------------------------------------------------------------------------------
def test_compute_bound_costs_choose_plain_decoding_and_probe_only_to_re_measure():
    controller = DepthController(4)
    measured(controller, 1, lambda width: float(width))  # verify w tokens costs w decode steps (CPU)
    # even a drafter accepting everything only ties at (1 + D) / (D + 1): plain decoding, the cheaper tie
    for row in (accepting_row(), rejecting_row(), RowAcceptance()):
        assert controller.best_depth([row], [10]) == 0
    chosen = [controller.choose([rejecting_row()], [10]) for _ in range(300)]
    # no depth pays, not even at a probe's acceptance: only depth-1 rounds that re-measure width 2 (a stale
    # width-2 estimate must not stop drafting for good), after 16, 32, 64 and 128 plain rounds, or when a probe
    # would cost more than its share of the time (probe_budget, 4%, scaled by 0.25 + the rows' first-position
    # acceptance ~0.01): width 2 costs one extra step here, so 95 rounds apart
    assert [i for i, depth in enumerate(chosen) if depth] == [94, 189, 284] and max(chosen) == 1
    assert controller.probes == 3 and controller.rounds_at_depth == {0: 297, 1: 3}


def test_flat_verify_cost_drafts_at_the_maximum_depth():
    controller = DepthController(4)
    measured(controller, 1, lambda width: 1.0)  # memory-bound GPU: a window costs one step
    assert controller.best_depth([accepting_row()], [10]) == 4
    sometimes = RowAcceptance()
    for agreed in [1, 0, 0, 0] * 10:
        sometimes.observe(4, agreed, decay=0.9)
    assert controller.best_depth([sometimes], [10]) == 4  # free to verify: anything accepted is a gain
    assert controller.best_depth([rejecting_row()], [10]) == 0  # nothing ever accepted: within min_gain
    assert controller.best_depth([accepting_row()], [2]) == 2  # a row's budget caps its depth


def test_drafting_cost_is_weighed_against_acceptance():
    controller = DepthController(4)
    measured(controller, 1, lambda width: 1.0 + 0.1 * (width - 1), draft=lambda depth: 0.6 * depth)
    assert controller.best_depth([rejecting_row()], [10]) == 0
    assert controller.best_depth([accepting_row()], [10]) >= 3
    middling = RowAcceptance()
    for agreed in [1, 0, 2, 1, 0, 1] * 5:
        middling.observe(4, agreed, decay=0.9)
    assert 0.2 < middling.acceptance(0.5, 2.0) < 0.6
    assert controller.best_depth([middling], [10]) == 0  # 0.6 s per drafted token: not worth it (first ~0.67)


def test_a_batch_drafts_for_the_rows_that_gain_and_others_ride_along():
    controller = DepthController(4)
    measured(controller, 2, lambda width: 1.0 + 0.2 * (width - 1))
    assert controller.best_depth([rejecting_row(), rejecting_row()], [10, 10]) == 0
    assert controller.best_depth([rejecting_row(), accepting_row()], [10, 10]) > 0
    assert controller.best_depth([accepting_row(), accepting_row()], [0, 0]) == 0  # no budget left to draft


def test_a_gain_within_the_noise_margin_is_not_taken():
    cost = lambda width: 1.0 + 0.95 * (width - 1)  # noqa: E731 - an accepting row gains ~3% per round
    strict, eager = DepthController(4), DepthController(4, min_gain=0.0)
    measured(strict, 1, cost)
    measured(eager, 1, cost)
    assert strict.best_depth([accepting_row()], [10]) == 0
    assert eager.best_depth([accepting_row()], [10]) > 0
    with pytest.raises(ValueError, match="min_gain"):
        DepthController(4, min_gain=1.0)


def test_without_waiting_requests_the_slowest_row_decides():
    controller = DepthController(4)
    measured(controller, 2, lambda width: 1.0 + 0.2 * (width - 1))
    rows = [accepting_row(), rejecting_row()]
    assert controller.best_depth(rows, [10, 10]) > 0  # per round, the accepting row's tokens pay
    assert controller.best_depth(rows, [10, 10], remaining=[50, 50]) == 0  # the rejecting row sets the run's length
    assert controller.best_depth(rows, [10, 10], remaining=[50, 5]) == 4  # the accepting row sets it
    assert controller.choose(rows, [10, 10], remaining=[50, 50]) == 0
    with pytest.raises(ValueError, match="remaining"):
        controller.choose(rows, [10, 10], remaining=[50])


def test_probes_back_off_and_a_row_that_turns_repetitive_gets_drafting_back():
    controller = DepthController(4, probe_every=4, probe_limit=16, probe_budget=None)  # the interval decides
    measured(controller, 1, lambda width: 1.0 + 0.2 * (width - 1))
    row = rejecting_row()
    chosen = [controller.choose([row], [100]) for _ in range(4 + 8 + 16 + 16)]
    probes = [i for i, depth in enumerate(chosen) if depth > 0]
    assert probes == [3, 11, 27, 43]  # after 4, then 8, then 16 (the limit) plain rounds
    assert all(chosen[i] == 4 for i in probes)  # a probe drafts as deep as a high acceptance would pay
    assert controller.probes == 4
    # the text turns repetitive: probes are accepted, and the controller drafts on its own again
    for _ in range(3):
        row.observe(4, 4, decay=controller.decay)
    assert controller.choose([row], [100]) == 2  # acceptance ~0.6 so far
    for _ in range(5):
        row.observe(4, 4, decay=controller.decay)
    assert controller.choose([row], [100]) == 4
    assert [controller.choose([rejecting_row()], [100]) for _ in range(4)] == [0, 0, 0, 4]  # interval reset


def test_first_measurement_explores_one_token_deeper_only():
    controller = DepthController(4)
    controller.observe_round(1, 0, 0.0, 1, 1.0)  # only plain rounds so far (the first-token rounds)
    assert controller.best_depth([RowAcceptance()], [10]) == 1  # the prior slope makes wider windows dearer
    assert DepthController(4).best_depth([RowAcceptance()], [10]) == 4  # nothing measured: as deep as allowed


def test_controller_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_depth"):
        DepthController(-1)
    with pytest.raises(ValueError, match="decay"):
        DepthController(4, decay=1.5)
    with pytest.raises(ValueError, match="probe_every"):
        DepthController(4, probe_every=0)
    with pytest.raises(ValueError, match="caps"):
        DepthController(4).choose([RowAcceptance()], [])


# -- through the engine ------------------------------------------------------------------------------------------
class FakeClock:
    """Seconds advanced by a cost model: every target forward of width ``w`` adds ``cost(w)``."""

    def __init__(self, cost) -> None:
        self.now = 0.0
        self.cost = cost

    def __call__(self) -> float:
        return self.now


def timed_engine(tiny, monkeypatch, name, cost, *, adaptive=True, depth=4):
    """An engine whose clock advances only by ``cost(width)`` per target forward (drafting is free)."""
    clock = FakeClock(cost)
    forward = tiny.target.forward

    def billed(ids, caches, **kwargs):
        clock.now += clock.cost(int(ids.shape[1]))
        return forward(ids, caches, **kwargs)

    monkeypatch.setattr(tiny.target, "forward", billed)
    return SpeculativeEngine(tiny.target, tiny.provider(name), draft_depth=depth, adaptive=adaptive, clock=clock), clock


def modelled_seconds(tiny, monkeypatch, name, cost, **options):
    engine, clock = timed_engine(tiny, monkeypatch, name, cost, **options)
    results = engine.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS])
    monkeypatch.undo()
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, MAX)
    return clock.now, engine, results


def test_compute_bound_target_decodes_no_slower_than_plain(tiny, monkeypatch):
    linear = float  # a window of w tokens costs w steps
    plain, _, _ = modelled_seconds(tiny, monkeypatch, None, linear)
    fixed, _, _ = modelled_seconds(tiny, monkeypatch, "draft-model", linear, adaptive=False)
    adaptive, engine, results = modelled_seconds(tiny, monkeypatch, "draft-model", linear)
    assert fixed > 1.3 * plain  # drafting at depth 4 loses here (acceptance is partial)
    assert adaptive <= plain + 2.0  # two drafting rounds at most (exploring, or a depth-1 probe), one step each
    # the first round at a new width is a warm-up (kernels compile): its cost is measured once more before the
    # controller trusts it (tests/drafters/test_copy_drafting.py: trusting a warm-up spike froze the depth at 0)
    assert engine.depth.rounds_at_depth[0] >= sum(engine.depth.rounds_at_depth.values()) - 2
    assert sum(r.drafted for r in results) <= 2 * len(PROMPTS)  # those two rounds, depth 1


def test_cheap_verify_windows_draft_deep_with_an_accepting_drafter(tiny, monkeypatch):
    flat = lambda width: 1.0  # noqa: E731 - a window costs one step (memory-bound)
    plain, _, _ = modelled_seconds(tiny, monkeypatch, None, flat)
    fixed, _, _ = modelled_seconds(tiny, monkeypatch, "draft-model-full", flat, adaptive=False)
    adaptive, engine, results = modelled_seconds(tiny, monkeypatch, "draft-model-full", flat)
    assert fixed < 0.5 * plain
    assert adaptive <= fixed + 2.0  # the exploring round(s) at depth 1, then depth 4
    assert engine.depth.rounds_at_depth[4] >= 2  # after two plain rounds (the first-token one is a warm-up)
    assert all(r.accepted == r.drafted > 0 for r in results)


@pytest.mark.parametrize("name", ["ngram", "draft-model", "assistant"])
def test_adaptation_never_changes_greedy_tokens(tiny, monkeypatch, name):
    sublinear = lambda width: 1.0 + 0.3 * (width - 1)  # noqa: E731 - drafting wins only with acceptance
    _, engine, results = modelled_seconds(tiny, monkeypatch, name, sublinear)
    assert engine.depth is not None and sum(engine.depth.rounds_at_depth.values()) > 0


@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_adaptation_never_changes_sampled_tokens(tiny, monkeypatch, name):
    requests = [RowRequest(p, max_tokens=MAX, sampling=RowSampling(0.9, 0.95, seed)) for seed, p in enumerate(PROMPTS)]
    plain = SpeculativeEngine(tiny.target, None).run(requests)
    fixed = SpeculativeEngine(tiny.target, tiny.provider(name), adaptive=False).run(requests)
    tokens = {}
    for label, cost in {"linear": float, "flat": lambda width: 1.0}.items():
        engine, _ = timed_engine(tiny, monkeypatch, name, cost)
        tokens[label] = [r.tokens for r in engine.run(requests)]
        monkeypatch.undo()
    assert tokens["linear"] == tokens["flat"] == [r.tokens for r in fixed] == [r.tokens for r in plain]
    assert len({tuple(t) for t in tokens["flat"]}) == len(PROMPTS)


def test_engine_without_a_drafter_or_with_adaptation_off_has_no_controller(tiny):
    assert SpeculativeEngine(tiny.target, None).depth is None
    assert SpeculativeEngine(tiny.target, tiny.provider("ngram"), adaptive=False).depth is None
    assert SpeculativeEngine(tiny.target, tiny.provider("ngram"), draft_depth=0).depth is None
    assert SpeculativeEngine(tiny.target, tiny.provider("ngram"), draft_depth=6).depth.max_depth == 6


def test_drafting_bench_reports_every_drafter_with_and_without_adaptation():
    from spec_cache.apps.bench import drafting

    figures = drafting.run(rows=2, new_tokens=6, tiny=True)  # raises if any run changes plain decoding's tokens
    assert figures["model"].startswith("tiny")
    for name in ("ngram", "draft-model"):
        row = figures["tiny"][name]
        assert row["adaptive_tok_s"] > 0 and row["fixed_tok_s"] > 0
        accepted, drafted = map(int, row["fixed_acceptance"].split("/"))
        assert 0 <= accepted <= drafted
    assert figures["drafting_vs_plain_best"] >= figures["drafting_vs_plain_ngram"] > 0
    copy = figures["copy"]["ngram"]  # the copy workload: ngram only, tokens checked against plain as above
    assert figures["drafting_copy_ngram"] == copy["adaptive_vs_plain_cpu"] > 0
    assert "drafting_copy_ngram_fixed" in figures and figures["copy"]["variant"] == "tiny"

"""Per-position acceptance in the depth controller: prompt lookup's drafts pass whole (a copied run) or fail at
the first token (a one-token match on chat), and one geometric rate over all positions over-rates shallow drafts
of such a row (chat on a CPU at B=3-4: tens of rounds at depth 1 at ~25% acceptance, 0.71-0.94x plain)."""

from __future__ import annotations

import pytest

from spec_cache.decode.depth import DepthController, RowAcceptance, expected_accepted


def all_or_nothing() -> RowAcceptance:
    row = RowAcceptance()
    for agreed in [4, 0, 4, 0, 4] * 4:
        row.observe(4, agreed, decay=0.9)
    return row


def test_positions_follow_what_each_position_passed():
    row = all_or_nothing()
    first, *deeper = row.positions(4, prior=0.5, weight=2.0)
    assert row.acceptance(0.5, 2.0) > 0.8  # one rate: ~0.86
    assert 0.5 < first < 0.7 and all(a > 0.9 for a in deeper)
    assert RowAcceptance().positions(3, prior=0.5, weight=2.0) == [0.5] * 3  # nothing seen: the prior
    assert expected_accepted(row.positions(4, 0.5, 2.0), 1) == pytest.approx(first)


def test_a_row_that_passes_whole_or_fails_at_once_is_not_drafted_shallow_on_a_cpu():
    """Width 2 costs 1.7 plain steps (a CPU at B=4): at one rate of ~0.86 depth 1 would win by 9%; at the first
    position's ~0.6 it loses, and deeper widths cost more than the run they add."""
    controller = DepthController(4)
    for width in range(1, 6):
        for _ in range(2):
            controller.observe_round(4, width - 1, 0.0, width, 1.0 + 0.7 * (width - 1))
    rows = [all_or_nothing() for _ in range(4)]
    assert (1 + rows[0].acceptance(0.5, 2.0)) / 1.7 > 1.05  # what the geometric model predicted
    assert controller.best_depth(rows, [50] * 4) == 0


def test_one_odd_plain_round_does_not_move_a_settled_estimate():
    """Pipelined plain rounds are timed unevenly: the round before a probe only waits for a forward already in
    flight (29-40 ms against ~130 ms), the one after a drafting round builds its own too (190-280 ms). The
    estimate is the median of the latest five, so neither moves it (a moving average moved it by -23% / +30%)."""
    from spec_cache.decode.depth import CostTable

    table = CostTable()
    for seconds in (0.13, 0.13, 0.12, 0.14, 0.13):
        table.observe(3, 1, seconds)
    table.observe(3, 1, 0.03)
    assert table.estimate(3, 1) == pytest.approx(0.13)
    table.observe(3, 1, 0.26)
    assert table.estimate(3, 1) == pytest.approx(0.13)

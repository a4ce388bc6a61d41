"""The argument checks the batched rows and drafters share (``rows.check_window`` / ``check_accepted``), and the
one round mechanics ``TargetRows`` and the quantized ``PhaseRows`` inherit from ``batch_rows.BatchRows``."""

from __future__ import annotations

import pytest

import spec_cache.rows.quantized_rows as quantized_rows
from spec_cache.rows.batch_rows import BatchRows
from spec_cache.rows.protocol import RoundContext, check_accepted, check_window
from spec_cache.rows.quantized_batch import PhaseRows
from spec_cache.rows.target import TargetRows


def test_check_window_returns_the_width_of_equal_non_empty_windows():
    assert check_window([[1, 2, 3], [4, 5, 6]], 2) == 3
    assert check_window([[7]], 1) == 1


@pytest.mark.parametrize("window, count, match", [
    ([[1, 2], [3]], 2, "equal length"),
    ([[], []], 2, "non-empty"),
    ([], 0, "non-empty"),
    ([[1]], 2, "one token list per row"),
])
def test_check_window_refuses_ragged_empty_or_miscounted_windows(window, count, match):
    with pytest.raises(ValueError, match=match):
        check_window(window, count)


def test_check_accepted_keeps_each_row_inside_its_verified_window():
    context = RoundContext(window=[[1, 2, 3], [4, 5, 6]], hidden=None)
    check_accepted([0, 2], 2, context)
    with pytest.raises(ValueError, match="row 1: 3 accepted of a window of 3"):
        check_accepted([0, 3], 2, context)
    with pytest.raises(ValueError, match="row 0: -1 accepted"):
        check_accepted([-1, 0], 2, context)
    with pytest.raises(ValueError, match="one accepted count per row"):
        check_accepted([0], 2, context)


def test_float_and_quantized_rows_share_one_set_of_round_mechanics():
    shared = ("prefill", "rollback", "filter_rows", "donors", "materialize", "dispose")
    for name in (*shared, "prepare_append"):
        assert getattr(TargetRows, name) is getattr(BatchRows, name), name
    for name in shared:  # PhaseRows.prepare_append only adds its KV-layout check before BatchRows'
        assert getattr(PhaseRows, name) is getattr(BatchRows, name), name


def test_the_runtime_no_longer_ships_the_per_row_reference():
    assert not hasattr(quantized_rows, "PerRowQuantizedTargetRows")
    from spec_cache.apps.bench.quantized_baseline import PerRowQuantizedTargetRows

    assert PerRowQuantizedTargetRows.__module__ == "spec_cache.apps.bench.quantized_baseline"

"""``tools/probe_writer_gil.py``: the write-behind GIL probe runs end to end on a small shape and reports its gaps
(what it measures is a timing, never asserted; that the checkpoints were written and the ticker ran is)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import probe_writer_gil  # noqa: E402


def test_a_small_probe_writes_its_checkpoints_and_reports_the_ticker_gaps(capsys):
    assert probe_writer_gil.main(["--layers", "2", "--tokens", "300", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["drained"] is True and result["checkpoints"] == 3 and len(result["save_on_caller_ms"]) == 3
    assert result["checkpoint_mib"] == pytest.approx(2 * 2 * 8 * 300 * 128 * 2 / 2**20, abs=0.1)
    assert result["wakeups"] >= 1 and result["gap_max_ms"] >= result["gap_p99_ms"] > 0


def test_a_shape_of_nothing_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        probe_writer_gil.main(["--tokens", "0"])
    assert stopped.value.code == 2 and "must be at least 1" in capsys.readouterr().err

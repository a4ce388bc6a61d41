"""``tools/bench_mlx_lm_server.report`` over a baseline that produced no tokens in a phase (mlx_lm.server's 8
restarted requests at 8 clients on the H100, 2cb2304, all came back empty): the report is written, with no ratio for
that phase and a warning, instead of a ZeroDivisionError that lost the whole client count's figures."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "gpu-runs" / "issue35-chat-c4-h100-2cb2304.json"


def test_a_baseline_with_no_tokens_gives_no_ratio_and_a_warning():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_mlx_lm_server as bench
    finally:
        sys.path.remove(str(ROOT / "tools"))
    section = json.loads(RUN.read_text())["clients"]["4"]
    results = copy.deepcopy(section["results"])
    empty = results["mlx-lm"]["after_restart"]
    empty.update(tokens=0, tokens_per_s=0.0, decode_requests=0)
    args = bench.parse(["--clients", "4", "--turns", "3"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rep = bench.report(results, ["mlx-lm", "serve"], args)
    assert math.isnan(rep["ratios"]["serve"]["tok/s after restart"])
    assert rep["ratios"]["serve"]["tok/s turns"] > 0
    assert "WARNING: mlx_lm.server produced no tokens after restart (8 requests)" in out.getvalue()
    figures = bench.figures(results, args)
    assert "serve_restart_ttft_c4" not in figures and figures["serve_tok_s_c4"] > 0


def test_empty_replies_count_in_no_ttft_and_the_figures_pair_the_requests_both_answered():
    """mlx_lm.server's two turn-8 agent replies came back empty on the H100 (df96b45) and their request times had
    counted as TTFTs: an empty reply is now ``failed`` in its summary, out of the percentiles, and the warm-turn
    figure compares only the requests both servers answered (a warning says so)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_mlx_lm_server as bench
    finally:
        sys.path.remove(str(ROOT / "tools"))

    def reply(ttft, tokens=8):
        return bench.Reply(ttft, "x" * tokens, 0, tokens, ttft + 1.0, 100)

    theirs = [reply(1.0), reply(2.0), reply(3.0), reply(9.0, tokens=0)]  # the last: an empty reply
    ours = [reply(0.5), reply(1.0), reply(1.5), reply(0.25)]
    summary = bench.summary(theirs, None)
    assert summary["failed"] == 1 and summary["n"] == 4
    assert summary["p50"] == 2.0  # 9.0 (the empty reply's request time) is no TTFT
    assert bench.answered(theirs) == [1.0, 2.0, 3.0, None]
    assert bench.paired_p50(bench.answered(theirs), bench.answered(ours)) == (2.0, 1.0, 1)

    def results(replies):
        first = [reply(5.0)] * len(replies)
        return {"turns": {1: bench.summary(first, None), 2: bench.summary(replies, None)},
                "all_turns": bench.summary(first + replies, 10.0), "warm_turns": bench.summary(replies, None),
                "after_restart": bench.summary(replies, 10.0), "texts": [[r.text] for r in replies],
                "texts_after_restart": [[r.text] for r in replies], "stages": {}, "stages_after_restart": {},
                "answered_warm": bench.answered(replies), "answered_after_restart": bench.answered(replies)}

    both = {"mlx-lm": results(theirs), "serve": results(ours)}
    args = bench.parse(["--clients", "4", "--turns", "2"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.report(both, ["mlx-lm", "serve"], args)
    assert "WARNING: mlx_lm.server produced no tokens on 1 of 4 requests" in out.getvalue()
    figures = bench.figures(both, args)
    # paired: 2.0 / 1.0 over the three requests both answered; unpaired it would read 2.0 / 0.75
    assert figures["serve_warm_ttft_c4"] == 2.0 and figures["serve_restart_ttft_c4"] == 2.0

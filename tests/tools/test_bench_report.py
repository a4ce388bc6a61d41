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

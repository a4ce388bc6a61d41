"""CI smoke test of the benchmarks: ``spec-cache bench --quick --json`` runs and prints one well-formed object.

Figures are not asserted (speed is for BENCHMARKS.md, never for tests); only that every section produced its
ratios, each a positive finite number, and that each goal is reported met or missed.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.server  # the write-amplification section drives a real server
@pytest.mark.slow
def test_quick_bench_runs_and_prints_json():
    run = subprocess.run([sys.executable, "-m", "spec_cache", "bench", "--quick", "--json"], capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["mode"] == "quick"
    for name in ("identity_vs_blake3", "identity_memo_ms", "put_vs_mlx_lm_save", "restore_vs_mlx_lm_load",
                 "lookup_growth", "dedup_bytes_ratio", "restore_vs_prefill_1k", "spec_batch_speedup",
                 "restored_vs_cold_decode", "memory_restore_vs_mlx_lm_load", "checkpoint_write_overhead",
                 "write_amplification"):
        value = result["figures"][name]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, name
    assert all(isinstance(g["met"], bool) for g in result["goals"].values())
    assert {"cpu", "cores", "blas", "mlx"} <= set(result["machine"])
    amp = result["details"]["write_amp"]  # a real server wrote each turn, and each later turn restored the earlier
    assert len(amp["bytes_written_per_turn"]) == amp["turns"] and all(b > 0 for b in amp["bytes_written_per_turn"])
    assert all(later > earlier for earlier, later in zip(amp["cached_tokens_per_turn"],
                                                          amp["cached_tokens_per_turn"][1:]))


def test_default_drafting_plan_keeps_every_cell_and_fits_the_2_core_vm():
    """Issue 39: ``spec-cache bench --only drafting`` ran past 25 minutes on the 2-core VM (q4 beside float32, three
    fixed-depth rounds per drafter): the default plan keeps every cell (chat, copy and random text x ngram and the
    draft model), each adaptive figure a median of 3 rounds between plain runs of 3 rows x 96 tokens, and runs the
    fixed depth (a reference column) once, in the copy cell (its ``*_fixed`` figures); q4 is opt-in; a time budget
    bounds the rounds after each cell's first. The plan's shape, never a wall-clock time."""
    from spec_cache.apps.bench import FULL, drafting

    cfg = FULL["drafting"]
    shape = drafting.plan(**cfg)
    assert shape["cells"] == ["float32 chat", "float32 copy", "float32 random"]
    assert shape["drafters"] == ["ngram", "draft-model"]
    assert (shape["rows"], shape["new_tokens"], shape["repeats"], shape["fixed_repeats"]) == (3, 96, 3, 1)
    assert shape["fixed_cells"] == ["float32 copy"]
    assert shape["decode_runs"] == 3 * (4 + 2 * 3) + 2  # per cell: 4 plain, 3 adaptive per drafter; 2 fixed in copy
    assert 0 < cfg["budget_s"] <= 540  # later rounds fit it (a loaded VM: 659 s with the fixed depth in every cell)
    full = drafting.plan(**{**cfg, "variants": ["float32", "q4"], "fixed_repeats": None, "fixed_workloads": None})
    assert full["cells"][:2] == ["float32 chat", "q4 chat"] and full["decode_runs"] == 4 * (4 + 2 * 6)


def test_drafting_bench_runs_the_fixed_depth_in_fewer_rounds_or_none():
    from spec_cache.apps.bench import drafting

    lines = []
    once = drafting.run(rows=1, new_tokens=4, tiny=True, drafters=("ngram",), random_text=False, repeats=3,
                        fixed_repeats=1, progress=lines.append)
    block = once["tiny"]["ngram"]
    assert len(block["adaptive_vs_plain_cpu_runs"]) == 3 and len(block["fixed_vs_plain_cpu_runs"]) == 1
    assert "drafting_copy_ngram_fixed" in once
    assert lines[0].startswith("drafting bench: 2 cells")
    assert sum(" round " in line for line in lines) == 2 * (3 + 3 + 1)  # per cell: 3 adaptive, 1 fixed, 3 plain
    never = drafting.run(rows=1, new_tokens=4, tiny=True, drafters=("ngram",), random_text=False, repeats=2,
                         fixed_repeats=0, progress=None)
    assert "fixed_vs_plain_cpu" not in never["tiny"]["ngram"] and "drafting_copy_ngram_fixed" not in never
    assert never["drafting_vs_plain_worst"] == min(never["drafting_vs_plain_ngram"], never["drafting_copy_ngram"])


def test_drafting_budget_shares_what_is_left_among_the_cells_and_keeps_every_first_round():
    """Issue 39: a time budget the drafting bench respects and reports (a fake clock: never a wall-clock time)."""
    from spec_cache.apps.bench import drafting

    assert drafting.cell_deadline(0.0, None, 5.0, 3) is None
    assert drafting.cell_deadline(0.0, 100.0, 10.0, 3) == 40.0  # 90 s left over 3 cells
    assert drafting.cell_deadline(0.0, 100.0, 130.0, 2) == 130.0  # over budget: no round after the first
    assert drafting.next_round_fits([], 999.0, 0.0)  # a cell's first round always runs
    assert drafting.next_round_fits([30.0, 20.0], 60.0, 80.0) and not drafting.next_round_fits([30.0, 20.0], 61.0, 80.0)
    assert drafting.next_round_fits([30.0], 1e9, None)

    ticks = iter(range(0, 10**6, 100))  # every reading of the clock 100 s after the last
    lines = []
    out = drafting.run(rows=1, new_tokens=4, tiny=True, drafters=("ngram",), random_text=False, repeats=3,
                       fixed_repeats=0, budget_s=50.0, clock=lambda: float(next(ticks)), progress=lines.append)
    assert out["plan"]["repeats"] == 3 and out["plan"]["cells"] == ["tiny chat", "tiny copy"]
    assert out["rounds_run"] == {"tiny chat": 1, "tiny copy": 1} and out["budget_cut"] == ["tiny chat", "tiny copy"]
    assert len(out["tiny"]["ngram"]["adaptive_vs_plain_cpu_runs"]) == 1 and out["tiny"]["rounds"] == 1
    assert {"drafting_vs_plain_ngram", "drafting_copy_ngram", "drafting_vs_plain_worst"} <= set(out)
    assert sum("time budget: 1 of 3 rounds" in line for line in lines) == 2
    free = drafting.run(rows=1, new_tokens=4, tiny=True, drafters=("ngram",), random_text=False, repeats=2,
                        fixed_repeats=1, fixed_workloads=("copy",), progress=None)
    assert free["rounds_run"] == {"tiny chat": 2, "tiny copy": 2} and free["budget_cut"] == []
    assert free["budget_s"] is None and free["plan"]["fixed_cells"] == ["tiny copy"]
    assert "fixed_vs_plain_cpu" not in free["tiny"]["ngram"] and "drafting_copy_ngram_fixed" in free


def test_bench_json_goes_to_a_path_and_holds_the_finished_sections_when_one_fails(tmp_path, monkeypatch):
    import spec_cache.apps.bench as bench

    def fine(cfg, log):
        return {"ran": True}, {"fine_figure": 1.5}

    def broken(cfg, log):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "_SECTIONS", {"identity": fine, "store_io": broken})
    monkeypatch.setattr(bench, "machine", lambda: {"cpu": "test"})
    path = tmp_path / "out.json"
    assert bench.main(["--only", "identity", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["figures"] == {"fine_figure": 1.5}
    with pytest.raises(RuntimeError, match="boom"):
        bench.main(["--only", "identity", "store_io", "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["details"] == {"identity": {"ran": True}} and written["error"] == "RuntimeError: boom"

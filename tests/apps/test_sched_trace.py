"""``SPEC_CACHE_SCHED_TRACE``: the scheduler's opt-in JSON-lines trace (``spec_cache.apps.server.trace``)."""

from __future__ import annotations

import json

import pytest

from tests.apps.test_server import Server, stopped, user, words


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("trace-model") / "tiny", seed=7)


def test_trace_records_steps_and_first_tokens(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_SCHED_TRACE", str(tmp_path / "trace"))
    srv = Server(tiny_model, tmp_path / "store", tmp_path)
    try:
        client = srv.client()
        for n in (20, 40):
            client.chat.completions.create(model="tiny", messages=[user(words(10, n))], max_tokens=4, temperature=0)
    finally:
        stopped(srv)
    files = list(tmp_path.glob("trace.*.jsonl"))
    assert len(files) == 1, files
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    firsts = [x for x in lines if x.get("first")]
    steps = [x for x in lines if "step_ms" in x]
    assert len(firsts) >= 2 and all(x["ttft_ms"] >= x["queue_ms"] >= 0 for x in firsts)
    assert any(x["prompt"] > 40 for x in firsts)
    assert sum(x["adm"] for x in steps) >= 2 and all(x["step_ms"] >= 0 and "wq" in x for x in steps)
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
    # the first line places the trace on the wall clock (a kernel cache's file times: trace_summary --compiles)
    assert set(lines[0]) == {"began_unix", "t"} and lines[0]["t"] == 0.0
    assert abs(lines[0]["began_unix"] - files[0].stat().st_mtime) < 120
    # a step's parts (issue 35: where a 216 ms step went could not be told from its total) and the device memory
    stepped = [x for x in steps if "parts" in x]
    assert stepped and all({"prefill", "round", "retire", "snapshots"} <= set(x["parts"]) for x in stepped)
    # the four phases of a step add up to at most its time; ``read`` (a pipelined round's wait for its tokens) is a
    # part of ``round``
    phases = ("prefill", "round", "retire", "snapshots")
    assert all(sum(x["parts"][k] for k in phases) <= x["step_ms"] + 0.1 for x in stepped)
    assert all(x["parts"].get("read", 0) <= x["parts"]["round"] + 0.01 for x in stepped)
    assert all(v >= 0 for x in stepped for v in x["parts"].values())
    assert all(x["mem"] >= 0 and x["mcache"] >= 0 for x in steps)
    # where a step's checkpoints went (``SpecCache.save_seconds``): within ``ck_ms``, in an iteration that saved
    saving = [x for x in steps if "ck_parts" in x]
    assert saving and all(set(x["ck_parts"]) == {"capture", "estimate", "memory", "queue"} for x in saving)
    assert all(0 <= sum(x["ck_parts"].values()) <= x["ck_ms"] + 0.1 for x in saving)
    # a first token's line says how long its HTTP request took to reach the queue (reading, rendering, tokenizing)
    assert all(x["http_ms"] >= 0 for x in firsts) and all("http_ms" in x for x in firsts if x["prompt"] > 40)


def test_no_trace_by_default(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("SPEC_CACHE_SCHED_TRACE", raising=False)
    srv = Server(tiny_model, tmp_path / "store", tmp_path)
    try:
        srv.client().chat.completions.create(model="tiny", messages=[user("w1 w2")], max_tokens=2, temperature=0)
    finally:
        stopped(srv)
    assert not list(tmp_path.glob("*.jsonl"))


def test_trace_summary_places_kernel_compiles_in_the_slow_steps(tmp_path, capsys):
    """``tools/diag/trace_summary.py --compiles``: a kernel file written while a slow step ran is named beside it;
    one written outside every slow step is counted for the process and named nowhere."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "diag"))
    try:
        import trace_summary
    finally:
        sys.path.pop(0)
    began = 1_000_000.0
    trace = tmp_path / "trace.42.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in (
        {"began_unix": began, "t": 0.0},
        {"step_ms": 20.0, "t": 1.0, "parts": {"round": 20.0}},
        {"step_ms": 900.0, "t": 3.0, "parts": {"round": 898.0}},  # ran from t 2.1 to 3.0
        {"step_ms": 21.0, "t": 5.0, "parts": {"round": 21.0}})) + "\n")
    compiles = tmp_path / "ptx-compiles.txt"
    compiles.write_text(f"{began + 2.5} 4096 /tmp/mlx/0.32.4/ptx/gather_bf16_3d.ptx\n"
                        f"{began + 4.0} 2048 /tmp/mlx/0.32.4/ptx/other.ptx\nnot a line\n")
    assert trace_summary.main([str(trace), "--compiles", str(compiles)]) == 0
    out = capsys.readouterr().out
    assert "kernels compiled 2" in out
    assert "slow step t=3.0 900.0 ms" in out and "compiled ['gather_bf16_3d.ptx']" in out
    assert "other.ptx" not in out
    assert trace_summary.main([str(trace), "--compiles", str(tmp_path / "missing.txt")]) == 2

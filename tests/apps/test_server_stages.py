"""Where a request's time goes: ``spec_cache_stage_seconds`` on ``/metrics`` (the serving issue's stage breakdown),
read the way ``tools/bench_serve.py`` reads it, against a real ``spec-cache serve`` process."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.apps.test_server import Server

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import bench_mlx_lm_server as bench  # noqa: E402

STAGES = ("queue", "restore", "prefill", "round", "checkpoint", "stream")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    root = tmp_path_factory.mktemp("stages")
    srv = Server(write_tiny_target(root / "tiny", seed=3), root / "store", root, keys=(), operator=None)
    yield srv
    srv.stop()


def chat(srv, messages, max_tokens=6) -> dict:
    reply = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_every_stage_is_observed_once_per_request_and_per_round(served):
    before = bench.stage_totals(served.port)
    assert set(STAGES) <= set(before)  # every series exists before any request
    first = [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8"}]
    answer = chat(served, first)["choices"][0]["message"]["content"]
    second = chat(served, first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "w9 w3"}])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the second turn restored the first
    got = bench.stage_breakdown(before, bench.stage_totals(served.port))
    assert got["queue"]["count"] == 2 and got["prefill"]["count"] == 2  # per client request (no side rows)
    assert got["restore"]["count"] >= 2  # a request restored once per prefill phase
    assert got["round"]["count"] >= 2 * 5  # one per engine round: at least the decode rounds of 6 tokens each
    assert got["stream"]["count"] >= got["prefill"]["count"]  # one per token event
    assert got["checkpoint"]["count"] >= 1  # the first turn's prompt and finish checkpoints were written
    for stage in STAGES:
        assert got[stage]["total_s"] >= 0 and got[stage]["mean_ms"] >= 0


def test_the_bench_reads_nothing_from_a_server_without_stages(served):
    assert bench.stage_breakdown({}, {}) == {}
    assert bench.figures({"serve": {}}, type("A", (), {"clients": 1, "paired": False})()) == {}  # no baseline

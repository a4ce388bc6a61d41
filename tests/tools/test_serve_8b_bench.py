"""Issue 27's GPU serving recipe on the CPU: ``tools/device/serve_8b_model.py`` writes a (tiny-shaped) model with a
given tokenizer, and ``tools/device/serve_8b_bench.py`` runs mlx_lm.server, ``spec-cache serve`` and the launcher
on it as real server processes into one JSON with the issue's figure keys; a second call resumes from the state
(finished units are not run again), a fresh machine from the JSON an earlier call returned, and a call out of time
records its units as skipped, keeping what finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_SHAPE = {"LAYERS": "2", "HIDDEN": "64", "HEADS": "4", "KV_HEADS": "2", "HEAD_DIM": "16", "INTER": "128",
              "VOCAB": "256"}


def run(script: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    got = subprocess.run([sys.executable, str(ROOT / "tools" / "device" / script), *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, **(env or {})))
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    return got


def test_recipe_writes_the_issue_keys_and_resumes(tmp_path):
    from spec_cache.testing.tiny import write_tiny_target

    tok = write_tiny_target(tmp_path / "tiny")  # its WordLevel tokenizer and chat template stand in for SmolLM2's
    model = tmp_path / "model"
    run("serve_8b_model.py", "--tok", str(tok), "--out", str(model), env=TINY_SHAPE)
    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 256)
    assert config["torch_dtype"] == "bfloat16" and (model / "tokenizer.json").exists()
    again = run("serve_8b_model.py", "--tok", str(tok), "--out", str(model), env=TINY_SHAPE)
    assert "already there" in again.stdout

    out = tmp_path / "out.json"
    common = ["--model", str(model), "--work", str(tmp_path / "work"), "--json", str(out), "--conversations", "1",
              "--turns", "2", "--system-words", "12", "--user-words", "4", "--max-tokens", "3",
              "--serve-args", "--warmup off"]
    run("serve_8b_bench.py", *common, "--clients", "1")
    data = json.loads(out.read_text())
    for ours in ("serve", "launcher"):
        for metric in ("warm_ttft", "tok_s", "restart_ttft"):
            assert data["figures"][f"gpu_{ours}_{metric}_c1"] > 0
        same = data["identical_replies"][f"{ours}_c1"]
        assert same["total"] == 2 and same["after_restart"]["total"] == 1
    section = data["clients"]["1"]
    assert section["servers"] == ["mlx-lm", "serve", "spec-cache"]
    for kind in section["servers"]:
        phases = section["ttft_ms"][kind]
        assert set(phases) == {"turn 1", "turn 2", "warm turns", "after restart"}
        assert all(phases[p]["p50"] <= phases[p]["p99"] for p in phases)
        assert section["decode_tok_s"][kind]["turns"]["n"] == 2  # 3 tokens per reply: a rate for each
    assert {"queue", "prefill", "round"} <= set(section["stages"]["serve"])
    assert "mlx-lm" not in section["stages"]

    # the same call again: every unit is done, nothing is started, the figures stay
    second = run("serve_8b_bench.py", *common, "--clients", "1", "--deadline-at", str(time.time() + 600))
    assert ": start (" not in second.stdout and "c1 mlx-lm: done" not in second.stdout
    assert json.loads(out.read_text())["figures"] == data["figures"]

    # a fresh machine (empty work directory) resumes from the JSON an earlier call returned
    moved = tmp_path / "returned.json"
    moved.write_text(out.read_text())
    fresh = [a if a != str(tmp_path / "work") else str(tmp_path / "work2") for a in common]
    third = run("serve_8b_bench.py", *fresh, "--clients", "1", "--resume-from", str(moved))
    assert ": start (" not in third.stdout and "resume: 3 finished units" in third.stdout
    assert json.loads(out.read_text())["figures"] == data["figures"]

    # out of time for 2 clients: recorded as skipped, 1 client's figures kept
    run("serve_8b_bench.py", *common, "--clients", "1 2", "--deadline-at", str(time.time() + 1))
    late = json.loads(out.read_text())
    assert late["figures"] == data["figures"]
    assert {u["status"] for u in late["clients"]["2"]["units"].values()} == {"skipped"}

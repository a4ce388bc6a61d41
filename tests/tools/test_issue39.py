"""Issue 39's GPU run (item 4) on the CPU: ``tools/device/issue39.sh`` with ``INSTALL=0`` (no wheels, no parts; the
symlink farm) runs its drafting and train parts whole on a tiny model with tiny shapes, and each part's summary
carries the issue's figure keys at every B run; the summary's key names and goals are checked on made-up bench
outputs at the GPU's shapes (4k / 16k, B = 1 / 4).

What must hold for the next session's few calls on the lent GPU: a part writes ``issue39-<part>.json`` and its log
into ``$OUT`` with no error, the drafting bench's and mlx-lm's rates land under one name per workload and B, the
trained head's held-out acceptance and its decode figures are there, and the training prompts keep the bundled
8 held-out prompts last (``--holdout 8``) and out of the training set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "device"))

import issue39  # noqa: E402

ROWS = [1, 4]


def _bench(variant: str = "q4") -> dict:
    block = {"plain_tok_s": 100.0}
    for name in ("ngram", "draft-model"):
        block[name] = {"adaptive_vs_plain": 1.1, "adaptive_tok_s": 110.0, "adaptive_acceptance": "5/9"}
    copy = json.loads(json.dumps(block))
    copy["ngram"].update(fixed_vs_plain=2.5, fixed_tok_s=250.0, fixed_acceptance="9/9", adaptive_vs_plain=2.1)
    return {"plan": {"cells": [f"{variant} chat", f"{variant} copy", f"{variant} random"],
                     "drafters": ["ngram", "draft-model"]},
            variant: block, "copy": copy, "random": block, "drafting_vs_plain_worst": 0.97}


def test_the_summaries_name_the_issues_figures_and_goals(tmp_path):
    bench = {"figures": {"gpu_8b_lmdb_vs_cold_4k": 4.5, "gpu_8b_lmdb_vs_cold_16k": 6.0,
                         "gpu_8b_next_turn_lmdb_vs_memory_4k": 0.9}, "errors": {}, "skipped": {},
             "results": {"limits": {"memcpy_1_GBps": 10.0}}}
    (tmp_path / "bench-gpu.json").write_text(json.dumps(bench))
    tiers = issue39.summary("tiers", tmp_path, ROWS)
    assert tiers["goals"]["gpu_8b_lmdb_vs_cold_4k"]["met"] and not tiers["goals"]["gpu_8b_lmdb_vs_cold_16k"]["met"]
    assert "gpu_8b_lmdb_vs_mlx_lm_load_forward_4k" not in tiers["goals"]  # not measured: no verdict
    assert tiers["bounds"] == {"memcpy_1_GBps": 10.0}

    for b in ROWS:
        (tmp_path / f"drafting-b{b}.json").write_text(json.dumps(_bench()))
        (tmp_path / f"mlx-lm-b{b}.json").write_text(json.dumps({w: {"tok_s": 50.0} for w in issue39.WORKLOADS}))
    drafting = issue39.summary("drafting", tmp_path, ROWS)
    figures = drafting["figures"]
    for b in ROWS:
        for workload in issue39.WORKLOADS:
            assert figures[f"gpu_drafting_{workload}_plain_vs_mlx_lm_b{b}"] == 2.0
            assert figures[f"gpu_drafting_{workload}_draft_model_adaptive_vs_mlx_lm_b{b}"] == 2.2
        assert figures[f"gpu_drafting_copy_ngram_fixed_vs_plain_b{b}"] == 2.5
        assert drafting["goals"][f"gpu_drafting_copy_ngram_adaptive_vs_plain_b{b}"]["met"]
        assert drafting["goals"][f"gpu_drafting_vs_plain_worst_b{b}"]["met"]
    assert json.loads((tmp_path / "issue39-drafting.json").read_text())["figures"] == figures

    (tmp_path / "train.json").write_text(json.dumps({"steps": 1500, "pairs": 9000, "heldout": {
        "trained": {"acceptance": 0.42, "tokens_per_round": 2.1}, "untrained": {"acceptance": 0.0}}}))
    (tmp_path / "trained-b1.json").write_text(json.dumps({k: {"vs_plain": 1.6, "acceptance": "8/9"}
                                                          for k in ("adaptive", "fixed")}))
    train = issue39.summary("train", tmp_path, ROWS)
    assert train["figures"]["gpu_trained_head_heldout_acceptance_d3"] == 0.42
    assert not train["goals"]["gpu_trained_head_heldout_acceptance_d3"]["met"]
    assert train["goals"]["gpu_trained_head_chat_adaptive_vs_plain_b1"]["met"]
    assert train["missing"] == ["trained-b4.json"]


def test_the_training_prompts_hold_out_the_bundled_eight_last():
    from spec_cache.apps.train_drafter import bundled_prompts

    train, heldout = bundled_prompts()
    texts = issue39.train_prompts(240, tiny=False)
    assert texts[-8:] == heldout and texts[:len(train)] == train
    assert len(texts) == len(train) + 240 + 8 and not set(texts[:-8]) & set(heldout)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The drafting part, then the train part, of the script on the tiny model, as its header's CPU checks."""
    tmp = tmp_path_factory.mktemp("issue39")
    env = dict(os.environ, INSTALL="0", PY=sys.executable, OUT=str(tmp / "out"), WORK=str(tmp / "work"),
               SC=str(tmp / "sc"), MODEL="tiny", ROWS="1 2", NEW_TOKENS="4", REPEATS="1", REPS="1", KERNEL_WARMUP="0",
               STEPS="12", BATCH="4", SEQ_LEN="16", GEN_TOKENS="10", SAMPLES="1", EXTRA="0", EVAL_TOKENS="6",
               DEADLINE="400")
    done = {}
    for part in ("drafting", "train"):
        done[part] = subprocess.run(["bash", "tools/device/issue39.sh"], cwd=ROOT, env=dict(env, PART=part),
                                    capture_output=True, text=True, timeout=500)
    return tmp / "out", done


def test_the_drafting_part_runs_whole_on_a_tiny_model(parts):
    out, done = parts
    p = done["drafting"]
    assert p.returncode == 0 and "PART=drafting exit 0" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((out / "issue39-drafting.json").read_text())
    assert result["missing"] == []
    for b in (1, 2):
        for workload in issue39.WORKLOADS:
            assert result["figures"][f"gpu_drafting_{workload}_plain_vs_mlx_lm_b{b}"] > 0
            assert result["figures"][f"gpu_drafting_{workload}_ngram_adaptive_vs_plain_b{b}"] > 0
        assert f"gpu_drafting_vs_plain_worst_b{b}" in result["goals"]
    assert (out / "issue39-drafting.log").read_text().count("--- B=") == 4


def test_the_train_part_trains_and_measures_the_head(parts):
    out, done = parts
    p = done["train"]
    assert p.returncode == 0 and "PART=train exit 0" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    figures = json.loads((out / "issue39-train.json").read_text())["figures"]
    assert figures["gpu_trained_head_steps"] == 12
    assert 0 <= figures["gpu_trained_head_heldout_acceptance_d3"] <= 1
    for b in (1, 2):
        assert figures[f"gpu_trained_head_chat_adaptive_vs_plain_b{b}"] > 0

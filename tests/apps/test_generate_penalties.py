"""``spec-cache generate --repetition-penalty R --repetition-context-size N`` (issue 36 item 4): the tokens equal
mlx-lm's ``generate_step`` with ``make_logits_processors(None, R, N)``, cold and restored from the store, drafting
with ngram; a penalty <= 0 is refused (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("generate-penalties") / "tiny", seed=7)


def generate(tmp: Path, target: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPEC_CACHE_IDENTITY_DIR=str(tmp / "identity-memo"), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "spec_cache", "--cache", str(tmp / "store"), "--json", "generate", "--model",
            str(target), "--drafter", "ngram", "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", "16", *extra]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_generate_applies_the_repetition_penalty_as_mlx_lm(target, tmp_path):
    from mlx_lm import load

    model, _ = load(str(target))
    for penalty, context in (("1.8", "20"), ("2.5", "4")):
        want = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=16,
                                            logits_processors=make_logits_processors(None, float(penalty),
                                                                                      int(context)))]
        for _ in ("cold", "restored"):
            done = generate(tmp_path, target, "--repetition-penalty", penalty, "--repetition-context-size", context)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["results"][0]["tokens"] == want
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=16)]
    assert json.loads(generate(tmp_path, target).stdout)["results"][0]["tokens"] == plain != want
    refused = generate(tmp_path, target, "--repetition-penalty", "0")
    assert refused.returncode == 2 and "--repetition-penalty" in refused.stderr

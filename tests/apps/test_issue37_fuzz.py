"""Every generating route answers the API's JSON for any body (issue 37 item 6): a lone surrogate in
``cache_salt`` or in a prompt, and a deeply nested ``tool_calls`` arguments string, were plain-text 500s. The known
cases are pinned below; a hypothesis fuzzer then posts generated JSON bodies (near-valid requests with hostile
field values, and arbitrary JSON) and raw byte bodies to ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/messages``: every answer is either a success (JSON, or a stream) or the route's error JSON with a 4xx status.
In-process (Starlette's TestClient) on the tiny llama target with its tokenizer and a real scheduler and cache; a
sampled temperature or top_p below its floor answers greedy's text (item 8, through the server)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's json decoder recurses


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer
    from starlette.testclient import TestClient

    from spec_cache.apps.server.app import ServerConfig, ServerState, create_app
    from spec_cache.apps.server.scheduler import Scheduler
    from spec_cache.decode.generator import Generator
    from spec_cache.testing.tiny import write_tiny_target
    from spec_cache.tiers.cache import SpecCache

    root = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPEC_CACHE_IDENTITY_DIR", str(root / "identity"))
        target = write_tiny_target(root / "tiny", seed=7)
        cache = SpecCache.open(root / "store")
        generator = Generator.load(target, None, cache=cache)
        tokenizer = load_tokenizer(target)
        config = ServerConfig("tiny", context_tokens=256, default_max_tokens=3)
        state = ServerState(generator=generator, tokenizer=tokenizer, config=config, cache=cache,
                            scheduler=Scheduler(generator, max_rows=4, max_queue=64,
                                                eos_token_ids=getattr(tokenizer, "eos_token_ids", None) or ()))
        # raise_server_exceptions=False: a route that lets an exception out shows as the response a client gets
        with TestClient(create_app(state), raise_server_exceptions=False) as test_client:
            yield test_client


def post(client, path: str, body) -> object:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" escapes
    return client.post(path, content=content, headers={"content-type": "application/json"})


def assert_api_answer(path: str, response, client_garbage: bool = True) -> None:
    """A success (JSON, or a server-sent stream), or the route's error JSON; 4xx when the body is the client's
    fault (``client_garbage``)."""
    kind = response.headers.get("content-type", "")
    if response.status_code == 200:
        assert kind.startswith(("application/json", "text/event-stream")), (kind, response.text[:200])
        if kind.startswith("application/json"):
            response.json()
        return
    assert kind.startswith("application/json"), (response.status_code, kind, response.text[:200])
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
        message = body["error"]["message"]
    else:
        assert isinstance(body["error"]["type"], str), body
        message = body["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message, body
    if client_garbage:
        assert 400 <= response.status_code < 500, (response.status_code, body)


def chat(**extra) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}], **extra}


KNOWN = [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": "\ud800"}),
    ("/v1/chat/completions", chat(cache_salt="salt \udfff")),
    ("/v1/completions", {"model": "tiny", "prompt": "hi \ud800 there", "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b \udc00"], "max_tokens": 2}),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x \ud83d"}])),
    ("/v1/messages", chat(messages=[{"role": "user", "content": "x \ud83d"}])),
    ("/v1/messages", chat(system="\udfff")),
    ("/v1/chat/completions", chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}])),
    ("/v1/chat/completions", chat(**{"\ud800": 1})),
]


@pytest.mark.parametrize("path,body", KNOWN, ids=[f"{i}:{p}" for i, (p, _) in enumerate(KNOWN)])
def test_known_plain_text_500s_are_json_400s(client, path, body):
    response = post(client, path, body)
    assert_api_answer(path, response)
    assert response.status_code == 400


def test_an_exception_a_route_lets_out_is_json(client, monkeypatch):
    """The catch-all: whatever a handler raises before its response starts is the API's JSON (500 for a bug,
    one line), never Starlette's plain text."""
    from spec_cache.apps.server import openai_routes

    def broken(*_args, **_kwargs):
        raise KeyError("a bug\nwith two lines")
    monkeypatch.setattr(openai_routes, "parse_completion", broken)
    response = post(client, "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert_api_answer("/v1/completions", response, client_garbage=False)
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"


# -- the fuzzer -------------------------------------------------------------------------------------------------
# Text mostly plain (so that bodies get past the first check and reach the tokenizer, the template, the scheduler),
# now and then hostile: a lone surrogate, NUL, template markers, nesting deeper than Python's json decoder.
PLAIN = st.text(max_size=12)
HOSTILE_TEXT = st.one_of(
    PLAIN, PLAIN, PLAIN, PLAIN,
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=5),
              st.sampled_from(["\ud800", "\udfff", "\ud83d", "\x00", "\u202e", "<|im_start|>", "{{", "%s", '"}']),
              st.text(max_size=5)),
    st.just(DEEP), st.just("{" * 3000), st.just('{"a":' * 3000),
)
NUMBERS = st.one_of(st.integers(-3, 300), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([1e-46, 1e-39, 5e-324, -0.0, 2**63, -(2**63), 10**100]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, HOSTILE_TEXT)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(HOSTILE_TEXT, inner, max_size=4)),
                        max_leaves=10)
ARGUMENTS = st.one_of(HOSTILE_TEXT, ANY_JSON, st.builds(json.dumps, ANY_JSON))
OPENAI_CALL = st.fixed_dictionaries({"id": st.one_of(st.just("c1"), SCALARS), "type": st.just("function"),
                                     "function": st.fixed_dictionaries({"name": st.one_of(st.just("f"), SCALARS),
                                                                        "arguments": ARGUMENTS})})
OPENAI_MESSAGES = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]), "content": HOSTILE_TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), HOSTILE_TEXT)},
                          optional={"tool_calls": st.one_of(st.lists(OPENAI_CALL, max_size=2), ANY_JSON)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": HOSTILE_TEXT,
                           "tool_call_id": st.one_of(st.just("c1"), SCALARS)}),
    st.fixed_dictionaries({"role": SCALARS, "content": ANY_JSON}),
), min_size=1, max_size=4)
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": HOSTILE_TEXT},
                          optional={"cache_control": st.one_of(st.just({"type": "ephemeral"}), ANY_JSON)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.one_of(st.just("t1"), SCALARS),
                           "name": st.one_of(st.just("f"), SCALARS), "input": ANY_JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.one_of(st.just("t1"), SCALARS),
                           "content": st.one_of(HOSTILE_TEXT, ANY_JSON)}),
    ANY_JSON)
ANTHROPIC_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system", 3]),
    "content": st.one_of(HOSTILE_TEXT, st.lists(ANTHROPIC_BLOCK, max_size=3))}), min_size=1, max_size=4)
TOOLS = st.one_of(ANY_JSON, st.lists(st.fixed_dictionaries({
    "type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.one_of(st.just("f"), HOSTILE_TEXT)}, optional={"description": SCALARS, "parameters": ANY_JSON})}),
    max_size=2), st.lists(st.fixed_dictionaries({"name": st.one_of(st.just("f"), HOSTILE_TEXT),
                                                 "input_schema": ANY_JSON}), max_size=2))
FIELDS = {  # each optional: a body gets a few of them (hostile ones too: a model, a max_tokens)
    "model": SCALARS, "max_tokens": st.one_of(st.integers(-1, 3), NUMBERS, SCALARS),
    "temperature": NUMBERS, "top_p": NUMBERS, "top_k": NUMBERS,
    "min_p": NUMBERS, "seed": NUMBERS, "n": st.one_of(st.integers(0, 3), NUMBERS),
    "stream": st.one_of(st.booleans(), st.booleans(), SCALARS),
    "stream_options": st.one_of(st.just({"include_usage": True}), ANY_JSON),
    "stop": st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_TEXT, max_size=3), SCALARS),
    "stop_sequences": st.one_of(st.lists(HOSTILE_TEXT, max_size=3), SCALARS),
    "cache_salt": st.one_of(HOSTILE_TEXT, SCALARS), "user": SCALARS, "system": st.one_of(HOSTILE_TEXT, ANY_JSON),
    "tools": TOOLS, "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), ANY_JSON),
    "metadata": ANY_JSON, "ignore_eos": st.one_of(st.booleans(), SCALARS),
}
PROMPTS = st.one_of(HOSTILE_TEXT, HOSTILE_TEXT, st.lists(st.integers(-5, 400), max_size=6),
                    st.lists(st.one_of(HOSTILE_TEXT, st.lists(st.integers(0, 300), max_size=3)), max_size=3),
                    ANY_JSON)


ANTHROPIC_FIELDS = ("stop_sequences", "stream", "system", "temperature", "tool_choice", "tools",
                    "top_k", "top_p", "metadata")
OPENAI_FIELDS = tuple(name for name in sorted(FIELDS) if name not in ("stop_sequences", "system", "metadata",
                                                                         "model", "max_tokens"))


def fields(required: dict, names: tuple[str, ...]) -> st.SearchStrategy:
    """A body: ``required`` (each value a strategy) plus up to a few fields: mostly of the route's own ``names``,
    now and then any of ``FIELDS`` (a field the route does not take)."""
    chosen = st.lists(st.sampled_from(names + tuple(sorted(FIELDS))[::4]), max_size=3, unique=True)
    return chosen.flatmap(lambda picked: st.fixed_dictionaries(
        {"model": st.just("tiny"), "max_tokens": st.integers(1, 3), **required,
         **{name: FIELDS[name] for name in picked}}))


BODIES = {
    "/v1/chat/completions": fields({"messages": st.one_of(OPENAI_MESSAGES, OPENAI_MESSAGES, ANY_JSON)},
                                   OPENAI_FIELDS),
    "/v1/completions": fields({"prompt": PROMPTS}, OPENAI_FIELDS),
    "/v1/messages": fields({"messages": st.one_of(ANTHROPIC_MESSAGES, ANTHROPIC_MESSAGES, ANY_JSON)},
                           ANTHROPIC_FIELDS),
}


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzzed_bodies_get_the_apis_json(client, data):
    path = data.draw(st.sampled_from(ROUTES), label="path")
    body = data.draw(st.one_of(BODIES[path], BODIES[path], BODIES[path], ANY_JSON, st.binary(max_size=64)),
                     label="body")
    assert_api_answer(path, post(client, path, body))


# -- item 8 through the server ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 1e-39}, {"temperature": 0.9, "top_p": 1e-46}],
                         ids=["temperature-1e-39", "top_p-1e-46"])
def test_sampling_below_the_floor_answers_greedys_text(client, sampling):
    body = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 8, "ignore_eos": True}
    greedy = post(client, "/v1/completions", {**body, "temperature": 0})
    degenerate = post(client, "/v1/completions", {**body, **sampling})
    assert greedy.status_code == degenerate.status_code == 200, degenerate.text
    assert degenerate.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]

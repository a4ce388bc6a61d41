"""Sampling penalties and ``logit_bias`` on a real ``spec-cache serve`` through the OpenAI SDK (issue 36 item 4:
they were refused with 400 while mlx_lm.server applies them): ``logit_bias`` +100 on a token makes every token that
one; ``repetition_penalty`` / ``frequency_penalty`` / ``presence_penalty`` give mlx-lm's own tokens
(``generate_step`` with ``make_logits_processors``, prompt included in the context, as mlx_lm.server); values out of
range are a 422 naming the parameter."""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from spec_cache.apps.server.protocol import UNSUPPORTED

pytestmark = [pytest.mark.server,  # spec-cache serve in a subprocess of its own
              pytest.mark.skipif("logit_bias" in UNSUPPORTED, reason="the server still refuses them: "
                                 "jobs.Requests.make_job does not pass params.processors yet")]

PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("penalties") / "tiny", seed=7)  # float32, word tokenizer


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    from tests.apps.test_server import Server

    tmp = tmp_path_factory.mktemp("penalties-serve")
    srv = Server(target, tmp / "store", tmp, "--drafter", "ngram", keys=("k-penalties",), operator=None)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(target):
    """mlx-lm's tokens for ``PROMPT`` with ``make_logits_processors(**kwargs)``, and its tokenizer."""
    from mlx_lm import load

    model, tokenizer = load(str(target))

    def tokens(**kwargs) -> list[int]:
        steps = generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS,
                              logits_processors=make_logits_processors(**kwargs))
        return [token for token, _ in steps]
    tokens.tokenizer = tokenizer
    return tokens


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="k-penalties", max_retries=0, timeout=120)


def complete(client, **kwargs) -> str:
    extra = kwargs.pop("extra_body", {})
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  extra_body={"ignore_eos": True, **extra}, **kwargs)
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


def test_a_logit_bias_of_100_makes_every_token_that_one(client, reference):
    text = complete(client, logit_bias={"42": 100})
    assert text == reference.tokenizer.decode([42] * MAX_TOKENS)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}],
                                          max_tokens=6, logit_bias={"43": 100}, temperature=0.9, seed=3)
    assert chat.choices[0].message.content == reference.tokenizer.decode([43] * 6)
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w6"}],
                                              max_tokens=4, logit_bias={"44": 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        reference.tokenizer.decode([44] * 4)


@pytest.mark.parametrize("case", ["repetition", "repetition-context", "frequency", "presence", "combined", "bias"])
def test_penalties_give_mlx_lm_tokens(client, reference, case):
    request, mlx_lm = {
        "repetition": ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
        "repetition-context": ({"extra_body": {"repetition_penalty": 2.5, "repetition_context_size": 4}},
                               {"repetition_penalty": 2.5, "repetition_context_size": 4}),
        "frequency": ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
        "presence": ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        "combined": ({"frequency_penalty": 0.5, "presence_penalty": 0.7, "logit_bias": {"9": 2.5},
                      "extra_body": {"repetition_penalty": 1.3, "presence_context_size": 12}},
                     {"frequency_penalty": 0.5, "presence_penalty": 0.7, "presence_context_size": 12,
                      "logit_bias": {9: 2.5}, "repetition_penalty": 1.3}),
        "bias": ({"logit_bias": {"12": 3.0, "13": -5}}, {"logit_bias": {12: 3.0, 13: -5.0}}),
    }[case]
    want = reference(**mlx_lm)
    assert want != reference()  # these values do change the greedy tokens
    text = complete(client, **request)
    assert text == reference.tokenizer.decode(want)
    assert complete(client, **request) == text  # again: the continuation record / the prefix restored


def test_neutral_values_are_served_and_change_nothing(client, reference):
    plain = complete(client)
    assert plain == reference.tokenizer.decode(reference())
    assert complete(client, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                    extra_body={"repetition_penalty": 0, "repetition_context_size": 20}) == plain
    assert complete(client, extra_body={"repetition_penalty": 1.0}) == plain


@pytest.mark.parametrize("extra,param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"), ({"repetition_context_size": -1}, "repetition_context_size"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"256": 1}}, "logit_bias"), ({"logit_bias": {"w5": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_values_out_of_range_are_refused_with_422(server, route, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"prompt": "w5 w6"} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "w5 w6"}]})
    r = httpx.post(server.url + route, headers=server.headers(), json=body, timeout=60)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize("extra,param", [
    ({"frequency_penalty": "1"}, "frequency_penalty"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"), ({"repetition_penalty": True}, "repetition_penalty"),
])
def test_values_of_the_wrong_type_are_refused_with_400(server, extra, param):
    body = {"model": "tiny", "max_tokens": 2, "prompt": "w5 w6", **extra}
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param

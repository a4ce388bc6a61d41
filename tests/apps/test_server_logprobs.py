"""``logprobs`` / ``top_logprobs`` / ``echo`` on a real ``spec-cache serve`` (tiny target + assistant drafter), driven
with the official ``openai`` client and raw HTTP: every logprob equals mlx-lm's (``generate_step``'s for generated
tokens, a direct forward's log-softmax for echoed prompt tokens), streamed or not, batched, on a prompt the cache
holds; out-of-range values are refused with 422; ``/v1/messages`` answers as before."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.apps.test_server import EOS, Server, stopped

openai = pytest.importorskip("openai")

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    root = tmp_path_factory.mktemp("serve-logprobs")
    target = write_tiny_target(root / "tiny", seed=7)
    drafter = write_tiny_drafter(root / "assistant", "assistant", target, seed=7)
    return target, drafter


@pytest.fixture(scope="module")
def reference(model):
    """(tokenizer, steps(prompt ids, n) -> [(token, logprobs list)] from generate_step, forward(ids) -> rows of
    log_softmax)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_tokenizer

    from spec_cache.rows.target import TargetModel

    target = TargetModel.load(model[0])

    def steps(prompt, max_tokens):
        out = []
        for token, logprobs in generate_step(mx.array(prompt), target.model, max_tokens=max_tokens):
            out.append((int(token), logprobs.astype(mx.float32).tolist()))
            if out[-1][0] == EOS:
                break
        return out

    def forward(ids):
        logits = target.model(mx.array(ids)[None])[0].astype(mx.float32)
        return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()

    return load_tokenizer(model[0]), steps, forward


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    srv = Server(model[0], tmp / "store", tmp, drafter=model[1])
    yield srv
    stopped(srv)


def chat_prompt(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True))


def token_text(tokenizer, token):
    return tokenizer.decode([token], skip_special_tokens=False)


def check_top(top, distribution, tokenizer, count):
    """``top``: [(token text, logprob)] most likely first; they are the ``count`` best of ``distribution``."""
    assert len(top) == count
    best = sorted(range(len(distribution)), key=lambda t: -distribution[t])[:count]
    for (text, logprob), token in zip(top, best):
        assert abs(logprob - distribution[token]) < TOL
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_chat_logprobs_and_top_logprobs_equal_generate_step(server, reference):
    tokenizer, steps, _ = reference
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w12"}],
                                           max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    want = steps(chat_prompt(tokenizer, "w5 w9 w12"), 10)
    assert len(want) == reply.usage.completion_tokens
    want = [(t, d) for t, d in want if t != EOS]  # the stop token has no text and no entry, as in OpenAI's API
    content = reply.choices[0].logprobs.content
    assert len(content) == len(want)
    for entry, (token, distribution) in zip(content, want):
        assert entry.token == token_text(tokenizer, token)
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - distribution[token]) < TOL
        check_top([(t.token, t.logprob) for t in entry.top_logprobs], distribution, tokenizer, 3)
    # streamed: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w12"}],
                                                 max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # logprobs without top_logprobs: no alternatives; without logprobs: null, as before
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w12"}],
                                           max_tokens=10, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[] for _ in content]
    assert [e.logprob for e in plain.choices[0].logprobs.content] == [e.logprob for e in content]
    off = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w12"}],
                                         max_tokens=10, temperature=0)
    assert off.choices[0].logprobs is None
    assert off.choices[0].message.content == reply.choices[0].message.content


def test_completions_logprobs_legacy_shape_streamed_too(server, reference):
    tokenizer, steps, _ = reference
    client = server.client()
    prompt = "w7 w8 w9 w10"
    ids = [int(t) for t in tokenizer.encode(prompt)]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    want = steps(ids, 8)
    lp = reply.choices[0].logprobs
    assert lp.tokens == [token_text(tokenizer, t) for t, _ in want]
    for token, logprob, top, (t, distribution) in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, want):
        assert abs(logprob - distribution[t]) < TOL
        assert top[token] == logprob  # the chosen token is always among the alternatives
        best = sorted(distribution, reverse=True)[:2]
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best, abs=TOL)
    text = reply.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and all(0 <= o <= len(text) for o in lp.text_offset)
    stream = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                            stream=True))
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in stream if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens and values == lp.token_logprobs
    assert "".join(c.choices[0].text for c in stream if c.choices) == text


def test_echo_max_tokens_0_is_lm_evals_loglikelihood(server, reference):
    """lm-eval's ``local-completions`` loglikelihood: a list of prompts, ``echo: true, logprobs: 1, max_tokens: 0``
    (or 1), temperature 0. Each prompt token's logprob equals a direct forward's; the first is null. Asked again
    (the prompts and their scores are in the cache now), the same numbers, bit for bit, from restored prompts."""
    tokenizer, steps, forward = reference
    client = server.client()
    prompts = ["w20 w21 w22 w23 w24 w25", "w20 w21 w22 w30"]
    answers = []
    for attempt in range(2):
        reply = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                          temperature=0)
        assert reply.usage.completion_tokens == 0
        answers.append([(c.index, c.text, c.logprobs.model_dump()) for c in reply.choices])
        if attempt:  # each prompt restored but its last token (its scores were kept by the first attempt)
            assert answers[1] == answers[0]
            restored = sum(len(tokenizer.encode(p)) - 1 for p in prompts)
            assert reply.usage.prompt_tokens_details.cached_tokens == restored
        for choice, prompt in zip(sorted(reply.choices, key=lambda c: c.index), prompts):
            ids = [int(t) for t in tokenizer.encode(prompt)]
            rows = forward(ids)
            lp = choice.logprobs
            assert choice.text == tokenizer.decode(ids, skip_special_tokens=False)
            assert lp.tokens == [token_text(tokenizer, t) for t in ids]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert len(lp.token_logprobs) == len(ids)
            for p in range(1, len(ids)):
                assert abs(lp.token_logprobs[p] - rows[p - 1][ids[p]]) < TOL
                assert max(lp.top_logprobs[p].values()) == pytest.approx(max(rows[p - 1]), abs=TOL)
            # each token's text starts at its offset (after the space the WordLevel decoder puts between words)
            assert all(choice.text[o:].lstrip().startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
            assert lp.text_offset == sorted(lp.text_offset)
    # max_tokens 1 (lm-eval's other form): the prompt's entries, then the generated token's
    ids = [int(t) for t in tokenizer.encode(prompts[0])]
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = reply.choices[0].logprobs
    (token, distribution), = steps(ids, 1)
    assert len(lp.token_logprobs) == len(ids) + 1
    assert abs(lp.token_logprobs[-1] - distribution[token]) < TOL
    assert abs(lp.token_logprobs[-2] - forward(ids)[-2][ids[-1]]) < TOL
    # echo without logprobs: the prompt's text first, no logprobs
    plain = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(prompts[1]) and plain.choices[0].logprobs is None


def test_refused_values_get_422_and_messages_are_unchanged(server):
    headers = server.headers()

    def post(path, body):
        return httpx.post(server.url + path, headers=headers, json=dict(model="tiny", **body), timeout=30)

    chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    for body, status in (
        (dict(chat, logprobs=True, top_logprobs=21), 422),
        (dict(chat, logprobs="yes"), 400),
        (dict(chat, top_logprobs=2), 400),  # top_logprobs needs logprobs: true
        ({"prompt": "w5", "max_tokens": 2, "logprobs": 6}, 422),
        ({"prompt": "w5", "max_tokens": 2, "logprobs": -1}, 422),
        ({"prompt": "w5", "max_tokens": 0}, 422),  # max_tokens 0 answers nothing without echo
        ({"prompt": "w5", "max_tokens": 2, "echo": "yes"}, 400),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        answer = post(path, body)
        assert answer.status_code == status, (body, answer.text)
        error = answer.json()["error"]
        assert error["message"] and "\n" not in error["message"]
    # the neutral values clients send by default are served
    assert post("/v1/chat/completions", dict(chat, logprobs=False, top_logprobs=0)).status_code == 200
    assert post("/v1/completions", {"prompt": "w5", "max_tokens": 2, "echo": False}).status_code == 200
    messages = httpx.post(server.url + "/v1/messages", headers=dict(headers, **{"anthropic-version": "2023-06-01"}),
                          json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "w5"}]},
                          timeout=30)
    assert messages.status_code == 200, messages.text
    body = messages.json()
    assert body["type"] == "message" and "logprobs" not in json.dumps(body)

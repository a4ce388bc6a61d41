"""The scripted model's tokenizer (``spec_cache.testing.scripted``): llguidance reads it, and under a JSON grammar
the greedy model writes ``ANSWER_JSON`` where it would otherwise write its tool call (issue 36: the
``response_format`` client tests run on it)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.testing.scripted import ANSWER_JSON, CALL, REPLY, write_scripted_model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from mlx_lm.utils import load

    model, tokenizer = load(str(write_scripted_model(tmp_path_factory.mktemp("scripted") / "m")))
    return model, tokenizer


def greedy(model, tokenizer, prompt: list[int], grammar=None, limit: int = 8) -> list[int]:
    """Token-by-token greedy decoding, masked by an llguidance matcher when ``grammar`` is given."""
    import llguidance
    import llguidance.hf

    matcher = None
    if grammar is not None:
        lltok = llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=tokenizer.eos_token_id)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    tokens = list(prompt)
    out = []
    for _ in range(limit):
        logits = np.array(model(mx.array([tokens]))[0, -1].astype(mx.float32))
        if matcher is not None:
            allowed = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[: logits.shape[0]] > 0
            logits = np.where(allowed, logits, -np.inf)
        token = int(np.argmax(logits))
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
        if matcher is not None:
            assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    return out


def test_llguidance_reads_every_token_as_the_text_it_decodes_to(scripted):
    import llguidance.hf

    _, tokenizer = scripted
    lltok = llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=tokenizer.eos_token_id)
    hf = tokenizer._tokenizer
    assert lltok.vocab_size == len(hf)
    for i in range(len(hf)):
        if hf.convert_ids_to_tokens(i) not in ("<unk>", "<|im_start|>", "<|im_end|>"):
            assert lltok.decode_bytes([i]).decode() == hf.convert_ids_to_tokens(i).replace("\u2581", " ")


def test_text_and_tool_calls_decode_as_they_did(scripted):
    _, tokenizer = scripted
    text = ('<|im_start|>user What is the weather in Paris?<|im_end|><|im_start|>assistant <tool_call> '
            f'{CALL} </tool_call><|im_end|><|im_start|>assistant {" ".join(REPLY)}<|im_end|>')
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert 0 not in ids  # no <unk>: every word of it is a piece
    assert tokenizer.decode(ids) == text
    reply = tokenizer.encode(" " + " ".join(REPLY), add_special_tokens=False)  # as templates put it: after a space
    assert len(reply) == len(REPLY) and tokenizer.decode(reply) == "It is sunny in Paris."  # the leading space: off


def test_a_json_grammar_turns_the_tool_call_into_the_json_answer(scripted):
    import llguidance

    model, tokenizer = scripted
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                           add_generation_prompt=True)
    eos = tokenizer.eos_token_id
    plain = greedy(model, tokenizer, prompt)
    assert tokenizer.decode(plain[:-1]) == f"<tool_call> {CALL} </tool_call>" and plain[-1] == eos
    for grammar in (llguidance.LLMatcher.grammar_from_json_schema(SCHEMA),
                    llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})):
        constrained = greedy(model, tokenizer, prompt, grammar)
        assert constrained[-1] == eos and tokenizer.decode(constrained[:-1]) == ANSWER_JSON
        assert json.loads(ANSWER_JSON) == {"city": "Paris"}

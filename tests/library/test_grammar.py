"""Grammar-constrained decoding (issue 36 item 1): ``RowSampling(grammar=Grammar.json_schema(...))`` gives exactly
the tokens of a sequential decode that masks each step with llguidance directly (``generate_step`` with a logits
processor over an ``LLMatcher``), with drafting on, after a restore and in a batch beside a plain row; the text
always parses and follows the schema.

The tiny target's ids are given a byte spelling here (``llguidance.TokenizerWrapper``: printable ASCII, digit pairs
and a few JSON pieces), so its random weights write JSON under the mask."""

from __future__ import annotations

import json

import llguidance
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.rows.grammar import Grammar, GrammarError
from spec_cache.rows.sampling import RowSampling, process_logits
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

EOS = 2
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"type": "boolean"}, "c": {"enum": ["x", "yz", "w"]}},
          "required": ["a", "b", "c"], "additionalProperties": False}
MAX_TOKENS = 48


class _Spelling:
    """Token bytes for the tiny vocabulary (256 ids: unk, bos, eos, then these pieces)."""

    def __init__(self, vocab: int = 256) -> None:
        pieces = [bytes([c]) for c in range(32, 127)]
        pieces += [b'{"', b'":', b'",', b'"}', b"true", b"false", b"null", b'"a"', b'"b"', b'"c"', b'"x"', b", "]
        pieces += [f"{i:02d}".encode() for i in range(10, 100)]
        letters = [bytes([a, b]) for a in b"abcxyzw\"" for b in b"abcxyzw\""]
        pieces += [p for p in letters if p not in pieces][:vocab - 3 - len(pieces)]
        assert len(pieces) == vocab - 3
        self.tokens = [b"\xff<unk>", b"\xff<s>", b"\xff</s>"] + pieces
        self.eos_token_id, self.bos_token_id, self.special_token_ids = EOS, 1, [0, 1, 2]

    def __call__(self, text: bytes) -> list[int]:
        out, i = [], 0
        while i < len(text):
            best = max((t for t in range(3, len(self.tokens)) if text.startswith(self.tokens[t], i)),
                       key=lambda t: len(self.tokens[t]))
            out.append(best)
            i += len(self.tokens[best])
        return out


@pytest.fixture(scope="module")
def spelling():
    return _Spelling()


@pytest.fixture(scope="module")
def llg(spelling):
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(spelling))


def text_of(spelling, tokens) -> str:
    return b"".join(spelling.tokens[t] for t in tokens if t != EOS).decode()


def reference(target, llg, grammar_text: str, prompt, max_tokens) -> list[int]:
    """A plain sequential greedy decode masked token by token by an ``LLMatcher`` (llguidance directly)."""
    matcher = llguidance.LLMatcher(llg, grammar_text, log_level=0)
    consumed = []

    def processor(tokens, logits):
        generated = [int(t) for t in np.array(tokens)[len(prompt):]]
        for token in generated[len(consumed):]:
            assert matcher.consume_token(token)
            consumed.append(token)
        allowed = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8) > 0
        allowed[EOS] = matcher.is_accepting()
        mask = np.zeros(logits.shape[-1], dtype=bool)
        mask[:allowed.shape[0]] = allowed[:logits.shape[-1]]
        return mx.where(mx.array(mask), logits, -mx.inf)

    out = []
    for token, _ in generate_step(mx.array(prompt), target.model, max_tokens=max_tokens, logits_processors=[processor]):
        out.append(int(token))
        if token == EOS:
            break
    return out


def run(tiny, provider_name, requests, *, depth=4, **kwargs):
    engine = SpeculativeEngine(tiny.target, tiny.provider(provider_name), draft_depth=depth, adaptive=False)
    return engine.run(requests, eos_token_ids=[EOS], **kwargs)


def check_schema(text: str) -> None:
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # pragma: no cover
        assert set(value) == {"a", "b", "c"} and isinstance(value["b"], bool)
    else:
        jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize("provider_name", [None, "draft-model-full", "ngram"])
def test_constrained_greedy_equals_a_sequential_masked_decode(tiny, llg, spelling, provider_name):
    grammar = Grammar.json_schema(llg, SCHEMA)
    want = reference(tiny.target, llg, grammar.grammar, PROMPTS[0], MAX_TOKENS)
    assert want[-1] == EOS
    check_schema(text_of(spelling, want))
    plain = RowRequest(PROMPTS[2], max_tokens=20)
    results = run(tiny, provider_name, [RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS,
                                                   sampling=RowSampling(grammar=grammar)), plain])
    assert results[0].tokens == want
    assert results[1].tokens == plain_greedy(tiny.target, PROMPTS[2], 20)  # its neighbour: untouched
    if provider_name is not None:
        assert results[0].drafted > 0  # windows of several positions were verified (the drafter is unconstrained)


def test_json_object_always_parses_and_max_tokens_cuts(tiny, llg, spelling):
    grammar = Grammar.json_object(llg)
    for prompt in PROMPTS:
        request = RowRequest(prompt, max_tokens=MAX_TOKENS, sampling=RowSampling(grammar=grammar))
        (result,) = run(tiny, "ngram", [request])
        assert result.tokens == reference(tiny.target, llg, grammar.grammar, prompt, MAX_TOKENS)
        if result.tokens[-1] == EOS:
            assert isinstance(json.loads(text_of(spelling, result.tokens)), dict)
        else:  # cut by max_tokens: a prefix of some object
            assert len(result.tokens) == MAX_TOKENS and text_of(spelling, result.tokens).startswith("{")
    (short,) = run(tiny, None, [RowRequest(PROMPTS[0], max_tokens=1, sampling=RowSampling(grammar=grammar))])
    assert short.reason == "length" and text_of(spelling, short.tokens) == "{"  # cut: it does not parse


@pytest.mark.parametrize("provider_name", ["draft-model-full", "ngram"])
def test_constrained_after_a_restore_equals_the_reference(tiny, llg, provider_name):
    grammar = Grammar.json_schema(llg, SCHEMA)
    prompt = PROMPTS[2]
    calls = []
    run(tiny, provider_name, [RowRequest(prompt, max_tokens=2)],
        on_checkpoint=lambda row, tokens, caches, draft: calls.append((list(tokens), caches, draft)))
    tokens, caches, draft = calls[0]
    warm = RowRequest(prompt, caches, len(tokens), draft, max_tokens=MAX_TOKENS, sampling=RowSampling(grammar=grammar))
    (result,) = run(tiny, provider_name, [warm])
    assert result.cached_tokens == len(prompt) - 1
    assert result.tokens == reference(tiny.target, llg, grammar.grammar, prompt, MAX_TOKENS)


def test_two_rows_share_one_grammar_and_sampled_rows_parse(tiny, llg, spelling):
    grammar = Grammar.json_schema(llg, SCHEMA)
    rows = [RowRequest(p, max_tokens=MAX_TOKENS, sampling=RowSampling(grammar=grammar)) for p in PROMPTS]
    results = run(tiny, "draft-model-full", rows)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == reference(tiny.target, llg, grammar.grammar, prompt, MAX_TOKENS)
    for seed in range(3):
        hot = RowSampling(temperature=1.0, seed=seed, grammar=grammar)
        (result,) = run(tiny, "ngram", [RowRequest(PROMPTS[1], max_tokens=MAX_TOKENS, sampling=hot)])
        assert result.tokens[-1] == EOS
        check_schema(text_of(spelling, result.tokens))


def test_window_masks_follow_the_drafts(llg, spelling):
    grammar = Grammar.json_schema(llg, SCHEMA)
    text = spelling(b'{"a":12,"b":true,"c":"x"}')
    prompt = [5, 6, 7]
    tokens = prompt + text
    logits = mx.zeros((len(text) + 1, 256))
    got = np.array(process_logits(logits, RowSampling(grammar=grammar), tokens, len(prompt), len(prompt)))
    matcher = grammar.matcher()
    for j, token in enumerate(text + [EOS]):
        assert np.isfinite(got[j][token])
        assert got[j][EOS] == (0 if matcher.is_accepting() else -np.inf)
        matcher.consume_token(token)
    with pytest.raises(ValueError, match="start"):
        process_logits(logits, RowSampling(grammar=grammar), tokens, len(prompt))


def test_bad_schemas_and_keys(llg):
    from spec_cache.tiers.continuations import request_key

    for schema in ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "not json", [1]):
        with pytest.raises(GrammarError):
            Grammar.json_schema(llg, schema)
    with pytest.raises(TypeError):
        RowSampling(grammar="json")
    a, b = Grammar.json_schema(llg, SCHEMA), Grammar.json_object(llg)
    keys = {request_key(b"k" * 32, [1, 2], RowSampling(grammar=g), True, [2]) for g in (a, b, None)}
    assert len(keys) == 3
    assert RowSampling(grammar=a).processes

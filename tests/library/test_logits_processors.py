"""Logits processors (issue 36 item 4): ``logit_bias``, ``repetition_penalty`` (+ context size),
``presence_penalty`` and ``frequency_penalty`` give exactly mlx-lm's tokens (``generate_step`` with
``make_logits_processors``), with drafting on (every window position sees the history its drafts would make), in a
batch beside a row without them (which stays the target's greedy sequence), after a restore, and pipelined."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_logits_processors,
    make_presence_penalty,
    make_sampler,
)

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.errors import InvalidRequest
from spec_cache.rows.sampling import RowSampler, RowSampling, process_logits
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

MAX_TOKENS = 24

#: name -> (RowSampling's processor fields, mlx-lm's processors for them)
CASES = {
    "logit_bias": ({"logit_bias": {7: 3.5, 11: -2.0, 40: 1.25}},
                   lambda: make_logits_processors({7: 3.5, 11: -2.0, 40: 1.25})),
    "repetition": ({"repetition_penalty": 1.8}, lambda: make_logits_processors(None, 1.8)),
    "repetition-context-4": ({"repetition_penalty": 2.5, "repetition_context_size": 4},
                             lambda: make_logits_processors(None, 2.5, 4)),
    "presence": ({"presence_penalty": 1.5}, lambda: [make_presence_penalty(1.5)]),
    "frequency": ({"frequency_penalty": 0.9, "frequency_context_size": 0},
                  lambda: [make_frequency_penalty(0.9, 0)]),
    "combined": ({"logit_bias": {9: 2.0}, "repetition_penalty": 1.3, "repetition_context_size": 6,
                  "presence_penalty": 0.7, "presence_context_size": 10, "frequency_penalty": 0.4,
                  "frequency_context_size": 30},
                 lambda: make_logits_processors({9: 2.0}, 1.3, 6, 0.7, 10, 0.4, 30)),
}


def mlx_lm_tokens(target, prompt, max_tokens, processors, sampler=None) -> list[int]:
    steps = generate_step(mx.array(prompt), target.model, max_tokens=max_tokens, logits_processors=processors,
                          sampler=sampler)
    return [token for token, _ in steps]


def run(tiny, provider_name, requests, *, depth=4, pipeline=False, **kwargs):
    engine = SpeculativeEngine(tiny.target, tiny.provider(provider_name), draft_depth=depth, adaptive=False,
                               pipeline=pipeline)
    return engine.run(requests, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("provider_name", [None, "draft-model-full", "ngram"])
def test_greedy_tokens_with_processors_equal_mlx_lm(tiny, provider_name, case):
    fields, processors = CASES[case]
    sampling = RowSampling(**fields)
    prompt = PROMPTS[0]
    want = mlx_lm_tokens(tiny.target, prompt, MAX_TOKENS, processors())
    assert want != plain_greedy(tiny.target, prompt, MAX_TOKENS)  # the processors do change these tokens
    plain = RowRequest(PROMPTS[2], max_tokens=MAX_TOKENS)
    results = run(tiny, provider_name, [RowRequest(prompt, max_tokens=MAX_TOKENS, sampling=sampling), plain])
    assert results[0].tokens == want
    assert results[1].tokens == plain_greedy(tiny.target, PROMPTS[2], MAX_TOKENS)  # its neighbour: untouched
    if provider_name == "draft-model-full":
        assert results[0].drafted > 0 and results[0].accepted > 0  # windows of several positions were verified


@pytest.mark.parametrize("provider_name", ["draft-model-full", "ngram"])
def test_processors_after_a_restore_equal_mlx_lm(tiny, provider_name):
    fields, processors = CASES["combined"]
    sampling = RowSampling(**fields)
    prompt = PROMPTS[2]
    calls = []
    run(tiny, provider_name, [RowRequest(prompt, max_tokens=2)],
        on_checkpoint=lambda row, tokens, caches, draft: calls.append((list(tokens), caches, draft)))
    tokens, caches, draft = calls[0]
    assert tokens == prompt[:-1]
    warm = RowRequest(prompt, caches, len(tokens), draft, max_tokens=MAX_TOKENS, sampling=sampling)
    (result,) = run(tiny, provider_name, [warm])
    assert result.cached_tokens == len(prompt) - 1
    assert result.tokens == mlx_lm_tokens(tiny.target, prompt, MAX_TOKENS, processors())


def test_pipelined_session_with_processors_equals_mlx_lm(tiny):
    fields, processors = CASES["repetition"]
    requests = [RowRequest(PROMPTS[1], max_tokens=MAX_TOKENS, sampling=RowSampling(**fields)),
                RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS)]
    results = run(tiny, None, requests, pipeline=True)
    assert results[0].tokens == mlx_lm_tokens(tiny.target, PROMPTS[1], MAX_TOKENS, processors())
    assert results[1].tokens == plain_greedy(tiny.target, PROMPTS[0], MAX_TOKENS)


def test_a_bias_of_100_makes_every_token_that_one(tiny):
    (result,) = run(tiny, "draft-model-full", [RowRequest(PROMPTS[0], max_tokens=10,
                                                          sampling=RowSampling(logit_bias={42: 100}))])
    assert result.tokens == [42] * 10
    hot = RowSampling(temperature=1.0, seed=3, logit_bias={42: 100})
    (sampled,) = run(tiny, "ngram", [RowRequest(PROMPTS[0], max_tokens=10, sampling=hot)])
    assert sampled.tokens == [42] * 10


def test_sampled_rows_apply_processors_before_sampling(tiny):
    """A sampled row with processors: they move its distribution (the tokens differ from the same seed without
    them), and a row's tokens still depend on its own seed only (drafting or not, batched or not)."""
    penalized = RowSampling(temperature=0.8, seed=5, logit_bias={42: 4.0}, repetition_penalty=3.0)
    plain = RowSampling(temperature=0.8, seed=5)
    (a,) = run(tiny, "draft-model-full", [RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS, sampling=penalized)])
    b, _ = run(tiny, None, [RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS, sampling=penalized),
                            RowRequest(PROMPTS[1], max_tokens=5, sampling=plain)])
    (c,) = run(tiny, None, [RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS, sampling=plain)])
    assert a.tokens == b.tokens != c.tokens


def test_window_positions_see_their_drafts():
    """``process_logits`` position ``j`` equals mlx-lm's processors over ``tokens[:position + j]``."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((5, 40)).astype(np.float32) * 3)
    tokens = [int(t) for t in rng.integers(0, 40, 33)]
    fields, processors = CASES["combined"]
    got = np.array(process_logits(logits, RowSampling(**fields), tokens, 29))
    for j in range(5):
        want = logits[j:j + 1]
        for processor in processors():
            want = processor(mx.array(tokens[:29 + j]), want)
        assert np.array_equal(np.array(want)[0], got[j])


def test_sampler_needs_the_tokens_of_a_processing_row():
    logits = mx.zeros((1, 2, 8))
    with pytest.raises(ValueError):
        RowSampler().sample(logits, [(RowSampling(presence_penalty=1.0), 3)])
    assert RowSampler()(logits, [(RowSampling(logit_bias={5: 1.0}), 3, [1, 2, 3, 4])]) == [[5, 5]]


def test_bad_processor_values_are_refused(tiny):
    for fields in ({"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"repetition_context_size": -1},
                   {"presence_penalty": float("nan")}, {"frequency_penalty": float("inf")},
                   {"logit_bias": {-1: 1.0}}, {"logit_bias": {1: float("nan")}}, {"logit_bias": [(1, 1.0), (1, 2.0)]}):
        with pytest.raises(InvalidRequest):
            RowSampling(**fields)
    for fields in ({"logit_bias": {"1": 1.0}}, {"logit_bias": {1: "x"}}, {"repetition_penalty": "2"},
                   {"presence_context_size": 2.5}, {"logit_bias": 3}):
        with pytest.raises(TypeError):
            RowSampling(**fields)
    vocab = tiny.target.vocab_size
    engine = SpeculativeEngine(tiny.target, None)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        engine.run([RowRequest(PROMPTS[0], max_tokens=2, sampling=RowSampling(logit_bias={vocab: 1.0}))])
    assert not RowSampling().processes and not RowSampling(repetition_penalty=1.0, presence_penalty=0).processes
    assert RowSampling(logit_bias={3: 0.0}).processes


def test_generator_and_continuation_keys_take_processors(tiny, tmp_path):
    from spec_cache.store.continuations import continuation_params
    from spec_cache.tiers.continuations import request_key

    greedy = continuation_params(temperature=0.0, top_p=1.0, seed=None, eos_ids=[2])
    assert request_key(b"k" * 32, [1, 2], RowSampling(), True, [2]) == request_key(b"k" * 32, [1, 2], None, True, [2])
    keys = {request_key(b"k" * 32, [1, 2], RowSampling(**fields), True, [2]) for fields, _ in CASES.values()}
    assert len(keys) == len(CASES) and request_key(b"k" * 32, [1, 2], None, True, [2]) not in keys
    assert b"processors" not in greedy


def test_sampled_processors_match_mlx_lm_distribution_shape(tiny):
    """A hot row with logit_bias +100 on one token and top_k 1 is mlx-lm's sampled output too (both keep one
    token); the sampler's own PRNG differs from mlx-lm's, so only such a determined case is compared."""
    sampling = RowSampling(temperature=0.7, seed=1, top_k=1, repetition_penalty=2.0)
    (ours,) = run(tiny, "draft-model-full", [RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS, sampling=sampling)])
    want = mlx_lm_tokens(tiny.target, PROMPTS[0], MAX_TOKENS, make_logits_processors(None, 2.0),
                         sampler=make_sampler(0.7, top_k=1))
    assert ours.tokens == want


@pytest.mark.parametrize("drafter", ["draft-model-full", "ngram"])
def test_generator_with_processors_restored_from_the_store_equals_mlx_lm(tiny, tmp_path, drafter):
    """``Generator.generate(..., repetition_penalty=...)``: a cold call stores the prefix, a second call restores it
    from the store, and both equal mlx-lm's tokens (a call's rows all take its processors); the
    continuation records of two calls with different processors never stand in for each other."""
    from spec_cache.decode.generator import Generator
    from spec_cache.tiers.cache import SpecCache

    fields, processors = CASES["combined"]
    drafter_dir = "ngram" if drafter == "ngram" else tiny.drafter_dir(drafter)
    cache = SpecCache.open(tmp_path / "store")
    gen = Generator.load(tiny.root / "target", drafter_dir, cache=cache, adaptive=False)
    prompt = PROMPTS[2] + PROMPTS[0]
    want = mlx_lm_tokens(tiny.target, prompt, MAX_TOKENS, processors())
    cold = gen.generate([prompt], max_tokens=MAX_TOKENS, **fields)
    cache.drain()
    warm = gen.generate([prompt, PROMPTS[1]], max_tokens=MAX_TOKENS, **fields)
    assert cold[0].tokens == warm[0].tokens == want
    assert warm[1].tokens == mlx_lm_tokens(tiny.target, PROMPTS[1], MAX_TOKENS, processors())
    assert warm[0].cached_tokens > 0
    plain = gen.generate([PROMPTS[1]], max_tokens=MAX_TOKENS)[0].tokens
    assert plain == plain_greedy(tiny.target, PROMPTS[1], MAX_TOKENS)
    with pytest.raises(TypeError):
        gen.generate([prompt], max_tokens=4, repetition_penality=1.5)  # a misspelt name is refused, not ignored
    # continuations: a record written under one set of processors is not replayed for another
    first = gen.generate([prompt], max_tokens=MAX_TOKENS, checkpoint_every=4, **fields)[0].tokens
    other = gen.generate([prompt], max_tokens=MAX_TOKENS, checkpoint_every=4, resume=True,
                         logit_bias={42: 100})[0].tokens
    assert first == want and other == [42] * MAX_TOKENS
    cache.close()

"""Degenerate sampling parameters mean greedy (issue 37 item 8): a ``temperature`` at or below ~1e-38 made
``1 / T`` overflow float32 and every logit NaN, and a ``top_p`` at or below ~1e-46 rounded to 0 in float32 and
kept no token: either way every step answered token id 0. Below ``MIN_TEMPERATURE`` / ``MIN_TOP_P`` a row samples
greedily; on the tiny model its tokens are exactly greedy's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import MIN_TEMPERATURE, RowSampler, RowSampling, Sampling, TokenSampler, _nucleus
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

DEGENERATE = [dict(temperature=1e-39), dict(temperature=1e-38), dict(temperature=5e-324),
              dict(temperature=MIN_TEMPERATURE / 2), dict(temperature=0.8, top_p=1e-46),
              dict(temperature=1.0, top_p=5e-324), dict(temperature=1.5, top_p=1e-7)]


@pytest.mark.parametrize("options", DEGENERATE, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_the_row_sampler_reads_a_degenerate_row_as_greedy(options):
    logits = mx.array(np.random.default_rng(5).standard_normal((2, 3, 64)).astype(np.float32) * 4)
    row = RowSampling(seed=9, **options)
    assert row.greedy
    got = np.array(RowSampler().sample(logits, [(row, 4), (row, 17)]))
    assert np.array_equal(got, np.argmax(np.array(logits), axis=-1))


def test_the_drafters_sampler_too():
    logits = mx.array(np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32))
    assert Sampling(1e-39).greedy
    assert np.array_equal(np.array(TokenSampler(Sampling(1e-39, seed=3))(logits)), np.argmax(np.array(logits), -1))


def test_a_nucleus_that_rounds_to_nothing_keeps_the_top_token():
    lp = mx.array(np.random.default_rng(7).standard_normal((3, 32)).astype(np.float32))
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    kept = np.array(_nucleus(lp, 1e-46)) > -np.inf
    assert kept.sum(axis=-1).tolist() == [1, 1, 1]
    assert np.array_equal(np.argmax(kept, axis=-1), np.argmax(np.array(lp), axis=-1))


def test_sampling_above_the_floor_still_samples():
    logits = mx.array(np.random.default_rng(8).standard_normal((2, 4, 64)).astype(np.float32))
    row = RowSampling(temperature=1.5, top_p=0.99, seed=7)
    assert not row.greedy and RowSampling(temperature=2 * MIN_TEMPERATURE).temperature == 2 * MIN_TEMPERATURE
    got = np.array(RowSampler().sample(logits, [(row, 10), (row, 3)]))
    assert not np.array_equal(got, np.argmax(np.array(logits), axis=-1))


@pytest.mark.parametrize("options", [dict(temperature=1e-39), dict(temperature=0.9, top_p=1e-46)],
                         ids=["temperature-1e-39", "top_p-1e-46"])
def test_the_tiny_model_generates_greedys_tokens(tiny, options):
    generator = Generator.load(tiny.root / "target", None, cache=None)
    results = generator.generate(PROMPTS, max_tokens=12, seed=4, **options)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, 12)

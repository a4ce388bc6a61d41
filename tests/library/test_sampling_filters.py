"""``top_k`` and ``min_p`` in the row sampler (issue 36 item 4: the server refused them, and before that ignored
them): each keeps exactly the tokens it names, greedy rows are untouched, a row's tokens still depend only on its
own seed and position, and a continuation key tells filtered requests apart while every older key stays as it was."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.errors import InvalidRequest
from spec_cache.rows.sampling import RowSampler, RowSampling, _min_p, _top_k
from spec_cache.store.continuations import continuation_params


def _logprobs(seed: int = 0, vocab: int = 50) -> mx.array:
    logits = mx.array(np.random.default_rng(seed).standard_normal((3, vocab)).astype(np.float32) * 3)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_top_k_keeps_the_k_most_likely_tokens():
    lp = _logprobs()
    kept = np.array(_top_k(lp, 5)) > -np.inf
    assert (kept.sum(axis=-1) == 5).all()
    ranks = np.argsort(-np.array(lp), axis=-1)[:, :5]
    assert all(set(np.flatnonzero(kept[w])) == set(ranks[w]) for w in range(3))
    assert np.array_equal(np.array(_top_k(lp, 50)), np.array(lp))  # k >= vocab: nothing filtered


def test_min_p_keeps_tokens_at_least_that_likely_relative_to_the_best():
    lp = np.array(_logprobs(1))
    kept = np.array(_min_p(mx.array(lp), 0.1)) > -np.inf
    want = lp >= lp.max(axis=-1, keepdims=True) + math.log(0.1)
    assert np.array_equal(kept, want) and kept.sum() > 3
    assert (np.array(_min_p(mx.array(lp), 1.0)) > -np.inf).sum(axis=-1).tolist() == [1, 1, 1]


def test_a_hot_row_with_top_k_one_or_min_p_one_samples_the_argmax():
    logits = mx.array(np.random.default_rng(2).standard_normal((2, 4, 64)).astype(np.float32))
    argmax = np.argmax(np.array(logits), axis=-1)
    sampler = RowSampler()
    for sampling in (RowSampling(1.5, 1.0, 7, top_k=1), RowSampling(1.5, 1.0, 7, min_p=1.0)):
        got = np.array(sampler.sample(logits, [(sampling, 10), (sampling, 3)]))
        assert np.array_equal(got, argmax)
    hot = np.array(sampler.sample(logits, [(RowSampling(1.5, 1.0, 7), 10), (RowSampling(1.5, 1.0, 7), 3)]))
    assert not np.array_equal(hot, argmax)  # without the filters these rows do sample away from the argmax


def test_filtered_rows_depend_only_on_their_seed_and_position():
    logits = mx.array(np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32))
    row = RowSampling(1.0, 0.9, 11, top_k=8, min_p=0.05)
    a = np.array(RowSampler().sample(logits, [(row, 20), (None, 0)]))
    b = np.array(RowSampler().sample(logits[:1], [(row, 20)]))
    assert np.array_equal(a[0], b[0])
    kept = np.array(_top_k(logits[0] / 1.0 - mx.logsumexp(logits[0], axis=-1, keepdims=True), 8)) > -np.inf
    assert all(kept[w, a[0, w]] for w in range(3))  # every sampled token is among the row's top 8


def test_bad_filter_values_are_refused():
    with pytest.raises(InvalidRequest):
        RowSampling(1.0, top_k=-1)
    with pytest.raises(InvalidRequest):
        RowSampling(1.0, min_p=1.5)
    with pytest.raises(TypeError):
        RowSampling(1.0, top_k=2.5)


def test_continuation_keys_tell_filters_apart_and_keep_older_keys():
    base = dict(temperature=0.7, top_p=1.0, seed=3, eos_ids=[2])
    plain = continuation_params(**base)
    assert continuation_params(**base, top_k=0, min_p=0.0) == plain  # unset: the bytes every older key used
    assert b"top_k" not in plain and b"min_p" not in plain
    assert len({plain, continuation_params(**base, top_k=5), continuation_params(**base, min_p=0.1)}) == 3
    greedy = dict(base, temperature=0.0)
    assert continuation_params(**greedy, top_k=5) == continuation_params(**greedy)  # greedy: filters change nothing

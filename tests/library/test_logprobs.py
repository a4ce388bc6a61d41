"""Token logprobs (``RowRequest.logprobs``) and prompt logprobs (``RowRequest.prompt_logprobs``) are exactly the
model's: mlx-lm's ``generate_step`` logprobs for greedy rows, a direct forward's log-softmax for any row and for
the prompt, whatever drafts, restores, batches or pipelines the row."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.errors import InvalidRequest
from spec_cache.rows.sampling import RowSampling
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

TOL = 1e-5
MAX_TOKENS = 12


def reference_step(target, prompt, max_tokens):
    """(token, logprobs [V] as a list) from mlx-lm's ``generate_step``."""
    steps = generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)
    return [(token, logprobs.astype(mx.float32).tolist()) for token, logprobs in steps]


def forward_logprobs(target, tokens):
    """log_softmax of a direct forward over ``tokens``: row ``i`` is the distribution of the token after ``i``."""
    logits = target.model(mx.array(tokens)[None])[0].astype(mx.float32)
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()


def check_entry(entry, token, distribution, top):
    assert entry.token == token
    assert abs(entry.logprob - distribution[token]) < TOL
    assert len(entry.top) == top
    best = sorted(distribution, reverse=True)[:top]
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    for (tid, lp), want in zip(entry.top, best):
        assert abs(lp - want) < TOL
        assert abs(distribution[tid] - lp) < TOL


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("provider_name", [None, "draft-model-full", "ngram"])
def test_greedy_logprobs_equal_generate_step(tiny, provider_name, pipeline):
    engine = SpeculativeEngine(tiny.target, tiny.provider(provider_name), draft_depth=3, adaptive=False,
                               pipeline=pipeline)
    requests = [RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=4),
                RowRequest(PROMPTS[1], max_tokens=MAX_TOKENS),  # does not ask: today's path
                RowRequest(PROMPTS[2], max_tokens=MAX_TOKENS, logprobs=0)]
    results = engine.run(requests)
    for request, result in zip(requests, results):
        assert result.tokens == plain_greedy(tiny.target, request.prompt, MAX_TOKENS)
        if request.logprobs is None:
            assert result.logprobs is None
            continue
        reference = reference_step(tiny.target, request.prompt, MAX_TOKENS)
        assert len(result.logprobs) == len(result.tokens)
        for entry, (token, distribution) in zip(result.logprobs, reference):
            check_entry(entry, token, distribution, request.logprobs)
    if provider_name == "draft-model-full":
        assert sum(r.accepted for r in results) > 0


def test_sampled_logprobs_are_the_models_before_temperature(tiny):
    engine = SpeculativeEngine(tiny.target, tiny.provider("draft-model-full"), draft_depth=3, adaptive=False)
    sampling = RowSampling(temperature=0.9, top_p=0.8, seed=7)
    prompt = PROMPTS[2]
    result = engine.run([RowRequest(prompt, max_tokens=MAX_TOKENS, sampling=sampling, logprobs=2)])[0]
    plain = engine.run([RowRequest(prompt, max_tokens=MAX_TOKENS, sampling=sampling)])[0]
    assert result.tokens == plain.tokens
    distributions = forward_logprobs(tiny.target, prompt + result.tokens)
    for i, (entry, token) in enumerate(zip(result.logprobs, result.tokens)):
        check_entry(entry, token, distributions[len(prompt) - 1 + i], 2)


def test_logprobs_after_a_restore_and_through_on_tokens(tiny):
    engine = SpeculativeEngine(tiny.target, tiny.provider("ngram"), draft_depth=3, adaptive=False)
    prompt = PROMPTS[2]
    stored = {}

    def keep(row, tokens, caches, draft):
        stored.setdefault(row, (list(tokens), caches, draft))
    engine.run([RowRequest(prompt[:9] + [1], max_tokens=2)], on_checkpoint=keep)
    tokens, caches, draft = stored[0]
    assert tokens == prompt[:9]
    session = engine.session()
    delivered = []
    finished = {}
    request = RowRequest(prompt, restored_caches=caches, restored_tokens=9, draft_checkpoint=draft,
                         max_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=1)
    other = RowRequest(PROMPTS[0], max_tokens=MAX_TOKENS)
    row = session.submit(request, on_tokens=lambda r, t, lp: delivered.append((list(t), lp)),
                         on_finish=lambda r, res: finished.__setitem__(r, res))
    session.submit(other, on_tokens=lambda r, t: None, on_finish=lambda r, res: finished.__setitem__(r, res))
    while session.step():
        pass
    session.close()
    result = finished[row]
    assert result.cached_tokens == 9
    assert result.tokens == plain_greedy(tiny.target, prompt, MAX_TOKENS)
    reference = reference_step(tiny.target, prompt, MAX_TOKENS)
    for entry, (token, distribution) in zip(result.logprobs, reference):
        check_entry(entry, token, distribution, 3)
    # the callback's third argument: the round's tokens' entries, the prompt's on the first call only
    assert [t for tokens, _ in delivered for t in tokens] == result.tokens
    assert [e for _, lp in delivered for e in lp.tokens] == result.logprobs
    assert delivered[0][1].prompt == result.prompt_logprobs
    assert all(lp.prompt is None for _, lp in delivered[1:])
    # a restored prefix is not scored (no logits); the tokens after it are, exactly
    distributions = forward_logprobs(tiny.target, prompt)
    assert result.prompt_logprobs[:10] == [None] * 10
    for p in range(10, len(prompt)):
        check_entry(result.prompt_logprobs[p], prompt[p], distributions[p - 1], 1)
    assert finished[1].logprobs is None and finished[1].prompt_logprobs is None


@pytest.mark.parametrize("step", [3, 512])
@pytest.mark.parametrize("provider_name", [None, "draft-model-full"])
def test_prompt_logprobs_equal_a_direct_forward(tiny, provider_name, step):
    """Scored in the prefill chunks, the cohort's rows of different lengths padded beside each other, one joining
    while another decodes (interleaved prefill)."""
    engine = SpeculativeEngine(tiny.target, tiny.provider(provider_name), draft_depth=3, adaptive=False,
                               prefill_step_size=step)
    session = engine.session()
    finished = {}
    done = lambda r, res: finished.__setitem__(r, res)  # noqa: E731
    rows = [session.submit(RowRequest(PROMPTS[1], max_tokens=6), on_finish=done)]
    session.step()
    rows.append(session.submit(RowRequest(PROMPTS[2], max_tokens=1, prompt_logprobs=2), on_finish=done))
    rows.append(session.submit(RowRequest(PROMPTS[0], max_tokens=3, prompt_logprobs=0, logprobs=1), on_finish=done))
    while session.step():
        pass
    session.close()
    assert finished[rows[0]].prompt_logprobs is None
    for row, prompt, top in ((rows[1], PROMPTS[2], 2), (rows[2], PROMPTS[0], 0)):
        result = finished[row]
        distributions = forward_logprobs(tiny.target, prompt)
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check_entry(result.prompt_logprobs[p], prompt[p], distributions[p - 1], top)
        assert result.tokens == plain_greedy(tiny.target, prompt, len(result.tokens))


def test_refused_values(tiny):
    engine = SpeculativeEngine(tiny.target, None)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(InvalidRequest):
            engine.run([RowRequest(PROMPTS[0], logprobs=bad)])
        with pytest.raises(InvalidRequest):
            engine.run([RowRequest(PROMPTS[0], prompt_logprobs=bad)])
    quantized = SpeculativeEngine(tiny.target, None, kv={"kvBits": 8, "kvGroupSize": 32})
    with pytest.raises(InvalidRequest, match="KV quantization"):
        quantized.run([RowRequest(PROMPTS[0], prompt_logprobs=0)])


def test_logprobs_after_logits_processors_equal_generate_steps(tiny):
    """mlx-lm (and mlx_lm.server) yields the logprobs of the processed logits (logit_bias, penalties): so does the
    engine, with drafting on."""
    from mlx_lm.sample_utils import make_logits_processors
    prompt = PROMPTS[0]
    processors = make_logits_processors(logit_bias={3: 2.5, 9: -1.0}, repetition_penalty=1.3)
    steps = generate_step(mx.array(prompt), tiny.target.model, max_tokens=MAX_TOKENS, logits_processors=processors)
    reference = [(token, logprobs.astype(mx.float32).tolist()) for token, logprobs in steps]
    sampling = RowSampling(logit_bias={3: 2.5, 9: -1.0}, repetition_penalty=1.3)
    engine = SpeculativeEngine(tiny.target, tiny.provider("draft-model-full"), draft_depth=3, adaptive=False)
    result = engine.run([RowRequest(prompt, max_tokens=MAX_TOKENS, sampling=sampling, logprobs=3)])[0]
    assert result.tokens == [token for token, _ in reference]
    for entry, (token, distribution) in zip(result.logprobs, reference):
        check_entry(entry, token, distribution, 3)

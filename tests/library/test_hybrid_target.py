"""A hybrid recurrent target (qwen3_next: gated-delta layers with ArraysCache state, full attention every 2nd
layer): logits bit-identical to mlx-lm, speculative == plain greedy (rejected drafts rolled back by replaying the
kept tokens through the recurrent mixers), checkpoints that mlx-lm itself continues from, and restored == cold on
repeat, on an extended turn, after reopening the store and in batches mixing warm and cold rows. Recurrent state
is an exact-boundary snapshot: it serves only its own length."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.rows.target import HybridTargetRows, TargetRows
from spec_cache.state.row_caches import prefix_caches
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny, plain_greedy  # noqa: F401

DRAFTERS = {"ngram": ("ngram", {}), "draft-model": ("draft-model", {})}
REPEATS = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # ngram finds something to propose (a random target rarely agrees)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 44)), REPEATS, [9]]
MAX = 12


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """qwen3_next, 3 layers: recurrent, full attention, recurrent."""
    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3-next"), "qwen3_next", num_layers=3, drafters=DRAFTERS)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, row, tokens, caches, draft):
        assert all(c.offset == len(tokens) for c in caches if not isinstance(c, ArraysCache))
        self.calls.append((row, list(tokens), caches, draft))

    def boundary(self, row):
        return next(call for call in self.calls if call[0] == row)

    def finish(self, row):
        return [call for call in self.calls if call[0] == row][-1]


def run(hybrid, name, requests, depth=4, **kwargs):
    engine = SpeculativeEngine(hybrid.target, hybrid.provider(name), draft_depth=depth, adaptive=False)
    return engine.run(requests, **kwargs)


def test_the_port_is_bit_identical_to_mlx_lm(hybrid):
    target = hybrid.target
    assert target.recurrent_layers == (0, 2) and target.num_layers == target.depth == 3
    assert [type(c) for c in target.make_caches()] == [ArraysCache, KVCache, ArraysCache]
    assert target.kv_geometry(0) == (0, 0) and target.kv_geometry(1) == (1, 64)
    ours, theirs = target.make_caches(), target.model.make_cache()
    for ids in ([[5, 6, 7, 8, 9, 10, 11]], [[12]], [[13]], [[14, 15, 16]]):
        mine = target.forward(mx.array(ids), ours).logits
        assert mx.array_equal(mine, target.model(mx.array(ids), cache=theirs)).item()
    assert len(set(plain_greedy(target, [5, 6, 7, 8], 32))) >= 8
    with pytest.raises(ValueError, match="recurrent"):
        target.rope(0)


def test_rows_of_a_hybrid_target_are_hybrid_rows(hybrid):
    rows = TargetRows.from_row_caches(hybrid.target, [None, None])
    assert isinstance(rows, HybridTargetRows)
    with pytest.raises(NotImplementedError, match="HybridTargetRows"):
        TargetRows(hybrid.target)
    rows.prefill([[5, 6, 7], [8]])
    with pytest.raises(ValueError, match="recurrent"):
        rows.donors(0)
    assert rows.donors(1).keys is not None


@pytest.mark.parametrize("name", [None, *DRAFTERS])
def test_speculative_equals_plain_greedy(hybrid, name):
    results = run(hybrid, name, [RowRequest(p, max_tokens=MAX) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(hybrid.target, prompt, MAX)
    if name is not None:  # drafts were proposed and rejected ones rolled back (ngram: from REPEATS)
        assert sum(r.drafted for r in results) > sum(r.accepted for r in results)
    if name == "draft-model":
        assert sum(r.accepted for r in results) > 0


def test_rollback_replays_the_kept_tokens(hybrid):
    target = hybrid.target
    prompts, window = [[5, 6, 7, 8, 9], [20, 21]], [[10, 11, 12, 13], [22, 23, 24, 25]]
    rows = TargetRows.from_row_caches(target, [None, None])
    rows.prefill(prompts)
    with pytest.raises(ValueError, match="never trimmable"):
        rows.rollback([1, 0])  # no verify window to replay
    rows.verify(window)
    with pytest.raises(ValueError, match="never trimmable"):
        rows.rollback([5, 0])  # reaches past the window; changes nothing
    rows.rollback([3, 1])
    assert rows.offsets == (6, 5)
    for row, kept in enumerate([prompts[0] + window[0][:1], prompts[1] + window[1][:3]]):
        caches = rows.extract(row)
        cold = target.model.make_cache()
        target.model(mx.array([kept]), cache=cold)
        for ours, theirs in zip(caches, cold):
            if isinstance(ours, ArraysCache):
                for a, b in zip(ours.cache, theirs.cache):
                    assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()
        follow = kept + [40, 41]  # mlx-lm continues from the rolled-back state exactly like a cold run
        steps = generate_step(mx.array(follow[len(kept):]), target.model, max_tokens=6, prompt_cache=caches)
        assert [t for t, _ in steps] == plain_greedy(target, follow, 6)


@pytest.mark.parametrize("name", [None, *DRAFTERS])
def test_restore_equals_cold(hybrid, name):
    recorder = Recorder()
    prompts = PROMPTS[:4]
    first = run(hybrid, name, [RowRequest(p, max_tokens=7) for p in prompts], on_checkpoint=recorder)
    repeat = []
    for index, prompt in enumerate(prompts):
        _, tokens, caches, draft = recorder.boundary(index)
        assert [type(c) for c in caches] == [ArraysCache, KVCache, ArraysCache]
        repeat.append(RowRequest(prompt, caches, len(tokens), draft, max_tokens=MAX))
    for prompt, result in zip(prompts, run(hybrid, name, repeat)):
        assert result.tokens == plain_greedy(hybrid.target, prompt, MAX)
        assert result.cached_tokens == len(prompt) - 1
    # an extended turn from the finish checkpoints, with the drafter row and without it, beside a cold row
    follow, requests = [], []
    for index, (prompt, result) in enumerate(zip(prompts, first)):
        _, tokens, caches, draft = recorder.finish(index)
        follow.append(prompt + result.tokens + [3 + index, 50])
        requests.append(RowRequest(follow[-1], caches, len(tokens), draft if index % 2 else None, max_tokens=MAX))
    requests.append(RowRequest(list(range(60, 75)), max_tokens=MAX))
    for request, result in zip(requests, run(hybrid, name, requests)):
        assert result.tokens == plain_greedy(hybrid.target, request.prompt, MAX)
        assert result.cached_tokens == request.restored_tokens


def test_a_recurrent_state_serves_only_its_own_length(hybrid):
    recorder = Recorder()
    run(hybrid, None, [RowRequest(PROMPTS[2], max_tokens=1)], on_checkpoint=recorder)
    _, tokens, caches, _ = recorder.boundary(0)
    windows = hybrid.target.layer_windows
    assert prefix_caches(caches, len(tokens) - 1, windows) is None
    same = prefix_caches(caches, len(tokens), windows)
    assert same is not None and all(a is b for a, b in zip(same[0].cache, caches[0].cache))
    with pytest.raises(ValueError, match="restored layer 1 holds"):
        run(hybrid, None, [RowRequest(PROMPTS[2] + [1], caches, len(tokens) + 1)])
    with pytest.raises(ValueError, match="ArraysCache"):
        run(hybrid, None, [RowRequest(PROMPTS[2], [KVCache(), caches[1], caches[2]], len(tokens))])


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_generator_restored_equals_cold_also_after_reopen(hybrid, tmp_path, name):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(hybrid.target, p, MAX) for p in prompts]
    target_dir, drafter_dir = hybrid.root / "target", hybrid.drafter_dir(name)
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:  # a new SpecCache over the same directory
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 for p, r in zip(prompts, again))
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        mixed = follow + [list(range(100, 120))]  # warm rows beside a cold one
        for prompt, r in zip(mixed, gen.generate(mixed, max_tokens=MAX)):
            assert r.tokens == plain_greedy(hybrid.target, prompt, MAX)
            assert r.cached_tokens == (len(prompt) - 3 if prompt in follow else 0)
        # recurrent state is an exact boundary: a prompt diverging inside a stored span finds no prefix
        diverged = list(range(3, 38)) + [250, 251]
        (r,) = gen.generate([diverged], max_tokens=MAX)
        assert r.cached_tokens == 0 and r.tokens == plain_greedy(hybrid.target, diverged, MAX)


def test_kv_quantization_of_a_hybrid_target_is_refused_up_front(hybrid):
    """Recurrent state has no quantized form: the engine says so at construction, not deep inside mlx-lm."""
    from spec_cache import KVOptions

    with pytest.raises(NotImplementedError, match=r"recurrent layers \[0, 2\]"):
        SpeculativeEngine(hybrid.target, None, kv=KVOptions(kv_bits=4))

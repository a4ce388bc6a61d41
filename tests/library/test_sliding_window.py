"""Sliding-window targets (gemma3_text, window 6 < the prompts): batched rows attend through window masks,
checkpoints hold mlx-lm's own RotatingKVCache snapshots (exact boundaries, never trimmed), and speculative ==
plain greedy, restored == cold, also after reopening the store."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import KVOptions
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import DRAFTERS, CheckpointRecorder, _identity_memo, build_tiny, plain_greedy  # noqa: F401

WINDOW = 6
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 44)), list(range(3, 30))]
MAX = 16


@pytest.fixture(scope="session")
def gemma(tmp_path_factory):
    """gemma3_text, 3 layers: sliding, global, sliding (window 6)."""
    return build_tiny(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3_text", num_layers=3, sliding_window=WINDOW)


def run(gemma, name, requests, depth=4, **kwargs):
    """Fixed draft depth: the acceptance assertions need every round to draft."""
    engine = SpeculativeEngine(gemma.target, gemma.provider(name), draft_depth=depth, adaptive=False)
    return engine.run(requests, **kwargs)


def test_the_target_mixes_rotating_and_full_caches(gemma):
    assert gemma.target.layer_windows == (WINDOW, None, WINDOW)
    assert [type(c) for c in gemma.target.make_caches()] == [RotatingKVCache, KVCache, RotatingKVCache]
    tokens = plain_greedy(gemma.target, PROMPTS[3], 32)
    assert len(set(tokens)) >= 8


@pytest.mark.parametrize("name", [None, *DRAFTERS])
def test_speculative_equals_plain_greedy(gemma, name):
    results = run(gemma, name, [RowRequest(p, max_tokens=MAX) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(gemma.target, prompt, MAX)
    if name not in (None, "dflash", "dflash2", "ngram"):  # ngram: no repeats to look up; dflash: untrained
        assert sum(r.accepted for r in results) > 0


def test_checkpoints_hold_mlx_lm_ring_snapshots(gemma):
    recorder = CheckpointRecorder()
    results = run(gemma, "deepspec", [RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for index, (prompt, result) in enumerate(zip(PROMPTS, results)):
        _, tokens, caches, _ = recorder.finish(index)
        assert [type(c) for c in caches] == [RotatingKVCache, KVCache, RotatingKVCache]
        reference = gemma.target.make_caches()
        gemma.target.model(mx.array([tokens]), cache=reference)
        for ours, theirs in zip(caches, reference):
            if isinstance(ours, RotatingKVCache):
                assert (ours.max_size, ours.keep, ours.keys.shape[2]) == (WINDOW, 0, min(len(tokens), WINDOW))
                theirs_keys = theirs._temporal_order(theirs.keys)[..., -min(len(tokens), WINDOW):, :]
                assert mx.allclose(ours.keys, theirs_keys, atol=1e-4).item()
        # mlx-lm itself continues from the snapshot exactly like the cold run
        full = prompt + result.tokens
        steps = generate_step(mx.array(full[len(tokens):]), gemma.target.model, max_tokens=4, prompt_cache=caches)
        assert [token for token, _ in steps] == plain_greedy(gemma.target, full, 4)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_restore_equals_cold(gemma, name):
    recorder = CheckpointRecorder()
    first = run(gemma, name, [RowRequest(p, max_tokens=9) for p in PROMPTS], on_checkpoint=recorder)
    repeat = []
    for index, prompt in enumerate(PROMPTS):
        _, tokens, caches, draft = recorder.boundary(index)
        repeat.append(RowRequest(prompt, caches, len(tokens), draft, max_tokens=MAX))
    for prompt, result in zip(PROMPTS, run(gemma, name, repeat)):
        assert result.tokens == plain_greedy(gemma.target, prompt, MAX)
        assert result.cached_tokens == len(prompt) - 1
    follow, requests, cold_drafter = [], [], []
    for index, (prompt, result) in enumerate(zip(PROMPTS, first)):
        _, tokens, caches, draft = recorder.finish(index)
        follow.append(prompt + result.tokens + [3 + index, 50])
        requests.append(RowRequest(follow[-1], caches, len(tokens), draft, max_tokens=MAX))
        cold_drafter.append(RowRequest(follow[-1], caches, len(tokens), None, max_tokens=MAX))
    for prompt, result in zip(follow, run(gemma, name, requests)):
        assert result.tokens == plain_greedy(gemma.target, prompt, MAX)
    for request, result in zip(cold_drafter, run(gemma, name, cold_drafter)):
        assert result.tokens == plain_greedy(gemma.target, request.prompt, MAX)
        if name == "assistant":  # the ring snapshot is cut back by one token to re-forward it
            assert result.cached_tokens == request.restored_tokens
        elif name in ("deepspec", "dflash", "dflash2", "qwen-mtp"):  # a cold row beside the restored target
            assert result.cached_tokens == request.restored_tokens


def test_assistant_cuts_a_ring_snapshot_back_by_one_token(gemma):
    recorder = CheckpointRecorder()
    run(gemma, None, [RowRequest(PROMPTS[2], max_tokens=2)], on_checkpoint=recorder)
    _, tokens, caches, _ = recorder.boundary(0)
    (result,) = run(gemma, "assistant", [RowRequest(PROMPTS[2], caches, len(tokens), None, max_tokens=MAX)])
    assert result.cached_tokens == len(PROMPTS[2]) - 2
    assert result.tokens == plain_greedy(gemma.target, PROMPTS[2], MAX)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_batches_with_random_restore_points(gemma, data):
    name = data.draw(st.sampled_from([None, "draft-model", "assistant", "ngram", "deepspec"]), label="provider")
    count = data.draw(st.integers(1, 3), label="rows")
    prompts = [data.draw(st.lists(st.integers(3, 255), min_size=1, max_size=14), label="prompt") for _ in range(count)]
    requests = []
    for prompt in prompts:
        restored = data.draw(st.integers(0, len(prompt) - 1), label="restored_tokens")
        if restored == 0:
            requests.append(RowRequest(prompt, max_tokens=8))
            continue
        recorder = CheckpointRecorder()
        run(gemma, name, [RowRequest(prompt[: restored + 1], max_tokens=1)], on_checkpoint=recorder)
        _, tokens, caches, draft = recorder.boundary(0)
        keep = data.draw(st.booleans(), label="keep draft checkpoint")
        requests.append(RowRequest(prompt, caches, restored, draft if keep else None, max_tokens=8))
    depth = data.draw(st.integers(0, 4), label="depth")
    for prompt, result in zip(prompts, run(gemma, name, requests, depth=depth)):
        assert result.tokens == plain_greedy(gemma.target, prompt, 8)


@pytest.mark.parametrize("name", ["assistant", "draft-model", "dflash"])
def test_generator_restored_equals_cold_also_after_reopen(gemma, tmp_path, name):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(gemma.target, p, MAX) for p in prompts]
    target_dir, drafter_dir = gemma.root / "target", gemma.drafter_dir(name)
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        for prompt, r in zip(follow, gen.generate(follow, max_tokens=MAX)):
            assert r.tokens == plain_greedy(gemma.target, prompt, MAX) and r.cached_tokens == len(prompt) - 3
        # ring snapshots are exact boundaries: a prompt that diverges inside a stored span finds no chunk prefix
        diverged = list(range(3, 38)) + [250, 251]
        (r,) = gen.generate([diverged], max_tokens=MAX)
        assert r.cached_tokens == 0 and r.tokens == plain_greedy(gemma.target, diverged, MAX)


def test_kv_quantization_of_a_sliding_window_target_is_refused(gemma):
    with pytest.raises(NotImplementedError, match="RotatingKVCache"):
        SpeculativeEngine(gemma.target, None, kv=KVOptions(kv_bits=4))

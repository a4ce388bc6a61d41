"""Gemma 4 text targets (gemma4_text: per-layer inputs, sliding window 6 < the prompts, and two trailing KV-shared
layers that hold no cache): logits bit-identical to mlx-lm, speculative == plain greedy, checkpoints in mlx-lm's
own cache layout (one cache per cache-holding layer; ring snapshots for sliding layers) that mlx-lm continues
from, and restored == cold on repeat, on an extended turn, after reopening and with warm and cold rows mixed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import KVOptions
from spec_cache.rows.target import DonorView
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import CheckpointRecorder, _identity_memo, build_tiny, plain_greedy  # noqa: F401

WINDOW = 6
DRAFTERS = {"ngram": ("ngram", {}), "draft-model": ("draft-model", {}), "draft-model-2": ("draft-model", {"layers": 2}),
            "assistant": ("assistant", {})}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 44)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9]]
MAX = 12


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """4 decoder layers: sliding, global, then a KV-shared sliding and a KV-shared global layer."""
    return build_tiny(tmp_path_factory.mktemp("tiny-gemma4"), "gemma4_text", num_layers=4, kv_shared_layers=2,
                      sliding_window=WINDOW, drafters=DRAFTERS)


def run(gemma4, name, requests, depth=4, **kwargs):
    engine = SpeculativeEngine(gemma4.target, gemma4.provider(name), draft_depth=depth, adaptive=False)
    return engine.run(requests, **kwargs)


def test_the_port_is_bit_identical_to_mlx_lm(gemma4):
    target = gemma4.target
    assert (target.num_layers, target.depth, target.layer_windows) == (2, 4, (WINDOW, None))
    assert [type(c) for c in target.make_caches()] == [RotatingKVCache, KVCache]
    assert target.model.model.embed_tokens_per_layer is not None  # per-layer inputs are exercised
    ours, theirs = target.make_caches(), target.model.make_cache()
    for ids in ([list(range(5, 14))], [[14]], [[15]], [[16, 17, 18]]):  # past the window: the rings wrap
        out = target.forward(mx.array(ids), ours, tap_layers=[3, -1])
        assert mx.array_equal(out.logits, target.model(mx.array(ids), cache=theirs)).item()
        assert out.taps[3].shape == out.taps[-1].shape == (1, len(ids[0]), target.hidden_size)
    assert len(set(plain_greedy(target, [5, 6, 7, 8], 32))) >= 8


@pytest.mark.parametrize("name", [None, *DRAFTERS])
def test_speculative_equals_plain_greedy(gemma4, name):
    results = run(gemma4, name, [RowRequest(p, max_tokens=MAX) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(gemma4.target, prompt, MAX)
    if name is not None:
        assert sum(r.drafted for r in results) > sum(r.accepted for r in results)  # rejected drafts rolled back
    if name in ("draft-model-2", "assistant"):
        assert sum(r.accepted for r in results) > 0


def test_checkpoints_are_mlx_lm_caches_it_continues_from(gemma4):
    recorder = CheckpointRecorder()
    results = run(gemma4, "draft-model", [RowRequest(p, max_tokens=MAX) for p in PROMPTS[:3]], on_checkpoint=recorder)
    for index, (prompt, result) in enumerate(zip(PROMPTS, results)):
        _, tokens, caches, _ = recorder.finish(index)
        assert [type(c) for c in caches] == [RotatingKVCache, KVCache]
        assert caches[0].max_size == WINDOW and caches[0].keys.shape[2] == min(len(tokens), WINDOW)
        full = prompt + result.tokens
        steps = generate_step(mx.array(full[len(tokens):]), gemma4.target.model, max_tokens=4, prompt_cache=caches)
        assert [token for token, _ in steps] == plain_greedy(gemma4.target, full, 4)


@pytest.mark.parametrize("name", [None, *DRAFTERS])
def test_restore_equals_cold(gemma4, name):
    recorder = CheckpointRecorder()
    prompts = PROMPTS[:4]
    first = run(gemma4, name, [RowRequest(p, max_tokens=7) for p in prompts], on_checkpoint=recorder)
    repeat = []
    for index, prompt in enumerate(prompts):
        _, tokens, caches, draft = recorder.boundary(index)
        repeat.append(RowRequest(prompt, caches, len(tokens), draft, max_tokens=MAX))
    for prompt, result in zip(prompts, run(gemma4, name, repeat)):
        assert result.tokens == plain_greedy(gemma4.target, prompt, MAX)
        assert result.cached_tokens == len(prompt) - 1
    follow, requests = [], []
    for index, (prompt, result) in enumerate(zip(prompts, first)):
        _, tokens, caches, draft = recorder.finish(index)
        follow.append(prompt + result.tokens + [3 + index, 50])
        requests.append(RowRequest(follow[-1], caches, len(tokens), draft if index % 2 else None, max_tokens=MAX))
    requests.append(RowRequest(list(range(60, 75)), max_tokens=MAX))  # a cold row beside the warm ones
    for request, result in zip(requests, run(gemma4, name, requests)):
        assert result.tokens == plain_greedy(gemma4.target, request.prompt, MAX)
        assert result.cached_tokens == request.restored_tokens


@pytest.mark.parametrize("name", ["ngram", "draft-model", "assistant"])
def test_generator_restored_equals_cold_also_after_reopen(gemma4, tmp_path, name):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(gemma4.target, p, MAX) for p in prompts]
    target_dir, drafter_dir = gemma4.root / "target", gemma4.drafter_dir(name)
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:  # a new SpecCache over the same directory
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 for p, r in zip(prompts, again))
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        mixed = follow + [list(range(100, 120))]
        for prompt, r in zip(mixed, gen.generate(mixed, max_tokens=MAX)):
            assert r.tokens == plain_greedy(gemma4.target, prompt, MAX)
            assert r.cached_tokens == (len(prompt) - 3 if prompt in follow else 0)


def test_assistant_blocks_are_the_target_layers_over_their_kv_sources(tmp_path):
    """The tiny assistant mirrors every decoder layer (Gemma 4 blocks; the KV-shared layers read the K/V of the
    layer they borrow from): given the target's layer input and K/V that include the token itself, each block
    computes exactly that layer's output (per-layer inputs off, which the assistant does not take)."""
    tiny = build_tiny(tmp_path, "gemma4_text", num_layers=4, kv_shared_layers=2, sliding_window=WINDOW,
                      per_layer_input_size=0, drafters={"assistant": ("assistant", {})})
    target, network = tiny.target, tiny.provider("assistant").network
    assert (network.config.block_style, network.config.donor_layers) == ("gemma4", (0, 1, 0, 1))
    assert network.config.intermediate_sizes == (256, 256, 512, 512)  # the KV-shared layers' double-wide MLPs
    ids = mx.array([[5, 9, 30, 31, 7]])
    caches = target.make_caches()
    out = target.forward(ids, caches, tap_layers=range(4))
    inputs = [target.embed(ids), *(out.taps[layer] for layer in range(3))]
    for block, (layer, donor) in enumerate(zip(network.layers, network.config.donor_layers)):
        view = DonorView(caches[donor].keys[..., :5, :], caches[donor].values[..., :5, :],
                         mx.ones((1, 1, 1, 5), dtype=mx.bool_), mx.array([5]))
        got = layer(inputs[block][:, -1:], view, target.rope(donor), mx.array([4]))
        assert mx.allclose(got, out.taps[block][:, -1:], atol=1e-5).item(), block


@pytest.mark.parametrize(("change", "message"), [
    ({"block_style": "gemma3"}, "block_style must be one of llama, gemma4"),
    ({"intermediate_sizes": [256]}, "intermediate_sizes must list one positive int per donor layer"),
    ({"intermediate_sizes": [256, 256, 0, 512]}, "intermediate_sizes must list one positive int per donor layer"),
])
def test_bad_assistant_block_config_is_refused(gemma4, change, message):
    from spec_cache.drafters.assistant import AssistantConfig

    config = gemma4.provider("assistant").config.to_dict()
    assert AssistantConfig.from_dict(config) == gemma4.provider("assistant").config  # round trip
    with pytest.raises(ValueError, match=message):
        AssistantConfig.from_dict({**config, **change})


def test_kv_quantization_of_gemma4_is_refused(gemma4):
    with pytest.raises(NotImplementedError, match="sliding"):
        SpeculativeEngine(gemma4.target, kv=KVOptions(kv_bits=8))

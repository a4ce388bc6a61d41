"""Projected-context drafters (DeepSpec, DFlash): the row context is the target's tapped hiddens projected into
the drafter's per-layer K/V, grown by accepted + 1 rows per round; checkpoints are validated on restore;
pairings and namespaces; speculative == plain greedy and restored == cold (the generic engine, row and generator
tests run both drafters too, through ``DRAFTERS``)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.drafters import detect_method, load_provider
from spec_cache.naming.identity import model_identity
from spec_cache.rows.protocol import RoundContext
from spec_cache.rows.target import TargetModel, TargetRows
from spec_cache.schemas import (
    CheckpointAttachment,
    DraftRowCheckpoint,
    SchemaError,
    encode_cache_headers,
    validate_checkpoint,
)
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

PROJECTED = ["deepspec", "dflash"]
MAX = 16


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, row, tokens, caches, draft):
        self.calls.append((row, list(tokens), caches, draft))

    def finish(self, row):
        return [call for call in self.calls if call[0] == row][-1]


def context_of(provider, target, tokens):
    """The drafter context a row covering ``tokens`` should hold: one target forward, its taps projected."""
    out = target.forward(mx.array([tokens]), target.make_caches(), tap_layers=provider.config.target_layer_ids)
    taps = mx.concatenate([out.taps[layer] for layer in provider.config.target_layer_ids], axis=-1)
    return provider.network.context_kv(taps, mx.array([0]))


@pytest.mark.parametrize("name", PROJECTED)
def test_checkpoint_is_the_projected_target_context(tiny, name):
    provider = tiny.provider(name)
    recorder = Recorder()
    results = SpeculativeEngine(tiny.target, provider, draft_depth=3).run(
        [RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for index, (prompt, result) in enumerate(zip(PROMPTS, results)):
        assert result.tokens == plain_greedy(tiny.target, prompt, MAX)
        _, tokens, _, checkpoint = recorder.finish(index)
        validate_checkpoint(checkpoint, expect_schema=provider.schema)
        tensors = checkpoint.attachment.tensors
        layers = provider.config.num_hidden_layers
        assert len(tensors) == 2 * layers and checkpoint.processed_tokens == len(tokens)
        expected = context_of(provider, tiny.target, tokens)
        for layer, (keys, values) in enumerate(expected):
            k, v = tensors[2 * layer], tensors[2 * layer + 1]
            assert k.shape == (1, provider.config.num_key_value_heads, len(tokens), provider.config.head_dim)
            # prefill rows and verify rows (accepted + 1 per round) come from different forwards: float noise only
            assert mx.allclose(k, keys, atol=1e-4).item() and mx.allclose(v, values, atol=1e-4).item()


def test_context_grows_by_accepted_plus_one_rows(tiny):
    provider = tiny.provider("deepspec")
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    group = provider.open(rows, [None, None])
    heads = [[5, 6, 7, 8], [9, 10]]
    group.prefill(heads, rows.prefill(heads, tap_layers=group.tap_layers))
    assert group.processed == (4, 2)
    window = [[9, 1, 2, 3], [11, 4, 5, 6]]
    out = rows.verify(window, tap_layers=group.tap_layers)
    group.commit([2, 0], RoundContext(window, out.hidden, out.taps))
    assert group.processed == (7, 3)
    first = group.capture(0)
    expected = context_of(provider, tiny.target, heads[0] + window[0][:3])
    assert mx.allclose(first.attachment.tensors[0], expected[0][0], atol=1e-4).item()
    assert provider.open(rows, [first, group.capture(1)]).processed == (7, 3)


@pytest.mark.parametrize("name", PROJECTED)
def test_batched_drafts_equal_single_row_drafts(tiny, name):
    """Rows with different context lengths draft in one batch exactly as they do alone (padding is masked)."""
    provider = tiny.provider(name)
    prompts = [[5, 6, 7, 8, 9, 10], [20], [30, 31, 32]]
    rows = TargetRows.from_row_caches(tiny.target, [None] * 3)
    group = provider.open(rows, [None] * 3)
    heads = [p[:-1] for p in prompts]
    group.prefill(heads, rows.prefill(heads, tap_layers=group.tap_layers))
    together = group.draft([p[-1] for p in prompts], 3)
    assert all(len(d) == 3 for d in together)
    for index, prompt in enumerate(prompts):
        alone = provider.open(rows, [group.capture(index)])
        assert alone.draft([prompt[-1]], 3) == [together[index]]


def test_dflash_drafts_at_most_its_block_width(tiny, tmp_path):
    write_tiny_drafter(tmp_path / "dflash3", "dflash", tiny.root / "target", gamma=3)
    provider = load_provider(tmp_path / "dflash3")
    assert provider.gamma == 3 and json.loads((tmp_path / "dflash3" / "dspark.json").read_text())["gamma"] == 3
    rows = TargetRows.from_row_caches(tiny.target, [None])
    group = provider.open(rows, [None])
    group.prefill([[5, 6, 7]], rows.prefill([[5, 6, 7]], tap_layers=group.tap_layers))
    assert [len(d) for d in group.draft([8], 6)] == [2]  # gamma - 1 masked positions
    assert [len(d) for d in group.draft([8], 1)] == [1]
    results = SpeculativeEngine(tiny.target, provider, draft_depth=6).run([RowRequest(PROMPTS[0], max_tokens=MAX)])
    assert results[0].tokens == plain_greedy(tiny.target, PROMPTS[0], MAX)


@pytest.mark.parametrize("name", PROJECTED)
def test_misaligned_or_foreign_context_is_refused(tiny, name):
    provider = tiny.provider(name)
    rows = TargetRows.from_row_caches(tiny.target, [None])
    group = provider.open(rows, [None])
    group.prefill([[5, 6, 7]], rows.prefill([[5, 6, 7]], tap_layers=group.tap_layers))
    good = group.capture(0)
    attachment = good.attachment
    metadata = dict(attachment.metadata)
    k, v = attachment.tensors
    cases = {
        "processed_tokens": DraftRowCheckpoint(4, attachment),
        "alignment": DraftRowCheckpoint(3, CheckpointAttachment(
            attachment.schema, dict(metadata, processedTokens=2), attachment.tensors)),
        "layer headers": DraftRowCheckpoint(3, CheckpointAttachment(
            attachment.schema, dict(metadata, cacheHeaders=encode_cache_headers(
                [{"kind": "kv", "offset": 3, "tensors": [0, 1]}, {"kind": "kv", "offset": 3, "tensors": [2, 3]}])),
            (k, v, k, v))),
        "heads x": DraftRowCheckpoint(3, CheckpointAttachment(
            attachment.schema, metadata, (mx.concatenate([k, k], axis=1), mx.concatenate([v, v], axis=1)))),
        "dtype": DraftRowCheckpoint(3, CheckpointAttachment(
            attachment.schema, metadata, (k.astype(mx.float16), v.astype(mx.float16)))),
        "codec": DraftRowCheckpoint(3, CheckpointAttachment(
            attachment.schema, dict(metadata, cacheCodecs="mlx-cache-v3"), attachment.tensors)),
    }
    before = group.processed
    for match, bad in cases.items():
        with pytest.raises(SchemaError, match=match if match != "codec" else "codec mismatch"):
            group.append([bad])
    assert group.processed == before
    other = "dflash-context-v1" if provider.schema == "deepspec-context-v1" else "deepspec-context-v1"
    with pytest.raises(SchemaError, match="schema"):
        provider.validate_checkpoint(DraftRowCheckpoint(3, CheckpointAttachment(other, metadata, attachment.tensors)))


@pytest.mark.parametrize("name", PROJECTED)
def test_drafter_for_another_target_depth_is_refused(tiny, tmp_path, name):
    deeper = write_tiny_target(tmp_path / "deeper", num_layers=3, tokenizer=False)
    write_tiny_drafter(tmp_path / "drafter", name, deeper)
    provider = load_provider(tmp_path / "drafter")
    family = {"deepspec": "DeepSpec", "dflash": "DFlash"}[name]
    message = f"{family} drafter was trained for a 3-layer target; this model has 2 layers"
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(tiny.target, provider)
    with pytest.raises(ValueError, match=message):
        Generator.load(tiny.root / "target", tmp_path / "drafter")
    # it fits the target it was made for
    results = SpeculativeEngine(TargetModel.load(deeper), provider).run([RowRequest(PROMPTS[0], max_tokens=4)])
    assert len(results[0].tokens) == 4


def test_namespaces_hash_the_family_config(tiny, tmp_path):
    deepspec, dflash = tiny.provider("deepspec"), tiny.provider("dflash")
    assert detect_method(tiny.drafter_dir("dflash")) == "dflash" and detect_method(tiny.drafter_dir("deepspec")) == "deepspec"
    assert deepspec.namespace == "deepspec-context-v1:" + model_identity(tiny.drafter_dir("deepspec"))
    assert dflash.namespace == "dflash-context-v1:" + model_identity(tiny.drafter_dir("dflash"), config_name="dspark.json")
    copy = tmp_path / "dflash-copy"
    shutil.copytree(tiny.drafter_dir("dflash"), copy)
    assert load_provider(copy).namespace == dflash.namespace  # the directory name does not count
    config = json.loads((copy / "dspark.json").read_text())
    (copy / "dspark.json").write_text(json.dumps(dict(config, gamma=5)))
    changed = load_provider(copy).namespace
    assert changed != dflash.namespace  # dspark.json does
    (copy / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')  # e.g. a Hugging Face config
    assert detect_method(copy) == "dflash" and load_provider(copy).namespace == changed  # it is not hashed


@pytest.mark.parametrize("name", PROJECTED)
def test_generator_restored_equals_cold_also_after_reopen(tiny, tmp_path, name):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(tiny.target, p, MAX) for p in prompts]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(tiny.root / "target", tiny.drafter_dir(name), cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(tiny.root / "target", tiny.drafter_dir(name), cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        turn = gen.generate(follow, max_tokens=MAX)
        for prompt, r in zip(follow, turn):
            assert r.tokens == plain_greedy(tiny.target, prompt, MAX)
            assert r.cached_tokens == len(prompt) - 3 and r.restored_drafter  # the first turn's finish state


def test_stored_context_is_bit_identical(tiny, tmp_path):
    recorder = Recorder()
    SpeculativeEngine(tiny.target, tiny.provider("dflash")).run([RowRequest(PROMPTS[0], max_tokens=5)],
                                                                 on_checkpoint=recorder)
    _, tokens, caches, checkpoint = recorder.finish(0)
    namespace = tiny.provider("dflash").namespace
    with SpecCache.open(tmp_path / "store") as cache:
        ns = cache.namespace("ab" * 32, "projected")
        assert cache.save(ns, tokens, caches, drafter_namespace=namespace, draft_checkpoint=checkpoint)
    with SpecCache.open(tmp_path / "store") as cache:
        hit = cache.restore(cache.namespace("ab" * 32, "projected"), tokens + [1], drafter_namespace=namespace)
    restored = hit.draft_checkpoint
    assert restored.processed_tokens == checkpoint.processed_tokens == len(tokens)
    assert dict(restored.attachment.metadata) == dict(checkpoint.attachment.metadata)
    for a, b in zip(checkpoint.attachment.tensors, restored.attachment.tensors):
        assert np.array_equal(np.array(a), np.array(b))

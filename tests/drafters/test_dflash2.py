"""DFlash 2 (``dflash2-context-v1``): DFlash's block drafter from a ``config.json``, projections quantized at
load (``draft_bits``), namespace ``dflash2-context-v1:<identity>:b<bits>``. Speculative == plain greedy;
restored == cold (engine with warm and cold rows in one batch, generator after reopening, extended turn);
a DFlash context is never restored into DFlash 2 or back; pairings refused with the seed's message."""

from __future__ import annotations

import inspect
import json
import shutil
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.drafters import METHODS, detect_method, load_provider
from spec_cache.naming.identity import model_identity
from spec_cache.rows.target import TargetModel
from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint, SchemaError
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from spec_cache.testing.tiny_writers import write_tiny_drafter_extra
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import PROMPTS, CheckpointRecorder, _identity_memo, plain_greedy  # noqa: F401

MAX = 12
FIXED = {"adaptive": False} if "adaptive" in inspect.signature(SpeculativeEngine).parameters else {}


class Setup:
    def __init__(self, root):
        self.root = root
        self.target_dir = write_tiny_target(root / "target", tokenizer=False)
        self.drafter_dir = write_tiny_drafter_extra(root / "dflash2", "dflash2", self.target_dir, gamma=4)
        self.float_dir = write_tiny_drafter_extra(root / "dflash2-b0", "dflash2", self.target_dir, draft_bits=0)
        self.target = TargetModel.load(self.target_dir)


@pytest.fixture(scope="module")
def d2(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("dflash2"))


def test_method_namespace_and_quantized_projections(d2):
    assert "dflash2" in METHODS and detect_method(d2.drafter_dir) == "dflash2"
    provider = load_provider(d2.drafter_dir)
    identity = model_identity(d2.drafter_dir, config_name="config.json")
    assert provider.namespace == f"dflash2-context-v1:{identity}:b4"
    assert isinstance(provider.network.fc, nn.QuantizedLinear) and provider.network.fc.bits == 4
    assert provider.dtype == mx.float32 and provider.gamma == 4
    unquantized = load_provider(d2.float_dir)
    assert unquantized.namespace.endswith(":b0") and isinstance(unquantized.network.fc, nn.Linear)
    assert not isinstance(unquantized.network.fc, nn.QuantizedLinear)


def test_bits_are_checked(d2, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(d2.drafter_dir, copy)
    assert load_provider(copy).namespace == load_provider(d2.drafter_dir).namespace  # the directory name: no
    config = json.loads((copy / "config.json").read_text())
    for bad in (7, True, "4"):
        (copy / "config.json").write_text(json.dumps(dict(config, draft_bits=bad)))
        with pytest.raises(ValueError, match="draft_bits must be one of"):
            load_provider(copy)
    (copy / "config.json").write_text(json.dumps(dict(config, draft_bits=8)))
    assert load_provider(copy).namespace.endswith(":b8")


@pytest.mark.parametrize("which", ["drafter_dir", "float_dir"])
def test_speculative_equals_plain_greedy_and_restored_equals_cold(d2, which):
    engine = SpeculativeEngine(d2.target, load_provider(getattr(d2, which)), draft_depth=3, **FIXED)
    recorder = CheckpointRecorder()
    cold = engine.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for prompt, result in zip(PROMPTS, cold):
        assert result.tokens == plain_greedy(d2.target, prompt, MAX)
    requests = []
    for index, prompt in enumerate(PROMPTS):
        if index == 1:
            requests.append(RowRequest(prompt, max_tokens=MAX))  # a cold row among warm ones
            continue
        _, tokens, caches, checkpoint = recorder.boundary(index)
        assert checkpoint.attachment.schema == "dflash2-context-v1"
        requests.append(RowRequest(prompt, restored_caches=caches, restored_tokens=len(tokens),
                                   draft_checkpoint=checkpoint, max_tokens=MAX))
    warm = engine.run(requests)
    for c, w in zip(cold, warm):
        assert (w.tokens, w.drafted, w.accepted) == (c.tokens, c.drafted, c.accepted)
    assert warm[0].cached_tokens == len(PROMPTS[0]) - 1 and warm[1].cached_tokens == 0


def test_generator_restored_equals_cold_also_after_reopen(d2, tmp_path):
    prompts = [list(range(3, 30)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(d2.target, p, MAX) for p in prompts]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(d2.target_dir, d2.drafter_dir, cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
    follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(d2.target_dir, d2.drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        for prompt, r in zip(follow, gen.generate(follow, max_tokens=MAX)):
            assert r.tokens == plain_greedy(d2.target, prompt, MAX)
            assert r.cached_tokens == len(prompt) - 3 and r.restored_drafter
        # the unquantized drafter is another namespace: its drafter part never crosses, the target part does
        # (the target-only namespace, issue 38)
        other = Generator.load(d2.target_dir, d2.float_dir, cache=cache)
        assert other.ns_key != gen.ns_key
        assert all(r.cached_tokens == len(p) - 1 and not r.restored_drafter
                   for p, r in zip(prompts, other.generate(prompts, max_tokens=2)))


def test_dflash_and_dflash2_contexts_never_cross(d2, tmp_path):
    write_tiny_drafter(tmp_path / "dflash", "dflash", d2.target_dir)
    dflash = load_provider(tmp_path / "dflash")
    dflash2 = load_provider(d2.float_dir)
    recorder = CheckpointRecorder()
    SpeculativeEngine(d2.target, dflash2, draft_depth=2).run([RowRequest(PROMPTS[0], max_tokens=3)],
                                                              on_checkpoint=recorder)
    checkpoint = recorder.finish(0)[3]
    with pytest.raises(SchemaError, match="expected 'dflash-context-v1'"):
        dflash.validate_checkpoint(checkpoint)
    attachment = checkpoint.attachment
    foreign = DraftRowCheckpoint(checkpoint.processed_tokens, CheckpointAttachment(
        "dflash-context-v1", attachment.metadata, attachment.tensors))
    with pytest.raises(SchemaError, match="expected 'dflash2-context-v1'"):
        dflash2.validate_checkpoint(foreign)
    misaligned = DraftRowCheckpoint(checkpoint.processed_tokens + 1, attachment)
    with pytest.raises(SchemaError, match="invalid projected context checkpoint alignment"):
        dflash2.validate_checkpoint(misaligned)


def test_drafter_for_another_target_depth_is_refused(d2, tmp_path):
    deeper = write_tiny_target(tmp_path / "deeper", num_layers=3, tokenizer=False)
    write_tiny_drafter_extra(tmp_path / "drafter", "dflash2", deeper)
    message = "DFlash 2 drafter was trained for a 3-layer target; this model has 2 layers - wrong"
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(d2.target, load_provider(tmp_path / "drafter"))


# ---------------------------------------------------------------------------------------------------------
# The drafter-side codec (spec-cache-kv-v1) round-trips quantized and recurrent caches bit for bit, as
# mlx-bun's drafter codecs do; a drafter that reads plain K/V refuses them by name.

def _quantized(tokens: int, converted_at: int | None) -> Any:
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    keys = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(1))
    cache.update_and_fetch(keys, keys * 2)
    quantized = cache.to_quantized(group_size=32, bits=4)
    if converted_at is not None:
        quantized.converted_at = converted_at
    return quantized


def _recurrent() -> Any:
    from mlx_lm.models.cache import ArraysCache

    cache = ArraysCache(3)
    cache.cache = [mx.arange(12, dtype=mx.float32).reshape(1, 3, 4), None, mx.ones((1, 2, 2), dtype=mx.bfloat16)]
    return cache


def test_codec_round_trips_quantized_and_recurrent_layers_bit_for_bit():
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from spec_cache.drafters.cache_codec import capture_kv_attachment, restore_kv_caches
    from spec_cache.schemas import validate_checkpoint

    plain = KVCache()
    plain.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)))
    caches = [plain, _quantized(5, 3), KVCache(), _recurrent(), _quantized(5, None)]
    metadata = {"processedTokens": 5, "pendingLast": False}
    attachment = capture_kv_attachment("standalone-draft-v1", caches, metadata)
    validate_checkpoint(DraftRowCheckpoint(5, attachment))
    headers = json.loads(attachment.metadata["cacheHeaders"])
    assert [h and h["kind"] for h in headers] == ["kv", "qkv", None, "arrays", "qkv"]
    assert headers[1]["minimumReusableOffset"] == 3 and "minimumReusableOffset" not in headers[4]
    assert (headers[1]["groupSize"], headers[1]["bits"]) == (32, 4) and headers[3]["present"] == "101"
    restored = restore_kv_caches(attachment)
    assert [type(c).__name__ for c in restored] == ["KVCache", "QuantizedKVCache", "KVCache", "ArraysCache",
                                                   "QuantizedKVCache"]
    again = capture_kv_attachment("standalone-draft-v1", restored, metadata)
    assert dict(again.metadata) == dict(attachment.metadata)
    for a, b in zip(attachment.tensors, again.tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    quantized = restored[1]
    assert isinstance(quantized, QuantizedKVCache) and quantized.offset == 5 and quantized.converted_at == 3
    assert mx.array_equal(mx.dequantize(*quantized.keys, group_size=32, bits=4),
                          mx.dequantize(*[p[..., :5, :] for p in caches[1].keys], group_size=32, bits=4)).item()
    assert restored[3].cache[1] is None and mx.array_equal(restored[3].cache[0], caches[3].cache[0]).item()


def test_plain_kv_drafters_refuse_other_layer_kinds(d2):
    from spec_cache.drafters.cache_codec import capture_kv_attachment

    provider = load_provider(d2.float_dir)
    attachment = capture_kv_attachment("dflash2-context-v1", [_quantized(4, None)], {"processedTokens": 4})
    with pytest.raises(SchemaError, match="kind"):
        provider.validate_checkpoint(DraftRowCheckpoint(4, attachment))
    with pytest.raises(NotImplementedError, match="spec-cache-kv-v1 writes kv, qkv, arrays"):
        capture_kv_attachment("dflash2-context-v1", [object()], {"processedTokens": 0})

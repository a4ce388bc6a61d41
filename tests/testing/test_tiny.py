"""Tiny model directories: real files that mlx-lm loads, deterministic from a seed, varied greedy output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load, load_model

from spec_cache.drafters import detect_method, load_provider
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import ARCHITECTURES, write_tiny_adapter, write_tiny_drafter, write_tiny_target
from tests.runtime_fixtures import _identity_memo, plain_greedy  # noqa: F401


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_target_directory_loads_with_mlx_lm(tmp_path, arch):
    path = write_tiny_target(tmp_path / arch, arch, seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    model, config = load_model(Path(path))
    assert config["model_type"] == arch and len(model.layers) == 2
    model_with_tokenizer, tokenizer = load(str(path))  # the tokenizer files make the offline load work
    assert tokenizer.eos_token_id == 2
    if arch != "qwen2":  # transformers 5 swaps in its byte-level Qwen2 tokenizer class for model_type qwen2
        assert tokenizer.encode("w5 w6", add_special_tokens=False) == [5, 6]
    target = TargetModel.load(path)
    assert target.kv_geometry(-1) == (1, 64)  # head_dim stays a multiple of the KV quantization group
    tokens = plain_greedy(target, [5, 6, 7, 8], 32)
    assert len(set(tokens)) >= 8, f"greedy output degenerates: {tokens}"
    logits = target.forward(mx.array([[5, 6, 7, 8]]), target.make_caches()).logits
    assert bool(mx.all(mx.isfinite(logits)))


def test_weights_follow_the_seed(tmp_path):
    a = write_tiny_target(tmp_path / "a", seed=1, tokenizer=False)
    b = write_tiny_target(tmp_path / "b", seed=1, tokenizer=False)
    c = write_tiny_target(tmp_path / "c", seed=2, tokenizer=False)
    read = lambda path: (path / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)
    assert (a / "config.json").read_text() == (c / "config.json").read_text()


def test_bad_target_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        write_tiny_target(tmp_path / "x", "mamba")
    with pytest.raises(ValueError, match="head_dim"):
        write_tiny_target(tmp_path / "x", "qwen2", hidden_size=96)
    with pytest.raises(ValueError, match="multiple"):
        write_tiny_target(tmp_path / "x", num_heads=3, num_kv_heads=2)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("target") / "t", seed=0, tokenizer=False)


def test_draft_model_is_a_real_mlx_lm_model_sharing_target_weights(tmp_path, target_dir):
    path = write_tiny_drafter(tmp_path / "draft", "draft-model", target_dir)
    model, config = load_model(Path(path))
    assert config["num_hidden_layers"] == 1 and len(model.layers) == 1
    target_weights = mx.load(str(target_dir / "model.safetensors"))
    draft_weights = mx.load(str(path / "model.safetensors"))
    assert set(draft_weights) < set(target_weights)
    assert all(mx.array_equal(draft_weights[name], target_weights[name]) for name in draft_weights)
    assert detect_method(path) == "draft-model"
    provider = load_provider(path)
    assert re.fullmatch(r"standalone-draft-v1:[0-9a-f]{64}", provider.namespace)


def test_assistant_directory(tmp_path, target_dir):
    path = write_tiny_drafter(tmp_path / "assistant", "assistant", target_dir, seed=4, donor_layers=[1])
    config = json.loads((path / "config.json").read_text())
    assert config["method"] == "assistant" and config["donor_layers"] == [1]
    provider = load_provider(path)
    assert re.fullmatch(r"gemma-assistant-v1:[0-9a-f]{64}", provider.namespace)
    weights = mx.load(str(path / "model.safetensors"))
    target_weights = mx.load(str(target_dir / "model.safetensors"))
    assert mx.array_equal(weights["layers.0.self_attn.q_proj.weight"],
                          target_weights["model.layers.1.self_attn.q_proj.weight"])
    other = load_provider(write_tiny_drafter(tmp_path / "other", "assistant", target_dir, seed=5, donor_layers=[1]))
    assert other.namespace != provider.namespace  # the namespace follows the weights


def test_ngram_directory_has_a_config_only(tmp_path, target_dir):
    path = write_tiny_drafter(tmp_path / "ngram", "ngram", target_dir, max=4, min=2)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    provider = load_provider(path)
    assert provider.namespace == "ngram-history-v1:4:2" and provider.supports_target_adapters


def test_bad_drafter_arguments(tmp_path, target_dir):
    with pytest.raises(ValueError, match="unknown drafter method"):
        write_tiny_drafter(tmp_path / "x", "medusa", target_dir)
    with pytest.raises(TypeError, match="unknown option"):
        write_tiny_drafter(tmp_path / "x", "draft-model", target_dir, depth=3)
    with pytest.raises(ValueError, match="layers"):
        write_tiny_drafter(tmp_path / "x", "draft-model", target_dir, layers=5)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"method": "medusa"}')
    with pytest.raises(ValueError, match="unknown drafter method"):
        load_provider(tmp_path / "odd")
    with pytest.raises(FileNotFoundError):
        load_provider(tmp_path / "missing")


def test_mismatched_pairing_is_refused(tmp_path, target_dir):
    from spec_cache.decode.engine import SpeculativeEngine

    wide = write_tiny_target(tmp_path / "wide", hidden_size=256, num_heads=4, tokenizer=False)
    assistant = load_provider(write_tiny_drafter(tmp_path / "assistant", "assistant", wide))
    with pytest.raises(ValueError, match="pairing"):
        SpeculativeEngine(TargetModel.load(target_dir), assistant)
    other_vocab = write_tiny_target(tmp_path / "vocab", vocab_size=300, tokenizer=False)
    draft = load_provider(write_tiny_drafter(tmp_path / "draft", "draft-model", other_vocab))
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(TargetModel.load(target_dir), draft)


@pytest.mark.parametrize("method,config_name", [("deepspec", "config.json"), ("dflash", "dspark.json")])
def test_projected_drafter_directory(tmp_path, target_dir, method, config_name):
    path = write_tiny_drafter(tmp_path / method, method, target_dir, seed=2, gamma=5)
    assert sorted(p.name for p in path.iterdir()) == sorted([config_name, "model.safetensors"])
    config = json.loads((path / config_name).read_text())
    assert config["method"] == method and config["num_target_layers"] == 2 and config["target_layer_ids"] == [0]
    assert ("gamma" in config) == (method == "dflash")
    provider = load_provider(path)
    assert detect_method(path) == method
    assert re.fullmatch(rf"{method}-context-v1:[0-9a-f]{{64}}", provider.namespace)
    weights = mx.load(str(path / "model.safetensors"))
    target_weights = mx.load(str(target_dir / "model.safetensors"))
    assert mx.array_equal(weights["layers.0.self_attn.k_proj.weight"],
                          target_weights["model.layers.1.self_attn.k_proj.weight"])


def test_adapter_directory_loads_with_mlx_lm_and_changes_the_output(tmp_path, target_dir):
    path = write_tiny_adapter(tmp_path / "lora", target_dir, seed=3)
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    model, _ = load_model(Path(target_dir))
    from mlx_lm.tuner.utils import load_adapters

    load_adapters(model, str(path))
    target = TargetModel.load(target_dir)
    adapted = TargetModel.from_model(model, target.config)
    prompt = [5, 6, 7, 8]
    assert plain_greedy(adapted, prompt, 12) != plain_greedy(target, prompt, 12)
    assert (path / "adapters.safetensors").read_bytes() == write_tiny_adapter(
        tmp_path / "again", target_dir, seed=3).joinpath("adapters.safetensors").read_bytes()


def test_bad_gemma4_and_hybrid_geometry(tmp_path):
    with pytest.raises(ValueError, match="kv_shared_layers"):
        write_tiny_target(tmp_path / "x", "gemma4_text", num_layers=2, kv_shared_layers=1)  # no global left
    with pytest.raises(ValueError, match="full_attention_interval"):
        write_tiny_target(tmp_path / "x", "qwen3_next", num_layers=2, full_attention_interval=3)


def test_gemma4_draft_model_is_the_targets_first_layers(tmp_path):
    target_dir = write_tiny_target(tmp_path / "t", "gemma4_text", num_layers=4, kv_shared_layers=2, tokenizer=False)
    path = write_tiny_drafter(tmp_path / "draft", "draft-model", target_dir)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_kv_shared_layers"]) == (1, 0)
    draft, target = TargetModel.load(path), TargetModel.load(target_dir)
    ids = mx.array([[5, 6, 7, 8, 9]])
    first_layer = target.forward(ids, target.make_caches(), tap_layers=[0], with_logits=False).taps[0]
    expected = target.model.model.norm(first_layer)
    assert mx.allclose(draft.forward(ids, draft.make_caches(), with_logits=False).hidden, expected, atol=1e-5).item()
    with pytest.raises(ValueError, match="layers must be in 1..2"):
        write_tiny_drafter(tmp_path / "x", "draft-model", target_dir, layers=3)  # a KV-shared layer has no K/V


def test_hybrid_draft_model_keeps_the_attention_layers(tmp_path):
    target_dir = write_tiny_target(tmp_path / "t", "qwen3_next", num_layers=4, tokenizer=False)
    path = write_tiny_drafter(tmp_path / "draft", "draft-model", target_dir, layers=2)
    draft = TargetModel.load(path)
    assert draft.recurrent_layers == () and draft.num_layers == 2  # plain K/V: the draft-model codec holds it
    weights, target_weights = mx.load(str(path / "model.safetensors")), mx.load(str(target_dir / "model.safetensors"))
    assert mx.array_equal(weights["model.layers.1.self_attn.q_proj.weight"],
                          target_weights["model.layers.3.self_attn.q_proj.weight"])


def test_mtp_and_dflash2_methods_go_to_the_drafter_writers(tmp_path, target_dir, monkeypatch):
    import spec_cache.testing.tiny_writers as writers

    calls = []
    monkeypatch.setattr(writers, "write_tiny_drafter_extra", lambda *args, **kw: calls.append((args, kw)) or args[0])
    for method in ("qwen-mtp", "dflash2"):
        assert write_tiny_drafter(tmp_path / method, method, target_dir, 3, bits=4) == tmp_path / method
    assert calls == [((tmp_path / m, m, target_dir, 3), {"bits": 4}) for m in ("qwen-mtp", "dflash2")]
    with pytest.raises(ValueError, match="qwen-mtp, dflash2"):
        write_tiny_drafter(tmp_path / "x", "medusa", target_dir)

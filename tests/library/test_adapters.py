"""LoRA adapters through mlx-lm: generation equals mlx-lm's own adapter loading, the adapter part of the prefix
namespace is ``id@<blake3 of adapter config and weights>`` joined with ``+``, adapter and base prefixes never
cross, and drafters that are not valid under a target adapter cache only the target part."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load

from spec_cache.convert.interop import import_prefix_namespace
from spec_cache.decode.generator import Generator
from spec_cache.drafters import open_provider
from spec_cache.naming.identity import artifact_identity
from spec_cache.naming.namespace import KVLayerConfig, KVOptions, cached_drafter_namespace, resolve_prefix_namespace
from spec_cache.rows.adapters import ADAPTER_IDENTITY_SEED, resolve_adapters
from spec_cache.testing.tiny import write_tiny_adapter, write_tiny_target
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny  # noqa: F401

PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
MAX = 12


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A tiny target with every drafter, and two adapters for it."""
    root = tmp_path_factory.mktemp("tiny-lora")
    tiny = build_tiny(root)
    write_tiny_target(root / "target", seed=0)  # the same weights again, now with tokenizer files for mlx_lm.load
    tiny.adapters = [write_tiny_adapter(root / "lora-a", root / "target", seed=1),
                     write_tiny_adapter(root / "lora-b", root / "target", seed=2, keys=("self_attn.k_proj",))]
    return tiny


def mlx_lm_greedy(model, prompt, max_tokens=MAX):
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def references(lora):
    adapted, _ = load(str(lora.root / "target"), adapter_path=str(lora.adapters[0]))
    base, _ = load(str(lora.root / "target"))
    return {"adapted": [mlx_lm_greedy(adapted, p) for p in PROMPTS], "base": [mlx_lm_greedy(base, p) for p in PROMPTS]}


def generator(lora, cache, method=None, adapters=None, **kwargs):
    adapters = [lora.adapters[0]] if adapters is None else adapters
    drafter = None if method is None else lora.drafter_dir(method)
    return Generator.load(lora.root / "target", drafter, cache=cache, adapters=adapters, **kwargs)


def test_adapter_output_equals_mlx_lm_and_differs_from_base(lora, references, tmp_path):
    assert references["adapted"] != references["base"]
    for method in (None, "ngram", "assistant"):
        results = generator(lora, None, method).generate(PROMPTS, max_tokens=MAX)
        assert [r.tokens for r in results] == references["adapted"]


def test_adapter_namespace_is_id_at_blake3_of_config_and_weights(lora, tmp_path):
    gen = generator(lora, None)
    (adapter,) = gen.adapters
    expected = artifact_identity(ADAPTER_IDENTITY_SEED, [(name, lora.adapters[0] / name)
                                                          for name in ("adapter_config.json", "adapters.safetensors")])
    assert adapter.namespace_entry == f"lora-a@{expected}" and re.fullmatch("[0-9a-f]{64}", expected)
    assert json.loads(gen.prefix_namespace)["adapters"] == f"lora-a@{expected}"
    assert json.loads(generator(lora, None, adapters="").prefix_namespace)["adapters"] == ""  # the base model
    # the revision follows the weights and the config, not the directory
    copy = tmp_path / "lora-a"
    shutil.copytree(lora.adapters[0], copy)
    assert resolve_adapters([copy])[0].revision == expected
    config = json.loads((copy / "adapter_config.json").read_text())
    config["lora_parameters"]["scale"] = 3.0
    (copy / "adapter_config.json").write_text(json.dumps(config))
    assert resolve_adapters([copy])[0].revision != expected
    renamed = resolve_adapters([("tone", lora.adapters[0])])[0]
    assert renamed.namespace_entry == f"tone@{expected}"


def test_stacked_adapters_join_with_plus_and_apply_in_order(lora):
    gen = generator(lora, None, adapters=lora.adapters)
    a, b = gen.adapters
    assert json.loads(gen.prefix_namespace)["adapters"] == f"lora-a@{a.revision}+lora-b@{b.revision}"
    model, _ = load(str(lora.root / "target"))
    load_adapters(model, str(lora.adapters[0]))
    model.update_modules(tree_unflatten([(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]))
    load_adapters(model, str(lora.adapters[1]))
    assert [r.tokens for r in gen.generate(PROMPTS, max_tokens=MAX)] == [mlx_lm_greedy(model, p) for p in PROMPTS]


@pytest.mark.parametrize("method,drafter_cached", [("ngram", True), ("assistant", False), ("deepspec", False)])
def test_restored_equals_cold_also_after_reopen(lora, references, tmp_path, method, drafter_cached):
    """ngram speculates under any adapter and caches its rows; the assistant and DeepSpec were trained for the
    base model, so only the target part is cached (the assistant re-forwards one token for its hidden; DeepSpec
    opens its row beside the restored target, over the tokens forwarded from there on)."""
    with SpecCache.open(tmp_path / "store") as cache:
        gen = generator(lora, cache, method)
        assert (gen.drafter_namespace is not None) == drafter_cached
        assert [r.tokens for r in gen.generate(PROMPTS, max_tokens=MAX)] == references["adapted"]
    with SpecCache.open(tmp_path / "store") as cache:
        warm = generator(lora, cache, method).generate(PROMPTS, max_tokens=MAX)
    assert [r.tokens for r in warm] == references["adapted"]
    for prompt, r in zip(PROMPTS, warm):
        assert r.restored_drafter == drafter_cached
        expected = {"ngram": len(prompt) - 1, "assistant": len(prompt) - 2, "deepspec": len(prompt) - 1}[method]
        assert r.cached_tokens == expected


def test_adapter_and_base_prefixes_never_cross(lora, references, tmp_path):
    with SpecCache.open(tmp_path / "store") as cache:
        generator(lora, cache, "ngram").generate(PROMPTS, max_tokens=MAX)
        base = generator(lora, cache, "ngram", adapters="").generate(PROMPTS, max_tokens=MAX)
        assert all(r.cached_tokens == 0 for r in base) and [r.tokens for r in base] == references["base"]
        stacked = generator(lora, cache, "ngram", adapters=lora.adapters).generate(PROMPTS, max_tokens=MAX)
        assert all(r.cached_tokens == 0 for r in stacked)
        again = generator(lora, cache, "ngram").generate(PROMPTS, max_tokens=MAX)
        assert all(r.cached_tokens == len(p) - 1 for p, r in zip(PROMPTS, again))


def test_bad_adapters_are_refused(lora, tmp_path):
    with pytest.raises(ValueError, match="not an adapter directory"):
        resolve_adapters("lora-a@" + "1" * 64)  # a namespace string alone would mislabel base-model output
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="adapters.safetensors"):
        resolve_adapters([tmp_path / "empty"])
    with pytest.raises(ValueError, match="distinct"):
        resolve_adapters([lora.adapters[0], ("lora-a", lora.adapters[1])])
    with pytest.raises(ValueError, match="free of"):
        resolve_adapters([("a+b", lora.adapters[0])])
    assert resolve_adapters("") == () and resolve_adapters(None) == ()


# The one namespace path: Generator.load and the mlx-lm import (interop.import_prefix_namespace) agree

IMPORT_KV = [KVOptions(), KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)]


@pytest.mark.parametrize("method", [None, "ngram", "ngram-dir", "assistant", "draft-model", "deepspec", "dflash"])
@pytest.mark.parametrize("stack", ["base", "one", "two"])
def test_import_namespace_is_the_generators(lora, method, stack):
    adapters = {"base": "", "one": [lora.adapters[0]], "two": lora.adapters}[stack]
    drafter = lora.drafter_dir("ngram") if method == "ngram-dir" else (
        None if method in (None, "ngram") else lora.drafter_dir(method))
    method_arg = "ngram" if method == "ngram" else None
    for kv in IMPORT_KV:
        gen = Generator.load(lora.root / "target", drafter, method_arg, kv=kv, adapters=adapters)
        assert import_prefix_namespace(drafter, method_arg, adapters, kv) == gen.prefix_namespace
        provider = open_provider(drafter, method_arg)
        assert resolve_prefix_namespace(provider, gen.adapters, kv) == gen.prefix_namespace
        assert cached_drafter_namespace(provider, gen.adapters) == gen.drafter_namespace


def test_import_namespace_refuses_what_generator_load_refuses(lora):
    with pytest.raises(ValueError, match="needs a drafter directory"):
        import_prefix_namespace(None, "assistant")
    with pytest.raises(ValueError, match="kv_bits must be >= 1"):
        import_prefix_namespace(kv={"kvBits": 0})
    with pytest.raises(ValueError, match="more than once"):
        import_prefix_namespace(kv=KVOptions(kv_config=(KVLayerConfig(0, 4), KVLayerConfig(0, 8))))
    with pytest.raises(ValueError, match="not an adapter directory"):
        import_prefix_namespace(adapters="lora-a@" + "1" * 64)

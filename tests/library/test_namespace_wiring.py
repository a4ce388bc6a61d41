"""Generator.load and ``spec-cache import-mlx-lm`` share one namespace path (``resolve_prefix_namespace``) and
refuse options that cannot run (``check_runnable``) before anything is registered (issue 11)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_model

from spec_cache.apps.cli import main as cli_main
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import KVLayerConfig, KVOptions
from spec_cache.store import maintenance
from spec_cache.testing.tiny import write_tiny_adapter, write_tiny_target
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny  # noqa: F401

PROMPT = list(range(3, 30))



@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("wiring")
    tiny = build_tiny(root, drafters={"assistant": ("assistant", {})})
    write_tiny_target(root / "target", seed=0)  # with tokenizer files
    tiny.adapter = write_tiny_adapter(root / "lora-a", root / "target", seed=1)
    return tiny


@pytest.mark.parametrize("kv", [KVOptions(kv_config=(KVLayerConfig(0, 4), KVLayerConfig(0, 8))),
                                KVOptions(kv_bits=0), KVOptions(kv_group_size=0)])
def test_generator_load_refuses_what_cannot_run_before_registering(lora, tmp_path, kv):
    with SpecCache.open(tmp_path / "store") as cache:
        with pytest.raises(ValueError, match="more than once|must be >= 1"):
            Generator.load(lora.root / "target", cache=cache, kv=kv)
    with SpecCache.open(tmp_path / "store") as cache:
        assert maintenance.namespaces(cache.store) == []  # refused before anything was registered


def test_cli_import_under_an_adapter_uses_the_generators_namespace(lora, tmp_path, capsys):
    target = lora.root / "target"
    model, _ = load_model(target)
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=caches)
    f = tmp_path / "mlx.safetensors"
    save_prompt_cache(str(f), caches, {"model": str(target), "tokenizer_config": "{}"})
    gen = Generator.load(target, lora.drafter_dir("assistant"), adapters=[lora.adapter])
    assert gen.drafter_namespace is None  # the assistant is not valid under a target adapter
    args = ["--cache", str(tmp_path / "store"), "import-mlx-lm", str(f), "--model", str(target), "--tokens",
            ",".join(map(str, PROMPT)), "--drafter", str(lora.drafter_dir("assistant")), "--adapter",
            str(lora.adapter), "--json"]
    assert cli_main(args) == 0
    assert json.loads(capsys.readouterr().out)["prefix_namespace"] == gen.prefix_namespace


def test_cli_import_refuses_a_method_without_its_directory(lora, tmp_path, capsys):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"")
    args = ["--cache", str(tmp_path / "store"), "import-mlx-lm", str(f), "--model", str(lora.root / "target"),
            "--tokens", "1,2", "--method", "assistant"]
    assert cli_main(args) == 2
    assert "needs a drafter directory" in capsys.readouterr().err

"""mlx-lm interop: exported files restore in mlx-lm to the same next-token logits; imported files resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_model

from spec_cache.apps.cli import main as cli_main
from spec_cache.convert.interop import InteropError, export_mlx_lm, import_mlx_lm
from spec_cache.decode.generator import Generator
from spec_cache.testing.tiny import write_tiny_target
from spec_cache.tiers.cache import SpecCache

PROMPT = list(range(3, 60))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("interop") / "target", seed=3)


def logits_after(model, caches, token):
    out = model(mx.array([[token]]), cache=caches)
    mx.eval(out)
    return out[0, -1]


def test_export_restores_in_mlx_lm_to_the_same_logits(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "memo"))
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target, cache=cache)
        gen.generate([PROMPT], max_tokens=2)
        out = tmp_path / "prompt.safetensors"
        covered = export_mlx_lm(cache, gen.ns_key, PROMPT[:-1], out, model=str(target), exact=True)
        assert covered == len(PROMPT) - 1
    caches, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == str(target) and json.loads(meta["spec_cache_tokens"]) == PROMPT[:-1]
    model, _ = load_model(Path(target))
    cold = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=cold)
    a, b = logits_after(model, caches, PROMPT[-1]), logits_after(model, cold, PROMPT[-1])
    assert bool(mx.array_equal(a, b).item())


def test_mlx_lm_generate_accepts_the_exported_file(target, tmp_path):
    store = tmp_path / "store"
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(PROMPT[:-1]))
    env_cache = ["--cache", str(store)]
    with SpecCache.open(store) as cache:
        gen = Generator.load(target, cache=cache)
        gen.generate([PROMPT], max_tokens=2)
        ns_hex = gen.ns_key.hex()
    out = tmp_path / "exported.safetensors"
    assert cli_main(env_cache + ["export-mlx-lm", ns_hex[:12], str(tokens_file), str(out), "--model", str(target),
                                 "--exact"]) == 0
    run = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(target), "--prompt-cache-file",
                          str(out), "--prompt", "w5", "--max-tokens", "4", "--ignore-chat-template"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Generation:" in run.stdout or "tokens-per-sec" in run.stdout


def test_import_of_an_mlx_lm_file_resumes_exactly(target, tmp_path):
    model, _ = load_model(Path(target))
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=caches)
    mx.eval([c.state for c in caches])
    f = tmp_path / "mlx.safetensors"
    save_prompt_cache(str(f), caches, {"model": str(target), "tokenizer_config": "{}"})
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target, cache=cache)
        ns = import_mlx_lm(cache, f, target, PROMPT[:-1], prefix_namespace=gen.prefix_namespace)
        assert ns == gen.ns_key
        (warm,) = gen.generate([PROMPT], max_tokens=6)
        assert warm.cached_tokens == len(PROMPT) - 1
        cold = Generator.load(target).generate([PROMPT], max_tokens=6)[0]
        assert warm.tokens == cold.tokens
        with pytest.raises(InteropError, match="covers 56 tokens, 10 token ids"):
            import_mlx_lm(cache, f, target, PROMPT[:10], prefix_namespace=gen.prefix_namespace)


def test_import_refuses_a_file_of_another_target(target, tmp_path):
    other = write_tiny_target(tmp_path / "other", seed=4)
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target, cache=cache)
        gen.generate([PROMPT], max_tokens=2)
        out = tmp_path / "x.safetensors"
        export_mlx_lm(cache, gen.ns_key, PROMPT[:-1], out)
        with pytest.raises(InteropError, match="exported for target"):
            import_mlx_lm(cache, out, other, PROMPT[:-1], prefix_namespace=gen.prefix_namespace)
        deeper = write_tiny_target(tmp_path / "deeper", seed=3, num_layers=3)
        f = tmp_path / "plain.safetensors"
        save_prompt_cache(str(f), load_prompt_cache(str(out)), {"model": "x", "tokenizer_config": "{}"})
        with pytest.raises(InteropError, match="holds 2 cache layers"):
            import_mlx_lm(cache, f, deeper, PROMPT[:-1], prefix_namespace=gen.prefix_namespace)


def test_import_cli_and_its_errors(target, tmp_path, capsys):
    model, _ = load_model(Path(target))
    caches = make_prompt_cache(model)
    model(mx.array([PROMPT[:20]]), cache=caches)
    f = tmp_path / "mlx.safetensors"
    save_prompt_cache(str(f), caches, {"model": str(target), "tokenizer_config": "{}"})
    base = ["--cache", str(tmp_path / "store")]
    tokens = ",".join(map(str, PROMPT[:20]))
    assert cli_main(base + ["import-mlx-lm", str(f), "--model", str(target), "--tokens", tokens, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 20 and out["prefix_namespace"].startswith('{"adapters":""')
    assert cli_main(base + ["import-mlx-lm", str(f), "--model", str(target), "--tokens", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "covers 20 tokens" in err[0]
    assert cli_main(base + ["import-mlx-lm", str(tmp_path / "nope"), "--model", str(target), "--tokens", "1"]) == 2
    capsys.readouterr()
    # a file mlx-lm wrote records no token ids: without --tokens, one line saying to give them
    assert cli_main(base + ["import-mlx-lm", str(f), "--model", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not record its token ids" in err[0] and "--tokens" in err[0]


def test_a_file_spec_cache_exported_imports_without_tokens(target, tmp_path, capsys):
    """Issue 36: ``import-mlx-lm`` demanded ``--tokens`` though ``export-mlx-lm`` had written them into the file
    (``spec_cache_tokens``); now they are read from it, and a restore from the imported entry is exact."""
    with SpecCache.open(tmp_path / "a") as cache:
        gen = Generator.load(target, cache=cache)
        gen.generate([PROMPT], max_tokens=2)
        out = tmp_path / "x.safetensors"
        covered = export_mlx_lm(cache, gen.ns_key, PROMPT[:-1], out)
    assert cli_main(["--cache", str(tmp_path / "b"), "--json", "import-mlx-lm", str(out), "--model",
                     str(target)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == covered
    with SpecCache.open(tmp_path / "b") as cache:
        (warm,) = Generator.load(target, cache=cache).generate([PROMPT], max_tokens=6)
    assert warm.cached_tokens == covered
    assert warm.tokens == Generator.load(target).generate([PROMPT], max_tokens=6)[0].tokens

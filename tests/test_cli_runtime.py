"""The runtime side of the CLI: the README's main job (demo) and `generate`, with their errors."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec_cache.cache import SpecCache
from spec_cache.cli import main as cli_main
from spec_cache.tiny import write_tiny_drafter, write_tiny_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-models")
    target = write_tiny_target(root / "target", seed=5)
    drafter = write_tiny_drafter(root / "assistant", "assistant", target, seed=5)
    return target, drafter


def test_demo_runs_and_reports_identical_tokens(tmp_path):
    run = subprocess.run([sys.executable, "-m", "spec_cache", "demo", "--cache", str(tmp_path / "store"),
                          "--max-tokens", "8"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens identical to the cold run: yes" in run.stdout
    assert "CACHED 2ND" in run.stdout and "verify:" in run.stdout
    ls = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "store"), "ls", "--json"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ls.returncode == 0 and json.loads(ls.stdout)["namespaces"][0]["hits"] > 0


def test_generate_resumes_on_the_second_call(models, tmp_path, capsys):
    target, drafter = models
    base = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--drafter", str(drafter),
            "--tokens", "5,6,7,8,9,10,11,12", "--max-tokens", "6", "--json"]
    assert cli_main(base) == 0
    first = json.loads(capsys.readouterr().out)
    assert cli_main(base) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == 7 and second["restored_drafter"]
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 6
    assert cli_main(base + ["--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == first["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent", "--tokens", "1,2"], "does not exist"),
    (["--method", "assistant", "--tokens", "1,2"], "needs --drafter"),
    (["--tokens", "1,-2"], "non-negative"),
    (["--tokens", "1,2", "--max-tokens", "0"], ">= 1"),
])
def test_generate_errors_are_one_line(models, tmp_path, capsys, args, message):
    target, _ = models
    argv = ["--cache", str(tmp_path / "store"), "generate"]
    if "--model" not in args:
        argv += ["--model", str(target)]
    assert cli_main(argv + args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("flag, expected", [(["--memory-bytes", "512M"], 512 << 20),
                                            (["--memory-bytes", "2G"], 2 << 30), (["--memory-bytes", "0"], 0),
                                            ([], None)])
def test_memory_bytes_reaches_speccache_open(models, tmp_path, capsys, monkeypatch, flag, expected):
    """``--memory-bytes N`` becomes ``SpecCache.open(..., memory_bytes=N)``; without it the library's default."""
    seen = []
    original = SpecCache.open.__func__
    takes_it = "memory_bytes" in inspect.signature(original).parameters

    def spy(cls, path, *args, **kwargs):
        seen.append(kwargs.get("memory_bytes"))
        if not takes_it:
            kwargs.pop("memory_bytes", None)
        return original(cls, path, *args, **kwargs)
    monkeypatch.setattr(SpecCache, "open", classmethod(spy))
    target, _ = models
    argv = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--method", "ngram",
            "--tokens", "5,6,7,8", "--max-tokens", "2", "--json", *flag]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert seen == [expected]


def test_memory_bytes_bad_size_is_a_usage_error(models, tmp_path, capsys):
    target, _ = models
    assert cli_main(["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--tokens", "1,2",
                     "--memory-bytes", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err


@pytest.mark.skipif("memory_bytes" not in inspect.signature(SpecCache.open).parameters,
                    reason="SpecCache.open does not take memory_bytes yet (the memory tier is being added)")
def test_generate_with_a_memory_tier_resumes(models, tmp_path, capsys):
    target, drafter = models
    base = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--drafter", str(drafter),
            "--tokens", "5,6,7,8,9,10,11,12", "--max-tokens", "4", "--json"]
    runs = []
    for memory in ("0", "64M", "64M"):
        assert cli_main(base + ["--memory-bytes", memory]) == 0, capsys.readouterr().err
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["cached_tokens"] == 0 and runs[1]["cached_tokens"] == runs[2]["cached_tokens"] == 7
    assert runs[0]["tokens"] == runs[1]["tokens"] == runs[2]["tokens"]

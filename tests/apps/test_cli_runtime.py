"""The runtime side of the CLI: the README's main job (demo) and `generate`, with their errors."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spec_cache.apps.cli import main as cli_main
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from spec_cache.tiers.cache import SpecCache

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-models")
    target = write_tiny_target(root / "target", seed=5)
    drafter = write_tiny_drafter(root / "assistant", "assistant", target, seed=5)
    return target, drafter


def test_demo_runs_and_reports_identical_tokens(tmp_path):
    temp = tmp_path / "tmp"  # the demo's own temporary directory goes here: it must be gone afterwards
    temp.mkdir()
    run = subprocess.run([sys.executable, "-m", "spec_cache", "demo", "--cache", str(tmp_path / "store"),
                          "--max-tokens", "8"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "TMPDIR": str(temp)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens identical to the cold run: yes" in run.stdout
    assert "CACHED 2ND" in run.stdout and "verify:" in run.stdout
    assert "DRAFTED/ACC  draft tokens proposed" in run.stdout  # the columns are explained
    assert "TTFT per batch" in run.stdout and "tok/s" in run.stdout
    assert f"spec-cache --cache {tmp_path / 'store'} ls" in run.stdout
    progress = [line for line in run.stderr.splitlines() if line.startswith("[demo] ")]
    assert len(progress) >= 2 * 3 * 2 and "[demo]" not in run.stdout  # a start and an end line per step
    assert list(temp.glob("spec-cache-demo-*")) == []  # no work directory left behind (MLX keeps its own "mlx")
    ls = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "store"), "ls", "--json"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    hits = json.loads(ls.stdout)["namespaces"][0]["hits"]
    assert ls.returncode == 0 and hits > 0
    assert f"; hits {hits}, misses" in run.stdout  # the summary counts this run's hits (it said 0 before a flush)


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
    (["--tokens", "1,2", "--adapter", "nodir"], "adapter directory nodir does not exist"),
    (["--tokens", "1,2", "--temperature", "-1"], ">= 0"),
    (["--tokens", "1,2", "--top-p", "0"], "(0, 1]"),
    (["--prompt-file", "/nonexistent/prompts.txt"], "no such file"),
    ([], "needs a prompt"),
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


def test_generate_writes_text_to_stdout_and_its_summary_to_stderr(models, tmp_path, capsys):
    target, _ = models
    argv = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--max-tokens", "3"]
    assert cli_main(argv + ["--tokens", "5,6,7,8"]) == 0
    out, err = capsys.readouterr()
    # token ids in: the text out, since the model has a tokenizer (mlx_lm.generate prints text too)
    assert len(out.splitlines()) == 1 and all(w.startswith("w") for w in out.split()) and out.split()
    assert "[prompt 1: 4 tokens, 0 from the cache" in err and "tok/s" in err
    assert cli_main(argv + ["--prompt", "w5 w6 w7"]) == 0  # the tiny target's tokenizer: words w3..w255
    out, err = capsys.readouterr()
    assert out.strip() and "tok/s" not in out and "tok/s" in err


def test_generate_reads_the_prompt_from_stdin_for_a_dash(models, tmp_path, capsys, monkeypatch):
    """``--prompt -`` reads stdin, as mlx_lm.generate does (issue 36: it was the one-character prompt "-")."""
    import io

    target, _ = models
    argv = ["generate", "--no-cache", "--model", str(target), "--max-tokens", "4"]
    assert cli_main(argv + ["--prompt", "w5 w6 w7"]) == 0
    direct, err = capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("w5 w6 w7\n"))
    assert cli_main(argv + ["--prompt", "-"]) == 0
    piped, piped_err = capsys.readouterr()
    assert piped == direct and err.split("tokens,")[0] == piped_err.split("tokens,")[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert cli_main(argv + ["--prompt", "-"]) == 2
    assert "stdin held no prompt text" in capsys.readouterr().err


def test_generate_takes_mlx_lm_top_k_and_min_p(models, tmp_path, capsys):
    """``--top-k`` / ``--min-p`` (mlx_lm.generate's flags, issue 36): a hot ``--top-k 1`` or ``--min-p 1`` run
    is the greedy one; a bad value is one line, exit 2."""
    target, _ = models
    argv = ["generate", "--no-cache", "--model", str(target), "--max-tokens", "6", "--tokens", "5,6,7"]
    outs = []
    for extra in ([], ["--temperature", "1.5", "--top-k", "1", "--seed", "3"],
                  ["--temperature", "1.5", "--min-p", "1", "--seed", "3"], ["--temperature", "1.5", "--seed", "3"]):
        assert cli_main(argv + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] != outs[3]
    for bad in (["--top-k", "-2"], ["--min-p", "2"]):
        assert cli_main(argv + bad) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_generate_several_prompts_in_one_batch(models, tmp_path, capsys):
    target, _ = models
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text("[9, 10, 11, 12]")
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("w5 w6 w7\n\nw8 w9\n")
    base = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--max-tokens", "3", "--json",
            "--raw"]  # the token counts below are of the bare text (no chat template)
    assert cli_main(base + ["--tokens", "5,6,7", "--tokens", str(tokens_file), "--prompt", "w20 w21",
                            "--prompt-file", str(prompts_file)]) == 0
    d = json.loads(capsys.readouterr().out)
    # --prompt, then --prompt-file's lines, then the --tokens prompts
    assert [r["prompt_tokens"] for r in d["results"]] == [2, 3, 2, 3, 4]
    assert all(len(r["tokens"]) == 3 and isinstance(r["text"], str) for r in d["results"])
    assert d["generated_tokens"] == 15 and d["tokens_per_s"] > 0 and d["tokens"] == d["results"][0]["tokens"]
    assert cli_main(base + ["--no-cache", "--tokens", "5,6,7"]) == 0  # alone: the tokens it had in the batch
    assert json.loads(capsys.readouterr().out)["results"][0]["tokens"] == d["results"][3]["tokens"]


def test_generate_sampling_options(models, tmp_path, capsys):
    target, _ = models
    argv = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--tokens", "5,6,7,8",
            "--max-tokens", "6", "--json", "--temperature", "1.5", "--top-p", "0.95"]
    runs = []
    for seed in ("1", "1", "2"):
        assert cli_main(argv + ["--seed", seed]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1]  # a seed reproduces its tokens (restored from the cache the second time)
    assert cli_main(argv[:-4] + ["--no-cache"]) == 0
    greedy = json.loads(capsys.readouterr().out)["tokens"]
    assert greedy != runs[0] or greedy != runs[2]  # temperature 1.5 over a random model is not its argmax


def test_generate_stop_strings_cut_the_text(models, tmp_path, capsys):
    target, _ = models
    argv = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--prompt", "w5 w6 w7",
            "--max-tokens", "6", "--json"]
    assert cli_main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    stop = full["text"].split()[2]  # the third generated word
    assert cli_main(argv + ["--stop", stop, "--stop", "never-there"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["stopped"] and cut["text"] == full["text"][:full["text"].index(stop)]
    n = len(cut["tokens"])  # decoding stopped at the stop string's round (issue 36), not at --max-tokens
    assert n < len(full["tokens"]) and cut["tokens"] == full["tokens"][:n]


def test_generate_max_bytes_is_recorded_with_the_store(models, tmp_path, capsys):
    target, _ = models
    argv = ["--cache", str(tmp_path / "store"), "generate", "--model", str(target), "--tokens", "5,6,7",
            "--max-tokens", "2", "--max-bytes", "64MiB"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert cli_main(["--cache", str(tmp_path / "store"), "--json", "stats"]) == 0
    assert json.loads(capsys.readouterr().out)["max_bytes"] == 64 << 20


def test_generate_names_what_is_wrong_with_a_model_or_drafter(models, tmp_path, capsys):
    target, drafter = models
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{oops")
    base = ["--cache", str(tmp_path / "store"), "generate", "--tokens", "5,6", "--max-tokens", "2"]
    for args, words in (([ "--model", str(bad)], [str(bad / "config.json"), "not valid JSON"]),
                        (["--model", str(target), "--drafter", str(drafter), "--method", "draft-model"],
                         ["not a 'draft-model' drafter", "'model_type'"])):
        assert cli_main(base + args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


def test_a_failing_generate_leaves_a_good_store_as_it_was(models, tmp_path, capsys):
    import hashlib

    target, drafter = models
    store = tmp_path / "store"
    base = ["--cache", str(store), "generate", "--model", str(target), "--tokens", "5,6,7", "--max-tokens", "2"]
    assert cli_main(base + ["--drafter", str(drafter)]) == 0
    before = hashlib.sha256((store / "data.mdb").read_bytes()).hexdigest()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2")
    for args in (["--drafter", str(drafter), "--method", "draft-model"], ["--adapter", str(tmp_path / "nodir")],
                 ["--temperature", "-3"], ["--top-p", "2"], ["--drafter", str(tmp_path / "nodir")],
                 ["--model", str(bad)]):
        assert cli_main(base + args) == 2, args
    capsys.readouterr()
    assert hashlib.sha256((store / "data.mdb").read_bytes()).hexdigest() == before

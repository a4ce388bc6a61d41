"""Crafted GGUF files never crash or hang the converter (issue 37 item 5): a corpus of hostile files, each refused
with one :class:`InvalidGGUF` / :class:`UnsupportedGGUF` line.

Why subprocesses: the attacker's files crashed the process inside ``mx.load``'s C reader (SIGSEGV on a header that
claims more metadata entries than it holds, SIGFPE on a zero alignment, an unbounded loop on nested arrays), which
no ``pytest.raises`` can observe. Every file is converted (and, if it converts, loaded) in a child process; a
signal, a timeout or any error other than the module's own one-line refusal fails the test, naming the file. The
files are batched in one child (it restarts past a file that killed it), so the corpus costs seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.library.gguf_corpus import metadata_cases, mutations
from tests.library.test_gguf import write_synthetic_gguf

ROOT = Path(__file__).resolve().parents[2]

#: converts each file named on the command line (into argv[1]/<stem>), loads what converts, prints one JSON line
#: before ("start") and after ("result") each
CHILD = r"""
import json, sys
from pathlib import Path
from spec_cache.convert import gguf as conv
for path in sys.argv[2:]:
    print(json.dumps({"start": path}), flush=True)
    try:
        out = conv.convert(path, Path(sys.argv[1]) / Path(path).stem, force=True)
        from mlx_lm.utils import load
        load(str(out))
        result = "ok"
    except conv.UnsupportedGGUF as error:
        result = "refused " + type(error).__name__ + ": " + str(error)
    except BaseException as error:
        result = "other " + type(error).__name__ + ": " + str(error)
    print(json.dumps({"file": path, "result": result}), flush=True)
"""


def _run_all(files: list[Path], out: Path, budget_s: float = 150.0) -> dict[str, str]:
    """file name -> "ok" / "refused ..." / "other ..." / "signal N" / "timeout" for every file, in as few child
    processes as the crashes allow."""
    results: dict[str, str] = {}
    pending = [str(f) for f in files]
    deadline = time.monotonic() + budget_s
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    while pending:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(out), *pending], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        try:
            stdout, _ = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, _ = child.communicate()
        started = None
        for line in stdout.splitlines():
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                results[Path(record["file"]).name] = record["result"]
                started = None
        done = {str(f) for f in files if Path(f).name in results}
        if started is not None:  # the child died (or hung) inside this file
            results[Path(started).name] = (f"signal {signal.Signals(-child.returncode).name}"
                                           if child.returncode and child.returncode < 0 else "timeout")
            done.add(started)
        elif child.returncode != 0 and not stdout:
            raise AssertionError(f"the converter child failed before any file (exit {child.returncode})")
        pending = [p for p in pending if p not in done]
        if time.monotonic() > deadline:
            for p in pending:
                results[Path(p).name] = "timeout"
            break
    return results


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[Path]]:
    """The valid base file and every crafted file (byte mutations of it, and metadata the header parses)."""
    root = tmp_path_factory.mktemp("gguf-corpus")
    base, _ = write_synthetic_gguf(root / "base")
    files = []
    for name, data in mutations(base.read_bytes()).items():
        path = root / "files" / f"{name}.gguf"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        files.append(path)
    for name, overrides in metadata_cases().items():
        made, _ = write_synthetic_gguf(root / "meta" / name, **overrides)
        files.append(made.rename(root / "files" / f"meta-{name}.gguf"))
    return base, files


def test_every_crafted_file_is_refused_in_one_line_never_a_crash_or_a_hang(corpus, tmp_path):
    base, files = corpus
    assert len(files) >= 80  # the attacker tried 80
    results = _run_all([base, *files], tmp_path / "out")
    assert results[base.name] == "ok", results[base.name]  # the control: the unmutated file converts and loads
    bad = {name: result for name, result in results.items()
           if name != base.name and not result.startswith(("refused InvalidGGUF: ", "refused UnsupportedGGUF: "))}
    assert not bad, f"{len(bad)} of {len(files)} crafted files not refused in one line: {bad}"
    multi = {name: result for name, result in results.items() if "\n" in result}
    assert not multi


def test_check_gguf_reads_the_base_file_and_names_the_first_problem(corpus):
    from spec_cache.convert.gguf import InvalidGGUF, check_gguf

    base, files = corpus
    metadata, tensors = check_gguf(base)
    assert metadata["general.architecture"] == "llama" and tensors["token_embd.weight"] == ("F32", (128, 260))
    by_name = {f.stem: f for f in files}
    for name, message in (("kv-count-plus-one", "tensor 0's name claims"), ("n-dims-0", "has 0 dims"),
                          ("meta-alignment-0", "general.alignment 0"), ("tensor-type-4", "unknown type id 4"),
                          ("array-item-type-9", "array of arrays"), ("tensor-offset-max", "offset")):
        with pytest.raises(InvalidGGUF, match=message):
            check_gguf(by_name[name])


def test_the_tokenizer_check_refuses_an_unknown_token_past_the_vocabulary_and_a_token_twice(corpus, tmp_path):
    """The attacker's pass: both converted and loaded before (the padding id out of range was already refused)."""
    from spec_cache.convert.gguf import InvalidGGUF, convert

    _, files = corpus
    by_name = {f.stem: f for f in files}
    for name, message in (("meta-unk-99999", r"unknown_token_id is 99999 \(expected 0 to 259\)"),
                          ("meta-tokens-duplicate", "holds 'a' twice"),
                          ("meta-tokens-duplicate-one", r"holds '<s>' twice \(again at id 2\)")):
        with pytest.raises(InvalidGGUF, match=message):
            convert(by_name[name], tmp_path / name)
        assert not (tmp_path / name).exists()


def test_convert_gguf_cli_exits_2_with_one_line_for_crafted_files(corpus, tmp_path):
    """The command line an attacker's file reaches: exit 2, one ``convert-gguf:`` line on stderr, nothing written."""
    _, files = corpus
    by_name = {f.stem: f for f in files}
    for name in ("kv-count-plus-one", "meta-alignment-0", "meta-block-count-1e9"):
        done = subprocess.run([sys.executable, "-m", "spec_cache.apps.gguf_cli", str(by_name[name]),
                               str(tmp_path / name)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 2, (name, done.returncode, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("convert-gguf: "), (name, done.stderr)
        assert not (tmp_path / name).exists()


def test_the_real_files_have_distinct_tokens_and_in_range_special_ids():
    """The refusals of the attacker's pass (a token string twice, an unknown token id past the vocabulary) refuse
    nothing a real file has: SmolLM2's and Gemma 3's GGUFs (each skipped when absent) pass the tokenizer check."""
    from spec_cache.apps.demo_real import find_smollm2_gguf
    from spec_cache.convert.gguf import _check_tokenizer, check_gguf
    from tests.library.test_gguf import find_gemma3_gguf

    paths = [p for p in (find_smollm2_gguf(), find_gemma3_gguf()) if p is not None]
    if not paths:
        pytest.skip("no real GGUF file here")
    for path in paths:
        metadata, tensors = check_gguf(path)
        tokens = metadata["tokenizer.ggml.tokens"]
        assert len(set(tokens)) == len(tokens)
        assert 0 <= metadata["tokenizer.ggml.unknown_token_id"] < len(tokens)
        _check_tokenizer(metadata, len(tokens))


def test_the_real_file_passes_the_structure_check():
    from spec_cache.apps.demo_real import SMOLLM2_FILE, find_smollm2_gguf
    from spec_cache.convert.gguf import check_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_FILE} absent")
    metadata, tensors = check_gguf(path)
    assert metadata["general.architecture"] == "llama" and len(tensors) == 272

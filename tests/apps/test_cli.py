"""Tests for the ``spec-cache`` CLI: every inspection command in a fresh process that never imports MLX, exit
codes, one-line errors, and ``--json`` output that is one JSON object."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import blake3
import lmdb
import msgpack
import numpy as np
import pytest

from spec_cache.schemas import NGRAM_HISTORY_V1, CheckpointAttachment
from spec_cache.store import LayerState, Store, Tensor

REPO = Path(__file__).resolve().parents[2]
NS_A = bytes.fromhex("abcd01") + blake3.blake3(b"a").digest()[:29]
NS_B = bytes.fromhex("abcd02") + blake3.blake3(b"b").digest()[:29]
DRAFTER = "ngram-history-v1:3:1"

# Runs the CLI's main() in a fresh interpreter, then fails if MLX (or mlx-lm) got imported on the way.
WRAPPER = """
import sys
from spec_cache.apps.cli import main
rc = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm"))
if loaded:
    print("MLX WAS IMPORTED: " + ", ".join(loaded), file=sys.stderr)
    sys.exit(99)
sys.exit(rc)
"""


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e.pop("SPEC_CACHE_DIR", None)
    e.update(SPEC_CACHE_IDENTITY_DIR=str(tmp_path / "identity-memo"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
             HOME=str(tmp_path / "home"))
    return e


@pytest.fixture
def cli(env):
    def run(*args, extra_env=None):
        return subprocess.run([sys.executable, "-c", WRAPPER, *map(str, args)], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**env, **(extra_env or {})})
    return run


def layers(tokens):
    t = np.asarray(tokens, np.float32)[None, None, :, None] * np.ones((1, 2, 1, 4), np.float32)
    return [LayerState("kv", {}, [Tensor.from_numpy(t), Tensor.from_numpy(-t)], token_axis=2)]


@pytest.fixture
def cache(tmp_path):
    """A closed store on disk: namespace A with 3 entries (one pinned, one with a drafter part), B with 1."""
    path = tmp_path / "cache"
    with Store.open(path, chunk_tokens=4, durable=False) as store:
        store.register_namespace(NS_A, target="a" * 64, prefix_namespace='{"method":"a"}')
        store.register_namespace(NS_B, target="b" * 64, prefix_namespace='{"method":"b"}', tenant=True)
        for i, n in enumerate((6, 9, 13)):
            t = list(range(i * 100, i * 100 + n))
            drafter = (DRAFTER, CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1},
                                                     (np.asarray(t, np.int32),))) if i == 1 else None
            store.put(NS_A, t, layers(t), drafter=drafter, pin=(i == 0))
        store.put(NS_B, [7, 7, 7], layers([7, 7, 7]))
        store.fetch(NS_A, list(range(6)))
        store.fetch(NS_A, [999])
    return path


def ok(out, code: int = 0) -> str:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    return out.stdout


def one_json(out, code: int = 0) -> dict:
    text = ok(out, code)
    obj = json.loads(text)
    assert isinstance(obj, dict)
    assert len(text.strip().splitlines()) == 1  # one object, one line
    return obj


def usage_error(out, *words) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("spec-cache: error: ")
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# --- help and argument errors -------------------------------------------------------------------------------------


def test_python_m_spec_cache_help(env):
    out = subprocess.run([sys.executable, "-m", "spec_cache", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0 and out.stderr == ""
    for command in ("ls", "show", "stats", "verify", "evict", "gc", "identity", "demo"):
        assert re.search(rf"\b{command}\b", out.stdout), command
    sub = subprocess.run([sys.executable, "-m", "spec_cache", "evict", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=env)
    assert sub.returncode == 0 and "--older-than" in sub.stdout and "--to-size" in sub.stdout


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["ls", "--bogus"], ["show"], ["evict", "--to-size"],
                                  ["evict", "--to-size", "12XB"], ["evict", "--older-than", "soon"],
                                  ["identity"], ["--cache"]])
def test_malformed_arguments(cli, cache, args):
    usage_error(cli("--cache", cache, *args) if args != ["--cache"] else cli(*args))


# --- inspection ---------------------------------------------------------------------------------------------------


def test_ls(cli, cache):
    human = ok(cli("--cache", cache, "ls"))
    assert NS_A.hex()[:16] in human and NS_B.hex()[:16] in human and "ENTRIES" in human
    for args in (("--cache", cache, "--json", "ls"), ("--cache", cache, "ls", "--json"),
                 ("ls", "--cache", cache, "--json")):
        obj = one_json(cli(*args))
        rows = {r["key"]: r for r in obj["namespaces"]}
        assert set(rows) == {NS_A.hex(), NS_B.hex()}
        a = rows[NS_A.hex()]
        assert (a["entries"], a["hits"], a["misses"], a["target"]) == (3, 1, 1, "a" * 64)
        assert a["bytes"] > 0 and a["last_use_ns"] > 0 and rows[NS_B.hex()]["tenant"] is True


def test_ls_wide_shows_what_tells_namespaces_apart(cli, cache):
    human = ok(cli("--cache", cache, "ls"))
    assert NS_A.hex() not in human and "a" * 64 not in human  # cut to fit a terminal
    wide = ok(cli("--cache", cache, "ls", "--wide"))
    assert NS_A.hex() in wide and NS_B.hex() in wide and "a" * 64 in wide and '{"method":"a"}' in wide
    with Store.open(cache, durable=False) as store:  # a prefix namespace longer than the 60 columns of plain ls
        store.register_namespace(bytes(32), target="c" * 64, prefix_namespace='{"x":"' + "y" * 80 + '"}')
        store.put(bytes(32), [1, 2, 3], layers([1, 2, 3]))
    assert "y" * 80 not in ok(cli("--cache", cache, "ls"))
    assert "y" * 80 in ok(cli("--cache", cache, "ls", "--wide"))
    rows = one_json(cli("--cache", cache, "ls", "--json"))["namespaces"]
    assert '{"x":"' + "y" * 80 + '"}' in [r["prefix_namespace"] for r in rows]


def test_closed_output_pipe_is_quiet(env, cache):
    """``spec-cache ls | head -0``: the reader is gone before the first line; no error, no traceback."""
    child = subprocess.Popen([sys.executable, "-c", WRAPPER, "--cache", str(cache), "ls", "--wide"], cwd=REPO,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()
    err = child.stderr.read()
    assert child.wait(120) == 141 and err == ""


def test_bench_plot_without_matplotlib_fails_before_running(env, tmp_path):
    code = ("import sys\nsys.modules['matplotlib'] = None  # as if not installed\n"
            "from spec_cache.apps.cli import main\nsys.exit(main(sys.argv[1:]))")
    for plot in (["--plot", str(tmp_path / "t.png")], [f"--plot={tmp_path / 't.png'}"], ["--pl", "t.png"]):
        out = subprocess.run([sys.executable, "-c", code, "bench", "--quick", *plot], cwd=REPO, capture_output=True,
                             text=True, timeout=60, env=env)
        assert out.stdout == ""  # nothing ran
        usage_error(out, "matplotlib")


def test_serve_is_wired_with_its_memory_tier_option(env):
    """``spec-cache serve`` parses (spec_cache.apps.server's options under the common ones) without loading MLX."""
    code = ("import sys\nfrom spec_cache.apps.cli import build_parser\na = build_parser().parse_args(sys.argv[1:])\n"
            "print(a.fn.__name__, a.memory_bytes, a.port, a.cache, a.shared,\n"
            "      sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code, "--cache", "/tmp/s", "serve", "--model", "/tmp/m",
                          "--memory-bytes", "2G", "--port", "0", "--shared", "redis://h:1/0"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=env)
    assert ok(out).split() == ["cmd_serve", str(2 << 30), "0", "/tmp/s", "redis://h:1/0", "[]"]


def test_cache_defaults_to_the_environment_variable(cli, cache, tmp_path):
    obj = one_json(cli("--json", "ls", extra_env={"SPEC_CACHE_DIR": str(cache)}))
    assert len(obj["namespaces"]) == 2
    usage_error(cli("ls", extra_env={"XDG_CACHE_HOME": str(tmp_path / "empty")}), "no spec-cache store")


def test_show(cli, cache):
    for key in (NS_A.hex(), NS_A.hex()[:8], NS_A.hex()[:6].upper()):
        obj = one_json(cli("--cache", cache, "--json", "show", key))
        assert obj["namespace"]["key"] == NS_A.hex()
        assert sorted(e["tokens"] for e in obj["entries"]) == [6, 9, 13]
        assert [e["drafters"] for e in obj["entries"] if e["tokens"] == 9] == [[DRAFTER]]
        assert [e["pinned"] for e in obj["entries"] if e["tokens"] == 6] == [True]
    human = ok(cli("--cache", cache, "show", NS_B.hex()[:10]))
    assert NS_B.hex() in human and "tenant      t:" in human
    # per-entry sizes say they leave out the shared chunks (issue 36 first hour, item 7)
    assert "OWN BYTES" in human and "counted once, in the namespace's total" in human
    usage_error(cli("--cache", cache, "show", "abcd"), "ambiguous")
    usage_error(cli("--cache", cache, "show", "ffffff"), "ffffff")
    usage_error(cli("--cache", cache, "show", "ab"))


def test_an_error_under_json_is_json_on_stdout_too(tmp_path):
    """A machine reading ``--json`` output gets JSON whatever happened (issue 36: ``--json verify`` on a missing
    store printed plain text only); people still get the one line on stderr."""
    out = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "none"), "--json", "verify"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2
    assert json.loads(out.stdout) == {"error": {"message": out.stderr.strip().removeprefix("spec-cache: error: "),
                                                "exit_code": 2}}
    plain = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(tmp_path / "none"), "verify"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert plain.returncode == 2 and plain.stdout == "" and plain.stderr.count("\n") == 1


def test_a_warning_on_the_cli_is_one_line_without_python_source(tmp_path, monkeypatch):
    """A ``CacheWarning`` (a damaged record read as a miss, say) reads as one ``spec-cache: warning:`` line, not
    Python's ``file:line: Category: ...`` with the source line under it (issue 36 first hour, item 7)."""
    import warnings

    from spec_cache.apps import cli as cli_module
    from spec_cache.tiers.cache import CacheWarning

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    cli_module.main(["--cache", str(tmp_path / "none"), "ls"])
    shown = warnings.formatwarning("lookup failed,\n treated as a miss", CacheWarning, "cache.py", 3,
                                   "warnings.warn(message, CacheWarning)")
    assert shown == "spec-cache: warning: lookup failed, treated as a miss\n"


def test_stats(cli, cache):
    s = one_json(cli("--cache", cache, "--json", "stats"))
    # format 1.3: the drafter part (1.2) and the entry tails (1.3) are stored in shared pieces, counted apart
    assert (s["entries"], s["namespaces"], s["format"], s["chunk_tokens"]) == (4, 2, "spec-cache-store 1.3", 4)
    assert s["chunks"] == 1 + 2 + 3 and s["drafter_parts"] == 1 and s["drafter_pieces"] >= 1 and s["bytes"] > 0
    assert (s["hits"], s["misses"]) == (1, 1)
    human = ok(cli("--cache", cache, "stats"))
    assert "entries" in human and "spec-cache-store 1.3" in human
    # every label stands apart from its value (``drafter_pieces17`` ran together); tenants read as text, not a repr
    rows = dict(line.split(None, 1) for line in human.splitlines() if line.strip())
    assert rows["drafter_pieces"].split()[0] == str(s["drafter_pieces"])
    assert "{" not in rows["tenants"] and "'" not in rows["tenants"] and "default:" in rows["tenants"]


def _flip_last_byte(path: Path, db: str) -> None:
    with Store.open(path, durable=False) as store:
        def fn(txn):
            key, value = next(iter(txn.cursor(db=store.env.dbs[db])))
            raw = bytearray(value)
            raw[-1] ^= 1
            txn.put(bytes(key), bytes(raw), db=store.env.dbs[db])
        store.env.write(fn)


def test_verify(cli, cache):
    v = one_json(cli("--cache", cache, "--json", "verify"))
    assert {"records", "ok", "corrupt", "unknown_schema"} <= set(v)
    pieces = one_json(cli("--cache", cache, "--json", "stats"))["drafter_pieces"]
    assert v["records"] == 6 + 4 + 1 + pieces and v["ok"] == v["records"] and v["corrupt"] == 0
    total = v["records"]
    assert f"{total} records: {total} ok, 0 corrupt" in ok(cli("--cache", cache, "verify"))
    _flip_last_byte(cache, "chunks")
    v = one_json(cli("--cache", cache, "--json", "verify"), code=1)
    assert (v["corrupt"], v["ok"]) == (1, v["records"] - 1)
    human = ok(cli("--cache", cache, "verify"), code=1)
    assert "1 corrupt" in human and "corrupt target chunk" in human


# --- changes ------------------------------------------------------------------------------------------------------


def test_evict_needs_a_filter(cli, cache):
    usage_error(cli("--cache", cache, "evict"), "--namespace")
    usage_error(cli("--cache", cache, "evict", "--namespace", "abcd"), "ambiguous")


@pytest.mark.parametrize("flags, entries_left, drafter_parts", [
    (["--namespace", NS_A.hex()[:8]], 1, 0),
    (["--drafter", DRAFTER], 4, 0),
    (["--older-than", "1h"], 4, 1),
    (["--older-than", "0s"], 1, 0),        # the pinned entry stays
    (["--to-size", "0"], 1, 0),            # the pinned entry stays
    (["--to-size", "2GiB"], 4, 1),
    (["--all"], 0, 0),
])
def test_evict(cli, cache, flags, entries_left, drafter_parts):
    before = one_json(cli("--cache", cache, "--json", "stats"))
    r = one_json(cli("--cache", cache, "--json", "evict", *flags))
    assert set(r) == {"entries", "drafter_parts", "bytes"}
    after = one_json(cli("--cache", cache, "--json", "stats"))
    assert (after["entries"], after["drafter_parts"]) == (entries_left, drafter_parts)
    assert r["bytes"] == before["bytes"] - after["bytes"]
    assert r["entries"] == before["entries"] - after["entries"]
    assert "evicted" in ok(cli("--cache", cache, "evict", "--to-size", "1TB"))


def test_gc(cli, cache):
    r = one_json(cli("--cache", cache, "--json", "gc"))
    assert r == {"corrupt_removed": 0, "broken_subtrees": 0, "orphans_removed": 0, "bytes": 0,
                 "index_rows_removed": 0, "namespaces_rebuilt": 0, "entries_removed": 0, "counters_fixed": 0}
    _flip_last_byte(cache, "edata")
    r = one_json(cli("--cache", cache, "--json", "gc"))
    assert r["corrupt_removed"] == 1 and r["bytes"] > 0
    assert one_json(cli("--cache", cache, "--json", "verify"))["corrupt"] == 0
    assert "removed 0 corrupt records" in ok(cli("--cache", cache, "gc"))


# --- identity -----------------------------------------------------------------------------------------------------


def _model_dir(path: Path) -> Path:
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": np.arange(12, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


def test_identity(cli, cache, tmp_path):
    from spec_cache.naming.identity import model_identity

    model = _model_dir(tmp_path / "model")
    expected = model_identity(model, memo=False)
    assert ok(cli("identity", model)).strip() == expected
    obj = one_json(cli("--cache", cache, "--json", "identity", model))
    assert obj["identity"] == expected and obj["dir"] == str(model.resolve())
    assert ok(cli("--cache", cache, "identity", model)).strip() == expected  # memoized in the store now
    with Store.open(cache, readonly=True) as store, store.env.read() as txn:
        assert txn.stat(store.env.dbs["memo"])["entries"] >= 1


def test_identity_of_a_directory_without_config(cli, tmp_path):
    empty = tmp_path / "no-config"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    usage_error(cli("identity", empty), "config.json")
    usage_error(cli("identity", tmp_path / "missing"), "does not exist")


# --- stores that cannot be used -----------------------------------------------------------------------------------

COMMANDS = [["ls"], ["show", "abcd01"], ["stats"], ["verify"], ["gc"], ["evict", "--all"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_missing_store(cli, tmp_path, command):
    missing = tmp_path / "nowhere"
    usage_error(cli("--cache", missing, *command), "no spec-cache store")
    assert not missing.exists()  # never created just to be inspected or evicted


@pytest.mark.parametrize("command", COMMANDS)
def test_unreadable_store(cli, tmp_path, command):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data.mdb").write_bytes(b"\x00garbage" * 1024)
    usage_error(cli("--cache", bad, *command), str(bad))


def test_newer_format_and_foreign_lmdb(cli, cache, tmp_path):
    env = lmdb.open(str(cache), max_dbs=16)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        meta = msgpack.unpackb(txn.get(b"format"))
        meta["major"] = 2
        txn.put(b"format", msgpack.packb(meta))
    env.close()
    for command in (["ls"], ["gc"], ["evict", "--all"]):
        usage_error(cli("--cache", cache, *command), "format 2")
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign))
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    for command in (["stats"], ["gc"]):
        usage_error(cli("--cache", foreign, *command), "not a spec-cache store")

"""Operator commands of issue 14: bad key prefixes named, evict's exit codes and counts, namespaces emptied by
eviction, the recorded budget, pin/unpin, compact, --version, verify --json of a store too damaged to open,
repair errors without internal paths, help text on every option, and a README CLI reference that lists every
command and option. A failing command leaves the store's bytes as they were."""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spec_cache import __version__
from spec_cache.apps.cli import build_parser
from spec_cache.store import Store, StoreError, maintenance
from spec_cache.store import compact as compact_module
from tests.apps.test_cli import NS_A, REPO, cache, cli, env, ok, one_json, usage_error  # noqa: F401 (fixtures)


def digest(store: Path) -> str:
    return hashlib.sha256((store / "data.mdb").read_bytes()).hexdigest()


@pytest.mark.parametrize("prefix, words", [("30b", ["'30b'", "too short"]), ("zzzz", ["'zzzz'", "not hexadecimal"]),
                                           ("ffff", ["'ffff'", "no namespace key starts with"])])
def test_a_bad_namespace_prefix_is_named(cli, cache, prefix, words):  # noqa: F811
    before = digest(cache)
    for command in (["show", prefix], ["evict", "--namespace", prefix]):
        usage_error(cli("--cache", cache, *command), *words)
    assert digest(cache) == before


def test_evict_of_a_drafter_that_is_not_stored_exits_2(cli, cache):  # noqa: F811
    before = digest(cache)
    usage_error(cli("--cache", cache, "evict", "--drafter", "nonsense"), "'nonsense'", "ngram-history-v1:3:1")
    assert digest(cache) == before


@pytest.mark.parametrize("flags, entries, drafter_parts", [
    (["--namespace", NS_A.hex()[:8]], 3, 1),    # entry 1 of A has the one drafter part: it goes along, counted
    (["--to-size", "0"], 3, 1),                 # the pinned entry of A stays
    (["--drafter", "ngram-history-v1:3:1"], 0, 1),
])
def test_evict_reports_the_drafter_parts_it_removed(cli, cache, flags, entries, drafter_parts):  # noqa: F811
    r = one_json(cli("--cache", cache, "--json", "evict", *flags))
    assert (r["entries"], r["drafter_parts"]) == (entries, drafter_parts)
    assert one_json(cli("--cache", cache, "--json", "stats"))["drafter_parts"] == 0


def test_ls_does_not_list_namespaces_emptied_by_eviction(cli, cache):  # noqa: F811
    ok(cli("--cache", cache, "evict", "--namespace", NS_A.hex()[:8]))
    listed = [n["key"] for n in one_json(cli("--cache", cache, "--json", "ls"))["namespaces"]]
    assert NS_A.hex() not in listed and len(listed) == 1
    assert NS_A.hex()[:16] not in ok(cli("--cache", cache, "ls"))
    everything = one_json(cli("--cache", cache, "--json", "ls", "--all"))["namespaces"]
    assert [n["entries"] for n in everything if n["key"] == NS_A.hex()] == [0]
    ok(cli("--cache", cache, "evict", "--all"))
    assert ok(cli("--cache", cache, "ls")).strip() == "no namespaces"


def test_stats_shows_the_budget_recorded_with_the_store(cli, cache):  # noqa: F811
    assert one_json(cli("--cache", cache, "--json", "stats"))["max_bytes"] is None
    Store.open(cache, max_bytes=3 << 30).close()
    assert one_json(cli("--cache", cache, "--json", "stats"))["max_bytes"] == 3 << 30
    assert re.search(r"max_bytes\s+3\.0 GiB", ok(cli("--cache", cache, "stats")))
    Store.open(cache).close()  # a writer without a budget leaves the recorded one
    assert one_json(cli("--cache", cache, "--json", "stats"))["max_bytes"] == 3 << 30


def _pinned(cache: Path) -> dict[str, bool]:
    with Store.open(cache, readonly=True) as store:
        return {e["key"]: e["pinned"] for e in maintenance.entries(store)}


def test_pin_and_unpin(cli, cache):  # noqa: F811
    before = digest(cache)
    usage_error(cli("--cache", cache, "unpin", "abcd"), "ambiguous")  # both namespaces start with abcd
    assert digest(cache) == before
    pins = _pinned(cache)
    unpinned = sorted(k for k, p in pins.items() if not p)
    assert len(unpinned) == 3
    r = one_json(cli("--cache", cache, "--json", "pin", unpinned[0][:10]))
    assert r == {"pinned": 1, "entries": 1}
    ok(cli("--cache", cache, "evict", "--to-size", "0"))  # only pinned entries stay
    assert sorted(_pinned(cache)) == sorted([unpinned[0]] + [k for k, p in pins.items() if p])
    assert "unpinned 1 of 1 entries" in ok(cli("--cache", cache, "unpin", unpinned[0][:10]))
    ok(cli("--cache", cache, "evict", "--to-size", "0"))
    assert unpinned[0] not in _pinned(cache)
    # a namespace key pins every entry of it
    r = one_json(cli("--cache", cache, "--json", "pin", NS_A.hex()[:8]))
    assert r["entries"] == 1 and r["pinned"] == 0  # its one entry left was pinned already
    before = digest(cache)
    usage_error(cli("--cache", cache, "pin", "zz"), "'zz'", "not hexadecimal")
    usage_error(cli("--cache", cache, "pin", "ffffff"), "'ffffff'")
    assert digest(cache) == before


def test_compact_shrinks_the_file_and_keeps_every_entry(cli, cache):  # noqa: F811
    before = one_json(cli("--cache", cache, "--json", "stats"))
    (cache / "compact.tmp").mkdir()  # left by a compaction that crashed before its swap: cleared
    (cache / "compact.tmp" / "data.mdb").write_bytes(b"half a copy")
    r = one_json(cli("--cache", cache, "--json", "compact"))
    assert r["file_bytes_after"] <= r["file_bytes_before"]
    after = one_json(cli("--cache", cache, "--json", "stats"))
    for key in ("entries", "bytes", "chunks", "drafter_parts", "namespaces"):
        assert after[key] == before[key], key
    assert one_json(cli("--cache", cache, "--json", "verify"))["corrupt"] == 0
    assert sorted(p.name for p in cache.iterdir()) == ["data.mdb", "lock.mdb", "reserve"]
    ok(cli("--cache", cache, "evict", "--all"))
    grown = (cache / "data.mdb").stat().st_size
    r = one_json(cli("--cache", cache, "--json", "compact"))
    assert r["file_bytes_after"] < grown and r["bytes_freed"] > 0
    assert "compacted" in ok(cli("--cache", cache, "compact"))


def test_compact_is_refused_while_the_store_is_open_elsewhere(cli, cache):  # noqa: F811
    before = digest(cache)
    with Store.open(cache, readonly=True):  # this test process holds LMDB's shared lock
        usage_error(cli("--cache", cache, "compact"), "open in another process")
    assert digest(cache) == before
    assert not (cache / "compact.tmp").exists()
    usage_error(cli("--cache", cache.parent / "nowhere", "compact"), "no spec-cache store")


def test_a_compaction_that_fails_before_its_swap_changes_nothing(cache, monkeypatch):  # noqa: F811
    before = digest(cache)

    def broken(work):
        raise StoreError("the compacted copy does not read back (simulated)")
    monkeypatch.setattr(compact_module, "_check_copy", broken)
    with pytest.raises(StoreError, match="simulated"):
        compact_module.compact(str(cache))
    assert digest(cache) == before and not (cache / "compact.tmp").exists()


def test_version(cli):  # noqa: F811
    assert ok(cli("--version")).strip() == f"spec-cache {__version__}"


def test_verify_json_of_a_truncated_store_prints_json(cli, cache):  # noqa: F811
    with open(cache / "data.mdb", "r+b") as f:
        f.truncate(8192)
    d = one_json(cli("--cache", cache, "--json", "verify"), 1)
    assert d["damaged"] is True and d["opened"] is False and "truncated" in d["error"]
    assert "truncated" in ok(cli("--cache", cache, "verify"), 1)
    (cache / "data.mdb").write_bytes(b"")
    assert "empty" in one_json(cli("--cache", cache, "--json", "verify"), 1)["error"]


def test_repair_errors_name_the_source_not_a_temporary_copy(cli, cache, tmp_path):  # noqa: F811
    import lmdb
    import msgpack

    lmdb_env = lmdb.open(str(cache), max_dbs=16)
    with lmdb_env.begin(write=True, db=lmdb_env.open_db(b"meta")) as txn:
        meta = msgpack.unpackb(txn.get(b"format"))
        meta["major"] = 9
        txn.put(b"format", msgpack.packb(meta))
    lmdb_env.close()
    line = usage_error(cli("--cache", cache, "repair", "--to", tmp_path / "salvaged"), str(cache), "format 9")
    assert "spec-cache-repair-" not in line and "source" not in line.split(str(cache))[0][-8:]


# --- help text and the README reference ---------------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


def test_every_subcommand_has_a_description_and_every_option_help():
    missing = []
    for name, parser in _subcommands().items():
        if name and not parser.description:
            missing.append(f"{name}: no description")
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name or 'spec-cache'} {'/'.join(action.option_strings) or action.dest}: no help")
    assert not missing, missing


def _readme_cli_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## CLI"):]
    return section[: section.index("```", section.index("```") + 3)]


def _segments(block: str) -> dict[str, str]:
    """The README CLI block cut per command: a command's line (two spaces, its name) and the lines under it."""
    out, name = {"": ""}, ""
    for line in block.splitlines():
        m = re.match(r"^  ([a-z][a-z-]*)\b", line)
        if m:
            name = m.group(1)
        elif line.startswith("spec-cache "):
            name = ""
        out[name] = out.get(name, "") + line + "\n"
    return out


def test_the_readme_cli_reference_lists_every_command_and_option():
    segments = _segments(_readme_cli_block())
    shared_options = {o for a in _subcommands()[""]._actions for o in a.option_strings}
    missing = []
    for name, parser in _subcommands().items():
        if name not in segments:
            missing.append(f"command {name}")
            continue
        for action in parser._actions:
            for option in action.option_strings:
                where = segments[""] if option in shared_options else segments[name]
                if option.startswith("--") and option != "--help" and not re.search(rf"{option}\b", where):
                    missing.append(f"{name or 'spec-cache'} {option}")
    assert not missing, missing


def test_help_of_every_subcommand_runs(env):  # noqa: F811
    for name in ("pin", "compact", "generate", "serve"):
        out = subprocess.run([sys.executable, "-m", "spec_cache", name, "--help"], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0 and "usage:" in out.stdout, out.stderr

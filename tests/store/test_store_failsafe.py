"""A damaged store is a cache fault, never an outage (issue 20).

* ``data.mdb`` truncated or replaced under an open store: the process keeps running, every read and write of that
  handle is a typed ``StoreUnavailable`` (a miss to the runtime), logged once; before, a truncation killed the
  process with SIGBUS (exit 135, nothing logged) and a replacement went unnoticed.
* A store found damaged at open is refused (the default) or, with ``on_damage="move-aside"``, renamed aside and a
  fresh one opened; a healthy file that merely ends before LMDB's ``last_pgno`` is not called damaged.
* A read-write open of a directory another user owns, or group/other may write, is refused with the fix named;
  read-only inspection still works.

Real processes: the store is damaged by this (parent) process while a child has it open.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from spec_cache.store import Store, StoreDamaged, StoreError, StoreUnsafe
from tools.faults import workload as W

REPO = Path(__file__).resolve().parents[2]
SPECS = [W.Spec(0, 1, 64), W.Spec(0, 2, 100), W.Spec(1, 3, 70), W.Spec(2, 4, 160), W.Spec(0, 5, 200)]
OTHER = [W.Spec(1, 9, 88), W.Spec(2, 10, 131)]

#: the child: open, serve every spec (hits), wait for the parent's fault, then three rounds of fetches and puts as
#: the runtime does them (a typed StoreError is a miss), the runtime's own restore, and a reopen
CHILD = textwrap.dedent("""
    import logging, sys, warnings
    from spec_cache.store import Store, StoreError
    from tools.faults import workload as W
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
    path, specs, after = sys.argv[1], [W.Spec.parse(s) for s in sys.argv[2].split(",")], sys.argv[3]
    store = Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False)
    print("ready", sum(store.fetch(s.ns_key, s.tokens) is not None for s in specs), flush=True)
    sys.stdin.readline()  # the parent damages the store now
    answers = []
    for _ in range(3):
        for s in specs:
            try:
                answers.append("hit" if store.fetch(s.ns_key, s.tokens) is not None else "miss")
            except StoreError as exc:
                answers.append(type(exc).__name__)
        try:
            W.put_spec(store, W.Spec(0, 40, 60))
            answers.append("put")
        except StoreError as exc:
            answers.append("put:" + type(exc).__name__)
    print("answers", " ".join(answers), flush=True)
    from spec_cache.tiers.cache import SpecCache
    cache = SpecCache(store, memory_bytes=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        restored = [cache.restore(s.ns_key, s.tokens) for s in specs for _ in range(3)]
    print("runtime", sum(r is None for r in restored), len({str(w.message) for w in seen}), flush=True)
    cache.close()
    if after:
        with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False) as again:
            print("reopened", sum(again.fetch(s.ns_key, s.tokens) is not None
                                  for s in [W.Spec.parse(x) for x in after.split(",")]), flush=True)
    print("exit", flush=True)
""")


def fill(path: Path, specs) -> None:
    with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
        W.register(store)
        for spec in specs:
            W.put_spec(store, spec)


def names(specs) -> str:
    return ",".join(s.name() for s in specs)


def run_child(path: Path, damage, after: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    """Start the child on ``path``, ``damage()`` the store once it serves, let it go on; its output lines."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), names(SPECS), after], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = child.stdout.readline()
        assert ready.split() == ["ready", str(len(SPECS))], ready + child.stderr.read()
        damage()
        out, err = child.communicate("go\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err), out.splitlines()


def assert_cold_and_logged_once(result: subprocess.CompletedProcess, lines: list[str], what: str) -> None:
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])  # not -7 (SIGBUS)
    answers = next(line for line in lines if line.startswith("answers")).split()[1:]
    assert answers == (["StoreUnavailable"] * len(SPECS) + ["put:StoreUnavailable"]) * 3, answers
    runtime = next(line for line in lines if line.startswith("runtime")).split()[1:]
    assert runtime == [str(3 * len(SPECS)), "1"], runtime  # every restore a miss, one distinct warning
    errors = [line for line in result.stderr.splitlines() if line.startswith("LOG ERROR")]
    assert len(errors) == 1, result.stderr  # once, not per request
    assert "unavailable" in errors[0] and what in errors[0], errors
    assert "Traceback" not in result.stderr and lines[-1] == "exit", result.stderr


def test_a_store_truncated_while_open_is_a_miss_not_sigbus(tmp_path):
    """Found: truncating data.mdb under a running process killed it with SIGBUS on its next lookup."""
    path = tmp_path / "store"
    fill(path, SPECS)
    result, lines = run_child(path, lambda: os.truncate(path / "data.mdb", 4 * 4096))
    assert_cold_and_logged_once(result, lines, "truncated")


def test_a_store_replaced_while_open_is_a_miss_and_a_reopen_finds_the_new_one(tmp_path):
    """Found: a data.mdb renamed over an open store (a restore from backup, rsync) went unnoticed: the process
    read the old file and wrote where no other process would ever read."""
    path, other = tmp_path / "store", tmp_path / "other"
    fill(path, SPECS)
    fill(other, OTHER)
    result, lines = run_child(path, lambda: os.replace(other / "data.mdb", path / "data.mdb"), after=names(OTHER))
    assert_cold_and_logged_once(result, lines, "replaced")
    assert f"reopened {len(OTHER)}" in lines


def test_a_store_removed_while_open_is_a_miss(tmp_path):
    path = tmp_path / "store"
    fill(path, SPECS)
    result, lines = run_child(path, lambda: shutil.rmtree(path))
    assert_cold_and_logged_once(result, lines, "removed")


def test_a_file_grown_by_another_thread_of_the_handle_is_not_called_shrunk(tmp_path, monkeypatch):
    """Found (CI, once: "data.mdb shrank from 655360 to 339968 bytes while open"): the runtime's thread checks
    data.mdb before a read while the write-behind thread commits. The reader's ``fstat`` came before a commit grew
    the file, the writer's next check raised the handle's ``seen`` to the new size, then the reader compared its
    older size with it: a healthy store called truncated, and the handle unavailable until reopened."""
    path = tmp_path / "store"
    fill(path, SPECS[:1])
    store = Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False)
    data, real_fstat, grown = store.env.data, os.fstat, []

    def writer():  # the other thread: a put that grows data.mdb, then the check before its next transaction
        W.put_spec(store, W.Spec(2, 41, 400))
        store.env.check_data()
        grown.append(data.seen)

    def fstat(fd):  # the reader's fstat returns, and its thread runs again only once the writer has done all that
        st = real_fstat(fd)
        if fd == data.fd and threading.current_thread() is threading.main_thread() and not grown:
            t = threading.Thread(target=writer)
            t.start()
            t.join()
        return st

    try:
        before = data.size()
        monkeypatch.setattr(os, "fstat", fstat)
        store.env.check_data()
        monkeypatch.undo()
        assert grown and grown[0] > before  # the interleaving under test happened
        assert data.fault is None
        for s in SPECS[:1] + [W.Spec(2, 41, 400)]:
            assert store.fetch(s.ns_key, s.tokens) is not None
    finally:
        monkeypatch.undo()
        store.close()


def test_a_damaged_store_at_open_is_refused_or_moved_aside(tmp_path, caplog):
    """Found: after a truncation the restart refused to start ("damaged ... run repair"): a cache fault became an
    outage. Refusing stays the default; ``on_damage="move-aside"`` keeps the damaged files and starts fresh."""
    path = tmp_path / "store"
    fill(path, SPECS)
    os.truncate(path / "data.mdb", os.path.getsize(path / "data.mdb") // 2)
    size = os.path.getsize(path / "data.mdb")
    for readonly in (False, True):
        with pytest.raises(StoreDamaged, match="truncated"):
            Store.open(path, readonly=readonly, on_damage="move-aside" if readonly else "refuse")
    assert sorted(os.listdir(tmp_path)) == ["store"] and os.path.getsize(path / "data.mdb") == size
    with pytest.raises(StoreError, match="on_damage must be one of"):
        Store.open(path, on_damage="delete")
    with caplog.at_level(logging.WARNING, logger="spec_cache.store"):
        with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, on_damage="move-aside") as store:
            W.register(store)
            assert all(store.fetch(s.ns_key, s.tokens) is None for s in SPECS)  # fresh and empty
            W.put_spec(store, SPECS[0])
            assert store.fetch(SPECS[0].ns_key, SPECS[0].tokens).length == SPECS[0].length
    aside = [name for name in os.listdir(tmp_path) if name.startswith("store.damaged-")]
    assert len(aside) == 1 and os.path.getsize(tmp_path / aside[0] / "data.mdb") == size  # kept as it was
    assert stat.S_IMODE(os.stat(tmp_path / aside[0]).st_mode) == 0o700
    moved = [r.getMessage() for r in caplog.records if "moved it aside" in r.getMessage()]
    assert len(moved) == 1 and str(tmp_path / aside[0]) in moved[0] and str(path) in moved[0]
    with Store.open(path) as store:  # the new store is a healthy one: the default open takes it
        assert store.fetch(SPECS[0].ns_key, SPECS[0].tokens) is not None


def test_a_healthy_file_that_ends_before_last_pgno_is_not_called_truncated(tmp_path):
    """Found: pages allocated and freed inside one transaction count in LMDB's ``last_pgno`` but are never
    written, so a healthy data.mdb may end before it; the open-time size check refused such a store as
    truncated (and would have moved it aside)."""
    path = tmp_path / "store"
    fill(path, SPECS[:2])
    with Store.open(path) as store:
        def put_and_drop(txn):
            txn.put(b"scratch", os.urandom(1 << 20), db=store.env.dbs["memo"])
            txn.delete(b"scratch", db=store.env.dbs["memo"])
        store.env.write(put_and_drop)
        needed = (store.env.env.info()["last_pgno"] + 1) * store.env.env.stat()["psize"]
    assert os.path.getsize(path / "data.mdb") < needed  # the state under test
    for readonly in (True, False):
        with Store.open(path, readonly=readonly, on_damage="move-aside" if not readonly else "refuse") as store:
            assert all(store.fetch(s.ns_key, s.tokens) is not None for s in SPECS[:2])
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_a_group_writable_store_is_refused_read_write_and_readable_read_only(tmp_path):
    path = tmp_path / "store"
    fill(path, SPECS[:1])
    for mode, who in ((0o770, "group"), (0o707, "others"), (0o777, "group and others")):
        os.chmod(path, mode)
        with pytest.raises(StoreUnsafe, match=f"writable by {who}") as caught:
            Store.open(path)
        message = str(caught.value)
        assert str(path) in message and f"{mode:04o}" in message and f"chmod 700 {path}" in message
        assert stat.S_IMODE(os.stat(path).st_mode) == mode  # refused untouched
        with Store.open(path, readonly=True) as store:
            assert store.fetch(SPECS[0].ns_key, SPECS[0].tokens) is not None
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o775)
    with pytest.raises(StoreUnsafe, match="writable by group"):
        Store.open(empty)
    assert os.listdir(empty) == []
    os.chmod(path, 0o700)
    with Store.open(path) as store:
        assert store.fetch(SPECS[0].ns_key, SPECS[0].tokens) is not None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a store to another user")
def test_a_store_owned_by_another_user_is_refused_read_write_and_readable_read_only(tmp_path):
    path = tmp_path / "store"
    fill(path, SPECS[:1])
    for name in ["", "data.mdb", "lock.mdb"]:
        os.chown(path / name, 65534, 65534)
    def owners():  # uid, gid, size and mtime of every file
        return {name: (*os.stat(path / name)[4:7], os.stat(path / name).st_mtime_ns) for name in os.listdir(path)}
    before = owners()
    with pytest.raises(StoreUnsafe, match="uid 65534") as caught:
        Store.open(path)
    message = str(caught.value)
    assert str(path) in message and "read-only" in message and "chown" in message
    assert owners() == before  # refused untouched
    with Store.open(path, readonly=True) as store:  # inspection stays allowed
        assert store.fetch(SPECS[0].ns_key, SPECS[0].tokens) is not None
    cli = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(path), "verify"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    cli = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(path), "gc"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "uid 65534" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr

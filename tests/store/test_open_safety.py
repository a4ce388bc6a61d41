"""Opening a store never takes over what is not one (issue 14): a store is created only in a new or empty
directory (with at most one missing parent); anything else is refused before any chmod or write; permission
problems are named as such; a closed cache says so."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import warnings

import lmdb
import pytest

from spec_cache.store import Store, StoreError, maintenance


def snapshot(path):
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            out[full] = (stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns)
    st = os.stat(path)
    out[str(path)] = (stat.S_IMODE(st.st_mode),)
    return out


def test_a_non_empty_directory_that_is_not_a_store_is_refused_untouched(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o755)
    (d / "f").write_text("user data")
    before = snapshot(d)
    with pytest.raises(StoreError, match="not a spec-cache store and not empty"):
        Store.open(d)
    assert snapshot(d) == before


def test_a_foreign_lmdb_directory_is_refused_untouched(tmp_path):
    d = tmp_path / "foreign"
    env = lmdb.open(str(d), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"theirs", txn=txn))
    env.close()
    os.chmod(d, 0o755)
    before = snapshot(d)
    with pytest.raises(StoreError, match="not a spec-cache store"):
        Store.open(d)
    assert snapshot(d) == before and not (d / "reserve").exists()


def test_at_most_one_missing_parent_is_created(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(tmp_path / "x" / "y" / "store")
    assert not (tmp_path / "x").exists()
    with Store.open(tmp_path / "a" / "store") as store:
        assert store.chunk_tokens > 0
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "store").st_mode) == 0o700


def test_an_empty_directory_becomes_a_store_and_a_file_path_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    Store.open(tmp_path / "empty").close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        Store.open(tmp_path / "file")


def test_a_zero_byte_data_file_is_named_and_not_replaced(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "data.mdb").write_bytes(b"")
    for readonly in (False, True):
        with pytest.raises(StoreError, match="data.mdb is empty"):
            Store.open(d, readonly=readonly)
    assert (d / "data.mdb").stat().st_size == 0 and not (d / "reserve").exists()


def test_a_data_file_another_process_is_creating_is_waited_for_not_called_damaged(tmp_path):
    """LMDB creates data.mdb empty and writes its meta pages a moment later (under its lock file's lock, which
    the open's checks do not take); CI saw a second process call that moment's 0 bytes damaged. Here the
    "creator" writes a real store's file 0.3 s after the empty one appeared: the open waits and succeeds."""
    import threading
    import time

    model = tmp_path / "model"
    with Store.open(model, chunk_tokens=8) as store:
        store.register_namespace(bytes(range(32)), target="a" * 64, prefix_namespace="p")
    content = (model / "data.mdb").read_bytes()
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    (d / "data.mdb").write_bytes(b"")

    def create():
        time.sleep(0.3)
        with open(d / "data.mdb", "r+b") as f:
            f.write(content)

    creator = threading.Thread(target=create)
    creator.start()
    try:
        with Store.open(d) as store:
            assert [n["target"] for n in maintenance.namespaces(store)] == ["a" * 64]
    finally:
        creator.join()


def test_a_reserve_being_made_by_another_opener_is_a_store_file(tmp_path):
    """``reserve.tmp`` exists while an opener allocates the reserve: a second process opening the new store at that
    moment called the directory "not a spec-cache store" (4 of 60 rounds of four processes opening one new store)."""
    d = tmp_path / "s"
    Store.open(d).close()
    (d / "reserve").rename(d / "reserve.tmp")
    with Store.open(d) as store:
        assert store.env.path == str(d)
    assert (d / "reserve").exists() or not (d / "reserve.tmp").exists()


def test_an_old_zero_byte_data_file_is_damaged_without_a_wait_for_a_creator(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "data.mdb").write_bytes(b"")
    old = os.stat(d / "data.mdb").st_mtime - 3600
    os.utime(d / "data.mdb", (old, old))
    with pytest.raises(StoreError, match="data.mdb is empty"):
        Store.open(d)


@pytest.fixture
def world_tmp():
    """A fresh directory under /tmp (pytest's own folders are 0700: another user could not reach a store in
    them), removed afterwards whether the test passed or not."""
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="spec-cache-test-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


#: the child imports everything as root (and runs the calls under test once on its own store, for lazy imports),
#: then becomes nobody (uid/gid 65534, no groups) for the part under test:
#: the interpreter and the venv may sit in a private (0700) clone that another user could not even import from
AS_NOBODY = """
import os, sys, tempfile
from spec_cache.store import Store, StoreError, maintenance
with tempfile.TemporaryDirectory() as warm:  # the same calls once as root: lazy imports (lmdb's) happen now
    Store.open(warm + "/s").close()
    with Store.open(warm + "/s", readonly=True) as s:
        maintenance.verify(s)
os.chdir("/")
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert os.getuid() == os.geteuid() == 65534 and os.getgid() == 65534
"""


def as_nobody(code: str, *args) -> subprocess.CompletedProcess:
    """Run ``code`` as uid 65534 after AS_NOBODY's imports (works from any clone location)."""
    return subprocess.run([sys.executable, "-c", AS_NOBODY + code, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")
def test_as_another_user_permission_denied_is_named_and_readonly_inspection_works(world_tmp):
    """A store owned by root, 0700: another user gets "permission denied"; made world-readable (files 0644,
    directory 0755) another user can inspect it read-only although lock.mdb is not theirs to write; and that
    user's write-open of a foreign non-empty directory changes nothing there."""
    tmp_path = world_tmp
    d = tmp_path / "store"
    Store.open(d).close()
    os.chmod(tmp_path, 0o755)
    code = ("try:\n    s = Store.open(sys.argv[1], readonly=True)\nexcept StoreError as e:\n    print('ERR', e)\n"
            "else:\n    print('OK', not maintenance.verify(s).damaged); s.close()\n")
    out = as_nobody(code, d)
    assert "permission denied" in out.stdout, out.stdout + out.stderr
    os.chmod(d, 0o755)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(d / name, 0o644)
    out = as_nobody(code, d)
    assert out.stdout.strip() == "OK True", out.stdout + out.stderr
    foreign = tmp_path / "theirs"
    foreign.mkdir(mode=0o777)
    os.chmod(foreign, 0o777)
    (foreign / "f").write_text("x")
    before = snapshot(foreign)
    out = as_nobody("try:\n    Store.open(sys.argv[1])\nexcept StoreError as e:\n    print('ERR', e)\n", foreign)
    assert "not a spec-cache store" in out.stdout, out.stdout + out.stderr
    assert snapshot(foreign) == before


def test_a_closed_cache_is_a_clear_error_or_a_warned_miss(tmp_path):
    from spec_cache.tiers.cache import CacheClosedError, CacheWarning, SpecCache

    cache = SpecCache.open(tmp_path / "s")
    ns = cache.namespace("ab" * 32, "{}")
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(CacheClosedError, match="closed"):
        cache.namespace("ab" * 32, "{}")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cache.restore(ns, [1, 2, 3]) is None
        assert cache.save(ns, [1, 2, 3], []) is None
    assert [w.category for w in seen] == [CacheWarning, CacheWarning]
    assert all("closed" in str(w.message) for w in seen)

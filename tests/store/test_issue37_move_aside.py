"""Damaged stores moved aside are bounded (issue 37 item 7).

Found: ``on_damage="move-aside"`` kept every damaged copy; 5 damage-and-restart cycles filled a 48 MiB tmpfs and
shrank ``serve``'s default budget (what the store holds + half the free space) from 24 to 8.2 MiB. Now at most
``KEEP_ASIDE`` copies stay (the newest), and copies the fresh store's budget needs the room of are deleted.

The file system is simulated: ``os.statvfs`` under the test's directory reports a 48 MiB disk whose used bytes
are the blocks the files under it hold, so the numbers do not depend on the machine's disk.
"""

from __future__ import annotations

import logging
import os

import pytest

from spec_cache.store import Store
from spec_cache.store.directory import KEEP_ASIDE, aside_copies, default_budget

DISK = 48 << 20


def _du(root: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """``tmp_path`` as a 48 MiB file system (for ``os.statvfs``: free = 48 MiB - what its files hold)."""
    real = os.statvfs
    root = str(tmp_path)

    def statvfs(path):
        st = real(path)
        if not os.path.abspath(os.fspath(path)).startswith(root):
            return st
        free = max(0, DISK - _du(root)) // st.f_frsize
        return os.statvfs_result((st.f_bsize, st.f_frsize, DISK // st.f_frsize, free, free, st.f_files,
                                  st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))
    monkeypatch.setattr(os, "statvfs", statvfs)
    return tmp_path


def test_damage_and_restart_cycles_keep_few_copies_and_the_budget(small_disk, caplog):
    """Each cycle as ``serve`` runs it: the default budget computed, the store opened with it (moving a damaged
    one aside), filled to ~90% of the budget, then ``data.mdb`` loses its second half (damaged at the next open)."""
    path = str(small_disk / "store")
    budgets, copies = [], []
    with caplog.at_level(logging.INFO, logger="spec_cache.store"):
        for _cycle in range(6):
            budget, _how = default_budget(path)
            budgets.append(budget)
            with Store.open(path, max_bytes=budget, on_damage="move-aside", durable=False) as store:
                copies.append(len(aside_copies(path)))
                blob = b"\x5a" * (budget * 9 // 10)
                store.env.write(lambda txn, blob=blob, store=store: txn.put(b"filler", blob,
                                                                              db=store.env.dbs["memo"]))
            assert _du(str(small_disk)) < DISK  # never filled
            data = os.path.join(path, "data.mdb")
            os.truncate(data, os.path.getsize(data) // 2)
    assert max(copies) <= KEEP_ASIDE and copies[-1] >= 1, copies
    assert min(budgets) >= budgets[0] - (1 << 20), [round(b / 2**20, 1) for b in budgets]
    deleted = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage() and "damaged" in r.getMessage()]
    assert deleted and all("\n" not in line for line in deleted)


def test_keep_aside_is_an_option(tmp_path):
    path = str(tmp_path / "store")
    for _ in range(3):
        with Store.open(path, durable=False):
            pass
        os.truncate(os.path.join(path, "data.mdb"), 0)
        Store.open(path, on_damage="move-aside", keep_aside=1, durable=False).close()
        assert len(aside_copies(path)) == 1
    Store.open(path, durable=False).close()
    os.truncate(os.path.join(path, "data.mdb"), 0)
    Store.open(path, on_damage="move-aside", keep_aside=0, durable=False).close()
    assert aside_copies(path) == []

"""Compaction in place: rewrite ``data.mdb`` without its free pages, then swap the copy in atomically.

LMDB never shrinks its file: pages freed by eviction are reused, not returned. ``compact`` writes a compacted
copy (LMDB's own ``MDB_CP_COMPACT`` copy: every live page, renumbered, inside one read transaction, so the copy
is one consistent snapshot) into a work directory inside the store, fsyncs it, checks that it opens as this
store, and ``rename``s it over ``data.mdb`` (one atomic step on the same filesystem), then fsyncs the directory.

Crash safety: before the rename the old ``data.mdb`` is untouched (a leftover work directory is removed by the
next ``compact``); after it the new file is whole (it was fsynced first). Exclusive use: compaction refuses a
store another process has open (LMDB keeps a shared ``fcntl`` lock on byte 0 of ``lock.mdb`` while a process
has the environment open; compaction takes it exclusively and holds it until the swap is done, so a process
that opens the store meanwhile waits in LMDB's open). ``fcntl`` locks are per process, so a caller must not hold
another handle on the same store in its own process while compacting (the CLI holds none).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
from dataclasses import dataclass

import lmdb

from .directory import COMPACT_WORK_NAME as WORK_NAME  # inside the store: same filesystem, the swap is a rename
from .errors import StoreError, StoreOpenError
from .store import Store


@dataclass
class CompactReport:
    path: str
    bytes_before: int
    bytes_after: int

    def as_dict(self) -> dict:
        return {"path": self.path, "file_bytes_before": self.bytes_before, "file_bytes_after": self.bytes_after,
                "bytes_freed": self.bytes_before - self.bytes_after}


def _lock_exclusively(fd: int) -> bool:
    """An exclusive ``fcntl`` lock on byte 0 of ``lock.mdb`` (LMDB's liveness lock); False if another process
    holds it (that process has the store open)."""
    lock = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, lock)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def compact(path: str) -> CompactReport:
    """Compact the store in directory ``path`` in place (see the module docstring); ``StoreError`` naming the
    problem when it is open elsewhere, damaged, or the disk cannot hold the copy. The store is unchanged then."""
    path = os.path.abspath(path)
    data = os.path.join(path, "data.mdb")
    work = os.path.join(path, WORK_NAME)
    store = Store.open(path)  # the usual checks: a store, readable, our format (and lock.mdb exists)
    lock_fd = None
    try:
        store.flush_best_effort()
        lock_fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR)
        if not _lock_exclusively(lock_fd):
            raise StoreOpenError(f"store at {path} is open in another process; stop it before compacting")
        shutil.rmtree(work, ignore_errors=True)  # left by a compaction that crashed before its swap
        os.mkdir(work, 0o700)
        try:
            before = os.path.getsize(data)
            try:
                store.env.env.copy(work, compact=True)
            except lmdb.Error as exc:
                raise StoreError(f"cannot compact the store at {path}: {exc}") from None
            copy = os.path.join(work, "data.mdb")
            _fsync_path(copy)
            _check_copy(work)
            after = os.path.getsize(copy)
            os.chmod(copy, 0o600)
            os.replace(copy, data)  # the atomic step
            _fsync_path(path)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        # LMDB's close clears this process's reader slot, then closes its lock.mdb descriptor, which drops every
        # fcntl lock this process holds on that file (ours too): nobody can open the store before that
        store.close()
        if lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock_fd)
    return CompactReport(path, before, after)


def _check_copy(work: str) -> None:
    """The compacted copy opens and has the store's format record (lock-free, read-only: writes nothing)."""
    try:
        env = lmdb.open(work, readonly=True, lock=False, subdir=True, max_dbs=16)
    except lmdb.Error as exc:
        raise StoreError(f"the compacted copy does not open ({exc}); the store is unchanged") from None
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            if txn.get(b"format", db=meta) is None:
                raise StoreError("the compacted copy has no format record; the store is unchanged")
    except lmdb.Error as exc:
        raise StoreError(f"the compacted copy does not read back ({exc}); the store is unchanged") from None
    finally:
        env.close()

"""The open ``data.mdb``, watched: a file shrunk, removed or replaced under an open store is found before LMDB
reads it, so a cache fault is a miss and a log line instead of a dead process.

LMDB maps ``data.mdb``; touching a mapped page past the file's end is SIGBUS (the process dies, exit 135, nothing
logged). ``DataFile`` holds its own descriptor of the file LMDB opened and, before every read and write
transaction (``Environment.read``/``write``), checks:

* ``fstat`` of that descriptor: the file LMDB maps is not shorter than the most this handle has seen. LMDB
  (without ``writemap``, which no spec-cache process uses) never shrinks ``data.mdb``: it only grows it, and
  ``spec-cache compact`` swaps in a new file by rename, refusing while another process has the store open. So any
  shrink is damage from outside (a truncation, a bad copy over it).
* ``stat`` of the path: it is still that file (same device and inode). ``data.mdb`` renamed over, deleted, or the
  whole directory replaced means this handle reads a stale file and writes where nobody reads.

The first failed check is logged once (ERROR, naming the store and what was found) and is sticky: every later
transaction of this handle raises the same ``StoreUnavailable`` at once, without touching the map. Cost: two
system calls per transaction (measured in RELIABILITY.md).

Not a size check against LMDB's ``last_pgno``: a healthy file may end before it (pages freed in the transaction
that allocated them are never written), so that check refuses healthy stores. At open, a file shorter than
``last_pgno`` asks ``reaches_every_page`` (a child process touches every page the store's trees reference) before
it is called truncated.

What it cannot catch: a file shrunk *during* a transaction that is already reading (the check runs before it), or
shrunk after another process grew it and before this handle saw the growth: windows of one transaction.

Threads of one handle check at once (the runtime's reads beside the write-behind thread's commits): each check
compares its size with the ``seen`` it read *before* its ``fstat``, so a size taken just before another thread's
commit grew the file is never compared with the larger size that thread stored since (that was a false
"shrank", found once in CI).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from .errors import StoreError, StoreOpenError, StoreUnavailable

log = logging.getLogger("spec_cache.store")
DATA_NAME = "data.mdb"


class DataFile:
    """Our own descriptor of the ``data.mdb`` LMDB has mapped, and the checks above."""

    __slots__ = ("store", "path", "fd", "ident", "seen", "fault", "lock")

    def __init__(self, store: str, expected: tuple[int, int] | None = None):
        """``expected``: (st_dev, st_ino) of the path seen before LMDB opened it; a mismatch means the file was
        swapped during the open (our descriptor and LMDB's could differ), refused as ``StoreOpenError``."""
        self.store = store
        self.path = os.path.join(store, DATA_NAME)
        self.fault: str | None = None
        self.lock = threading.Lock()
        try:
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreOpenError(f"cannot open store at {store}: {DATA_NAME}: {exc.strerror}") from None
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)
        self.seen = st.st_size  # the largest size seen: LMDB only ever grows the file
        if expected is not None and expected != self.ident:
            self.close()
            raise StoreOpenError(f"cannot open store at {store}: {DATA_NAME} was replaced while it was being "
                                 "opened; open it again")

    def size(self) -> int:
        """Bytes in the file LMDB maps (not whatever the path names now)."""
        return os.fstat(self.fd).st_size

    def check(self) -> None:
        """Raise ``StoreUnavailable`` unless the mapped file is still the store's and has not shrunk."""
        if self.fault is not None:
            raise StoreUnavailable(self.fault)
        if self.fd < 0:
            raise StoreError(f"store at {self.store} is closed")
        # ``seen`` is read before the fstat: threads of one handle check at once (a read beside the write-behind
        # thread's commit), and a size this fstat took before another thread's commit grew the file may be compared
        # only with what was seen before it, never with the larger size that thread's next check stored meanwhile
        seen = self.seen
        size = os.fstat(self.fd).st_size
        if size < seen:
            self._fail(f"{DATA_NAME} shrank from {seen} to {size} bytes while open (truncated)")
        with self.lock:  # the largest size seen: a check that read an older size never lowers it
            if size > self.seen:
                self.seen = size
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            self._fail(f"{DATA_NAME} was removed while open")
        except OSError as exc:
            self._fail(f"{DATA_NAME} cannot be checked ({exc.strerror})")
        if (now.st_dev, now.st_ino) != self.ident:
            self._fail(f"{DATA_NAME} was replaced by another file while open")

    def _fail(self, what: str) -> None:
        self.fault = (f"store at {self.store} is unavailable: {what}; lookups miss and checkpoints are not stored "
                      "by this handle (reopen it: a restart with on_damage='move-aside' sets a damaged store aside "
                      "and starts a fresh one)")
        log.error("spec-cache: %s", self.fault)
        raise StoreUnavailable(self.fault)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: run in a child (a SIGBUS kills only it): open read-only without the lock table, walk every named database and
#: touch each value's first and last byte (the last page of an overflow run is its highest)
_WALK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, subdir=True, max_dbs=64, map_size=int(sys.argv[2]))
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        try:
            db = env.open_db(name, txn=txn, create=False)
        except lmdb.Error:
            continue
        for _, value in txn.cursor(db=db):
            if len(value):
                value[0], value[len(value) - 1]
print("ok")
"""


def reaches_every_page(store: str, map_size: int, timeout_s: float = 300.0) -> bool | None:
    """Whether every page the store references lies inside ``data.mdb`` (a child walks them all, so SIGBUS on a
    truncated file costs only the child): True, False (the child died of SIGBUS/SIGSEGV), or None when the walk
    could not tell (an LMDB error, a timeout). Cost: one read of every B-tree page plus two pages per value; run
    only when the file is shorter than LMDB's ``last_pgno`` says."""
    try:
        out = subprocess.run([sys.executable, "-c", _WALK, store, str(map_size)], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode in (-signal.SIGBUS, -signal.SIGSEGV):
        return False
    return True if out.returncode == 0 and out.stdout.strip() == "ok" else None

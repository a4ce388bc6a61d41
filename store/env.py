"""The LMDB environment of one cache directory: sub-databases, format meta, permissions, map growth, space.

One environment per directory (``data.mdb`` + ``lock.mdb`` + ``reserve``, files 0600, directory 0700). The
meta record carries the store format; a store of a newer major format is refused, never rewritten, and so is a
``data.mdb`` shorter than its committed pages (LMDB would die of SIGBUS on it; ``open_environment`` with
``on_damage="move-aside"`` renames such a store aside and starts a fresh one). Every read and write transaction
first checks that ``data.mdb`` was not shrunk, removed or replaced under the open handle (``datafile.py``: an
``fstat`` and a ``stat``, ~1 + ~4 µs; ``StoreUnavailable`` instead of SIGBUS). Write transactions go through
``write()``, which grows the map and retries when LMDB reports it full, adopts a map that another process
grew, evicts (through its caller) when the disk is full, and clears reader slots of killed processes. Read
transactions (``read()``) turn LMDB's own errors into ``StoreError``.

Space: puts stop ``HEADROOM_BYTES`` short of the map limit and the disk's free space, and ``reserve`` holds that
much disk while there is room; writes that make room (unpin, evict, gc) may use both, so a store that filled
its disk (or whose disk something else filled) can always be emptied again.

Write path (what a large put costs, measured for a 256 MiB state on 2-core VMs): the record encoder gathers the
tensors into one buffer (one copy, checksummed as it goes), ``txn.put`` copies it into pages LMDB mallocs for
the transaction, and the commit ``pwrite``s those pages and ``fdatasync``s (twice: data, then the meta page).
What made the put machine-sensitive was not LMDB but the allocator and the disk:

* glibc serves each 16 MiB value LMDB mallocs from fresh memory (mmap'd, or heap top trimmed back after every
  commit) and the copy into it page-faults at the VM's first-touch rate (~1-2 GB/s, vs ~6 GB/s into memory
  already mapped): on one VM ``txn.put`` of 256 MiB took ~230 ms, ~45 ms with the thresholds below. So a
  writable store sets glibc's ``M_MMAP_THRESHOLD`` (32 MiB, the most glibc allows) and ``M_TRIM_THRESHOLD``
  (``TRIM_THRESHOLD_BYTES``) once per process, unless the process set them itself (``MALLOC_*`` environment,
  ``GLIBC_TUNABLES``) or ``SPEC_CACHE_MALLOC_TUNE=0``. Cost: up to that much freed heap stays mapped for reuse.
* ``fdatasync`` of new data is bounded by the disk (0.6-0.8 GB/s for 256 MiB here, less into a file that grows:
  ext4 allocates the blocks at writeback); mlx-lm's ``save_prompt_cache`` + fsync pays the same.
* ``writemap`` (LMDB writing straight into a shared map of the file) would save ``txn.put``'s copy, but LMDB
  then ftruncates ``data.mdb`` to the whole map as a sparse file and a full disk turns into SIGBUS on a page
  fault instead of an error at commit, which the disk-full handling here relies on. It stays off.
* Map growth: a put that finds the map full is aborted, the map grown and the put run again (all of its
  encoding redone), so ``write`` grows the map ahead of time in big steps (doubling) once it is
  ``GROW_AHEAD_FRACTION`` used.

Why one file of ~560 lines: ``Environment`` is one state machine over one ``lmdb.Environment`` (open, write with
growth / full-disk / stale-reader recovery, reserve); directory checks live in ``directory.py``, glibc tuning
in ``allocator.py``.

``Environment.last_write`` holds the last write's phases (seconds in ``fn``, in the commit, attempts) for
benchmarks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, TypeVar

import lmdb
import msgpack

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None

from .allocator import tune_allocator
from .datafile import DataFile, reaches_every_page
from .directory import (
    KEEP_ASIDE,
    RESERVE_NAME,
    RESERVE_WORK_NAME,
    check_data_file,
    first_unenterable,
    move_aside,
    prepare_dir,
    secure,
)
from .errors import StoreDamaged, StoreError, StoreFormatError, StoreFullError, StoreOpenError
from .txn_gate import TxnGate

STORE_FORMAT = "spec-cache-store"
STORE_MAJOR = 1
STORE_MINOR = 0
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_MAP_SIZE = 1 << 30
MAX_MAP_SIZE = 1 << 44
READER_CHECK_S = 5.0
HEADROOM_BYTES = 4 << 20  # map growth and disk space (``reserve``) puts leave to unpin/evict/gc a full store
DISK_FULL_BYTES = 64 << 20  # an EIO/ENOSPC commit with less free than this (or 5% of the disk) is "disk full"
GROW_AHEAD_FRACTION = 0.75  # grow the map before a write once this much of it is in use
BUDGET_KEY = b"budget"  # meta: the byte budget the store was last opened with (informational; see ``budget``)
SUBDBS = ("meta", "nsinfo", "nodes", "chunks", "entries", "edata", "drafts", "lru", "memo")
ON_DAMAGE = ("refuse", "move-aside")
T = TypeVar("T")
log = logging.getLogger("spec_cache.store")


def open_environment(path, *, on_damage: str = "refuse", readonly: bool = False, keep_aside: int = KEEP_ASIDE,
                     aside_budget: int | None = None, **options) -> "Environment":
    """``Environment(path, ...)``; a store too damaged to open (``StoreDamaged``: ``data.mdb`` truncated or empty)
    is refused (``on_damage="refuse"``) or, for a read-write open with ``on_damage="move-aside"``, renamed to
    ``<path>.damaged-<UTC time>`` (logged with both paths: ``spec-cache repair`` can still salvage it) and a fresh
    empty store opened in its place. A read-only open always refuses (it writes nothing).

    Copies set aside are bounded (``directory.prune_aside``): the newest ``keep_aside`` (default ``KEEP_ASIDE``, 2)
    stay, older ones are deleted; with ``aside_budget`` (the store's ``max_bytes``) copies are deleted too, oldest
    first, while the disk has less free space than that budget, so damage-and-restart cycles never take the room
    the fresh store was promised. Each deletion is logged (one line)."""
    if on_damage not in ON_DAMAGE:
        raise StoreError(f"on_damage must be one of {', '.join(ON_DAMAGE)}, got {on_damage!r}")
    if not isinstance(keep_aside, int) or isinstance(keep_aside, bool) or keep_aside < 0:
        raise StoreError(f"keep_aside must be an int >= 0, got {keep_aside!r}")
    path = os.path.abspath(os.fspath(path))
    for attempt in range(3):
        seen = _ident(path)
        try:
            return Environment(path, readonly=readonly, **options)
        except StoreDamaged as exc:
            if readonly or on_damage == "refuse" or attempt == 2:
                raise
            if _ident(path) == seen:  # else another process set it aside already: open what is there now
                aside = move_aside(path, keep=keep_aside, budget=aside_budget)
                kept = f"moved it aside to {aside}" if aside else "deleted it (no room to keep a copy)"
                log.warning("spec-cache: store at %s was damaged (%s); %s and opened a fresh empty store "
                            "(on_damage='move-aside')", path, " ".join(str(exc).split()), kept)
    raise AssertionError("unreachable")




def _write_failed(exc: lmdb.Error) -> bool:
    """A commit that could not write its pages: LMDB reports a short write as EIO, else ENOSPC/EFBIG/EDQUOT."""
    text = str(exc)
    return isinstance(exc, lmdb.DiskError) or any(
        s in text for s in ("Input/output error", "No space left", "File too large", "quota exceeded"))


class ReadTxn:
    """``with env.read() as txn``: the LMDB read transaction, aborted on exit; LMDB errors raised inside the
    block come out as ``StoreError`` naming the store."""

    __slots__ = ("txn", "path", "_gate")

    def __init__(self, txn, path: str, gate: TxnGate | None = None):
        self.txn = txn
        self.path = path
        self._gate = gate  # left on exit (``TxnGate``: a map resize waits for open read transactions)

    def __enter__(self):
        return self.txn

    def __exit__(self, exc_type, exc, tb):
        try:
            self.txn.abort()
        finally:
            gate, self._gate = self._gate, None
            if gate is not None:
                gate.leave_read()
        if exc_type is not None and issubclass(exc_type, lmdb.Error):
            raise StoreError(f"store at {self.path} cannot be read: LMDB reports {exc}; the store may be damaged "
                             f"(run 'spec-cache verify')") from None
        return False

    def __getattr__(self, name):  # used without ``with``: behave as the transaction itself
        return getattr(self.txn, name)


def _file_size(path: str) -> int:
    """Bytes in ``path`` (0 when it cannot be read)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _ident(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path``, None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _reason(exc: lmdb.Error) -> str:
    """LMDB's error without the path it repeats (the message names the store once)."""
    text = str(exc)
    head, sep, tail = text.partition(": ")
    return tail if sep and os.path.sep in head else text


class Environment:
    """Owns the ``lmdb.Environment`` and its named sub-databases."""

    def __init__(self, path: str, *, readonly: bool = False, durable: bool = True,
                 map_size: int | None = None, chunk_tokens: int | None = None):
        self.path = os.path.abspath(os.fspath(path))
        self.readonly = readonly
        self.gate = TxnGate()  # read transactions share it; a map resize (``_set_mapsize``) takes it alone
        self._reader_checked = time.monotonic()
        self.last_write: dict = {}
        self.data: DataFile | None = None  # the data.mdb LMDB maps, checked before every transaction
        self._whole: tuple[int, int] | None = None  # (size, needed) a page walk found whole (``_check_file_size``)
        if not readonly:
            tune_allocator()
        if readonly:
            self._check_readable()
            lock = os.access(os.path.join(self.path, "lock.mdb"), os.W_OK)
        else:
            if prepare_dir(self.path):
                self._peek()  # a foreign or newer store is refused before LMDB's lock file is touched
            lock = True
        old_umask = os.umask(0o077)
        try:
            # read-only on a store whose lock file we may not write (another user's): lock-free reads (see
            # ``_check_readable``); everything else takes LMDB's lock table
            size = map_size or DEFAULT_MAP_SIZE
            expected = _ident(os.path.join(self.path, "data.mdb"))
            for attempt in range(8):
                try:
                    self.env = lmdb.open(self.path, map_size=size, max_dbs=len(SUBDBS) + 2, subdir=True,
                                         readonly=readonly, sync=durable, metasync=durable, max_readers=256,
                                         lock=lock, writemap=False, readahead=False, mode=0o600)
                    break
                except lmdb.MapResizedError:
                    # the open's own first transaction found pages past the map asked for: another process grew
                    # the store meanwhile; ask for a map that covers the file as it is now (plus headroom)
                    if attempt == 7:
                        raise
                    size = max(size, 2 * _file_size(os.path.join(self.path, "data.mdb")))
        except lmdb.Error as exc:
            raise StoreOpenError(f"cannot open store at {self.path}: {_reason(exc)}") from None
        finally:
            os.umask(old_umask)
        try:
            self.data = DataFile(self.path, expected)
            self._check_file_size()
            if lock:
                self.env.reader_check()  # clear reader slots left by killed processes
            for attempt in range(8):
                try:
                    existing = self._existing_format()  # before anything is created: a refused store stays untouched
                    self.dbs = {name: self.env.open_db(name.encode(), create=not readonly) for name in SUBDBS}
                    break
                except lmdb.MapResizedError:  # another process grew the map since we opened it: adopt its size
                    if attempt == 7:
                        raise
                    self.env.set_mapsize(0)
            if not readonly:  # every check passed: only now modes change and the reserve is made
                secure(self.path)
                self._keep_reserve()
            self.meta = existing if existing is not None else self._create_format(chunk_tokens)
        except lmdb.Error as exc:
            self.close()
            raise StoreOpenError(f"cannot open store at {self.path}: {_reason(exc)}") from None
        except BaseException:
            self.close()
            raise

    def _peek(self) -> None:
        """Check an existing ``data.mdb`` through a lock-free read-only open (which writes nothing)."""
        try:
            self.env = lmdb.open(self.path, readonly=True, lock=False, subdir=True, max_dbs=len(SUBDBS) + 2)
        except lmdb.Error as exc:
            raise StoreOpenError(f"cannot open store at {self.path}: {_reason(exc)}") from None
        try:
            self._check_file_size()
            for attempt in range(8):
                try:
                    self._existing_format()
                    break
                except lmdb.MapResizedError:  # another process grew the map: adopt its size
                    if attempt == 7:
                        raise
                    self.env.set_mapsize(0)
                except StoreFormatError:
                    # a lock-free read is no snapshot while another process writes (one creating this store right
                    # now): looked at again a moment later before it is called foreign
                    if attempt >= 3:
                        raise
                    time.sleep(0.05)
                except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError):
                    # the same hazard on a busy store: a page a writer recycled under this lock-free read (seen
                    # as "Located page was wrong type" while another process wrote). Looked at again; if it stays
                    # so, the peek gives way: the locked open below reads the format again from a real snapshot
                    # (and still refuses a foreign or newer store there), and a damaged page is its to report
                    if attempt >= 3:
                        return
                    time.sleep(0.05)
        except lmdb.Error as exc:
            raise StoreOpenError(f"cannot open store at {self.path}: {_reason(exc)}") from None
        finally:
            self.env.close()
            self.env = None

    def _check_readable(self) -> None:
        """A read-only open needs a readable ``data.mdb``; permission problems are named as such.

        Read-only inspection of a store whose ``lock.mdb`` this user cannot write (another user's store, a
        read-only mount) opens without LMDB's lock table: safe while no process writes the store; during a
        concurrent write a reader may see pages being rewritten (every record is still checksummed, so that
        shows as a corrupt record, never as wrong data)."""
        if not os.path.isdir(self.path):
            if os.path.lexists(self.path):
                raise StoreOpenError(f"store path {self.path} is not a directory")
            blocked = first_unenterable(self.path)
            if blocked is not None:
                raise StoreOpenError(f"permission denied: cannot enter {blocked}")
            raise StoreOpenError(f"no spec-cache store at {self.path}")
        if not os.access(self.path, os.X_OK | os.R_OK):
            raise StoreOpenError(f"permission denied: cannot read store directory {self.path}")
        if not os.path.exists(os.path.join(self.path, "data.mdb")):
            raise StoreOpenError(f"no spec-cache store at {self.path}")
        check_data_file(self.path)

    def _check_file_size(self) -> None:
        """Refuse a ``data.mdb`` shorter than its committed pages (truncated by a full disk, a bad copy, a
        filesystem error): LMDB maps the file and would die with SIGBUS on the first page past its end.

        A file shorter than ``last_pgno`` says may still be whole (pages freed in the transaction that allocated
        them are counted but never written): then a child process touches every referenced page
        (``datafile.reaches_every_page``) and only a child killed by SIGBUS, or a walk that could not finish,
        makes it damaged. Rare (a few commits in a thousand end so), cost one walk of the store's pages."""
        needed = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        try:
            size = self.data.size() if self.data is not None else os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError as exc:
            raise StoreOpenError(f"cannot open store at {self.path}: {exc.strerror}") from None
        if size >= needed or self._whole == (size, needed):
            return
        reached = reaches_every_page(self.path, max(self.env.info()["map_size"], 2 * needed))
        if reached:
            self._whole = (size, needed)
            return
        how = "a page past its end is referenced" if reached is False else "a walk of its pages could not finish"
        raise StoreDamaged(
            f"store at {self.path} is damaged: data.mdb holds {size} bytes but its committed pages need "
            f"{needed} and {how} (the file was truncated); run 'spec-cache repair' to copy out what is left")

    def _existing_format(self) -> dict | None:
        """The format record of an existing store (checked), or None for an empty environment.

        Reads only (one read transaction): an LMDB file that holds other databases, or a store of a newer
        major format, is refused before any sub-database is created in it.
        """
        with self.env.begin() as txn:
            names = []
            for key, _ in txn.cursor():
                names.append(bytes(key))
                if len(names) > len(SUBDBS):
                    break
            if not names:
                return None
            known = {name.encode() for name in SUBDBS}
            foreign = StoreFormatError(f"{self.path} holds an LMDB database that is not a spec-cache store")
            if any(name not in known for name in names):
                raise foreign
            if b"meta" not in names:  # only our sub-databases, meta not yet: another process is creating them
                return None
            try:
                meta_db = self.env.open_db(b"meta", txn=txn, create=False)
            except lmdb.Error:
                raise foreign from None
            raw = txn.get(b"format", db=meta_db)
            if raw is None:
                return None  # another process is creating this store right now
            raw = bytes(raw)
        try:
            meta = msgpack.unpackb(raw, raw=False)
            name, major = meta["format"], meta["major"]
            int(meta["chunk_tokens"])
        except Exception:
            raise StoreFormatError(f"{self.path}: unreadable store format record") from None
        if name != STORE_FORMAT:
            raise StoreFormatError(f"{self.path} is not a spec-cache store (format {name!r})")
        if not isinstance(major, int) or major > STORE_MAJOR:
            raise StoreFormatError(
                f"{self.path} holds store format {major}.{meta.get('minor', 0)}; this spec-cache reads format "
                f"{STORE_MAJOR}.x — upgrade spec-cache (the store is left untouched)")
        return meta

    def _create_format(self, chunk_tokens: int | None) -> dict:
        if self.readonly:
            raise StoreFormatError(f"{self.path} has no spec-cache format record")
        meta = {"format": STORE_FORMAT, "major": STORE_MAJOR, "minor": STORE_MINOR,
                "chunk_tokens": int(chunk_tokens or DEFAULT_CHUNK_TOKENS), "created_ns": time.time_ns()}
        if meta["chunk_tokens"] < 1:
            raise StoreError("chunk_tokens must be >= 1")

        def init(txn):
            existing = txn.get(b"format", db=self.dbs["meta"])
            if existing is None:
                txn.put(b"format", msgpack.packb(meta), db=self.dbs["meta"])
                return meta
            return msgpack.unpackb(existing, raw=False)
        return self.write(init)

    def budget(self) -> int | None:
        """The byte budget recorded with the store (``meta`` key ``budget``: msgpack ``{max_bytes, set_ns}``,
        written by the last writer opened with ``max_bytes``), or None when none was recorded or it is unreadable."""
        with self.read() as txn:
            raw = txn.get(BUDGET_KEY, db=self.dbs["meta"])
            raw = None if raw is None else bytes(raw)
        try:
            value = msgpack.unpackb(raw, raw=False)["max_bytes"] if raw is not None else None
        except Exception:
            return None
        return value if type(value) is int and value > 0 else None

    def record_budget(self, max_bytes: int) -> None:
        """Record ``max_bytes`` as the store's budget (what ``stats`` shows); one small write when it changed."""
        if self.readonly or self.budget() == max_bytes:
            return
        value = msgpack.packb({"max_bytes": int(max_bytes), "set_ns": time.time_ns()})
        self.write(lambda txn: txn.put(BUDGET_KEY, value, db=self.dbs["meta"]))

    def read(self) -> "ReadTxn":
        """A read-only transaction (use as a context manager); adopts a map grown by another process.

        An LMDB error inside it (a damaged page: ``MDB_CORRUPTED``, ``MDB_PAGE_NOTFOUND``...) leaves the
        ``with`` block as a ``StoreError``, never as a bare ``lmdb.Error``. Before it begins, ``data.mdb`` is
        checked (``datafile.py``): shrunk, removed or replaced, it raises ``StoreUnavailable`` instead of LMDB
        reading past the file's end (SIGBUS).
        """
        self.check_data()
        self.gate.enter_read()
        try:
            try:
                txn = self.env.begin(buffers=True)
            except lmdb.MapResizedError:  # another process grew the map: adopt it, with no reader of ours open
                self.gate.leave_read()
                self._set_mapsize(0)
                self.gate.enter_read()
                txn = self.env.begin(buffers=True)
        except lmdb.Error as exc:  # e.g. the reader table is full
            self.gate.leave_read()
            raise StoreError(f"store at {self.path}: cannot start a read transaction ({exc})") from None
        except BaseException:
            self.gate.leave_read()
            raise
        return ReadTxn(txn, self.path, self.gate)

    def _set_mapsize(self, size: int) -> None:
        """``set_mapsize`` once no other thread of this process holds a read transaction (``TxnGate``)."""
        with self.gate.exclusive():
            self.env.set_mapsize(size)

    def write(self, fn: Callable[[lmdb.Transaction], T], *, on_full: Callable[[], bool] | None = None,
              making_room: bool = False) -> T:
        """Run ``fn(txn)`` in one write transaction, all of it or none of it.

        On a full map the transaction is aborted, the map doubled (up to the disk's free space) and ``fn``
        run again; ``on_full`` may free space first (eviction) and returns whether it did. A full disk (the
        commit cannot extend ``data.mdb``) is handled the same way: evict, retry, else ``StoreFullError``.
        Every few seconds, and before growing, reader slots of killed processes are cleared (a stale slot
        would pin old pages and make the file grow without bound in a long-running process). Writes that make
        room (``making_room``: unpin, evict, gc, dropping corrupt records) may use the headroom puts leave.
        """
        if self.readonly:
            raise StoreError("store was opened read-only")
        self.check_data()
        if time.monotonic() - self._reader_checked > READER_CHECK_S:
            self._clear_stale_readers()
            self._keep_reserve()
        maintenance = making_room
        self._grow_ahead()
        for attempt in range(64):
            try:
                return self._transaction(fn, attempt)
            except lmdb.MapResizedError:
                self._set_mapsize(0)
            except lmdb.MapFullError:
                if self._clear_stale_readers():
                    continue
                if not self._grow(maintenance=maintenance):
                    if maintenance and self._release_reserve():
                        continue
                    if on_full is None or not on_full():
                        raise StoreFullError(
                            f"store at {self.path} is full: the map cannot grow past "
                            f"{self.env.info()['map_size']} bytes (disk space) and nothing more can be evicted"
                        ) from None
            except lmdb.PanicError as exc:
                raise StoreError(f"store at {self.path}: LMDB hit a fatal error ({exc}); close and reopen the "
                                 f"store") from None
            except lmdb.Error as exc:  # never a bare LMDB exception above this layer
                if not _write_failed(exc):
                    raise StoreError(f"store at {self.path}: LMDB error while writing ({exc})") from None
                # the commit could not extend data.mdb: free pages inside it (evict) and try again
                if maintenance and self._release_reserve():
                    continue
                if on_full is None or not on_full():
                    reason = self._no_space_reason()
                    if reason is None:
                        raise StoreError(f"store at {self.path}: I/O error while writing ({exc}) with "
                                         f"{self._free_bytes()} bytes free on the disk") from None
                    raise StoreFullError(f"store at {self.path}: {reason} and nothing more can be evicted; the "
                                         f"store is unchanged and still readable") from None
        raise StoreFullError(f"store at {self.path}: write did not fit after repeated map growth or eviction")

    def _transaction(self, fn: Callable[[lmdb.Transaction], T], attempt: int) -> T:
        """One attempt of ``write``: ``fn`` in a write transaction, committed (timed into ``last_write``)."""
        txn = self.env.begin(write=True, buffers=True)
        t0 = time.perf_counter()
        try:
            result = fn(txn)
        except BaseException:
            txn.abort()
            raise
        t1 = time.perf_counter()
        txn.commit()  # durable: LMDB fdatasyncs the data pages, then the meta page
        self.last_write = {"fn_s": t1 - t0, "commit_s": time.perf_counter() - t1, "attempts": attempt + 1}
        return result

    def _grow_ahead(self) -> None:
        """Grow the map (doubling, within the disk's free space) before a write once ``GROW_AHEAD_FRACTION`` of
        it is in use, so a large put is rarely aborted half-way by a full map and run again."""
        try:
            info = self.env.info()
            used = (info["last_pgno"] + 1) * self.env.stat()["psize"]
            if used > GROW_AHEAD_FRACTION * info["map_size"]:
                self._grow()
        except lmdb.Error:
            pass

    def _keep_reserve(self) -> None:
        """Hold ``HEADROOM_BYTES`` of disk in ``reserve`` (allocated blocks, not a sparse file) while the disk has
        room, so a store on a disk that filled up (by itself or by anything else) can still be unpinned and
        evicted. Checked at open and every ``READER_CHECK_S`` of writing."""
        path = os.path.join(self.path, RESERVE_NAME)
        work = os.path.join(self.path, RESERVE_WORK_NAME)
        try:
            if os.path.exists(path) or self._free_bytes() < 4 * HEADROOM_BYTES:
                return
            fd = os.open(work, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, HEADROOM_BYTES)  # real blocks, no data written
                else:  # pragma: no cover - macOS
                    block = bytes(1 << 20)
                    for _ in range(HEADROOM_BYTES >> 20):
                        os.write(fd, block)
            finally:
                os.close(fd)
            os.replace(work, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(work)

    def _release_reserve(self) -> bool:
        """Give the reserve's disk space back for a write that makes room (unpin, evict, gc)."""
        try:
            os.remove(os.path.join(self.path, RESERVE_NAME))
        except OSError:
            return False
        return True

    def _clear_stale_readers(self) -> int:
        self._reader_checked = time.monotonic()
        try:
            return self.env.reader_check()
        except lmdb.Error:
            return 0

    def _free_bytes(self) -> int:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _no_space_reason(self) -> str | None:
        """Why a write that failed for lack of room failed: a full disk or the file size limit (None: neither,
        so it was some other I/O error)."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        free = st.f_bavail * st.f_frsize
        if free < max(DISK_FULL_BYTES, st.f_blocks * st.f_frsize // 20):
            return f"the disk is full ({free} bytes free)"
        if resource is not None:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY and \
                    os.path.getsize(os.path.join(self.path, "data.mdb")) + DISK_FULL_BYTES > limit:
                return f"data.mdb reached the file size limit ({limit} bytes, RLIMIT_FSIZE)"
        return None

    def _grow(self, *, maintenance: bool = False) -> bool:
        """Double the map, up to ``MAX_MAP_SIZE`` and the disk's free space. Puts stop ``HEADROOM_BYTES``
        short of both, so that a full store can still be unpinned, evicted and collected: those writes (no
        eviction callback) may use the headroom. Returns whether the map grew."""
        current = self.env.info()["map_size"]
        free = self._free_bytes()
        used = os.path.getsize(os.path.join(self.path, "data.mdb"))
        if maintenance:
            target = min(max(current * 2, current + HEADROOM_BYTES), MAX_MAP_SIZE + HEADROOM_BYTES, used + free)
        else:
            target = min(current * 2, MAX_MAP_SIZE, used + free - HEADROOM_BYTES)
        if target <= current:
            return False
        try:
            self._set_mapsize(target)
        except lmdb.Error:
            return False
        return True

    def check_data(self) -> None:
        """``StoreUnavailable`` if ``data.mdb`` was shrunk, removed or replaced under this handle (``datafile.py``);
        cost: an ``fstat`` and a ``stat``."""
        if self.data is not None:
            self.data.check()

    def close(self) -> None:
        self.env.close()
        if self.data is not None:
            self.data.close()

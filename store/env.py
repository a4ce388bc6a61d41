"""The LMDB environment of one cache directory: sub-databases, format meta, permissions, map growth.

One environment per directory (``data.mdb`` + ``lock.mdb``, files 0600, directory 0700). The meta record
carries the store format; a store of a newer major format is refused, never rewritten. Write transactions
go through ``write()``, which grows the map and retries when LMDB reports it full, and adopts a map that
another process grew.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import Callable, TypeVar

import lmdb
import msgpack

from .errors import StoreError, StoreFormatError, StoreFullError, StoreOpenError

STORE_FORMAT = "spec-cache-store"
STORE_MAJOR = 1
STORE_MINOR = 0
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_MAP_SIZE = 1 << 30
MAX_MAP_SIZE = 1 << 44
SUBDBS = ("meta", "nsinfo", "nodes", "chunks", "entries", "edata", "drafts", "lru", "memo")
T = TypeVar("T")


def _secure_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StoreOpenError(f"cannot create store directory {path}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise StoreOpenError(f"store path {path} is not a directory")
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) != 0o700 and st.st_uid == os.getuid():
        os.chmod(path, 0o700)


class Environment:
    """Owns the ``lmdb.Environment`` and its named sub-databases."""

    def __init__(self, path: str, *, readonly: bool = False, durable: bool = True,
                 map_size: int | None = None, chunk_tokens: int | None = None):
        self.path = os.path.abspath(os.fspath(path))
        self.readonly = readonly
        if readonly:
            if not os.path.exists(os.path.join(self.path, "data.mdb")):
                raise StoreOpenError(f"no spec-cache store at {self.path}")
        else:
            _secure_dir(self.path)
        old_umask = os.umask(0o077)
        try:
            self.env = lmdb.open(self.path, map_size=map_size or DEFAULT_MAP_SIZE, max_dbs=len(SUBDBS) + 2,
                                 subdir=True, readonly=readonly, sync=durable, metasync=durable,
                                 max_readers=256, lock=True, writemap=False, readahead=False, mode=0o600)
        except lmdb.Error as exc:
            raise StoreOpenError(f"cannot open store at {self.path}: {exc}") from None
        finally:
            os.umask(old_umask)
        if not readonly:
            for name in ("data.mdb", "lock.mdb"):
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(self.path, name), 0o600)
        try:
            self.env.reader_check()  # clear reader slots left by killed processes
            existing = self._existing_format()  # before anything is created: a refused store stays untouched
            self.dbs = {name: self.env.open_db(name.encode(), create=not readonly) for name in SUBDBS}
            self.meta = existing if existing is not None else self._create_format(chunk_tokens)
        except lmdb.Error as exc:
            self.env.close()
            raise StoreOpenError(f"cannot open store at {self.path}: {exc}") from None
        except BaseException:
            self.env.close()
            raise

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
            if b"meta" not in names or any(name not in known for name in names):
                raise foreign
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

    def read(self):
        """A read-only transaction (use as a context manager); adopts a map grown by another process."""
        try:
            return self.env.begin(buffers=True)
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)
            return self.env.begin(buffers=True)
        except lmdb.Error as exc:  # e.g. the reader table is full
            raise StoreError(f"store at {self.path}: cannot start a read transaction ({exc})") from None

    def write(self, fn: Callable[[lmdb.Transaction], T], *, on_full: Callable[[], bool] | None = None) -> T:
        """Run ``fn(txn)`` in one write transaction, all of it or none of it.

        On a full map the transaction is aborted, the map doubled (up to the disk's free space) and ``fn``
        run again; ``on_full`` may free space first (eviction) and returns whether it did.
        """
        if self.readonly:
            raise StoreError("store was opened read-only")
        for _attempt in range(64):
            try:
                with self.env.begin(write=True, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)
            except lmdb.MapFullError:
                if not self._grow():
                    if on_full is None or not on_full():
                        raise StoreFullError(
                            f"store at {self.path} is full: the map cannot grow past "
                            f"{self.env.info()['map_size']} bytes (disk space) and nothing more can be evicted"
                        ) from None
            except lmdb.DiskError as exc:
                raise StoreFullError(f"store at {self.path}: disk error while writing ({exc})") from None
            except lmdb.Error as exc:  # never a bare LMDB exception above this layer
                raise StoreError(f"store at {self.path}: LMDB error while writing ({exc})") from None
        raise StoreFullError(f"store at {self.path}: write did not fit after repeated map growth")

    def _grow(self) -> bool:
        current = self.env.info()["map_size"]
        try:
            free = os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize
        except OSError:
            free = 0
        used = os.path.getsize(os.path.join(self.path, "data.mdb"))
        target = min(current * 2, MAX_MAP_SIZE, used + free)
        if target <= current:
            return False
        try:
            self.env.set_mapsize(target)
        except lmdb.Error:
            return False
        return True

    def close(self) -> None:
        self.env.close()

"""Opening a store while another process grows its map: LMDB's open starts a transaction that can fail with
MDB_MAP_RESIZED (pages past the map asked for); the open retries with a map covering the file, never an error."""

from __future__ import annotations

import lmdb

from spec_cache.store import Store
from spec_cache.store import env as store_env


def test_open_retries_with_a_map_covering_the_file_when_another_process_grew_it(tmp_path, monkeypatch):
    path = tmp_path / "store"
    Store.open(path).close()
    real = lmdb.open
    sizes = []

    def grown_meanwhile(*args, **kwargs):
        if kwargs.get("readonly"):  # the lock-free peek at an existing store
            return real(*args, **kwargs)
        sizes.append(kwargs["map_size"])
        if len(sizes) == 1:
            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED: Database contents grew beyond environment "
                                       "mapsize")
        return real(*args, **kwargs)

    monkeypatch.setattr(store_env.lmdb, "open", grown_meanwhile)
    store = Store.open(path)
    try:
        assert store.namespace_info(b"\0" * 32) is None and store.chunk_tokens > 0  # a working store
    finally:
        store.close()
    assert len(sizes) == 2
    assert sizes[1] >= max(sizes[0], 2 * (path / "data.mdb").stat().st_size)


def test_a_page_recycled_under_the_lock_free_peek_does_not_fail_the_open(tmp_path, monkeypatch):
    """The peek at an existing store reads without LMDB's lock table: while another process writes, it may meet a
    page recycled under it ("MDB_CORRUPTED: Located page was wrong type", seen in the concurrency harness). That is
    no damage: the peek gives way and the locked open reads the format from a real snapshot."""
    path = tmp_path / "store"
    Store.open(path).close()
    real = store_env.Environment._existing_format
    peeks = []

    def recycled(self):
        if self.env is not None and self.env.flags().get("lock") is False:  # the lock-free peek
            peeks.append(1)
            raise lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type")
        return real(self)

    monkeypatch.setattr(store_env.Environment, "_existing_format", recycled)
    store = Store.open(path)
    try:
        assert store.chunk_tokens > 0 and len(peeks) == 4  # looked at again, then left to the locked open
    finally:
        store.close()

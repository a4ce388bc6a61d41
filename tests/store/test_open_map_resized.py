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

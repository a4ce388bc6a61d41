"""The artifact-identity memo kept in the store: a hit skips hashing, a changed file misses, garbage is a miss."""

import os

import pytest

import spec_cache.naming.identity as identity
from spec_cache.naming.identity import model_identity
from spec_cache.store import Store


def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return d


def test_store_memo_hit_skips_hashing_and_survives_reopen(tmp_path, monkeypatch):
    d = model_dir(tmp_path)
    with Store.open(tmp_path / "store") as store:
        first = model_identity(d, memo=store.memo())
    with Store.open(tmp_path / "store") as store:
        monkeypatch.setattr(identity, "_digest_files", lambda *a, **k: pytest.fail("re-hashed an unchanged model"))
        assert model_identity(d, memo=store.memo()) == first
        monkeypatch.undo()
        os.utime(d / "model.safetensors", ns=(1, 1))  # mtime changed: a miss, hashed again, same bytes
        calls = []
        real = identity._digest_files
        monkeypatch.setattr(identity, "_digest_files", lambda *a, **k: calls.append(1) or real(*a, **k))
        assert model_identity(d, memo=store.memo()) == first and calls == [1]


def test_store_memo_ignores_garbage_and_read_only_stores(tmp_path):
    d = model_dir(tmp_path)
    with Store.open(tmp_path / "store") as store:
        memo = store.memo()
        digest = model_identity(d, memo=memo)
        (key,) = [bytes(k).decode() for k, _ in store.env.env.begin().cursor(db=store.env.dbs["memo"])]
        memo.put(key, "not-a-digest")
        assert model_identity(d, memo=memo) == digest  # corrupt memo value: a miss, rewritten
        assert memo.get(key) == digest
    with Store.open(tmp_path / "store", readonly=True) as store:
        assert model_identity(d, memo=store.memo()) == digest  # read-only: reads the memo, never writes

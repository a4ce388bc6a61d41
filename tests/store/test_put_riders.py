"""Rows that ride in a checkpoint's own transaction (``Store.put(rider=...)``; issue 21's write amplification): a
continuation record written beside the state it names costs no commit of its own, lands with it or not at all, and
a rider that fails is undone alone while the checkpoint stays."""

from __future__ import annotations

import numpy as np

from spec_cache.store import PutResult
from spec_cache.store.continuations import Continuation, ContinuationTable
from spec_cache.store.verify import verify
from tests.store.test_put_many import _conversation, _open, _state
from tests.store.test_write_amp_store import NS, _count_commits, _layers


def _record(n: int, seed: int = 0) -> Continuation:
    key = bytes([seed + 1]) * 32
    return Continuation(key, NS, 100, tuple(range(n)), finished=False)


def test_a_rider_lands_in_the_checkpoints_commit(tmp_path):
    tokens, kv = _conversation()
    store = _open(tmp_path)
    try:
        table = ContinuationTable(store)
        commits = _count_commits(store)
        store.put(NS, tokens[:200], _layers(kv, 200), rider=lambda txn: table.write_in(txn, _record(5)))
        assert len(commits) == 1  # before: the record was a second commit of its own (~12-20 KiB of pages)
        got = table.get(_record(5).key)
        assert got is not None and got.tokens == tuple(range(5))
        assert store.fetch(NS, tokens[:200]).length == 200
        assert not verify(store).damaged
    finally:
        store.close()


def test_a_batch_with_riders_is_one_commit_and_reads_back_as_lone_puts(tmp_path):
    tokens, kv = _conversation()
    lengths = (70, 130, 200, 333)
    batch, alone = _open(tmp_path, "batch"), _open(tmp_path, "alone")
    try:
        tables = {s: ContinuationTable(s) for s in (batch, alone)}
        commits = _count_commits(batch)
        outcomes = batch.put_many([(NS, tokens[:n], _layers(kv, n),
                                    {"rider": lambda txn, i=i: tables[batch].write_in(txn, _record(i + 1, i))})
                                   for i, n in enumerate(lengths)])
        assert all(isinstance(o, PutResult) for o in outcomes) and len(commits) == 1
        for i, n in enumerate(lengths):
            record = _record(i + 1, i)
            alone.put(NS, tokens[:n], _layers(kv, n), rider=lambda txn, r=record: tables[alone].write_in(txn, r))
        assert _state(batch, tokens) == _state(alone, tokens)
        got = [(r.key, r.tokens) for r in tables[batch].records()]
        assert sorted(got) == sorted((r.key, r.tokens) for r in tables[alone].records()) and len(got) == 4
    finally:
        batch.close()
        alone.close()


def test_a_rider_that_fails_is_undone_alone_and_the_checkpoint_stays(tmp_path):
    tokens, kv = _conversation()
    store = _open(tmp_path)
    try:
        table = ContinuationTable(store)

        def half_then_fail(txn):
            table.write_in(txn, _record(3))  # its rows are written, then it fails: none of them may stay
            raise ValueError("simulated rider failure")
        commits = _count_commits(store)
        result = store.put(NS, tokens[:130], _layers(kv, 130), rider=half_then_fail)
        assert isinstance(result, PutResult) and len(commits) == 1
        assert table.get(_record(3).key) is None and table.records() == []
        got = store.fetch(NS, tokens[:130])
        assert got is not None and got.length == 130
        want = np.ascontiguousarray(kv[0, :, :, :130])
        assert np.array_equal(np.asarray(got.layers[0].tensors[0].data), want)
        assert not verify(store).damaged
    finally:
        store.close()

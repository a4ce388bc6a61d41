"""Several checkpoints in one LMDB commit (``Store.put_many``; issue 21's write amplification): each checkpoint gets
the outcome a lone put would give it. (The write-behind writer does not batch yet: see BENCHMARKS.md.)"""

from __future__ import annotations

import numpy as np

from spec_cache.store import InvalidInput, PutResult, Store, StoreFullError
from spec_cache.store.maintenance import entries
from spec_cache.store.verify import verify
from tests.store.test_write_amp_store import NS, _count_commits, _layers


def _open(tmp_path, name="store", **options):
    store = Store.open(tmp_path / name, chunk_tokens=64, **options)
    store.register_namespace(NS, target="t", prefix_namespace="p")
    return store


def _conversation(seed=7, n=600):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, n).tolist(), rng.standard_normal((2, 1, 2, n, 8)).astype(np.float32)


def _state(store: Store, tokens) -> list:
    """What a reader gets back for each prefix length (bytes of every tensor), from LMDB."""
    out = []
    for n in (70, 130, 200, 333):
        got = store.fetch(NS, tokens[:n])
        out.append(None if got is None else (got.length, [bytes(memoryview(t.data)) for layer in got.layers
                                                          for t in layer.tensors]))
    return out


def test_a_batch_is_one_commit_and_reads_back_as_sequential_puts(tmp_path):
    tokens, kv = _conversation()
    lengths = (70, 129, 130, 200, 333)
    batch, alone = _open(tmp_path, "batch"), _open(tmp_path, "alone")
    try:
        commits = _count_commits(batch)
        outcomes = batch.put_many([(NS, tokens[:n], _layers(kv, n), {}) for n in lengths])
        assert len(commits) == 1 and all(isinstance(o, PutResult) for o in outcomes)
        for n in lengths:
            alone.put(NS, tokens[:n], _layers(kv, n))
        assert _state(batch, tokens) == _state(alone, tokens)
        assert not verify(batch).damaged
        stored = sorted(entries(batch, NS), key=lambda e: e["tokens"])
        assert [o.entry.hex() for o in outcomes] == [e["key"] for e in stored]
    finally:
        batch.close()
        alone.close()


def test_one_bad_checkpoint_fails_alone_and_the_others_are_stored(tmp_path):
    tokens, kv = _conversation()
    store = _open(tmp_path, max_bytes=1 << 20)
    try:
        huge_tokens, huge_kv = _conversation(seed=8, n=3000)  # over the budget on its own
        outcomes = store.put_many([
            (NS, tokens[:100], _layers(kv, 100), {}),
            (NS, tokens[:50], _layers(kv, 60), {}),  # layers cover 60 tokens, not 50: bad input
            (NS, huge_tokens, _layers(np.repeat(huge_kv, 4, axis=2), 3000), {}),
            (NS, tokens[:300], _layers(kv, 300), {}),
        ])
        assert isinstance(outcomes[0], PutResult) and isinstance(outcomes[3], PutResult)
        assert isinstance(outcomes[1], InvalidInput) and isinstance(outcomes[2], StoreFullError)
        assert sorted(e["tokens"] for e in entries(store, NS)) == [100, 300]
        assert not verify(store).damaged
    finally:
        store.close()


def test_a_failing_transaction_falls_back_to_lone_puts(tmp_path, monkeypatch):
    tokens, kv = _conversation()
    store = _open(tmp_path)
    try:
        real = store._commit
        seen = []

        def second_fails_in_a_batch(txn, checkpoint, pin):
            seen.append(checkpoint.length)
            if len(seen) == 2:  # only inside the first (batched) transaction
                raise StoreFullError("simulated: no room beside the first")
            return real(txn, checkpoint, pin)

        monkeypatch.setattr(store, "_commit", second_fails_in_a_batch)
        outcomes = store.put_many([(NS, tokens[:n], _layers(kv, n), {}) for n in (100, 200)])
        assert all(isinstance(o, PutResult) for o in outcomes), outcomes
        assert sorted(e["tokens"] for e in entries(store, NS)) == [100, 200]
    finally:
        store.close()

"""Readers of one process never wait for its writes (``store/txn_gate.py``; issue 35: the server's scheduler thread
spent seconds in ``Store.reading`` behind the write-behind thread's puts), while a map resize still runs with no
read transaction of the process open, as LMDB requires."""

from __future__ import annotations

import threading
import time

import numpy as np

from spec_cache.store import LayerState, Store, Tensor
from spec_cache.store.continuations import ContinuationTable
from spec_cache.store.txn_gate import TxnGate
from tests.store.test_put_many import _conversation, _open
from tests.store.test_write_amp_store import NS, _layers


def test_lookup_fetch_and_continuations_go_on_while_a_put_is_in_its_transaction(tmp_path):
    tokens, kv = _conversation()
    store = _open(tmp_path)
    try:
        store.put(NS, tokens[:200], _layers(kv, 200))
        inside, release = threading.Event(), threading.Event()

        def rider(txn):  # holds the put's write transaction open until the reads below are done
            inside.set()
            release.wait(30)
        writer = threading.Thread(target=store.put, args=(NS, tokens[:400], _layers(kv, 400)),
                                  kwargs={"rider": rider})
        writer.start()
        assert inside.wait(30)
        t0 = time.monotonic()
        assert store.lookup(NS, tokens[:300]).length == 200  # the snapshot before the put
        got = store.fetch(NS, tokens[:300])
        assert got.length == 200 and bytes(memoryview(got.layers[0].tensors[0].data)) == kv[0, :, :, :200].tobytes()
        assert ContinuationTable(store).get(b"\x01" * 32) is None
        waited = time.monotonic() - t0
        assert writer.is_alive()  # every read above finished while the put was still inside its transaction
        release.set()
        writer.join(30)
        assert waited < 30
        assert store.fetch(NS, tokens[:500]).length == 400
    finally:
        release.set()
        store.close()


def test_a_map_resize_waits_for_another_threads_read_and_loses_nothing(tmp_path):
    store = Store.open(tmp_path / "s", chunk_tokens=64, map_size=1 << 20, durable=False)
    store.register_namespace(NS, target="t", prefix_namespace="p")
    rng = np.random.default_rng(3)
    reading, done_reading = threading.Event(), threading.Event()
    order = []

    def reader():
        with store.reading() as txn:
            txn.get(b"format", db=store.env.dbs["meta"])
            reading.set()
            time.sleep(0.5)
            order.append("reader left")
        done_reading.set()
    try:
        t = threading.Thread(target=reader)
        t.start()
        assert reading.wait(30)
        stored = []
        for i in range(6):  # ~4 MiB in a map of 1 MiB: the map grows, after the reader has left
            toks = rng.integers(0, 50_000, 256).tolist()
            k = rng.standard_normal((1, 4, 256, 256), dtype=np.float32)
            store.put(NS, toks, [LayerState("kv", {}, [Tensor.from_numpy(k)], token_axis=2)])
            stored.append((toks, k))
        order.append("puts done")
        t.join(30)
        assert order == ["reader left", "puts done"]
        assert store.env.env.info()["map_size"] > 1 << 20
        for toks, k in stored:
            assert store.fetch(NS, toks).layers[0].tensors[0].array().tobytes() == k.tobytes()
    finally:
        store.close()


def test_gate_readers_share_a_resize_is_alone_and_a_reader_may_resize():
    gate = TxnGate()
    gate.enter_read()
    gate.enter_read()  # nested reads of one thread
    with gate.exclusive():  # this thread's own reads do not block its resize (a write inside a read)
        pass
    other_in = threading.Event()

    def other():
        gate.enter_read()
        other_in.set()
        time.sleep(0.3)
        gate.leave_read()
    t = threading.Thread(target=other)
    t.start()
    assert other_in.wait(10)
    t0 = time.monotonic()
    with gate.exclusive():  # waits for the other thread's read
        assert gate.readers == 2
        assert time.monotonic() - t0 > 0.2
    gate.leave_read()
    gate.leave_read()
    t.join(10)
    assert gate.readers == 0

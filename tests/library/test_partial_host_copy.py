"""A checkpoint copies to the host only the tokens the store does not hold (issue 35: on a GPU every checkpoint of
a 6k-token 8B row copied ~800 MiB device-to-host, whole history included, and filled the write-behind queue).

MLX's CPU backend hands out numpy views (no copy to save), so these tests stand in a copier that copies through
``copy_token_range`` with ``ctypes.memmove`` as the CUDA route does with ``cuMemcpy``, and check what it copied and
that every stored byte comes back bit-identical, including when a chunk the copy counted on is gone by the put."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.state import cache_state, device_copy
from spec_cache.store import ChunkNotCopied, InvalidInput, LayerState, Store, Tensor
from spec_cache.tiers.cache import SpecCache
from tests.library.test_memory_tier import kv


def _memmove(dst: int, src: int, n: int) -> None:
    ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("shape,axis,start", [((1, 4, 10, 3), 2, 6), ((2, 3, 10, 4), 2, 0), ((1, 1, 7, 5), 2, 7),
                                              ((3, 10), 1, 4), ((10, 2, 2), 0, 3)])
def test_copy_token_range_copies_exactly_the_positions_from_start(shape, axis, start):
    rng = np.random.default_rng(1)
    src = rng.standard_normal(shape).astype(np.float32)
    out = np.zeros_like(src)
    n = device_copy.copy_token_range(device_copy._pointer(out), device_copy._pointer(src), src.shape,
                                     src.itemsize, axis, start, _memmove)
    index = [slice(None)] * len(shape)
    index[axis] = slice(start, None)
    assert np.array_equal(out[tuple(index)], src[tuple(index)])
    index[axis] = slice(0, start)
    assert not out[tuple(index)].any()
    assert n == src[tuple([slice(None)] * axis + [slice(start, None)])].nbytes


class FakeDeviceToHost:
    """The CUDA copier's interface over MLX's CPU memory: full and ranged copies, counting bytes and starts."""

    def __init__(self):
        self.bytes, self.starts = 0, []

    def __call__(self, x):
        mx.eval(x)
        out = np.array(np.asarray(memoryview(x)), copy=True)
        self.bytes += out.nbytes
        self.starts.append(0)
        return out

    def copy_from(self, x, axis, start, stop=None):
        mx.eval(x)
        view = np.asarray(memoryview(x))
        shape = list(view.shape)
        shape[axis] = shape[axis] if stop is None else stop
        out = np.empty(shape, view.dtype)
        out.view(np.uint8).fill(0xA5)  # what the positions before ``start`` hold is never stored: garbage here
        self.bytes += device_copy.copy_token_range(device_copy._pointer(out), device_copy._pointer(view),
                                                   shape, view.itemsize, axis, start, _memmove,
                                                   src_length=view.shape[axis])
        self.starts.append(start)
        return out


@pytest.fixture
def copier(monkeypatch):
    fake = FakeDeviceToHost()
    monkeypatch.setattr(cache_state, "_device_to_host", lambda: fake)
    return fake


def _extend(c, n: int, seed: int):
    """A cache holding ``c``'s tokens then ``n`` more (the next turn of one conversation)."""
    more = kv(n, seed=seed)
    out = kv(1)
    out.keys = mx.concatenate([c.keys[..., :c.offset, :], more.keys], axis=2)
    out.values = mx.concatenate([c.values[..., :c.offset, :], more.values], axis=2)
    out.offset = c.offset + n
    mx.eval(out.keys, out.values)
    return out


def _same(got, c) -> bool:
    k, v = got.caches[0].keys[..., :got.caches[0].offset, :], got.caches[0].values[..., :got.caches[0].offset, :]
    return np.array_equal(np.array(k), np.array(c.keys[..., :c.offset, :])) and \
        np.array_equal(np.array(v), np.array(c.values[..., :c.offset, :]))


def test_a_warm_checkpoint_copies_only_what_the_store_lacks_and_reads_back_whole(tmp_path, copier):
    first = kv(600, seed=3)
    second = _extend(first, 400, seed=4)
    tokens = list(range(1000))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "{}")
        cache.save(ns, tokens[:600], [first], background=True)
        assert cache.drain()
        assert copier.starts == [0, 0]  # nothing held yet: keys and values whole
        copier.starts.clear()
        before = copier.bytes
        cache.save(ns, tokens, [second], background=True)
        assert cache.drain()
        assert copier.starts == [512, 512]  # the store held chunks 1-2 (256 tokens each) of the history
        assert copier.bytes - before == 2 * (1000 - 512) * 2 * 4 * 4  # keys + values, 2 heads x 4 dims float32
        cache.memory.clear()
        got = cache.restore(ns, tokens)
        assert got.tier == "local" and got.length == 1000 and _same(got, second)
        assert _same(cache.restore(ns, tokens[:600]), first)


def test_checkpoints_of_one_batch_count_the_chunks_the_earlier_ones_write(tmp_path, copier):
    """The phases of one request arrive in one write-behind batch: the later ones copy from where the earlier
    ones' chunks end, though none of them is in the store yet when the copies are made."""
    first = kv(600, seed=5)
    second = _extend(first, 300, seed=6)
    tokens = list(range(900))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "{}")
        job_a = _job(cache, ns, tokens[:600], first)
        job_b = _job(cache, ns, tokens, second)
        assert cache._write_many([job_a, job_b]) == 0
        assert copier.starts == [0, 0, 512, 512]
        cache.memory.clear()
        assert _same(cache.restore(ns, tokens), second) and _same(cache.restore(ns, tokens[:600]), first)


def _job(cache, ns, tokens, c):
    from spec_cache.state.cache_state import capture_caches
    from spec_cache.tiers.cache import _WriteJob
    return _WriteJob(ns, list(tokens), capture_caches([c], defer_copy=True), None, 0, None)


def test_a_chunk_gone_since_the_copy_began_means_a_whole_copy_not_a_wrong_byte(tmp_path, copier, monkeypatch):
    """The store said it held more than it does by the put (evicted meanwhile; faked here by an answer too
    high): the put refuses (``ChunkNotCopied``, nothing written) and the cache copies every token and puts again."""
    first = kv(300, seed=7)
    second = _extend(first, 500, seed=8)
    tokens = list(range(800))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "{}")
        cache.save(ns, tokens[:300], [first], background=False)
        copier.starts.clear()
        monkeypatch.setattr(cache.store, "held_tokens", lambda *a: 768)  # it holds 256
        cache.save(ns, tokens, [second], background=True)
        assert cache.drain()
        assert copier.starts == [768, 768, 0, 0]
        cache.memory.clear()
        got = cache.restore(ns, tokens)
        assert got.length == 800 and _same(got, second)


def test_store_put_refuses_a_copied_from_that_needs_chunks_it_lacks(tmp_path):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 600, 4)).astype(np.float32)
    layers = [LayerState("kv", {}, [Tensor.from_numpy(k)], token_axis=2)]
    with Store.open(tmp_path / "s", chunk_tokens=256) as store:
        store.register_namespace(b"n" * 32, target="t", prefix_namespace="p")
        assert store.held_tokens(b"n" * 32, list(range(600)), layers) == 0
        with pytest.raises(ChunkNotCopied):
            store.put(b"n" * 32, list(range(600)), layers, copied_from=256)
        assert store.lookup(b"n" * 32, list(range(600))) is None  # nothing written
        with pytest.raises(InvalidInput, match="chunk boundary"):
            store.put(b"n" * 32, list(range(600)), layers, copied_from=100)
        with pytest.raises(InvalidInput, match="chunk boundary"):
            store.put(b"n" * 32, list(range(600)), layers, copied_from=768)
        store.put(b"n" * 32, list(range(300)), [LayerState("kv", {}, [Tensor.from_numpy(k[:, :, :300])], 2)])
        assert store.held_tokens(b"n" * 32, list(range(600)), layers) == 256
        partial = k.copy()
        partial[:, :, :256] = 0  # what a copy from 256 leaves there
        store.put(b"n" * 32, list(range(600)), [LayerState("kv", {}, [Tensor.from_numpy(partial)], 2)],
                  copied_from=256)
        assert store.fetch(b"n" * 32, list(range(600))).layers[0].tensors[0].array().tobytes() == k.tobytes()

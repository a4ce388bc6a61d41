"""A checkpoint of rows ``TargetRows.extract`` handed over is captured without a new MLX op (issue 35: on the H100
the scheduler thread spent 7-13 ms a checkpointing step queueing uint16 views and contiguous copies of 64 arrays
that were already owned, contiguous and queued, and an MLX eval call there can wait for the queued forward).

No GPU here: ``device_copy.is_gpu`` is made to say yes, and the copier is the real ``DeviceToHost`` over the
stand-in libcuda of ``test_d2h_stream`` (``ctypes.memmove``), so bfloat16 arrays reach it as they are, without the
uint16 view the capture used to build; every stored byte must still come back bit-identical."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from spec_cache.rows.target import TargetRows
from spec_cache.state import cache_state, device_copy
from spec_cache.state.cache_state import capture_caches, host_layers, mark_queued
from spec_cache.tiers.cache import SpecCache
from tests.library.test_d2h_stream import FakeAdvice, FakeDriver
from tests.runtime_fixtures import _identity_memo, tiny  # noqa: F401


def _kv(n: int, seed: int, dtype=mx.bfloat16, buffer: int | None = None) -> KVCache:
    """A single-row cache of ``n`` tokens in a buffer of ``buffer`` (default ``n``: owned and exact, as extract's)."""
    rng = np.random.default_rng(seed)
    size = buffer or n
    c = KVCache()
    c.keys = mx.contiguous(mx.array(rng.standard_normal((1, 2, size, 8)).astype(np.float32)).astype(dtype))
    c.values = mx.contiguous(mx.array(rng.standard_normal((1, 2, size, 8)).astype(np.float32)).astype(dtype))
    c.offset = n
    mx.eval(c.keys, c.values)
    return c


def _words(x: mx.array) -> np.ndarray:
    """What the store keeps of ``x``: its bytes, bfloat16 as uint16 words."""
    return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)


class _Evals:
    """Counts ``mx.async_eval`` calls and the MLX ops the capture builds (``contiguous``, ``view``)."""

    def __init__(self, monkeypatch):
        self.async_evals, self.contiguous = 0, 0
        real_async, real_contiguous = mx.async_eval, mx.contiguous

        def async_eval(*args):
            self.async_evals += 1
            return real_async(*args)

        def contiguous(*args, **kwargs):
            self.contiguous += 1
            return real_contiguous(*args, **kwargs)

        monkeypatch.setattr(cache_state.mx, "async_eval", async_eval)
        monkeypatch.setattr(cache_state.mx, "contiguous", contiguous)


@pytest.fixture
def gpu(monkeypatch):
    """``is_gpu`` says yes; host copies go through ``DeviceToHost`` over the stand-in driver."""
    monkeypatch.setattr(device_copy, "is_gpu", lambda: True)
    d2h = device_copy.DeviceToHost(FakeAdvice(FakeDriver()), threads=1)
    monkeypatch.setattr(cache_state, "_device_to_host", lambda: d2h)
    return d2h


def test_marked_caches_are_captured_as_they_are_with_no_mlx_op(gpu, monkeypatch):
    caches = [_kv(40, seed=1), _kv(40, seed=2)]
    mark_queued(caches)
    evals = _Evals(monkeypatch)
    layers = capture_caches(caches, defer_copy=True)
    assert evals.async_evals == 0 and evals.contiguous == 0
    for cache, layer in zip(caches, layers):
        assert all(t.data is a for t, a in zip(layer.tensors, (cache.keys, cache.values)))
        assert [t.dtype for t in layer.tensors] == ["bfloat16", "bfloat16"]
    host = host_layers(layers)
    for cache, layer in zip(caches, host):
        for t, a in zip(layer.tensors, (cache.keys, cache.values)):
            assert t.data.dtype == np.uint16 and np.array_equal(t.data, _words(a))
    assert gpu.bytes == sum(a.nbytes for c in caches for a in (c.keys, c.values))


def test_unmarked_caches_get_contiguous_copies_queued_in_one_call(gpu, monkeypatch):
    caches = [_kv(40, seed=3), _kv(40, seed=4)]
    evals = _Evals(monkeypatch)
    layers = capture_caches(caches, defer_copy=True)
    assert evals.async_evals == 1 and evals.contiguous == 4
    host = host_layers(layers)
    assert all(np.array_equal(t.data, _words(a)) for c, layer in zip(caches, host)
               for t, a in zip(layer.tensors, (c.keys, c.values)))


def test_a_marked_cache_cut_to_its_offset_still_gets_its_copy(gpu, monkeypatch):
    """The mark covers the cache's own arrays only: a tensor the capture cut from a longer buffer (a view) is made
    contiguous and queued as before, and comes back holding exactly the offset's tokens."""
    c = _kv(40, seed=5, buffer=64)
    mark_queued([c])
    evals = _Evals(monkeypatch)
    layers = capture_caches([c], defer_copy=True)
    assert evals.async_evals == 1 and evals.contiguous == 2
    (layer,) = host_layers(layers)
    assert np.array_equal(layer.tensors[0].data, _words(c.keys[..., :40, :]))
    assert np.array_equal(layer.tensors[1].data, _words(c.values[..., :40, :]))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_a_marked_checkpoint_round_trips_bit_identical_through_the_store(tmp_path, gpu, dtype):
    c = _kv(300, seed=6, dtype=dtype)
    mark_queued([c])
    tokens = list(range(300))
    with SpecCache.open(tmp_path / "s") as cache:
        ns = cache.namespace("ab" * 32, "{}")
        cache.save(ns, tokens, [c], background=True)
        assert cache.drain()
        cache.memory.clear()
        got = cache.restore(ns, tokens)
        assert got.tier == "local" and got.length == 300
        back = got.caches[0]
        assert back.keys.dtype == dtype
        assert np.array_equal(_words(back.keys[..., :300, :]), _words(c.keys))
        assert np.array_equal(_words(back.values[..., :300, :]), _words(c.values))


def test_off_the_gpu_the_capture_is_unchanged_by_the_mark(monkeypatch):
    """On the CPU (unified memory, numpy views cost nothing) marked or not, bfloat16 arrays are viewed as uint16
    and queued: the mark is only a GPU shortcut."""
    monkeypatch.setattr(device_copy, "is_gpu", lambda: False)
    c = _kv(20, seed=7)
    mark_queued([c])
    layers = capture_caches([c], defer_copy=True)
    assert all(t.data.dtype == mx.uint16 for t in layers[0].tensors)
    (layer,) = host_layers(layers)
    assert np.array_equal(layer.tensors[0].data, _words(c.keys))


def test_target_rows_extract_marks_what_it_hands_over(tiny):  # noqa: F811
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    rows.prefill([[1, 2, 3, 4], [5, 6]])
    out = rows.extract(0)
    assert out and all(cache_state._is_queued(c) for c in out)
    assert not cache_state._is_queued(KVCache())


def test_host_view_reads_bfloat16_words_without_an_mlx_op():
    x = mx.arange(24, dtype=mx.float32).astype(mx.bfloat16).reshape(2, 3, 4)
    mx.eval(x)
    view = device_copy.host_view(x)
    assert view.dtype == np.uint16 and view.shape == (2, 3, 4) and np.array_equal(view, _words(x))
    strided = x[:, :, ::2]
    mx.eval(strided)
    with pytest.raises(ValueError, match="strided bfloat16"):
        device_copy.host_view(strided)
    f = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)[:, :, ::2]
    mx.eval(f)
    assert np.array_equal(device_copy.host_view(f), np.array(f))


def test_the_copier_takes_bfloat16_and_strided_arrays(gpu):
    x = mx.arange(64, dtype=mx.float32).astype(mx.bfloat16).reshape(1, 2, 4, 8)
    mx.eval(x)
    assert np.array_equal(gpu(x), _words(x))
    strided = x[..., 1:3, :]
    assert np.array_equal(gpu(strided), _words(mx.contiguous(strided)))
    part = gpu.copy_from(x, 2, 2)
    assert np.array_equal(part[..., 2:, :], _words(x)[..., 2:, :])  # the positions before are never read

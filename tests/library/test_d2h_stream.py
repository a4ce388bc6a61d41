"""The checkpoint copier (``device_copy.DeviceToHost``) issues its device-to-host copies on non-blocking streams of
its own (issue 35: a plain ``cuMemcpy`` runs on CUDA's legacy default stream, which waits for every kernel queued
on MLX's streams, so the write-behind thread's copy of a checkpoint waited behind the next forwards).

No GPU here: a stand-in for libcuda copies host memory with ``ctypes.memmove`` and records which call made each
copy, on which stream, from which thread. The copier's own logic (streams per thread, the pinned bounce buffers,
the fall-back when no stream can be made) runs as it does on CUDA, and every byte must come back."""

from __future__ import annotations

import ctypes
import threading

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.state import device_copy


class _Fn:
    """A callable that takes attributes (``argtypes``), as a ctypes function does."""

    def __init__(self, f):
        self.f = f

    def __call__(self, *args):
        return self.f(*args)


def _int(value) -> int:
    return int(value.value) if isinstance(value, ctypes.c_void_p) else int(value)


class FakeDriver:
    def __init__(self, streams_ok: bool = True):
        self.calls: list[tuple] = []
        self.flags: list[int] = []
        self.synced: list[int] = []
        self._buffers = []
        self._next = 1000
        self._lock = threading.Lock()
        self.cuMemcpy = _Fn(self._memcpy)
        self.cuMemcpyAsync = _Fn(self._memcpy_async)
        self.cuStreamCreate = _Fn(lambda ref, flags: self._stream_create(ref, flags, streams_ok))
        self.cuStreamSynchronize = _Fn(lambda s: self.synced.append(_int(s)) or 0)
        self.cuMemAllocHost_v2 = _Fn(self._alloc_host)

    def _memcpy(self, dst, src, n):
        ctypes.memmove(dst, src, n)
        self.calls.append(("sync", None, threading.get_ident(), n))
        return 0

    def _memcpy_async(self, dst, src, n, stream):
        ctypes.memmove(dst, src, n)
        self.calls.append(("async", _int(stream), threading.get_ident(), n))
        return 0

    def _stream_create(self, ref, flags, ok):
        if not ok:
            return 1  # CUDA_ERROR_INVALID_VALUE
        with self._lock:
            self._next += 1
            ref._obj.value = self._next
        self.flags.append(_int(flags.value if hasattr(flags, "value") else flags))
        return 0

    def _alloc_host(self, ref, size):
        buf = ctypes.create_string_buffer(_int(size.value if hasattr(size, "value") else size))
        self._buffers.append(buf)
        ref._obj.value = ctypes.addressof(buf)
        return 0


class FakeAdvice:
    def __init__(self, driver):
        self._driver = driver

    def _driver_context(self) -> bool:
        return True


def _array(nbytes: int) -> mx.array:
    x = mx.arange(nbytes // 4, dtype=mx.int32) * 3 + 1
    mx.eval(x)
    return x


@pytest.mark.parametrize("mode", ["pinned", "direct"])
def test_copies_run_on_a_non_blocking_stream_of_their_own(mode):
    driver = FakeDriver()
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode=mode)
    x = _array(200_000)  # several bounce-buffer parts in pinned mode
    out = d2h(x)
    assert np.array_equal(out, np.asarray(memoryview(x)))
    assert driver.calls and {kind for kind, *_ in driver.calls} == {"async"}
    assert driver.flags == [device_copy._CU_STREAM_NON_BLOCKING]  # one stream for this thread, non-blocking
    stream = driver.calls[0][1]
    assert all(s == stream for _, s, _, _ in driver.calls)
    assert len(driver.synced) == len(driver.calls) and set(driver.synced) == {stream}  # waits for its own stream
    assert sum(n for *_, n in driver.calls) == x.nbytes


def test_each_copying_thread_has_its_own_stream():
    driver = FakeDriver()
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=3, part_bytes=1 << 16, mode="pinned")
    x = _array(2 << 20)  # large enough to be split across the pool
    assert np.array_equal(d2h(x), np.asarray(memoryview(x)))
    by_thread: dict[int, set] = {}
    for _, stream, thread, _ in driver.calls:
        by_thread.setdefault(thread, set()).add(stream)
    assert len(by_thread) >= 2  # the copy was shared out
    assert all(len(streams) == 1 for streams in by_thread.values())  # one stream per thread
    streams = [next(iter(s)) for s in by_thread.values()]
    assert len(set(streams)) == len(streams)  # never shared between threads


def test_a_ranged_copy_goes_on_the_stream_too():
    driver = FakeDriver()
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode="pinned")
    x = mx.arange(2 * 3 * 50 * 4, dtype=mx.float32).reshape(2, 3, 50, 4)
    mx.eval(x)
    out = d2h.copy_from(x, 2, 20)
    ref = np.asarray(memoryview(x))
    assert np.array_equal(out[:, :, 20:], ref[:, :, 20:])  # the positions before are left unwritten
    assert {kind for kind, *_ in driver.calls} == {"async"}


def test_without_a_stream_the_copier_falls_back_to_cumemcpy(caplog):
    driver = FakeDriver(streams_ok=False)
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode="pinned")
    x = _array(100_000)
    assert np.array_equal(d2h(x), np.asarray(memoryview(x)))
    assert {kind for kind, *_ in driver.calls} == {"sync"} and not d2h.stream_copies
    assert "no CUDA stream" in caplog.text


def test_the_stream_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_D2H_STREAM", "0")
    driver = FakeDriver()
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode="direct")
    x = _array(10_000)
    assert np.array_equal(d2h(x), np.asarray(memoryview(x)))
    assert {kind for kind, *_ in driver.calls} == {"sync"} and driver.flags == []


# --- token ranges in 2-D copies (cuMemcpy2DAsync) -----------------------------------------------------------------
class FakeDriver2D(FakeDriver):
    """``FakeDriver`` with ``cuMemcpy2DAsync_v2``: reads the ``CUDA_MEMCPY2D`` it is handed and copies row by row
    (``corrupt``: the first byte of each copy comes out wrong, as a mis-laid struct would)."""

    def __init__(self, corrupt: bool = False):
        super().__init__()
        self.corrupt = corrupt
        self.cuMemcpy2DAsync_v2 = _Fn(self._memcpy2d)

    def _memcpy2d(self, ref, stream):
        spec = ref._obj
        assert spec.srcMemoryType == device_copy._CU_MEMORYTYPE_UNIFIED
        assert spec.dstMemoryType == device_copy._CU_MEMORYTYPE_HOST
        assert spec.srcXInBytes == spec.srcY == spec.dstXInBytes == spec.dstY == 0
        for row in range(spec.Height):
            ctypes.memmove(spec.dstHost + row * spec.dstPitch, spec.srcDevice + row * spec.srcPitch,
                           spec.WidthInBytes)
        if self.corrupt:
            ctypes.memset(spec.dstHost, 0xAB, 1)
        self.calls.append(("2d", _int(stream), threading.get_ident(), spec.WidthInBytes * spec.Height))
        return 0


def _heads(tokens: int = 50) -> mx.array:
    x = mx.arange(2 * 3 * tokens * 4, dtype=mx.float32).reshape(2, 3, tokens, 4) * 3 + 1
    mx.eval(x)
    return x


@pytest.mark.parametrize("mode", ["pinned", "direct"])
def test_a_token_range_is_one_2d_copy_not_one_copy_per_head(mode):
    driver = FakeDriver2D()
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode=mode)
    assert d2h.runs_2d
    x = _heads()
    ref = np.asarray(memoryview(x))
    out = d2h.copy_from(x, 2, 20)
    assert np.array_equal(out[:, :, 20:], ref[:, :, 20:])
    assert [kind for kind, *_ in driver.calls] == ["2d"]  # six runs (2 x 3 heads), one call
    assert driver.calls[0][3] == 6 * 30 * 4 * 4
    lent = d2h.copy_from(x, 2, 7, stop=33)  # a longer checkpoint's array lent to an earlier one
    assert lent.shape == (2, 3, 33, 4) and np.array_equal(lent[:, :, 7:], ref[:, :, 7:33])
    assert len(driver.synced) == len(driver.calls) == 2


def test_runs_beyond_the_bounce_buffer_go_in_several_2d_copies_or_one_copy_each():
    driver = FakeDriver2D()
    run = 30 * 4 * 4  # 480 bytes a head from position 20
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=2 * run, mode="pinned")
    x = _heads()
    ref = np.asarray(memoryview(x))
    out = d2h.copy_from(x, 2, 20)
    assert np.array_equal(out[:, :, 20:], ref[:, :, 20:])
    assert [kind for kind, *_ in driver.calls] == ["2d"] * 3  # two runs per bounce buffer
    driver.calls.clear()
    small = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=run // 2, mode="pinned")
    out = small.copy_from(x, 2, 20)
    assert np.array_equal(out[:, :, 20:], ref[:, :, 20:])
    assert {kind for kind, *_ in driver.calls} == {"async"}  # a run alone overflows it: parted, one run at a time


def test_2d_copies_that_fail_their_self_test_are_turned_off(caplog):
    driver = FakeDriver2D(corrupt=True)
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode="pinned")
    assert "2-D copies off (wrong bytes)" in device_copy.check_runs_2d(d2h)
    assert not d2h.runs_2d and "failed their self-test" in caplog.text
    x = _heads()
    out = d2h.copy_from(x, 2, 20)
    assert np.array_equal(out[:, :, 20:], np.asarray(memoryview(x))[:, :, 20:])
    good = device_copy.DeviceToHost(FakeAdvice(FakeDriver2D()), threads=1, part_bytes=1 << 16, mode="pinned")
    assert device_copy.check_runs_2d(good) == ", token ranges in 2-D copies" and good.runs_2d


def test_without_a_stream_or_when_turned_off_ranges_copy_run_by_run(monkeypatch):
    assert not device_copy.DeviceToHost(FakeAdvice(FakeDriver()), threads=1, mode="pinned").runs_2d  # no export
    monkeypatch.setenv("SPEC_CACHE_D2H_2D", "0")
    driver = FakeDriver2D()
    d2h = device_copy.DeviceToHost(FakeAdvice(driver), threads=1, part_bytes=1 << 16, mode="pinned")
    assert not d2h.runs_2d
    x = _heads()
    assert np.array_equal(d2h.copy_from(x, 2, 20)[:, :, 20:], np.asarray(memoryview(x))[:, :, 20:])
    assert [kind for kind, *_ in driver.calls] == ["async"] * 6

"""Host bytes into MLX arrays at the hardware's speed: the ``concat`` that ``Store.fetch`` uses on a restore.

Why one file of ~600 lines: every route shares the CUDA driver bindings (memory advice, cuMemcpy, pinned
buffers) and the run-time checks that decide whether a route may be used; split, they would import each other.

``Store.fetch(concat=...)`` hands over each token-sliceable tensor as pieces (numpy views into the LMDB map, valid
only during the call) and keeps whatever ``concat(pieces, axis, dtype)`` returns. Three routes:

* **Staging route (MLX's CUDA backend).** MLX's CUDA allocator hands out managed memory; pages a kernel touched
  live on the GPU, and a host write into them faults at ~2.3-2.7 GB/s (``../shared/reference/platform-facts.md``
  section 7). The loader keeps one reusable MLX staging buffer whose pages CUDA is advised to keep in host memory
  (``cuMemAdvise``/``cudaMemAdvise`` SetPreferredLocation=host, SetAccessedBy=GPU 0, through ctypes). Several
  threads copy the pieces into a writable numpy view of it (numpy's copy releases the GIL, host-resident pages
  take writes at memcpy speed), then one device op copies that region into a fresh device array (``stage[a:b] +
  0`` on 32-bit words: bit-exact for every dtype, ``-0.0`` and NaN payloads included), started asynchronously so
  the GPU reads region ``i`` (at ~49 GB/s) while the host fills region ``i + 1``. The staging buffer never leaves
  the loader: only arrays made from it by that device op do, and a region is written again only after the op
  that read it has finished (a small fence array evaluated after it on the same stream).
  Measured there: ~20 GB/s end to end against 1.3-2.0 GB/s for ``mx.array(numpy)`` + a device join.
* **Join route (other GPUs, or when the staging route is not available):** ``cache_state.mx_concat``: each piece
  copied into MLX once, joined on the device.
* **CPU:** ``HOST_ARRAYS`` (a ``store.fill.Sink``): the store copies each record's tensors straight into fresh
  MLX arrays and checksums the record in the same pass, several records at once (one copy of every byte, and the
  checksums off the critical path); ``None`` (numpy assembly, then one ``mx.array`` copy) or ``fresh_concat``
  (one copy per tensor, checksums on the verifier's threads) when forced; see ``cache_state.restore_concat``.

The staging route depends on an implementation detail of MLX's CUDA backend (managed memory), so it is detected
at run time: the buffer must be managed memory, the advice must succeed, and a self-test round trip must give
the bytes back; otherwise the loader is not offered and the join route is used. ``SPEC_CACHE_COPY_ROUTE``
(``staging`` | ``join`` | ``numpy`` | ``fresh`` | ``fill``) forces a route for benchmarks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

log = logging.getLogger("spec_cache.state.device_copy")

_MX_DTYPES = {
    "bool": mx.bool_, "uint8": mx.uint8, "uint16": mx.uint16, "uint32": mx.uint32, "uint64": mx.uint64,
    "int8": mx.int8, "int16": mx.int16, "int32": mx.int32, "int64": mx.int64, "float16": mx.float16,
    "bfloat16": mx.bfloat16, "float32": mx.float32, "complex64": mx.complex64,
}
_NP_DTYPES = {"bool": np.bool_, "bfloat16": np.uint16}  # numpy has no bfloat16: its words travel as uint16

#: a copy below this many bytes runs on the calling thread (a thread hand-off costs more than it saves)
PARALLEL_MIN_BYTES = 2 << 20
#: the share of work each thread gets is at least this many bytes
TASK_MIN_BYTES = 1 << 20


def _np_dtype(dtype: str):
    return np.dtype(_NP_DTYPES.get(dtype, dtype))


def is_gpu() -> bool:
    return "gpu" in str(mx.default_device()).lower()


def is_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available()) and is_gpu()
    except Exception:
        return False


# --- copying pieces into a destination, on several threads ------------------------------------------------------
def _split(dst: np.ndarray, src: np.ndarray, parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(dst, src)`` split along their first axis longer than 1 into at most ``parts`` pairs."""
    if parts <= 1:
        return [(dst, src)]
    for ax, n in enumerate(src.shape):
        if n > 1:
            parts = min(parts, n)
            edges = [n * k // parts for k in range(parts + 1)]
            idx = [slice(None)] * src.ndim
            out = []
            for a, b in zip(edges, edges[1:]):
                idx[ax] = slice(a, b)
                out.append((dst[tuple(idx)], src[tuple(idx)]))
            return out
    return [(dst, src)]


def _copy_all(pairs) -> None:
    for d, s in pairs:
        np.copyto(d, s, casting="no")


class Copier:
    """Copies numpy pieces into a destination view, splitting large copies over a thread pool."""

    def __init__(self, threads: int | None = None):
        self.threads = max(1, threads if threads is not None else min(8, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="spec-cache-copy") \
            if self.threads > 1 else None

    def copy(self, dst: np.ndarray, pieces: list, axis: int) -> None:
        """Write ``pieces`` one after another along ``axis`` into ``dst`` (whose shape is their join)."""
        pairs, at = [], 0
        idx = [slice(None)] * dst.ndim
        for p in pieces:
            p = np.asarray(p)
            step = p.shape[axis]
            idx[axis] = slice(at, at + step)
            pairs.append((dst[tuple(idx)], p.view(dst.dtype) if p.dtype != dst.dtype else p))
            at += step
        total = dst.nbytes
        workers = min(self.threads, total // TASK_MIN_BYTES) if self._pool is not None else 1
        if workers <= 1 or total < PARALLEL_MIN_BYTES:
            _copy_all(pairs)
            return
        # cut every pair into pieces of about total / (4 * workers) bytes, then deal them out by size
        share = max(TASK_MIN_BYTES, total // (4 * workers))
        tasks = []
        for d, s in pairs:
            tasks.extend(_split(d, s, -(-s.nbytes // share)))
        groups: list[list] = [[] for _ in range(workers)]
        loads = [0] * workers
        for d, s in sorted(tasks, key=lambda t: -t[1].nbytes):
            k = loads.index(min(loads))
            groups[k].append((d, s))
            loads[k] += s.nbytes
        futures = [self._pool.submit(_copy_all, g) for g in groups[1:]]
        _copy_all(groups[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


# --- CUDA memory advice through ctypes -------------------------------------------------------------------------
class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_ADVISE_SET_PREFERRED_LOCATION = 3
_ADVISE_SET_ACCESSED_BY = 5
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_CU_DEVICE_CPU = -1
_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
_CU_STREAM_NON_BLOCKING = 0x1
_CU_MEMORYTYPE_HOST = 1
_CU_MEMORYTYPE_UNIFIED = 4


class _Memcpy2D(ctypes.Structure):
    """The driver API's ``CUDA_MEMCPY2D`` (``cuda.h``; ctypes pads each enum before a pointer as C does)."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


def _strided_bytes(address: int, rows: int, run: int, pitch: int) -> np.ndarray:
    """A writable ``[rows, run]`` uint8 view of host memory at ``address``, rows ``pitch`` bytes apart."""
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * ((rows - 1) * pitch + run)).from_address(address))
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, run), strides=(pitch, 1))


def _load(names) -> ctypes.CDLL | None:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _cudart_candidates() -> list[str]:
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    try:  # the CUDA runtime that pip's nvidia packages bring (MLX links its own statically)
        import nvidia  # type: ignore

        for base in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13/lib", "cuda_runtime/lib"):
                for so in ("libcudart.so.13", "libcudart.so.12"):
                    path = os.path.join(base, sub, so)
                    if os.path.exists(path):
                        names.append(path)
    except Exception:
        pass
    names += ["/usr/local/cuda/lib64/libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.12"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    return names


class CudaAdvice:
    """``advise_host(ptr, n)``: keep managed pages in host memory, mapped for GPU 0; through the driver API
    (libcuda, which MLX's CUDA build links) or else the runtime API (libcudart)."""

    def __init__(self):
        self.how = None
        self._driver = _load(["libcuda.so.1", "libcuda.so"])
        self._cudart = None

    def _driver_context(self) -> bool:
        cu = self._driver
        ctx = ctypes.c_void_p()
        if cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            return True
        dev = ctypes.c_int()
        if cu.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            return False
        if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return False
        return cu.cuCtxSetCurrent(ctx) == 0

    def is_managed(self, ptr: int) -> bool | None:
        """Whether ``ptr`` is CUDA managed memory (None: could not ask)."""
        cu = self._driver
        if cu is None:
            return None
        try:
            if not self._driver_context():
                return None
            flag = ctypes.c_uint(0)
            rc = cu.cuPointerGetAttribute(ctypes.byref(flag), _CU_POINTER_ATTRIBUTE_IS_MANAGED, ctypes.c_uint64(ptr))
            return bool(flag.value) if rc == 0 else None
        except Exception:
            return None

    def advise_host(self, ptr: int, nbytes: int) -> bool:
        errors = []
        if self._driver is not None:
            try:
                if self._driver_context():
                    cu = self._driver
                    fn = getattr(cu, "cuMemAdvise_v2", None)
                    if fn is not None:
                        fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _CUmemLocation]
                        a = fn(ptr, nbytes, _ADVISE_SET_PREFERRED_LOCATION, _CUmemLocation(_LOCATION_HOST, 0))
                        b = fn(ptr, nbytes, _ADVISE_SET_ACCESSED_BY, _CUmemLocation(_LOCATION_DEVICE, 0))
                        if a == 0 and b == 0:
                            self.how = "cuMemAdvise_v2 (libcuda)"
                            return True
                        errors.append(f"cuMemAdvise_v2 -> {a}, {b}")
                    fn = cu.cuMemAdvise  # older ABI: a device ordinal, CU_DEVICE_CPU for the host
                    fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
                    a = fn(ptr, nbytes, _ADVISE_SET_PREFERRED_LOCATION, _CU_DEVICE_CPU)
                    b = fn(ptr, nbytes, _ADVISE_SET_ACCESSED_BY, 0)
                    if a == 0 and b == 0:
                        self.how = "cuMemAdvise (libcuda)"
                        return True
                    errors.append(f"cuMemAdvise -> {a}, {b}")
                else:
                    errors.append("no CUDA context")
            except Exception as exc:  # a missing symbol, a foreign ABI
                errors.append(f"libcuda: {exc}")
        if self._cudart is None:
            self._cudart = _load(_cudart_candidates())
        rt = self._cudart
        if rt is not None:
            try:
                version = ctypes.c_int(0)
                rt.cudaRuntimeGetVersion(ctypes.byref(version))
                if version.value >= 13000:  # CUDA 13: cudaMemAdvise takes a {type, id} location
                    fn = rt.cudaMemAdvise
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _CUmemLocation]
                    a = fn(ptr, nbytes, _ADVISE_SET_PREFERRED_LOCATION, _CUmemLocation(_LOCATION_HOST, 0))
                    b = fn(ptr, nbytes, _ADVISE_SET_ACCESSED_BY, _CUmemLocation(_LOCATION_DEVICE, 0))
                else:
                    fn = rt.cudaMemAdvise
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
                    a = fn(ptr, nbytes, _ADVISE_SET_PREFERRED_LOCATION, _CU_DEVICE_CPU)
                    b = fn(ptr, nbytes, _ADVISE_SET_ACCESSED_BY, 0)
                if a == 0 and b == 0:
                    self.how = f"cudaMemAdvise (libcudart {version.value})"
                    return True
                errors.append(f"cudaMemAdvise -> {a}, {b}")
            except Exception as exc:
                errors.append(f"libcudart: {exc}")
        else:
            errors.append("no libcudart found")
        self.how = "; ".join(errors) or "no CUDA library"
        return False


# --- the staging loader -----------------------------------------------------------------------------------------
def _pointer(view: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0])


def copy_token_range(dst: int, src: int, shape: Sequence[int], itemsize: int, axis: int, start: int,
                     copy: Callable[[int, int, int], None], src_length: int | None = None,
                     copy_runs: Callable[[int, int, int, int, int, int], None] | None = None) -> int:
    """Copy positions ``start:`` along ``axis`` of a C-contiguous array at ``src`` into the same place of one
    shaped alike at ``dst`` (``shape``): one ``copy(dst, src, nbytes)`` per contiguous run (per index of the axes
    before ``axis``; one run when they are all 1), or, given ``copy_runs``, one ``copy_runs(dst, src, run, count,
    src_pitch, dst_pitch)`` for all of them (a 2-D copy: ``count`` runs of ``run`` bytes, ``*_pitch`` apart).
    ``src_length``: the source is longer along ``axis`` (a later checkpoint of the same row lent to an earlier one,
    ``SpecCache._lend``); only its first ``shape[axis]`` positions are read. Returns the bytes copied."""
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1:]) * itemsize
    length = shape[axis]
    stride = length if src_length is None else src_length
    if stride < length:
        raise ValueError(f"source holds {stride} positions along axis {axis}, {length} asked")
    start = max(0, min(start, length))
    run = (length - start) * inner
    if run == 0:
        return 0
    if copy_runs is not None and outer > 1:
        copy_runs(dst + start * inner, src + start * inner, run, outer, stride * inner, length * inner)
        return run * outer
    for i in range(outer):
        copy(dst + (i * length + start) * inner, src + (i * stride + start) * inner, run)
    return run * outer


class StagingLoader:
    """``concat(pieces, axis, dtype)`` through a reusable host-resident MLX staging buffer (see module doc).

    One loader per process is enough (``staging_loader()``); calls are serialized by a lock. ``advise=False``
    skips the CUDA advice (the route still works, at managed-memory fault speed; on a CPU build it is a plain
    staging copy), which the tests use.
    """

    ALIGN = 256  # each region starts on a 256-byte boundary (32-bit words; GPU-friendly)

    def __init__(self, capacity: int = 256 << 20, threads: int | None = None, advise: bool = True,
                 max_capacity: int = 4 << 30):
        self.max_capacity = max_capacity
        self.advise = advise
        self.advice = CudaAdvice() if advise else None
        self.copier = Copier(threads)
        self._lock = threading.Lock()
        self._pending: deque = deque()  # (start, end, fence): regions a device op may still be reading
        self._pos = 0
        self._stage = None
        self._words = None
        self._view = None
        self.capacity = 0
        self.bytes_in = 0
        self.calls = 0
        self.copy_s = 0.0  # host copies (threads) into the staging buffer
        self.wait_s = 0.0  # waiting for device ops still reading a region about to be reused
        self._allocate(capacity)

    # the buffer ---------------------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        self._wait_all()
        capacity = -(-capacity // self.ALIGN) * self.ALIGN
        # made on the CPU stream, so its pages are first touched by the host, never by a kernel
        stage = mx.zeros((capacity // 4,), dtype=mx.uint32, stream=mx.cpu)
        mx.eval(stage)
        view = np.array(stage, copy=False).view(np.uint8)
        if not view.flags.writeable or view.nbytes != capacity:
            raise RuntimeError("MLX did not give a writable view of the staging buffer")
        if self.advice is not None:
            if not self.advice.advise_host(_pointer(view), capacity):
                raise RuntimeError(f"CUDA memory advice failed: {self.advice.how}")
        self._stage, self._view, self.capacity, self._pos = stage, view, capacity, 0

    def _wait_all(self) -> None:
        if self._pending:
            mx.eval([f for _, _, f in self._pending])
            self._pending.clear()

    def _region(self, nbytes: int) -> int:
        """Start of a free region of ``nbytes``: waits for device ops still reading it."""
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        if size > self.capacity // 2:  # keep room for two regions in flight
            self._allocate(min(max(2 * size, 2 * self.capacity), max(self.max_capacity, 2 * size)))
        if self._pos + size > self.capacity:
            self._pos = 0
        start, end = self._pos, self._pos + size
        keep = deque()
        waits = []
        for entry in self._pending:
            if entry[0] < end and start < entry[1]:
                waits.append(entry[2])
            else:
                keep.append(entry)
        if waits:
            t0 = time.perf_counter()
            mx.eval(waits)
            self.wait_s += time.perf_counter() - t0
        self._pending = keep
        self._pos = end
        return start

    # the route ----------------------------------------------------------------------------------------------
    def __call__(self, pieces: list, axis: int, dtype: str) -> mx.array:
        np_dtype, shape, nbytes = _joined(pieces, axis, dtype)
        if nbytes == 0:
            return mx.zeros(shape, dtype=_MX_DTYPES[dtype])
        with self._lock:
            start = self._region(nbytes)
            dst = self._view[start:start + nbytes].view(np_dtype).reshape(shape)
            t0 = time.perf_counter()
            self.copier.copy(dst, pieces, axis)
            self.copy_s += time.perf_counter() - t0
            words = -(-nbytes // 4)
            region = self._stage[start // 4:start // 4 + words]
            copied = region + 0  # the device op: a fresh array, bit-exact (integer words)
            out = copied if nbytes == 4 * words else copied.view(mx.uint8)[:nbytes]
            out = out.view(_MX_DTYPES[dtype]).reshape(shape)
            fence = copied[:1] + 0  # evaluated after ``copied`` on the same stream
            mx.async_eval(out, fence)
            self._pending.append((start, start + 4 * words, fence))
            self.bytes_in += nbytes
            self.calls += 1
            return out

    def counters(self) -> dict:
        return {"calls": self.calls, "bytes": self.bytes_in, "copy_s": self.copy_s, "wait_s": self.wait_s,
                "capacity": self.capacity, "threads": self.copier.threads}

    def reset_counters(self) -> None:
        self.calls, self.bytes_in, self.copy_s, self.wait_s = 0, 0, 0.0, 0.0

    def close(self) -> None:
        with self._lock:
            self._wait_all()
            self.copier.close()
            self._stage = self._view = None


def self_test(loader: StagingLoader) -> None:
    """Round-trip every dtype width, odd sizes and signed zeros/NaN payloads; raise if any byte differs."""
    rng = np.random.default_rng(0)
    for dtype, shape, cut in (("bfloat16", (1, 2, 37, 8), [5, 20, 37]), ("float32", (2, 3, 11), [4, 11]),
                              ("uint8", (1, 1, 13, 3), [1, 13]), ("float16", (1, 1, 9000, 130), [4000, 9000])):
        npd = _np_dtype(dtype)
        whole = rng.integers(0, 256, size=int(np.prod(shape)) * npd.itemsize, dtype=np.uint8).view(npd)
        whole = whole.reshape(shape)
        edges = [0] + cut
        pieces = [whole[:, :, a:b] if len(shape) == 4 else whole[:, a:b] for a, b in zip(edges, edges[1:])]
        axis = 2 if len(shape) == 4 else 1
        out = loader(pieces, axis, dtype)
        back = np.array(out.view(mx.uint16) if dtype == "bfloat16" else out)
        if back.shape != whole.shape or back.tobytes() != whole.tobytes():
            raise RuntimeError(f"staging self-test failed for {dtype} {shape}")


_LOADER: StagingLoader | None = None
_LOADER_STATE = {"tried": False, "why": None}
_LOADER_LOCK = threading.Lock()


def staging_loader() -> StagingLoader | None:
    """The process's staging loader on MLX's CUDA backend, or None where it is not available (why: ``status()``)."""
    global _LOADER
    with _LOADER_LOCK:
        if not _LOADER_STATE["tried"]:
            _LOADER_STATE["tried"] = True
            if not is_cuda():
                _LOADER_STATE["why"] = "not MLX's CUDA backend"
            else:
                try:
                    probe = mx.zeros((1024,), dtype=mx.uint32, stream=mx.cpu)
                    mx.eval(probe)
                    managed = CudaAdvice().is_managed(_pointer(np.array(probe, copy=False)))
                    if managed is False:
                        raise RuntimeError("MLX's buffers are not CUDA managed memory")
                    loader = StagingLoader()
                    self_test(loader)
                    _LOADER = loader
                    _LOADER_STATE["why"] = f"staging route on ({loader.advice.how}, managed={managed}, " \
                                           f"{loader.copier.threads} copy threads)"
                except Exception as exc:
                    _LOADER_STATE["why"] = f"staging route off: {type(exc).__name__}: {exc}"
                    log.info(_LOADER_STATE["why"])
        return _LOADER


def status() -> str:
    """Which host-to-MLX route a restore takes here, and why."""
    staging_loader()
    return _LOADER_STATE["why"] or ""


# --- CPU ------------------------------------------------------------------------------------------------------
def _joined(pieces: list, axis: int, dtype: str) -> tuple[np.dtype, list[int], int]:
    """(numpy dtype, shape, bytes) of ``pieces`` joined along ``axis``."""
    np_dtype = _np_dtype(dtype)
    shape = list(np.asarray(pieces[0]).shape)
    shape[axis] = sum(np.asarray(p).shape[axis] for p in pieces)
    return np_dtype, shape, int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize


def fresh_concat(pieces: list, axis: int, dtype: str) -> mx.array:
    """One copy on a CPU build: a new MLX array made by a CPU op, filled through its numpy view before anyone
    else holds it (the array is never written again)."""
    np_dtype, shape, nbytes = _joined(pieces, axis, dtype)
    if nbytes == 0:
        return mx.zeros(shape, dtype=_MX_DTYPES[dtype])
    out = mx.zeros(shape, dtype=mx.uint16 if dtype == "bfloat16" else _MX_DTYPES[dtype], stream=mx.cpu)
    mx.eval(out)
    dst = np.array(out, copy=False)
    if not dst.flags.writeable:
        raise RuntimeError("MLX did not give a writable view")
    _cpu_copier().copy(dst.view(np_dtype), pieces, axis)
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out


class HostArrays:
    """The CPU route of a restore (``store.fill.Sink``): the store writes every token-sliceable tensor straight
    from LMDB's map into a fresh MLX array through its numpy view, checksumming each record in the same pass on
    several threads, so each byte is copied once (numpy assembly + ``mx.array`` copied it twice). The arrays are
    made by a CPU op and evaluated here, and written before anyone else holds them (never again after).
    Called as a ``concat`` (readers that assemble tensor by tensor) it is ``fresh_concat``."""

    def allocate(self, specs: list) -> list:
        outs = [mx.zeros(tuple(shape), dtype=mx.uint16 if dtype == "bfloat16" else _MX_DTYPES[dtype], stream=mx.cpu)
                for dtype, shape in specs]
        mx.eval(outs)
        made = []
        for (dtype, _shape), out in zip(specs, outs):
            view = np.array(out, copy=False)
            if not view.flags.writeable:
                raise RuntimeError("MLX did not give a writable view")
            made.append((out.view(mx.bfloat16) if dtype == "bfloat16" else out, view.view(_np_dtype(dtype))))
        return made

    def __call__(self, pieces: list, axis: int, dtype: str) -> mx.array:
        return fresh_concat(pieces, axis, dtype)


HOST_ARRAYS = HostArrays()
_CPU_COPIER: Copier | None = None


def _cpu_copier() -> Copier:
    global _CPU_COPIER
    if _CPU_COPIER is None:
        _CPU_COPIER = Copier(1)
    return _CPU_COPIER


# --- device -> host without moving MLX's pages: the capture side (to_tensor) ------------------------------------
class DeviceToHost:
    """Copies an evaluated MLX array into a new numpy array with the CUDA driver's ``cuMemcpy`` (a copy-engine
    transfer), so the array's managed pages stay on the GPU.

    Reading MLX's managed memory through a numpy view instead migrates its pages to the host: the next kernel
    that reads the array (a memory-tier hit, or a buffer MLX recycles for a later request) pulls them back at
    fault speed (~3 GB/s on the H200). ``threads`` copies run at once for large arrays.

    Each copying thread has its own non-blocking CUDA stream (``cuStreamCreate(CU_STREAM_NON_BLOCKING)``) and
    issues ``cuMemcpyAsync`` on it, then waits for that stream alone. A plain ``cuMemcpy`` runs on the legacy default
    stream, which waits for every kernel queued on MLX's (blocking) streams first: the write-behind thread's copy
    of a checkpoint then waited behind the next forwards (issue 35's H100 trace). The source is complete before
    the copy is issued (``mx.eval`` waits for the array's own event), so nothing else is needed to order them.
    Where a stream cannot be made, the synchronous ``cuMemcpy`` is used (``stream_copies`` False).
    """

    def __init__(self, advice: CudaAdvice, threads: int = 4, part_bytes: int = 64 << 20, mode: str | None = None):
        self.advice = advice
        self.threads = max(1, threads)
        self.part_bytes = part_bytes
        #: "direct": cuMemcpy straight into the new numpy array (pageable); "pinned": through page-locked bounce
        #: buffers (one per thread, ``part_bytes`` each), then a numpy copy into the new array
        self.mode = mode or os.environ.get("SPEC_CACHE_D2H_MODE", "pinned")  # H200: 7.8 vs 3.1 GB/s
        self._bounce: dict[int, tuple[int, np.ndarray]] = {}
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="spec-cache-d2h") \
            if self.threads > 1 else None
        cu = advice._driver
        if cu is None:
            raise RuntimeError("no libcuda")
        self._memcpy = cu.cuMemcpy
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
        self._memcpy_async = getattr(cu, "cuMemcpyAsync", None)
        if self._memcpy_async is not None:
            self._memcpy_async.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._streams: dict[int, int] = {}
        #: copies go on a non-blocking stream of their own (False: no stream could be made; plain cuMemcpy)
        self.stream_copies = self._memcpy_async is not None \
            and os.environ.get("SPEC_CACHE_D2H_STREAM", "1") != "0"
        #: ``cuMemcpy2DAsync``: a token range's runs (one per head of a K/V tensor) in one driver call; None: one
        #: call per run (no such export, no stream, ``SPEC_CACHE_D2H_2D=0``, or ``device_to_host``'s self-test
        #: of it failed)
        self._memcpy2d = getattr(cu, "cuMemcpy2DAsync_v2", None) \
            if os.environ.get("SPEC_CACHE_D2H_2D", "1") != "0" else None
        if self._memcpy2d is not None:
            self._memcpy2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self.bytes = 0
        self.seconds = 0.0

    def _pinned(self) -> tuple[int, np.ndarray]:
        """This thread's page-locked bounce buffer (``cuMemAllocHost``), made on first use."""
        key = threading.get_ident()
        got = self._bounce.get(key)
        if got is None:
            cu = self.advice._driver
            ptr = ctypes.c_void_p()
            rc = cu.cuMemAllocHost_v2(ctypes.byref(ptr), ctypes.c_size_t(self.part_bytes))
            if rc != 0:
                raise RuntimeError(f"cuMemAllocHost failed ({rc})")
            view = np.ctypeslib.as_array((ctypes.c_uint8 * self.part_bytes).from_address(ptr.value))
            got = self._bounce[key] = (int(ptr.value), view)
        return got

    def _stream(self) -> int | None:
        """This thread's non-blocking stream (made on first use); None where none can be made."""
        if not self.stream_copies:
            return None
        key = threading.get_ident()
        got = self._streams.get(key)
        if got is None:
            handle = ctypes.c_void_p()
            rc = self.advice._driver.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(_CU_STREAM_NON_BLOCKING))
            if rc != 0 or not handle.value:
                log.warning("spec-cache: no CUDA stream for device-to-host copies (cuStreamCreate -> %s): "
                            "plain cuMemcpy, which waits for queued kernels", rc)
                self.stream_copies = False
                return None
            got = self._streams[key] = int(handle.value)
        return got

    def _memcpy_now(self, dst: int, src: int, n: int) -> None:
        """Copy ``n`` bytes and return when they are there: on this thread's own stream where it has one."""
        stream = self._stream()
        if stream is None:
            rc = self._memcpy(dst, src, n)
            if rc != 0:
                raise RuntimeError(f"cuMemcpy failed ({rc})")
            return
        rc = self._memcpy_async(dst, src, n, stream)
        if rc == 0:
            rc = self.advice._driver.cuStreamSynchronize(ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyAsync failed ({rc})")

    def _copy(self, dst: int, src: int, n: int) -> None:
        if not self.advice._driver_context():
            raise RuntimeError("no CUDA context for cuMemcpy")
        if self.mode != "pinned":
            self._memcpy_now(dst, src, n)
            return
        ptr, view = self._pinned()
        at = 0
        while at < n:
            step = min(self.part_bytes, n - at)
            self._memcpy_now(ptr, src + at, step)
            ctypes.memmove(dst + at, ptr, step)
            at += step

    @property
    def runs_2d(self) -> bool:
        """Whether a token range's runs go in one 2-D copy (``_copy_runs``) rather than one copy each."""
        return self._memcpy2d is not None and self.stream_copies

    def _memcpy2d_now(self, dst: int, dst_pitch: int, src: int, src_pitch: int, run: int, rows: int) -> None:
        """``rows`` runs of ``run`` bytes from (unified) ``src`` to host ``dst``, on this thread's stream; returns
        when they are there."""
        stream = self._stream()
        if stream is None:
            raise RuntimeError("a 2-D copy needs a stream")
        spec = _Memcpy2D(srcMemoryType=_CU_MEMORYTYPE_UNIFIED, srcDevice=src, srcPitch=src_pitch,
                         dstMemoryType=_CU_MEMORYTYPE_HOST, dstHost=dst, dstPitch=dst_pitch,
                         WidthInBytes=run, Height=rows)
        rc = self._memcpy2d(ctypes.byref(spec), ctypes.c_void_p(stream))
        if rc == 0:
            rc = self.advice._driver.cuStreamSynchronize(ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuMemcpy2DAsync failed ({rc})")

    def _copy_runs(self, dst: int, src: int, run: int, count: int, src_pitch: int, dst_pitch: int) -> None:
        """``count`` runs of ``run`` bytes, ``src_pitch`` / ``dst_pitch`` apart: a K/V tensor's token range is
        one run per head. Why not one ``_copy`` each: every driver call and ``memmove`` gives the GIL up and
        takes it back, and on a busy server taking it back waits for the scheduler thread's Python (issue 35's
        agent run on the H200, d49a463: the write-behind thread spent ~15 s of ~35 on these copies, ~270 MB/s,
        its samples spread over the three calls of each run). Here a bounce buffer's worth of runs is one
        ``cuMemcpy2DAsync``, one wait and (pinned mode) one numpy copy out of the bounce buffer."""
        if not self.advice._driver_context():
            raise RuntimeError("no CUDA context for cuMemcpy")
        if self.mode != "pinned":
            self._memcpy2d_now(dst, dst_pitch, src, src_pitch, run, count)
            return
        if run > self.part_bytes:  # one run fills the bounce buffer: the per-run copy parts it anyway
            for i in range(count):
                self._copy(dst + i * dst_pitch, src + i * src_pitch, run)
            return
        ptr, view = self._pinned()
        per = self.part_bytes // run
        for first in range(0, count, per):
            rows = min(per, count - first)
            self._memcpy2d_now(ptr, run, src + first * src_pitch, src_pitch, run, rows)
            np.copyto(_strided_bytes(dst + first * dst_pitch, rows, run, dst_pitch),
                      view[: rows * run].reshape(rows, run))

    def copy_from(self, x: mx.array, axis: int, start: int, stop: int | None = None) -> np.ndarray:
        """``x`` on the host with only the positions from ``start`` along ``axis`` copied (the ones before are left
        unwritten: ``Store.put(copied_from=start)`` never reads them); ``stop``: the result is ``x``'s first
        ``stop`` positions along ``axis`` (a later checkpoint's array lent to an earlier one). For a checkpoint
        whose first chunks the store already holds (``Store.held_tokens``): a warm turn's checkpoint copies its new
        tokens, not its whole history (issue 35's H100 trace: ~800 MiB copied per checkpoint of a 6k-token 8B row,
        30 s of the write-behind thread over a 24-request run, the queue full, puts made on the scheduler thread)."""
        t0 = time.perf_counter()
        src_view = _source_view(x)  # only for the pointer and dtype: no byte is read here
        # ``np.empty``, not ``np.zeros``: a K/V tensor is ~30 MiB, under glibc's dynamic mmap threshold once one such
        # block was freed, so ``calloc`` took it from the heap and cleared it byte by byte, with the GIL held (issue
        # 35's H100 py-spy at b393693: 1168 of the write-behind thread's samples on that line, while the scheduler's
        # pure-Python steps and the request threads stalled behind it)
        shape = list(src_view.shape)
        if stop is not None:
            shape[axis] = stop
        out = np.empty(shape, dtype=src_view.dtype)
        n = copy_token_range(_pointer(out), _pointer(src_view), shape, src_view.itemsize, axis, start,
                             self._copy, src_length=src_view.shape[axis],
                             copy_runs=self._copy_runs if self.runs_2d else None)
        self.bytes += n
        self.seconds += time.perf_counter() - t0
        return out

    def __call__(self, x: mx.array) -> np.ndarray:
        t0 = time.perf_counter()
        src_view = _source_view(x)  # only for the pointer and dtype: no byte is read here
        out = np.empty(src_view.shape, dtype=src_view.dtype)
        n = out.nbytes
        if n:
            src, dst = _pointer(src_view), _pointer(out)
            if self._pool is None or n < 2 * self.part_bytes:
                self._copy(dst, src, n)
            else:
                parts = min(self.threads * 4, -(-n // self.part_bytes))
                edges = [n * k // parts for k in range(parts + 1)]
                jobs = [(dst + a, src + a, b - a) for a, b in zip(edges, edges[1:])]
                futures = [self._pool.submit(self._copy, *job) for job in jobs[1:]]
                self._copy(*jobs[0])
                for f in futures:
                    f.result()
        self.bytes += n
        self.seconds += time.perf_counter() - t0
        return out


def host_view(x: mx.array) -> np.ndarray:
    """A numpy view of an MLX array's buffer, bfloat16 as its uint16 words (numpy has no bfloat16, and PEP 3118
    no format for it): no copy and no MLX op, so a thread that did not build ``x`` may call it once ``x`` is
    evaluated (a deferred capture hands its arrays over so, ``cache_state.capture_caches``). A bfloat16 array must
    be contiguous here (a strided one raises ``ValueError``; other dtypes keep their strides)."""
    m = memoryview(x)
    if m.format != "bfloat16":
        return np.asarray(m)
    if not m.c_contiguous:
        raise ValueError(f"a strided bfloat16 array {tuple(x.shape)} has no host view")
    return np.frombuffer(m.cast("B"), dtype=np.uint16).reshape(m.shape)


def _source_view(x: mx.array) -> np.ndarray:
    """``x`` evaluated and viewed for a copy out of it: contiguous (deferred captures arrive so; anything else is
    made contiguous here, an MLX op on this thread, the rare path)."""
    mx.eval(x)
    if memoryview(x).c_contiguous:
        return host_view(x)
    c = mx.contiguous(x)
    mx.eval(c)
    return host_view(c)


def check_runs_2d(d2h: DeviceToHost) -> str:
    """Self-test of ``d2h``'s 2-D copies of token ranges (a lent source longer than the result, runs of several
    heads); on a wrong byte or a driver error they are turned off (one copy per run, as before). Returns what the
    copier's status line says about them."""
    if not d2h.runs_2d:
        return ""
    src = mx.arange(2 * 3 * 40 * 8, dtype=mx.int32).reshape(2, 3, 40, 8) * 5 + 1
    mx.eval(src)
    want = np.asarray(memoryview(src))[:, :, :29]
    try:
        got = d2h.copy_from(src, 2, 13, stop=29)
        if np.array_equal(got[:, :, 13:], want[:, :, 13:]):
            return ", token ranges in 2-D copies"
        why = "wrong bytes"
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    d2h._memcpy2d = None
    log.warning("spec-cache: 2-D device-to-host copies failed their self-test (%s): one copy per run", why)
    return f", 2-D copies off ({why})"


_D2H: DeviceToHost | None = None
_D2H_STATE = {"tried": False, "why": None}


def device_to_host() -> DeviceToHost | None:
    """The process's device-to-host copier on MLX's CUDA backend where the staging route passed its checks
    (the buffers are managed memory and libcuda answers); None elsewhere (a numpy view of the array is then as
    good). ``SPEC_CACHE_CAPTURE_ROUTE=view`` turns it off."""
    global _D2H
    with _LOADER_LOCK:
        if _D2H_STATE["tried"]:
            return _D2H
    loader = staging_loader()
    with _LOADER_LOCK:
        if not _D2H_STATE["tried"]:
            _D2H_STATE["tried"] = True
            if os.environ.get("SPEC_CACHE_CAPTURE_ROUTE", "") == "view":
                _D2H_STATE["why"] = "off (SPEC_CACHE_CAPTURE_ROUTE=view)"
            elif loader is None or loader.advice is None:
                _D2H_STATE["why"] = "off (no staging route here)"
            else:
                try:
                    d2h = DeviceToHost(loader.advice)
                    probe = mx.arange(3000, dtype=mx.int32) * 7
                    if not np.array_equal(d2h(probe), np.arange(3000, dtype=np.int32) * 7):
                        raise RuntimeError("device-to-host self-test failed")
                    runs = check_runs_2d(d2h)
                    _D2H = d2h
                    _D2H_STATE["why"] = (f"cuMemcpyAsync on its own non-blocking stream, {d2h.threads} threads"
                                         if d2h.stream_copies else f"cuMemcpy, {d2h.threads} threads") + runs
                except Exception as exc:
                    _D2H_STATE["why"] = f"off: {type(exc).__name__}: {exc}"
        return _D2H


def capture_status() -> str:
    device_to_host()
    return _D2H_STATE["why"] or ""

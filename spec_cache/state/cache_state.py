"""mlx-lm cache objects <-> the store's ``LayerState`` (the only place that knows both).

Which class is which stored kind, and what each keeps, is ``spec_cache.state.cache_kinds``' table (the memory tier
uses the same one): ``kv`` and ``qkv`` sliced to the real offset (token axis 2, so the store may split them into
shared chunks), ``rotating`` and ``arrays`` whole. This module adds the host side: arrays to store ``Tensor``s
(``to_tensor``; deferred copies for a background writer) and back (``to_mx``, ``mx_concat``, ``restore_concat``).

Restored arrays are owned copies, bit-identical to what was stored.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from spec_cache.errors import RestoreRefused
from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint
from spec_cache.state.cache_kinds import kind_named, kind_of
from spec_cache.store import LayerState, Tensor, numpy_dtype

_MX_DTYPES = {
    "bool": mx.bool_, "uint8": mx.uint8, "uint16": mx.uint16, "uint32": mx.uint32, "uint64": mx.uint64,
    "int8": mx.int8, "int16": mx.int16, "int32": mx.int32, "int64": mx.int64, "float16": mx.float16,
    "bfloat16": mx.bfloat16, "float32": mx.float32, "complex64": mx.complex64,
}


def dtype_of(x: mx.array) -> str:
    return str(x.dtype).rsplit(".", 1)[-1]


def to_tensor(x: mx.array) -> Tensor:
    """An ``mx.array`` as a store ``Tensor``: a numpy view of its buffer (bfloat16 as uint16 words); on MLX's
    CUDA backend an owned host copy made by the copy engine instead (``device_copy.device_to_host``): reading
    managed memory through a view would move the array's pages to the host, and the next kernel that reads it
    (a memory-tier hit) would pull them back at fault speed."""
    from spec_cache.state import device_copy
    name = dtype_of(x)
    if getattr(_DEFER, "on", False) and x.size:
        return Tensor(name, tuple(x.shape), x)  # queued by capture_caches, copied out by host_layers
    raw = x.view(mx.uint16) if name == "bfloat16" else x
    mx.eval(raw)
    if not raw.size:
        return Tensor(name, tuple(x.shape), np.zeros(raw.shape, dtype=numpy_dtype(name)))
    d2h = device_copy.device_to_host() if device_copy.is_gpu() else None
    arr = d2h(raw) if d2h is not None else np.asarray(memoryview(raw))
    return Tensor(name, tuple(x.shape), arr)


def mx_concat(pieces: list, axis: int, dtype: str) -> mx.array:
    """``Store.fetch``'s ``concat``: copy each piece (a numpy view into the map) into MLX once, join in MLX.

    On a GPU the join runs on the device; the host makes one copy of the stored bytes instead of two.
    """
    arrays = [mx.array(p).view(mx.bfloat16) if dtype == "bfloat16" else mx.array(p, dtype=_MX_DTYPES[dtype])
              for p in pieces]
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)


def restore_concat():
    """The ``concat`` to give ``Store.fetch`` (see ``spec_cache.state.device_copy``): on MLX's CUDA backend the staging
    loader (one host copy on several threads into a host-resident staging buffer, then a device copy: ~20 GB/s
    on the H200) where its run-time checks pass, else ``mx_concat`` (pieces copied into MLX once and joined on
    the device); on the CPU ``device_copy.HOST_ARRAYS`` (records copied straight into fresh MLX arrays and
    checksummed in the same pass). ``SPEC_CACHE_COPY_ROUTE`` = ``staging`` | ``join`` | ``numpy`` | ``fresh`` |
    ``fill`` forces a route (``staging`` falls back to ``join`` where it is not available; ``numpy``: None)."""
    from spec_cache.state import device_copy
    route = os.environ.get("SPEC_CACHE_COPY_ROUTE", "")
    if route == "numpy":
        return None
    if route == "join":
        return mx_concat
    if route == "fresh":
        return device_copy.fresh_concat
    if route == "fill":
        return device_copy.HOST_ARRAYS
    if route == "staging" or device_copy.is_gpu():
        loader = device_copy.staging_loader() if device_copy.is_cuda() or route == "staging" else None
        return loader if loader is not None else mx_concat
    return device_copy.HOST_ARRAYS


def to_mx(t: Any) -> mx.array:
    """A tensor as an ``mx.array``: an ``mx.array`` as is; a store ``Tensor`` as an owned array of its dtype
    (bfloat16 from its uint16 words; data ``mx_concat`` already built in MLX checked against the record's dtype);
    anything else with the buffer protocol (a numpy array) copied into MLX."""
    if isinstance(t, mx.array):
        return t
    if not isinstance(t, Tensor):
        return mx.array(t)
    if isinstance(t.data, mx.array):  # already built by mx_concat
        if dtype_of(t.data) != t.dtype:
            raise RestoreRefused(f"restored tensor is {dtype_of(t.data)}, its record says {t.dtype}")
        return t.data
    arr = t.array()
    if t.dtype == "bfloat16":
        return mx.array(arr).view(mx.bfloat16)
    if t.dtype == "float64":
        raise RestoreRefused("float64 tensors cannot be restored into MLX")
    return mx.array(arr, dtype=_MX_DTYPES[t.dtype])


def layer_state(cache: Any) -> LayerState:
    """One mlx-lm cache (single row) as a ``LayerState`` covering exactly its offset (see ``cache_kinds``)."""
    kind = kind_of(cache)
    meta, arrays = kind.capture(cache)
    return LayerState(kind.name, meta, [to_tensor(a) for a in arrays], token_axis=kind.token_axis)


def from_layer_state(layer: LayerState) -> Any:
    """Rebuild the mlx-lm cache a ``LayerState`` came from (owned, bit-identical arrays)."""
    kind = kind_named(layer.kind)
    return kind.build(layer.meta, [to_mx(t) for t in layer.tensors])


def capture_caches(caches: Sequence[Any], *, defer_copy: bool = False) -> list[LayerState]:
    """Single-row mlx-lm caches as ``LayerState``s.

    ``defer_copy``: leave each tensor's bytes in MLX (queued for evaluation) for ``host_layers`` to copy out later,
    on another thread: every MLX operation is built here, on the caller's thread, and queued (``mx.async_eval``:
    the caller never waits for the device); the later copy waits for the evaluation and only reads evaluated
    buffers (``cuMemcpy`` on CUDA, a numpy view elsewhere). Why: an MLX graph can be evaluated only on the thread
    whose stream built it; a request thread must not wait for it. On a GPU each tensor is made contiguous (the copy
    engine reads one span), except the arrays of caches ``mark_queued`` named, which are already owned, contiguous
    and queued: those are taken as they are, and a capture of nothing else builds no MLX op and calls no
    ``async_eval`` (issue 35's H100 trace: 7-13 ms a checkpointing step on the scheduler thread went to queueing 64
    views and copies of arrays that needed neither; an MLX eval call can wait there for queued work).
    """
    if not defer_copy:
        return [layer_state(c) for c in caches]
    from spec_cache.state import device_copy
    gpu = device_copy.is_gpu()
    _DEFER.on = True
    try:
        layers = [layer_state(c) for c in caches]
    finally:
        _DEFER.on = False
    queued: list = []
    out = []
    for cache, layer in zip(caches, layers):
        ready = {id(a) for a in kind_of(cache).arrays(cache)} if gpu and _is_queued(cache) else set()
        tensors = []
        for t in layer.tensors:
            x = t.data
            if isinstance(x, mx.array) and id(x) not in ready:
                x = x.view(mx.uint16) if t.dtype == "bfloat16" else x
                x = mx.contiguous(x) if gpu else x
                queued.append(x)
                t = Tensor(t.dtype, t.shape, x)
            tensors.append(t)
        out.append(LayerState(layer.kind, layer.meta, tensors, layer.token_axis))
    if queued:
        mx.async_eval(queued)  # queued on the caller's stream; host_layers' reads wait for it (from any thread)
    return out


_QUEUED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def mark_queued(caches: Sequence[Any]) -> None:
    """Say that ``caches``' arrays are owned (no other cache writes them), contiguous and already queued for
    evaluation on the caller's stream (``TargetRows.extract``'s snapshots): a deferred capture of them on a GPU
    then needs no MLX op of its own (``capture_caches``). Held weakly: the mark goes with the cache object."""
    for cache in caches:
        try:
            _QUEUED.add(cache)
        except TypeError:  # a cache type without weak references: captured the ordinary way
            pass


def _is_queued(cache: Any) -> bool:
    try:
        return cache in _QUEUED
    except TypeError:
        return False


def host_layers(layers: Sequence[LayerState], start: int = 0) -> list[LayerState]:
    """``capture_caches(..., defer_copy=True)``'s layers with their bytes copied to host memory (safe on a
    background thread: no MLX graph is built). ``start`` (where ``copies_bytes()``): the token-axis layers get
    only their positions from ``start`` on, the rest unwritten (for ``Store.put(copied_from=start)``: the store holds
    the chunks before it)."""
    return [LayerState(layer.kind, layer.meta, [_host_tensor(t, layer.token_axis, start) for t in layer.tensors],
                       layer.token_axis) for layer in layers]


def copies_bytes() -> bool:
    """Whether ``host_layers`` copies bytes out of MLX (MLX's CUDA backend: device memory), so skipping what the
    store holds saves work; elsewhere it hands out numpy views of MLX's (unified) memory, which cost nothing."""
    return _device_to_host() is not None


def _device_to_host():
    from spec_cache.state import device_copy
    return device_copy.device_to_host() if device_copy.is_gpu() else None


def _host_tensor(t: Tensor, axis: int | None = None, start: int = 0) -> Tensor:
    if not isinstance(t.data, mx.array):
        return t
    d2h = _device_to_host()
    lent = axis is not None and tuple(t.data.shape) != t.shape  # a longer checkpoint's array: its first positions
    if d2h is None:
        from spec_cache.state.device_copy import host_view
        view = host_view(t.data)
        if lent:  # a strided view of the positions it covers (the store copies strided views as they are)
            view = view[(slice(None),) * axis + (slice(0, t.shape[axis]),)]
        return Tensor(t.dtype, t.shape, view)
    if lent:
        return Tensor(t.dtype, t.shape, d2h.copy_from(t.data, axis, start, stop=t.shape[axis]))
    if axis is not None and start > 0:
        return Tensor(t.dtype, t.shape, d2h.copy_from(t.data, axis, start))
    return Tensor(t.dtype, t.shape, d2h(t.data))


def lendable(earlier: Sequence[LayerState], later: Sequence[LayerState], length: int) -> bool:
    """Whether a later checkpoint's deferred arrays (``later``: the same tokens and more) can stand in for
    ``earlier``'s (a checkpoint of ``length`` tokens; its own arrays, or only its shapes, data None): every layer
    token-sliceable, of one kind with the same scalars (a quantized layer's conversion point among them), tensors
    alike in dtype and in shape off the token axis, no bytes already on the host. ``on_loan`` then builds what the
    writer copies.

    Why: a queued checkpoint holds its own snapshot of the row (``TargetRows.extract``: ~2 GB for a 15k-token 8B
    row) until the writer gets to it; a row checkpointed at each message boundary while the writer is behind held
    one such copy per boundary (issue 35's agent run on an H100: device memory 14 -> 76 GiB, every step then freeing
    and reallocating MLX's buffers). Lent, the earlier snapshot is dropped; its write copies the positions it covers
    out of the later one (``host_layers``: a lent tensor's shape is shorter than its array along the token axis).
    KV positions are written once (a rollback drops only positions after the accepted ones), and the store already
    takes a checkpoint's leading chunks from whichever checkpoint wrote them first. On unified memory (a CPU,
    Apple silicon) the lent tensor is a strided host view, no copy; on MLX's CUDA backend the copier reads the
    positions it covers out of the later array."""
    if len(earlier) != len(later):
        return False
    for mine, theirs in zip(earlier, later):
        axis = mine.token_axis
        if (mine.kind != theirs.kind or not kind_named(mine.kind).trimmable or axis is None
                or theirs.token_axis != axis or mine.meta != theirs.meta or len(mine.tensors) != len(theirs.tensors)):
            return False
        for a, b in zip(mine.tensors, theirs.tensors):
            if not (a.data is None or isinstance(a.data, mx.array)) or not isinstance(b.data, mx.array) \
                    or a.dtype != b.dtype:
                return False
            data_shape = tuple(b.data.shape)
            if (len(a.shape) != len(data_shape) or a.shape[axis] != length or data_shape[axis] < length
                    or any(x != y for i, (x, y) in enumerate(zip(a.shape, data_shape)) if i != axis)):
                return False
    return True


def on_loan(mine: Sequence[LayerState], theirs: Sequence[LayerState]) -> list[LayerState]:
    """``mine``'s shapes over ``theirs``' arrays (``lendable`` said they fit), for the writer's copy of the positions
    ``mine`` covers."""
    return [LayerState(a.kind, a.meta, [Tensor.checked(t.dtype, t.shape, u.data)
                                         for t, u in zip(a.tensors, b.tensors)], a.token_axis)
            for a, b in zip(mine, theirs)]


def shapes_only(layers: Sequence[LayerState]) -> list[LayerState]:
    """``layers`` without their bytes (dtypes and shapes kept): a checkpoint on loan reads a later one's arrays."""
    return [LayerState(layer.kind, layer.meta, [Tensor.checked(t.dtype, t.shape, None) for t in layer.tensors],
                       layer.token_axis) for layer in layers]


_DEFER = threading.local()  # ``on`` while ``capture_caches(defer_copy=True)`` runs: ``to_tensor`` keeps bytes in MLX


def restore_caches(layers: Sequence[LayerState]) -> list[Any]:
    """The mlx-lm caches of restored ``layers``, evaluated (each kind's ``arrays``). Stored state that does not
    build (a meta key missing, shapes that do not fit) is a ``RestoreRefused`` naming the layer: the one place a
    restore interprets stored bytes, so callers catch that name, never a bare ``ValueError`` (issue 34)."""
    caches = []
    for index, layer in enumerate(layers):
        try:
            caches.append(from_layer_state(layer))
        except RestoreRefused:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise RestoreRefused(f"stored layer {index} ({layer.kind}) does not rebuild: {exc}") from exc
    mx.eval([a for c in caches for a in kind_of(c).arrays(c)])
    return caches


def attachment_to_store(cp: DraftRowCheckpoint) -> CheckpointAttachment:
    """A drafter checkpoint's attachment with its tensors as store Tensors."""
    a = cp.attachment
    tensors = tuple(t if isinstance(t, Tensor) else to_tensor(t) for t in a.tensors)
    return CheckpointAttachment(a.schema, dict(a.metadata), tensors)


def checkpoint_from_store(length: int, attachment: CheckpointAttachment) -> DraftRowCheckpoint:
    """A restored attachment as a ``DraftRowCheckpoint`` with owned ``mx.array`` tensors (a tensor that does not
    convert: ``RestoreRefused``)."""
    try:
        tensors = tuple(to_mx(t) for t in attachment.tensors)
    except (ValueError, TypeError, KeyError) as exc:
        raise RestoreRefused(f"stored drafter attachment {attachment.schema} does not rebuild: {exc}") from exc
    mx.eval(list(tensors))
    return DraftRowCheckpoint(length, CheckpointAttachment(attachment.schema, dict(attachment.metadata), tensors))

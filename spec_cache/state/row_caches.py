"""Single-row mlx-lm caches <-> rows of a batch: what a checkpoint holds and what a batched row needs.

A checkpoint holds one row as mlx-lm's own single-sequence caches (``KVCache``; ``RotatingKVCache`` for a
sliding-window layer; ``QuantizedKVCache`` for a converted layer). Batched rows need each layer's K/V right-aligned
in a ``BatchKVCache`` whose offset is the row's position. These helpers convert between the two and cut a restored
state back to a shorter prefix where that is exact.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from spec_cache.errors import RestoreRefused

__all__ = ["row_position", "row_content", "merge_rows", "rotating_snapshot", "prefix_caches"]


def row_position(layers: Sequence[Any], row: int = 0) -> int:
    """The token count of one row's restored caches (every K/V layer must agree; a recurrent ``ArraysCache``
    carries no count), else ValueError."""
    positions = {int(cache.offset) for cache in layers if not isinstance(cache, ArraysCache)}
    if not positions:
        raise RestoreRefused(f"row {row}: restored caches have no K/V layer to tell their length")
    if len(positions) != 1:
        raise RestoreRefused(f"row {row}: restored caches disagree on their length: {sorted(positions)}")
    return positions.pop()


def _temporal(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A ring buffer's keys and values in temporal order (mlx-lm's ``_temporal_order``)."""
    return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)


def row_content(cache: Any, window: int | None, layer: int, row: int) -> tuple[mx.array, mx.array] | None:
    """The K/V a batched row needs from one restored single-row cache: everything for a full-attention layer,
    the last ``min(offset, window)`` keys for a sliding one. None for an empty cache."""
    where = f"row {row} layer {layer}"
    if isinstance(cache, RotatingKVCache):
        if window is None:
            raise RestoreRefused(f"{where}: a rotating cache for a full-attention layer")
        if cache.keep != 0 or cache.max_size != window:
            raise RestoreRefused(f"{where}: rotating cache (max_size {cache.max_size}, keep {cache.keep}) does not "
                                 f"match the layer's window {window}")
        if cache.keys is None or cache.offset == 0:
            return None
        keys, values = _temporal(cache)
        held = min(int(cache.offset), window)
        return keys[..., -held:, :], values[..., -held:, :]
    if type(cache) is not KVCache:
        raise RestoreRefused(f"{where}: {type(cache).__name__} layers cannot join batched full-precision rows")
    if cache.keys is None or cache.offset == 0:
        return None
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def merge_rows(contents: Sequence[tuple[mx.array, mx.array] | None], positions: Sequence[int]) -> BatchKVCache:
    """One layer's ``BatchKVCache`` from per-row K/V (right-aligned), each row's offset at its position."""
    sizes = [0 if c is None else int(c[0].shape[2]) for c in contents]
    longest = max(sizes, default=0)
    cache = BatchKVCache([longest - size for size in sizes])
    if longest == 0:
        return cache
    sample = next(c for c in contents if c is not None)
    _, heads, _, k_dim = sample[0].shape
    v_dim = sample[1].shape[3]
    keys, values = [], []
    for content, size in zip(contents, sizes):
        pad = longest - size
        if content is None:
            keys.append(mx.zeros((1, heads, longest, k_dim), dtype=sample[0].dtype))
            values.append(mx.zeros((1, heads, longest, v_dim), dtype=sample[1].dtype))
            continue
        k, v = content
        if pad:
            k = mx.pad(k, [(0, 0), (0, 0), (pad, 0), (0, 0)])
            v = mx.pad(v, [(0, 0), (0, 0), (pad, 0), (0, 0)])
        keys.append(k)
        values.append(v)
    cache.keys = mx.concatenate(keys, axis=0)
    cache.values = mx.concatenate(values, axis=0)
    cache.offset = mx.array(list(positions), dtype=mx.int32)
    cache._idx = longest
    return cache


def rotating_snapshot(keys: mx.array, values: mx.array, position: int, window: int) -> RotatingKVCache:
    """mlx-lm's ``RotatingKVCache(max_size=window)`` holding the last ``window`` of ``keys`` (temporal order,
    ``[1, H, T, D]`` ending at ``position``): the state mlx-lm itself continues from exactly."""
    held = min(position, window)
    if keys.shape[2] < held:
        raise ValueError(f"a sliding layer holds {keys.shape[2]} keys; its snapshot at {position} needs {held}")
    cache = RotatingKVCache(max_size=window, keep=0)
    if held:
        k = mx.contiguous(keys[..., keys.shape[2] - held :, :])
        v = mx.contiguous(values[..., values.shape[2] - held :, :])
        cache.state = (k, v, position, 0, window, held)
    return cache


def prefix_caches(caches: Sequence[Any], tokens: int, windows: Sequence[int | None]) -> list | None:
    """New single-row caches holding the first ``tokens`` of ``caches`` (which are only read), or None when
    that state cannot be rebuilt from them.

    Full-precision KV slices exactly. A sliding-window snapshot loses its oldest key with every token it is
    cut by, so it serves ``tokens`` only while the keys it keeps still cover that position's window. A quantized
    layer serves no prefix below its conversion point (a cold run holds full precision there). A recurrent
    state (``ArraysCache``) serves only its own length.
    """
    out = []
    whole = row_position(caches)
    for cache, window in zip(caches, windows):
        position = whole if isinstance(cache, ArraysCache) else int(cache.offset)
        cut = position - tokens
        if cut < 0:
            raise ValueError(f"cannot take {tokens} tokens of caches holding {position}")
        if isinstance(cache, ArraysCache):
            if cut:
                return None
            copy = ArraysCache(len(cache.cache))
            copy.cache = list(cache.cache)
            out.append(copy)
        elif isinstance(cache, RotatingKVCache):
            if cache.keys is None:
                out.append(RotatingKVCache(max_size=cache.max_size, keep=cache.keep))
                continue
            keys, values = _temporal(cache)
            held = min(position, window or cache.max_size)
            keys, values = keys[..., keys.shape[2] - held :, :], values[..., values.shape[2] - held :, :]
            kept = held - cut
            if kept < min(tokens, (window or cache.max_size) - 1):
                return None
            keys, values = keys[..., :kept, :], values[..., :kept, :]
            snapshot = RotatingKVCache(max_size=cache.max_size, keep=0)
            if kept:
                snapshot.state = (keys, values, tokens, 0, cache.max_size, kept)
            out.append(snapshot)
        elif isinstance(cache, QuantizedKVCache):
            point = getattr(cache, "converted_at", None)
            if point is None or tokens < point:
                return None
            sliced = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
            if tokens:
                sliced.keys = tuple(a[..., :tokens, :] for a in cache.keys)
                sliced.values = tuple(a[..., :tokens, :] for a in cache.values)
            sliced.offset = tokens
            sliced.converted_at = point
            out.append(sliced)
        else:
            sliced = KVCache()
            if tokens:
                sliced.keys = cache.keys[..., :tokens, :]
                sliced.values = cache.values[..., :tokens, :]
                sliced.offset = tokens
            out.append(sliced)
    return out

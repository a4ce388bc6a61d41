"""The batch caches rows are held in, and the mechanics of moving rows in and out of them (no class dispatch).

Which of these a cache layer uses is ``spec_cache.state.cache_kinds``' table: each kind there calls the pieces
here for its own rows, and nothing here looks at a cache's class. The pieces:

* full-precision K/V (kinds ``kv`` and ``rotating``): mlx-lm's ``BatchKVCache``, rows right-aligned behind left
  padding (``merge_rows``, ``clone_batch_cache``); a sliding layer written back as mlx-lm's ``RotatingKVCache``
  snapshot (``rotating_snapshot``; a ring read in temporal order: ``temporal``);
* quantized K/V (kind ``qkv``): :class:`BatchQuantizedKVCache`, ``BatchKVCache``'s mechanics over
  ``QuantizedKVCache``'s layout (mlx-lm 0.32 has no batched quantized cache);
* recurrent state (kind ``arrays``): a batched mlx-lm ``ArraysCache`` (``merge_states``, ``join_states``,
  ``clone_states``, ``split_state``); rollback by replay is ``spec_cache.rows.target.HybridTargetRows``'.

Moved here from ``state/row_caches.py``, ``rows/batch_rows.py``, ``rows/recurrent_rows.py`` and
``rows/quantized_batch.py`` (which re-export them) so the table, one floor below the rows, can reach them.

**BatchQuantizedKVCache.** Per layer the keys and values are each a triple (packed ``uint32`` words, scales,
biases; ``[B, heads, T, ...]``, groups along ``head_dim``), rows right-justified behind left padding, exactly as
``BatchKVCache`` keeps them. Padding runs along the sequence axis, never inside a quantization group, so a row's
words, scales and biases are bit-for-bit those of its single-row cache. Because the cache has ``bits`` and
``group_size``, ``mlx_lm.models.base.scaled_dot_product_attention`` attends through ``mx.quantized_matmul`` (the
path a single-row ``QuantizedKVCache`` takes), and :meth:`~BatchQuantizedKVCache.make_mask` masks the left padding
(``create_causal_mask(..., left_padding=...)``), so padded keys get ``finfo.min`` scores and zero weight. Per-row
rollback is ``BatchKVCache``'s: ``prepare(right_padding=...)`` + ``finalize()`` rolls a row's discarded tail round
to its left padding.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, QuantizedKVCache, RotatingKVCache, dynamic_roll

from spec_cache.errors import RestoreRefused

__all__ = ["BatchQuantizedKVCache", "clone_batch_cache", "clone_states", "join_states", "merge_rows",
           "merge_states", "rotating_snapshot", "split_state", "temporal"]


# -- full-precision K/V: BatchKVCache ----------------------------------------------------------------------------
def temporal(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A ring buffer's keys and values in temporal order (mlx-lm's ``_temporal_order``)."""
    return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)


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


def clone_batch_cache(cache: BatchKVCache) -> BatchKVCache:
    """A BatchKVCache with its own array objects (mlx-lm mutates some of them in place, e.g. ``+=``)."""
    clone = BatchKVCache.__new__(BatchKVCache)
    clone.keys = None if cache.keys is None else cache.keys[...]
    clone.values = None if cache.values is None else cache.values[...]
    clone.offset = cache.offset[...]
    clone.left_padding = cache.left_padding[...]
    clone._idx = cache._idx
    clone._right_padding = None
    return clone


# -- recurrent state: a batched ArraysCache --------------------------------------------------------------------
def merge_states(contents: Sequence[list | None], size: int) -> ArraysCache:
    """One batched ``ArraysCache`` from per-row arrays; an empty row gets zeros, which is exactly what the layer
    starts from when its state is None."""
    cache = ArraysCache(size)
    present = [c for c in contents if c is not None]
    if not present:
        return cache
    for i in range(size):
        sample = present[0][i]
        zeros = mx.zeros((1, *sample.shape[1:]), dtype=sample.dtype)
        cache.cache[i] = mx.concatenate([zeros if c is None else c[i] for c in contents], axis=0)
    return cache


def clone_states(cache: ArraysCache) -> ArraysCache:
    """A new ``ArraysCache`` over the same (immutable) arrays: mlx-lm assigns new arrays, never writes them."""
    clone = ArraysCache(len(cache.cache))
    clone.cache = list(cache.cache)
    return clone


def join_states(first: ArraysCache, first_rows: int, second: ArraysCache, second_rows: int) -> ArraysCache:
    """``first``'s rows then ``second``'s (zeros for a side that holds no state yet); neither is changed."""
    joined = ArraysCache(len(first.cache))
    for i, (a, b) in enumerate(zip(first.cache, second.cache)):
        if a is None and b is None:
            continue
        sample = a if a is not None else b
        if a is None:
            a = mx.zeros((first_rows, *sample.shape[1:]), dtype=sample.dtype)
        if b is None:
            b = mx.zeros((second_rows, *sample.shape[1:]), dtype=sample.dtype)
        joined.cache[i] = mx.concatenate([a, b], axis=0)
    return joined


def split_state(cache: ArraysCache, row: int) -> ArraysCache:
    """Row ``row`` as a single-row ``ArraysCache`` of owned contiguous arrays (mlx-lm's own layout)."""
    single = ArraysCache(len(cache.cache))
    single.cache = [None if a is None else mx.contiguous(a[row : row + 1]) for a in cache.cache]
    return single


# -- quantized K/V ----------------------------------------------------------------------------------------------
Triple = tuple[mx.array, mx.array, mx.array]


def _pad_seq(parts: Triple, left: int, right: int) -> Triple:
    if not left and not right:
        return parts
    return tuple(mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]) for a in parts)


class BatchQuantizedKVCache:
    """Quantized K/V of a batch of rows of one layer, left-padded (see module doc).

    ``offset[row]`` is the row's token count (its RoPE position), ``left_padding[row]`` the padded slots before
    its first key, ``_idx`` the filled length of the sequence axis (``left_padding + offset`` for every row).
    """

    step = 256

    def __init__(self, left_padding: Sequence[int], *, group_size: int, bits: int) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(list(left_padding), dtype=mx.int32)
        self.offset = -self.left_padding
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = int(group_size)
        self.bits = int(bits)

    # -- forward ----------------------------------------------------------------------------------------
    def _grow(self, keys: mx.array, values: mx.array, steps: int) -> None:
        """Room for ``steps`` more positions (capacity in multiples of ``step``, as mlx-lm's caches)."""
        prev = self._idx
        if self.keys is not None and prev + steps <= self.keys[0].shape[2]:
            return
        batch, heads = keys.shape[:2]
        new = (self.step + steps - 1) // self.step * self.step
        per_word = 32 // self.bits

        def empty(dim: int, dtype: mx.Dtype) -> Triple:
            shape = (batch, heads, new)
            return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=dtype))

        grown_k, grown_v = empty(keys.shape[3], keys.dtype), empty(values.shape[3], values.dtype)
        if self.keys is None:
            self.keys, self.values = grown_k, grown_v
            return
        self.keys = tuple(mx.concatenate([a[..., :prev, :], b], axis=2) for a, b in zip(self.keys, grown_k))
        self.values = tuple(mx.concatenate([a[..., :prev, :], b], axis=2) for a, b in zip(self.values, grown_v))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        """Quantize ``keys``/``values`` ``[B, heads, L, D]`` (as ``QuantizedKVCache`` does), append them to every
        row and return the filled part of the cache."""
        steps = keys.shape[2]
        self._grow(keys, values, steps)
        prev = self._idx
        quant_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        quant_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for held, new in zip((*self.keys, *self.values), (*quant_k, *quant_v)):
            held[..., prev : prev + steps, :] = new
        self._idx += steps
        self.offset = self.offset + steps
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return (tuple(a[..., : self._idx, :] for a in self.keys),
                tuple(a[..., : self._idx, :] for a in self.values))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_) -> mx.array:
        """Causal over the filled positions, left padding masked (``BatchKVCache.make_mask``)."""
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, window_size=window_size)

    # -- per-row rollback -------------------------------------------------------------------------------
    def prepare(self, *, left_padding: Sequence[int] | None = None, right_padding: Sequence[int] | None = None,
                **_) -> None:
        """``right_padding[row]``: how many of the last appended positions the row discards at :meth:`finalize`."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty BatchQuantizedKVCache")
            added = mx.array(list(left_padding), dtype=mx.int32)
            self.left_padding = self.left_padding + added
            self.offset = self.offset - added
        if right_padding is not None and max(right_padding, default=0) > 0:
            self._right_padding = mx.array(list(right_padding), dtype=mx.int32)

    def finalize(self) -> None:
        """Turn each row's discarded tail into left padding (a roll along the sequence axis)."""
        if self._right_padding is None:
            return
        shift = self._right_padding[:, None]
        self.keys = tuple(dynamic_roll(a, shift, axis=2) for a in self.keys)
        self.values = tuple(dynamic_roll(a, shift, axis=2) for a in self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    # -- rows in and out --------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.offset.shape[0])

    def filter(self, batch_indices: mx.array) -> None:
        """Keep rows ``batch_indices`` (in that order), then drop padding every row shares."""
        if self.keys is not None:
            self.keys = tuple(a[batch_indices] for a in self.keys)
            self.values = tuple(a[batch_indices] for a in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = min(self.left_padding.tolist(), default=0)
        if shared > 0:
            if self.keys is not None:
                self.keys = tuple(a[..., shared:, :] for a in self.keys)
                self.values = tuple(a[..., shared:, :] for a in self.values)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append ``other``'s rows (both right-justified to the longer filled length)."""
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError(f"cannot join {other.bits}-bit / group {other.group_size} rows to "
                             f"{self.bits}-bit / group {self.group_size} rows")
        if other.keys is None and self.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        longest = max(self._idx, other._idx)
        sample = self if self.keys is not None else other

        def padded(cache: "BatchQuantizedKVCache") -> tuple[Triple, Triple, mx.array]:
            left = longest - cache._idx
            if cache.keys is None:
                rows = cache.batch_size
                keys = tuple(mx.zeros((rows, a.shape[1], longest, a.shape[3]), dtype=a.dtype) for a in sample.keys)
                values = tuple(mx.zeros((rows, a.shape[1], longest, a.shape[3]), dtype=a.dtype)
                               for a in sample.values)
                return keys, values, cache.left_padding + left
            keys = _pad_seq(tuple(a[..., : cache._idx, :] for a in cache.keys), left, 0)
            values = _pad_seq(tuple(a[..., : cache._idx, :] for a in cache.values), left, 0)
            return keys, values, cache.left_padding + left

        mine, theirs = padded(self), padded(other)
        self.keys = tuple(mx.concatenate(pair, axis=0) for pair in zip(mine[0], theirs[0]))
        self.values = tuple(mx.concatenate(pair, axis=0) for pair in zip(mine[1], theirs[1]))
        self.left_padding = mx.concatenate([mine[2], theirs[2]])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = longest

    def extract(self, row: int) -> QuantizedKVCache:
        """Row ``row`` as an owned single-row ``QuantizedKVCache`` (offset == its token count)."""
        single = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        count = int(self.offset[row].item())
        if self.keys is None or count == 0:
            return single
        left = int(self.left_padding[row].item())
        single.keys = tuple(mx.contiguous(a[row : row + 1, :, left : self._idx]) for a in self.keys)
        single.values = tuple(mx.contiguous(a[row : row + 1, :, left : self._idx]) for a in self.values)
        single.offset = count
        return single

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache | None], *, group_size: int,
              bits: int) -> "BatchQuantizedKVCache":
        """One batch from single-row quantized caches (None: an empty row), right-justified."""
        counts = []
        for row, cache in enumerate(caches):
            if cache is None:
                counts.append(0)
                continue
            if getattr(cache, "bits", None) is None:  # a layout check: the table's qkv kind sends only its rows here
                raise RestoreRefused(f"row {row}: a {type(cache).__name__} cannot join quantized rows")
            if (cache.bits, cache.group_size) != (bits, group_size):
                raise RestoreRefused(f"row {row}: {cache.bits}-bit / group {cache.group_size} KV, the batch holds "
                                     f"{bits}-bit / group {group_size}")
            counts.append(0 if cache.keys is None else int(cache.offset))
        longest = max(counts, default=0)
        batch = cls([longest - n for n in counts], group_size=group_size, bits=bits)
        if longest == 0:
            return batch
        sample = next(c for c, n in zip(caches, counts) if n)
        keys, values = [], []
        for cache, count in zip(caches, counts):
            if count == 0:
                keys.append(tuple(mx.zeros((1, a.shape[1], longest, a.shape[3]), dtype=a.dtype) for a in sample.keys))
                values.append(tuple(mx.zeros((1, a.shape[1], longest, a.shape[3]), dtype=a.dtype)
                                    for a in sample.values))
                continue
            keys.append(_pad_seq(tuple(a[..., :count, :] for a in cache.keys), longest - count, 0))
            values.append(_pad_seq(tuple(a[..., :count, :] for a in cache.values), longest - count, 0))
        batch.keys = tuple(mx.concatenate(parts, axis=0) for parts in zip(*keys))
        batch.values = tuple(mx.concatenate(parts, axis=0) for parts in zip(*values))
        batch.offset = mx.array(counts, dtype=mx.int32)
        batch._idx = longest
        return batch

    def dequantized(self) -> tuple[mx.array, mx.array] | tuple[None, None]:
        """Full-precision keys and values of the filled positions (padding dequantizes to zeros)."""
        if self.keys is None or self._idx == 0:
            return None, None
        keys, values = self.keys_and_values()
        return (mx.dequantize(*keys, group_size=self.group_size, bits=self.bits),
                mx.dequantize(*values, group_size=self.group_size, bits=self.bits))

    def clone(self) -> "BatchQuantizedKVCache":
        """The same rows in new array objects (``update_and_fetch`` writes into its arrays in place)."""
        copy = BatchQuantizedKVCache([], group_size=self.group_size, bits=self.bits)
        copy.keys = None if self.keys is None else tuple(a[...] for a in self.keys)
        copy.values = None if self.values is None else tuple(a[...] for a in self.values)
        copy.offset, copy.left_padding, copy._idx = self.offset[...], self.left_padding[...], self._idx
        return copy

    def arrays(self) -> list[mx.array]:
        held = [self.offset, self.left_padding]
        if self.keys is not None:
            held += [*self.keys, *self.values]
        return held

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

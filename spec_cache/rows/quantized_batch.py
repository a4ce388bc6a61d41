"""A left-padded batch of quantized KV rows: mlx-lm's ``BatchKVCache`` mechanics over ``QuantizedKVCache``'s layout.

mlx-lm 0.32 batches only full-precision KV (``BatchKVCache``) and quantizes only one sequence
(``QuantizedKVCache``). :class:`BatchQuantizedKVCache` is both: per layer the keys and values are each a triple
(packed ``uint32`` words, scales, biases; ``[B, heads, T, ...]``, groups along ``head_dim``), rows right-justified
behind left padding, exactly as ``BatchKVCache`` keeps them. Padding runs along the sequence axis, never inside a
quantization group, so a row's words, scales and biases are bit-for-bit those of its single-row cache. Because
the cache has ``bits`` and ``group_size``, ``mlx_lm.models.base.scaled_dot_product_attention`` attends through
``mx.quantized_matmul`` (the path a single-row ``QuantizedKVCache`` takes), and :meth:`make_mask` masks the left
padding (``create_causal_mask(..., left_padding=...)``), so padded keys get ``finfo.min`` scores and zero weight.

:class:`PhaseRows` is a group of rows sharing one forward over such caches: per layer a ``BatchKVCache`` (a layer
kept in full precision) or a ``BatchQuantizedKVCache``; its round mechanics are ``batch_rows.BatchRows``' (as
``target.TargetRows``'). ``spec_cache.rows.quantized_rows`` keeps the rows before their
conversion point in one (all layers full precision) and the converted rows in another.

Per-row rollback is ``BatchKVCache``'s: ``prepare(right_padding=...)`` + ``finalize()`` rolls a row's discarded
tail round to its left padding. :meth:`merge` / :meth:`extract` convert from / to single-row ``QuantizedKVCache``.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

from spec_cache.errors import RestoreRefused
from spec_cache.rows.batch_rows import BatchRows, clone_batch_cache
from spec_cache.rows.kv_quant import LayerQuant
from spec_cache.rows.protocol import PreparedStateChange, check_row, check_window
from spec_cache.rows.target import ForwardOutput, TargetModel
from spec_cache.state.row_caches import merge_rows, row_position

__all__ = ["BatchQuantizedKVCache", "PhaseRows", "single_arrays"]

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
            if not isinstance(cache, QuantizedKVCache):
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


def _float_content(cache: Any, layer: int, row: int) -> tuple[mx.array, mx.array] | None:
    if type(cache) is not KVCache:
        raise RestoreRefused(f"row {row} layer {layer}: a {type(cache).__name__} where full-precision KV belongs")
    if cache.keys is None or cache.offset == 0:
        return None
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class PhaseRows(BatchRows):
    """Rows of one target that share every forward: per layer one left-padded batch cache, a ``BatchKVCache``
    where ``quants[layer]`` is None, else a :class:`BatchQuantizedKVCache` of that layer's bits and group size.

    ``offsets[row]`` is the row's token count. Prefill, per-row rollback, two-phase append, filter and donors are
    ``BatchRows``' (a quantized layer's donor K/V dequantized); membership changes act between rounds.
    """

    def __init__(self, model: TargetModel, quants: Sequence[LayerQuant | None]) -> None:
        if len(quants) != model.num_layers:
            raise ValueError(f"expected {model.num_layers} layer plans, got {len(quants)}")
        super().__init__(model)
        self.quants = tuple(quants)

    @classmethod
    def from_row_caches(cls, model: TargetModel, quants: Sequence[LayerQuant | None],
                        rows: Sequence[Sequence[Any] | None]) -> "PhaseRows":
        """Rows from single-row caches (``KVCache`` per full-precision layer, ``QuantizedKVCache`` per quantized
        one; None: an empty row). The caller's caches are only read."""
        built = cls(model, quants)
        rows = [None if layers is None else list(layers) for layers in rows]
        for row, layers in enumerate(rows):
            if layers is not None and len(layers) != model.num_layers:
                raise RestoreRefused(f"row {row}: expected {model.num_layers} layer caches, got {len(layers)}")
        built._lengths = [0 if layers is None else row_position(layers, row) for row, layers in enumerate(rows)]
        if not rows:
            return built
        caches = []
        for layer, quant in enumerate(built.quants):
            per_row = [None if layers is None else layers[layer] for layers in rows]
            if quant is None:
                contents = [None if cache is None else _float_content(cache, layer, row)
                            for row, cache in enumerate(per_row)]
                caches.append(merge_rows(contents, built._lengths))
            else:
                caches.append(BatchQuantizedKVCache.merge(per_row, group_size=quant.group_size, bits=quant.bits))
        built._caches = caches
        return built

    # -- the caches -------------------------------------------------------------------------------------
    def _ensure_caches(self) -> list:
        if self._caches is None:
            batch = [0] * self.row_count
            self._caches = [BatchKVCache(batch) if quant is None else
                            BatchQuantizedKVCache(batch, group_size=quant.group_size, bits=quant.bits)
                            for quant in self.quants]
        return self._caches

    def _clone(self, cache: Any) -> Any:
        return cache.clone() if isinstance(cache, BatchQuantizedKVCache) else clone_batch_cache(cache)

    def _layer_arrays(self, cache: Any) -> list[mx.array]:
        return cache.arrays() if isinstance(cache, BatchQuantizedKVCache) else super()._layer_arrays(cache)

    def _donor_kv(self, cache: Any) -> tuple[mx.array, mx.array]:
        return cache.dequantized() if isinstance(cache, BatchQuantizedKVCache) else super()._donor_kv(cache)

    # -- rounds -----------------------------------------------------------------------------------------
    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append an equal-length window to every row (one forward); logits/hidden for all its positions."""
        width = check_window(window, self.row_count)
        out = self.model.forward(mx.array([list(w) for w in window], dtype=mx.uint32), self._ensure_caches(),
                                 tap_layers=tap_layers)
        self._lengths = [n + width for n in self._lengths]
        return out

    # -- rows in and out --------------------------------------------------------------------------------
    def extract(self, row: int) -> list:
        """Owned single-row caches holding exactly the row's tokens (``KVCache`` / ``QuantizedKVCache``)."""
        check_row(row, self.row_count)
        if self._lengths[row] == 0 or self._caches is None:
            return [KVCache() if quant is None else QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
                    for quant in self.quants]
        out = [cache.extract(row) for cache in self._caches]
        mx.eval([part for cache in out for part in single_arrays(cache)])
        return out

    def prepare_append(self, other: "PhaseRows") -> PreparedStateChange:
        """This group's state with ``other``'s rows appended (``other`` is only read: its caches are copied)."""
        if other.model is not self.model or other.quants != self.quants:
            raise ValueError("cannot append rows of another model or another KV layout")
        return super().prepare_append(other)


def single_arrays(cache: Any) -> list[mx.array]:
    """The arrays of a single-row ``KVCache`` / ``QuantizedKVCache`` (what ``mx.eval`` materializes)."""
    if cache.keys is None:
        return []
    if isinstance(cache, QuantizedKVCache):
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]

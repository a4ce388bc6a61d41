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
kept in full precision) or a ``BatchQuantizedKVCache``. ``spec_cache.quantized_rows`` keeps the rows before their
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
from spec_cache.kv_quant import LayerQuant
from spec_cache.row_caches import merge_rows, row_position
from spec_cache.rows import PrefillContext, PreparedStateChange, check_keep, check_per_row, check_row
from spec_cache.target import DonorView, ForwardOutput, TargetModel, clone_batch_cache

__all__ = ["BatchQuantizedKVCache", "PhaseRows"]

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


def _batch_arrays(cache: Any) -> list[mx.array]:
    if isinstance(cache, BatchQuantizedKVCache):
        return cache.arrays()
    held = [cache.offset, cache.left_padding]
    if cache.keys is not None:
        held += [cache.keys, cache.values]
    return held


def _float_content(cache: Any, layer: int, row: int) -> tuple[mx.array, mx.array] | None:
    if type(cache) is not KVCache:
        raise RestoreRefused(f"row {row} layer {layer}: a {type(cache).__name__} where full-precision KV belongs")
    if cache.keys is None or cache.offset == 0:
        return None
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class PhaseRows:
    """Rows of one target that share every forward: per layer one left-padded batch cache, a ``BatchKVCache``
    where ``quants[layer]`` is None, else a :class:`BatchQuantizedKVCache` of that layer's bits and group size.

    ``offsets[row]`` is the row's token count. Same round operations as ``target.TargetRows`` (prefill, verify,
    per-row rollback, extract, two-phase append, filter, donors); membership changes act between rounds.
    """

    def __init__(self, model: TargetModel, quants: Sequence[LayerQuant | None]) -> None:
        if len(quants) != model.num_layers:
            raise ValueError(f"expected {model.num_layers} layer plans, got {len(quants)}")
        self.model = model
        self.quants = tuple(quants)
        self._caches: list | None = None
        self._lengths: list[int] = []

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

    # -- state ------------------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(self._lengths)

    def materialize(self) -> None:
        if self._caches:
            mx.eval([a for cache in self._caches for a in _batch_arrays(cache)])

    def dispose(self) -> None:
        self._caches = None
        self._lengths = []

    def _ensure_caches(self) -> list:
        if self._caches is None:
            batch = [0] * self.row_count
            self._caches = [BatchKVCache(batch) if quant is None else
                            BatchQuantizedKVCache(batch, group_size=quant.group_size, bits=quant.bits)
                            for quant in self.quants]
        return self._caches

    # -- rounds -----------------------------------------------------------------------------------------
    def prefill(self, tokens_per_row: Sequence[Sequence[int]], step: int = 512, *,
                tap_layers: Sequence[int] = ()) -> PrefillContext:
        """Append each row's tokens (any lengths, zero included), one forward per chunk of ``step``; the
        final hidden at each row's last token and the taps at every appended position (``TargetRows.prefill``)."""
        check_per_row(tokens_per_row, self.row_count, "token list")
        lengths = [len(tokens) for tokens in tokens_per_row]
        longest = max(lengths, default=0)
        if longest == 0:
            return PrefillContext(None, lengths)
        caches = self._ensure_caches()
        ids = mx.array([list(t) + [0] * (longest - len(t)) for t in tokens_per_row], dtype=mx.uint32)
        for cache in caches:
            cache.prepare(right_padding=[longest - n for n in lengths])
        last_index = mx.array([max(n - 1, 0) for n in lengths])
        has_tokens = mx.array([n > 0 for n in lengths])[:, None, None]
        last_hidden = mx.zeros((len(lengths), 1, self.model.hidden_size), dtype=self.model.dtype)
        taps: dict[int, list[mx.array]] = {layer: [] for layer in tap_layers}
        for start in range(0, longest, step):
            chunk = ids[:, start : start + step]
            out = self.model.forward(chunk, caches, tap_layers=tap_layers, with_logits=False)
            local = mx.clip(last_index - start, 0, chunk.shape[1] - 1)
            here = has_tokens & ((last_index >= start) & (last_index < start + chunk.shape[1]))[:, None, None]
            last_hidden = mx.where(here, mx.take_along_axis(out.hidden, local[:, None, None], axis=1), last_hidden)
            for layer in taps:
                taps[layer].append(out.taps[layer])
            mx.eval([a for cache in caches for a in _batch_arrays(cache)] + [last_hidden]
                    + [parts[-1] for parts in taps.values()])
        for cache in caches:
            cache.finalize()
        self._lengths = [a + b for a, b in zip(self._lengths, lengths)]
        self.materialize()
        return PrefillContext(last_hidden, lengths, {layer: mx.concatenate(p, axis=1) for layer, p in taps.items()})

    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append an equal-length window to every row (one forward); logits/hidden for all its positions."""
        check_per_row(window, self.row_count, "token list")
        widths = sorted({len(tokens) for tokens in window})
        if len(widths) != 1 or widths[0] == 0:
            raise ValueError(f"verify windows must be non-empty and of equal length, got lengths {widths}")
        out = self.model.forward(mx.array([list(w) for w in window], dtype=mx.uint32), self._ensure_caches(),
                                 tap_layers=tap_layers)
        self._lengths = [n + widths[0] for n in self._lengths]
        return out

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[row]`` tokens of each row (they become left padding)."""
        rejected = [int(r) for r in rejected]
        check_per_row(rejected, self.row_count, "rollback count")
        for row, (count, held) in enumerate(zip(rejected, self._lengths)):
            if not 0 <= count <= held:
                raise ValueError(f"row {row}: cannot roll back {count} of its {held} tokens")
        if not any(rejected):
            return
        for cache in self._caches or ():
            cache.prepare(right_padding=rejected)
            cache.finalize()
        self._lengths = [n - r for n, r in zip(self._lengths, rejected)]

    # -- rows in and out --------------------------------------------------------------------------------
    def extract(self, row: int) -> list:
        """Owned single-row caches holding exactly the row's tokens (``KVCache`` / ``QuantizedKVCache``)."""
        check_row(row, self.row_count)
        if self._lengths[row] == 0 or self._caches is None:
            return [KVCache() if quant is None else QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
                    for quant in self.quants]
        out = [cache.extract(row) for cache in self._caches]
        mx.eval([part for cache in out for part in _single_arrays(cache)])
        return out

    def prepare_append(self, other: "PhaseRows") -> PreparedStateChange:
        """This group's state with ``other``'s rows appended (``other`` is only read: its caches are copied)."""
        if other.model is not self.model or other.quants != self.quants:
            raise ValueError("cannot append rows of another model or another KV layout")
        if other.row_count == 0:
            return PreparedStateChange(lambda: None, lambda: None)
        theirs = [_clone(cache) for cache in other._ensure_caches()]
        if self.row_count == 0 or self._caches is None:
            caches = theirs
        else:
            caches = [_clone(cache) for cache in self._caches]
            for mine, joining in zip(caches, theirs):
                mine.extend(joining)
        lengths = self._lengths + other._lengths

        def put(state: tuple) -> None:
            self._caches, self._lengths = state

        return PreparedStateChange.swap(lambda: (self._caches, self._lengths), put, (caches, lengths))

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep``, in that order; ``[]`` releases everything."""
        keep = check_keep(keep, self.row_count)
        if not keep:
            self.dispose()
            return
        if self._caches is not None:
            indices = mx.array(keep, dtype=mx.int32)
            for cache in self._caches:
                cache.filter(indices)
        self._lengths = [self._lengths[row] for row in keep]

    # -- ports for drafters -----------------------------------------------------------------------------
    def donors(self, layer: int) -> DonorView:
        """K/V of ``layer`` for every row (a quantized layer dequantized), with the keys each row may see."""
        positions = mx.array(self._lengths, dtype=mx.int32)
        cache = None if self._caches is None else self._caches[layer]
        if cache is None or cache.keys is None or cache._idx == 0:
            return DonorView(None, None, None, positions)
        if isinstance(cache, BatchQuantizedKVCache):
            keys, values = cache.dequantized()
        else:
            keys, values = cache.keys_and_values()
        valid = mx.arange(cache._idx)[None, :] >= cache.left_padding[:, None]
        return DonorView(keys, values, valid[:, None, None, :], positions)


def _clone(cache: Any) -> Any:
    return cache.clone() if isinstance(cache, BatchQuantizedKVCache) else clone_batch_cache(cache)


def _single_arrays(cache: Any) -> list[mx.array]:
    if cache.keys is None:
        return []
    if isinstance(cache, QuantizedKVCache):
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]

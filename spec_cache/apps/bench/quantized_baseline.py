"""The per-row quantized target rows: one forward per row through mlx-lm's single-row caches.

Why it lives in the bench: it is the implementation ``spec_cache.rows.quantized_rows.QuantizedTargetRows`` replaced
(rows batched by phase) and is kept only as the reference the batched rows must equal token for token
(``tests/library/test_quantized_batch.py``, ``test_quantized_kv.py``) and as the baseline of
``spec-cache bench --only quantized`` and ``tools/bench_real.py``'s ``kv`` section; the runtime never uses it.
:func:`per_row_engine` is the engine those benchmarks run it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from spec_cache.errors import RestoreRefused
from spec_cache.rows.kv_quant import KVPlan
from spec_cache.rows.protocol import (
    PrefillContext,
    PreparedStateChange,
    check_keep,
    check_per_row,
    check_row,
    check_window,
)
from spec_cache.rows.quantized_batch import single_arrays
from spec_cache.rows.quantized_rows import check_restored
from spec_cache.rows.target import DonorView, ForwardOutput, TargetModel

__all__ = ["PerRowQuantizedTargetRows", "copy_cache", "per_row_engine"]


def copy_cache(cache: Any) -> Any:
    """An owned copy of a single-row ``KVCache`` / ``QuantizedKVCache`` (new array objects, sliced to the
    offset), keeping ``converted_at``."""
    n = int(cache.offset)
    if isinstance(cache, QuantizedKVCache):
        copy = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        if cache.keys is not None and n:
            copy.keys = tuple(a[..., :n, :] for a in cache.keys)
            copy.values = tuple(a[..., :n, :] for a in cache.values)
        copy.offset = n
        copy.converted_at = getattr(cache, "converted_at", None)
        return copy
    if type(cache) is not KVCache:
        raise RestoreRefused(f"{type(cache).__name__} layers cannot join quantized rows")
    copy = KVCache()
    if cache.keys is not None and n:
        copy.keys = cache.keys[..., :n, :]
        copy.values = cache.values[..., :n, :]
        copy.offset = n
    return copy


@dataclass
class _Row:
    caches: list
    length: int
    conversion: int
    converted: bool


class PerRowQuantizedTargetRows:
    """Rows of one target under a :class:`KVPlan`, each with its own single-row caches and conversion point,
    one forward per row (the reference :class:`QuantizedTargetRows` must equal)."""

    def __init__(self, model: TargetModel, plan: KVPlan) -> None:
        self.model = model
        self.plan = plan
        self._rows: list[_Row] = []

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_row_caches(
        cls, model: TargetModel, plan: KVPlan, rows: Sequence[Sequence[Any] | None], conversions: Sequence[int]
    ) -> "PerRowQuantizedTargetRows":
        """Rows from single-row caches (None: an empty row) and each row's conversion point. The caller's caches
        are only read. Raises ValueError for caches that do not fit the plan or that a cold run converting at
        the row's point would not hold."""
        check_per_row(conversions, len(rows), "conversion point")
        built = cls(model, plan)
        for row, (layers, point) in enumerate(zip(rows, conversions)):
            if layers is None:
                built._rows.append(_Row(model.make_caches(), 0, int(point), False))
                continue
            layers, length, conversion = check_restored(layers, plan, int(point), row)
            copies = [copy_cache(cache) for cache in layers]
            built._rows.append(_Row(copies, length, int(point), conversion is not None))
        built._convert_due()
        return built

    # -- state ------------------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._rows)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(row.length for row in self._rows)

    @property
    def conversions(self) -> tuple[int, ...]:
        return tuple(row.conversion for row in self._rows)

    def window_limits(self) -> list[int | None]:
        """A row that has not converted takes at most ``conversion - length`` tokens per verify window."""
        return [None if row.converted else row.conversion - row.length for row in self._rows]

    def materialize(self) -> None:
        mx.eval([a for row in self._rows for cache in row.caches for a in single_arrays(cache)])

    def dispose(self) -> None:
        self._rows = []

    # -- rounds -----------------------------------------------------------------------------------------
    def _forward(self, row: _Row, tokens: Sequence[int], tap_layers: Sequence[int], with_logits: bool):
        out = self.model.forward(mx.array([list(tokens)], dtype=mx.uint32), row.caches, tap_layers=tap_layers,
                                 with_logits=with_logits)
        row.length += len(tokens)
        return out

    def _convert_due(self) -> None:
        for row in self._rows:
            if not row.converted and row.length >= row.conversion:
                if row.length != row.conversion:
                    raise RuntimeError(f"a row passed its conversion point {row.conversion} unconverted")
                row.caches = self.plan.convert(row.caches, row.conversion)
                row.converted = True

    def prefill(
        self, tokens_per_row: Sequence[Sequence[int]], step: int = 512, *, tap_layers: Sequence[int] = (),
        need_hidden: bool = True,
    ) -> PrefillContext:
        """Append each row's tokens in chunks of ``step``, split at the row's conversion point (``need_hidden``
        is accepted and ignored: the hidden is always returned)."""
        check_per_row(tokens_per_row, self.row_count, "token list")
        lengths = [len(tokens) for tokens in tokens_per_row]
        longest = max(lengths, default=0)
        if longest == 0:
            return PrefillContext(None, lengths)
        hidden_size, dtype = self.model.hidden_size, self.model.dtype
        last, taps = [], {layer: [] for layer in tap_layers}
        for row, tokens in zip(self._rows, tokens_per_row):
            tokens = list(tokens)
            row_last = mx.zeros((1, 1, hidden_size), dtype=dtype)
            row_taps: dict[int, list] = {layer: [] for layer in tap_layers}
            while tokens:
                room = len(tokens) if row.converted else row.conversion - row.length
                chunk, tokens = tokens[: min(step, room)], tokens[min(step, room) :]
                out = self._forward(row, chunk, tap_layers, with_logits=False)
                row_last = out.hidden[:, -1:, :]
                for layer in tap_layers:
                    row_taps[layer].append(out.taps[layer])
                self._convert_due()
                mx.eval([row_last] + [a for cache in row.caches for a in single_arrays(cache)])
            last.append(row_last)
            for layer in tap_layers:
                parts = row_taps[layer]
                held = sum(p.shape[1] for p in parts)
                if held < longest:
                    parts = parts + [mx.zeros((1, longest - held, hidden_size), dtype=dtype)]
                taps[layer].append(mx.concatenate(parts, axis=1))
        joined = {layer: mx.concatenate(parts, axis=0) for layer, parts in taps.items()}
        return PrefillContext(mx.concatenate(last, axis=0), lengths, joined)

    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append an equal-length window to every row (one forward per row); logits/hidden for all positions.

        A row whose window runs past its conversion point must roll those tokens back before it converts
        (:meth:`rollback` converts); the engine keeps kept tokens within :meth:`window_limits`.
        """
        check_window(window, self.row_count)
        outs = [self._forward(row, tokens, tap_layers, with_logits=True) for row, tokens in zip(self._rows, window)]
        return ForwardOutput(
            mx.concatenate([o.logits for o in outs], axis=0),
            mx.concatenate([o.hidden for o in outs], axis=0),
            {layer: mx.concatenate([o.taps[layer] for o in outs], axis=0) for layer in tap_layers},
        )

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[row]`` tokens of each row (the caches' own ``trim``), then convert the rows
        whose kept tokens reached their conversion point."""
        rejected = [int(r) for r in rejected]
        check_per_row(rejected, self.row_count, "rollback count")
        for index, (count, row) in enumerate(zip(rejected, self._rows)):
            if not 0 <= count <= row.length:
                raise ValueError(f"row {index}: cannot roll back {count} of its {row.length} tokens")
            if row.converted and row.length - count < row.conversion:
                raise ValueError(f"row {index}: cannot roll back below its conversion point {row.conversion}")
        for count, row in zip(rejected, self._rows):
            if count:
                for cache in row.caches:
                    cache.trim(count)
                row.length -= count
        self._convert_due()

    # -- rows in and out --------------------------------------------------------------------------------
    def extract(self, row: int, **_: Any) -> list:
        """Owned single-row caches of the row (``QuantizedKVCache`` layers record ``converted_at``)."""
        check_row(row, self.row_count)
        copies = [copy_cache(cache) for cache in self._rows[row].caches]
        mx.eval([a for cache in copies for a in single_arrays(cache)])
        return copies

    def prepare_append(self, other: "PerRowQuantizedTargetRows") -> PreparedStateChange:
        """This group's rows with ``other``'s appended (``other`` is only read: its caches are copied)."""
        if other.model is not self.model:
            raise ValueError("cannot append rows of a different model")
        if not isinstance(other, PerRowQuantizedTargetRows) or other.plan != self.plan:
            raise ValueError("cannot append rows of another KV plan")
        joining = [_Row([copy_cache(c) for c in row.caches], row.length, row.conversion, row.converted)
                   for row in other._rows]
        rows = self._rows + joining

        def put(value: list) -> None:
            self._rows = value

        return PreparedStateChange.swap(lambda: self._rows, put, rows)

    def filter_rows(self, keep: Sequence[int]) -> None:
        keep = check_keep(keep, self.row_count)
        self._rows = [self._rows[row] for row in keep]

    # -- ports for drafters -----------------------------------------------------------------------------
    def donors(self, layer: int) -> DonorView:
        """K/V of ``layer`` for every row (quantized layers dequantized), right-aligned, with a validity mask."""
        positions = mx.array([row.length for row in self._rows], dtype=mx.int32)
        longest = max((row.length for row in self._rows), default=0)
        if longest == 0:
            return DonorView(None, None, None, positions)
        heads, head_dim = self.model.kv_geometry(layer)
        keys, values = [], []
        for row in self._rows:
            k, v = _full_precision(row.caches[layer])
            if k is None:
                k = mx.zeros((1, heads, 0, head_dim), dtype=self.model.dtype)
                v = mx.zeros((1, heads, 0, head_dim), dtype=self.model.dtype)
            pad = [(0, 0), (0, 0), (longest - row.length, 0), (0, 0)]
            keys.append(mx.pad(k, pad))
            values.append(mx.pad(v, pad))
        index = mx.arange(longest)[None, :]
        valid = index >= (longest - positions)[:, None]
        return DonorView(mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0), valid[:, None, None, :],
                         positions)


def _full_precision(cache: Any) -> tuple[mx.array | None, mx.array | None]:
    n = int(cache.offset)
    if cache.keys is None or n == 0:
        return None, None
    if isinstance(cache, QuantizedKVCache):
        def dequantize(parts):
            return mx.dequantize(*(a[..., :n, :] for a in parts), group_size=cache.group_size, bits=cache.bits)

        return dequantize(cache.keys), dequantize(cache.values)
    return cache.keys[..., :n, :], cache.values[..., :n, :]


def per_row_engine() -> type:
    """``SpeculativeEngine`` with quantized rows run one forward per row (the benchmarks' baseline)."""
    from spec_cache.decode.engine import SpeculativeEngine

    class PerRowEngine(SpeculativeEngine):
        def _rows(self, restored, conversions):
            if self.plan is None:
                return super()._rows(restored, conversions)
            return PerRowQuantizedTargetRows.from_row_caches(self.target, self.plan, restored, conversions)

    return PerRowEngine

"""Target rows under KV quantization, batched: rows share one forward per phase (before / after conversion).

mlx-lm converts a row's KV once, at its conversion point (``spec_cache.rows.kv_quant``): every token before it is
computed against full-precision K/V, every token from it on against affine-quantized K/V, and a layer's attention
takes one path for the whole batch (``scaled_dot_product_attention`` looks at the cache). Rows convert at
different offsets, so :class:`QuantizedTargetRows` keeps two groups of left-padded rows
(``spec_cache.rows.quantized_batch.PhaseRows``): the rows still before their point (all layers ``BatchKVCache``) and the
converted rows (per planned layer a ``BatchQuantizedKVCache``, unplanned layers ``BatchKVCache``). A round runs
one forward per non-empty group (at most two, whatever the row count) and returns the outputs in row order. A row
converts once its kept tokens reach the point: it is extracted from the first group, converted with mlx-lm's own
``KVCache.to_quantized`` (``KVPlan.convert``) and appended to the second, in row order.

The conversion point is exact as before: a prefill runs each row's tokens up to its point in the first group, then
the rest in the second, and :meth:`~QuantizedTargetRows.window_limits` stops a row's kept verify window there.
The batched forward gives bit-identical logits to one forward per row (tested against
``spec_cache.apps.bench.quantized_baseline.PerRowQuantizedTargetRows``, the previous one-forward-per-row
implementation through mlx-lm's single-row ``KVCache`` / ``QuantizedKVCache``, kept in the bench as reference and
baseline, and against ``generate_step``):
padding runs along the sequence axis, never inside a quantization group, and padded keys are masked out. That is
established on MLX's CPU kernels (the tests' float32 models). On MLX's CUDA backend (0.32.4, H200) quantized KV does
not run at all with float32 activations, one row or four: ``quantized_matmul`` has "no implementation for problem
shape 1x16x64x8, transpose: true, activation: float32, bits: 4, group size: 64" inside mlx-lm's quantized attention.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from spec_cache.errors import RestoreRefused
from spec_cache.rows.kv_quant import KVPlan, converted_at, reusable
from spec_cache.rows.protocol import (
    PrefillContext,
    PreparedStateChange,
    check_keep,
    check_per_row,
    check_row,
    check_window,
)
from spec_cache.rows.quantized_batch import PhaseRows
from spec_cache.rows.target import DonorView, ForwardOutput, TargetModel, row_position
from spec_cache.state.cache_kinds import kind_of

__all__ = ["QuantizedTargetRows", "check_restored"]


def check_restored(layers: Sequence[Any], plan: KVPlan, point: int, row: int) -> tuple[list, int, int | None]:
    """Restored single-row ``layers`` (one cache per layer of ``plan``) as a list, the tokens they hold and where
    they were converted (None: full precision), after checking they fit ``plan`` and are what a cold run
    converting at ``point`` holds (else RestoreRefused)."""
    layers = list(layers)
    if len(layers) != len(plan.layers):
        raise RestoreRefused(f"row {row}: expected {len(plan.layers)} layer caches, got {len(layers)}")
    length = row_position(layers, row)
    quantized = [kind_of(cache).quantized for cache in layers]
    if any(quantized):
        for layer, (cache, quant) in enumerate(zip(layers, plan.layers)):
            where = f"row {row} layer {layer}"
            if quant is None:
                if quantized[layer]:
                    raise RestoreRefused(f"{where}: quantized, but the plan keeps this layer in full precision")
            elif not quantized[layer]:
                raise RestoreRefused(f"{where}: full precision beside converted layers; the plan quantizes it")
            elif (cache.bits, cache.group_size) != (quant.bits, quant.group_size):
                raise RestoreRefused(f"{where}: {cache.bits}-bit / group {cache.group_size} KV, the plan wants "
                                     f"{quant.bits}-bit / group {quant.group_size}")
    conversion = converted_at(layers)
    if not reusable(length, conversion, point):
        held = "full precision" if conversion is None else f"converted at {conversion}"
        raise RestoreRefused(f"row {row}: restored KV of {length} tokens ({held}) is not what a cold run "
                             f"converting at {point} holds")
    return layers, length, conversion


class QuantizedTargetRows:
    """Rows of one target under a :class:`KVPlan`, batched by phase (see module doc): the rows before their
    conversion point share one forward, the converted rows another."""

    def __init__(self, model: TargetModel, plan: KVPlan) -> None:
        self.model = model
        self.plan = plan
        self._before = PhaseRows(model, (None,) * model.num_layers)
        self._after = PhaseRows(model, plan.layers)
        self._points: list[int] = []
        self._converted: list[bool] = []

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_row_caches(
        cls, model: TargetModel, plan: KVPlan, rows: Sequence[Sequence[Any] | None], conversions: Sequence[int]
    ) -> "QuantizedTargetRows":
        """Rows from single-row caches (None: an empty row) and each row's conversion point. The caller's caches
        are only read. Raises ValueError for caches that do not fit the plan or that a cold run converting at
        the row's point would not hold."""
        check_per_row(conversions, len(rows), "conversion point")
        built = cls(model, plan)
        before, after = [], []
        for row, (layers, point) in enumerate(zip(rows, conversions)):
            converted = False
            if layers is not None:
                layers, _, conversion = check_restored(layers, plan, int(point), row)
                converted = conversion is not None
            (after if converted else before).append(layers)
            built._points.append(int(point))
            built._converted.append(converted)
        built._before = PhaseRows.from_row_caches(model, built._before.quants, before)
        built._after = PhaseRows.from_row_caches(model, plan.layers, after)
        built._convert_due()
        return built

    # -- state ------------------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._points)

    @property
    def offsets(self) -> tuple[int, ...]:
        held = {False: iter(self._before.offsets), True: iter(self._after.offsets)}
        return tuple(next(held[converted]) for converted in self._converted)

    @property
    def conversions(self) -> tuple[int, ...]:
        return tuple(self._points)

    def window_limits(self) -> list[int | None]:
        """A row that has not converted takes at most ``conversion - length`` tokens per verify window."""
        return [None if converted else point - length
                for converted, point, length in zip(self._converted, self._points, self.offsets)]

    def materialize(self) -> None:
        self._before.materialize()
        self._after.materialize()

    def dispose(self) -> None:
        self._before.dispose()
        self._after.dispose()
        self._points, self._converted = [], []

    # -- row bookkeeping --------------------------------------------------------------------------------
    def _index(self, row: int) -> int:
        """The row's index inside its phase group (each group holds its rows in row order)."""
        phase = self._converted[row]
        return sum(1 for other in self._converted[:row] if other == phase)

    def _split(self, per_row: Sequence[Any]) -> tuple[list, list]:
        return ([x for x, done in zip(per_row, self._converted) if not done],
                [x for x, done in zip(per_row, self._converted) if done])

    def _join(self, before: mx.array | None, after: mx.array | None) -> mx.array:
        """Per-group outputs (rows along axis 0) back in row order."""
        if before is None or after is None:
            return after if before is None else before
        order, counts = [], {False: 0, True: len(before)}
        for done in self._converted:
            order.append(counts[done])
            counts[done] += 1
        return mx.take(mx.concatenate([before, after], axis=0), mx.array(order, dtype=mx.int32), axis=0)

    def _convert_due(self) -> None:
        """Move the rows whose kept tokens reached their conversion point to the converted group."""
        lengths = self.offsets
        due = [row for row, done in enumerate(self._converted) if not done and lengths[row] >= self._points[row]]
        if not due:
            return
        for row in due:
            if lengths[row] != self._points[row]:
                raise RuntimeError(f"row {row} passed its conversion point {self._points[row]} unconverted")
        moving = [self.plan.convert(self._before.extract(self._index(row)), self._points[row]) for row in due]
        change = self._after.prepare_append(PhaseRows.from_row_caches(self.model, self.plan.layers, moving))
        change.commit()
        change.dispose()
        staying = [self._index(row) for row, done in enumerate(self._converted) if not done and row not in due]
        self._before.filter_rows(staying)
        held = [row for row, done in enumerate(self._converted) if done] + due  # the converted group's order now
        for row in due:
            self._converted[row] = True
        if held != sorted(held):
            self._after.filter_rows([held.index(row) for row in sorted(held)])

    # -- rounds -----------------------------------------------------------------------------------------
    def prefill(
        self, tokens_per_row: Sequence[Sequence[int]], step: int = 512, *, tap_layers: Sequence[int] = (),
        need_hidden: bool = True,
    ) -> PrefillContext:
        """Append each row's tokens: up to its conversion point with the rows before theirs, the rest with the
        converted rows (each group chunked by ``step``). ``need_hidden`` is accepted and ignored (the hidden is
        always returned here)."""
        check_per_row(tokens_per_row, self.row_count, "token list")
        tokens_per_row = [list(tokens) for tokens in tokens_per_row]
        lengths = [len(tokens) for tokens in tokens_per_row]
        if max(lengths, default=0) == 0:
            return PrefillContext(None, lengths)
        held = self.offsets
        first = [0 if done else min(n, point - length)
                 for n, done, point, length in zip(lengths, self._converted, self._points, held)]
        phase_index = [self._index(row) for row in range(self.row_count)]
        early = self._before.prefill(self._split([t[:n] for t, n in zip(tokens_per_row, first)])[0], step,
                                     tap_layers=tap_layers) if any(first) else None
        self._convert_due()
        late = self._after.prefill(self._split([t[n:] for t, n in zip(tokens_per_row, first)])[1], step,
                                   tap_layers=tap_layers) if any(a < b for a, b in zip(first, lengths)) else None
        late_index = [self._index(row) for row in range(self.row_count)]
        zeros = mx.zeros((1, 1, self.model.hidden_size), dtype=self.model.dtype)
        last, taps = [], {layer: [] for layer in tap_layers}
        longest = max(lengths)
        for row, (total, n) in enumerate(zip(lengths, first)):
            if total > n:
                last.append(late.last_hidden[late_index[row] : late_index[row] + 1])
            elif n:
                last.append(early.last_hidden[phase_index[row] : phase_index[row] + 1])
            else:
                last.append(zeros)
            for layer in tap_layers:
                parts = []
                if n:
                    parts.append(early.taps[layer][phase_index[row] : phase_index[row] + 1, :n])
                if total > n:
                    parts.append(late.taps[layer][late_index[row] : late_index[row] + 1, : total - n])
                if total < longest:
                    parts.append(mx.zeros((1, longest - total, self.model.hidden_size), dtype=self.model.dtype))
                taps[layer].append(mx.concatenate(parts, axis=1))
        joined = {layer: mx.concatenate(parts, axis=0) for layer, parts in taps.items()}
        return PrefillContext(mx.concatenate(last, axis=0), lengths, joined)

    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append an equal-length window to every row (one forward per phase group); outputs in row order.

        A row whose window runs past its conversion point must roll those tokens back before it converts
        (:meth:`rollback` converts); the engine keeps kept tokens within :meth:`window_limits`.
        """
        check_window(window, self.row_count)
        outs = [group.verify(rows, tap_layers=tap_layers) if rows else None
                for group, rows in zip((self._before, self._after), self._split(window))]
        early, late = outs

        def joined(pick) -> mx.array:
            return self._join(None if early is None else pick(early), None if late is None else pick(late))

        return ForwardOutput(joined(lambda o: o.logits), joined(lambda o: o.hidden),
                             {layer: joined(lambda o, layer=layer: o.taps[layer]) for layer in tap_layers})

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[row]`` tokens of each row, then convert the rows whose kept tokens reached
        their conversion point."""
        rejected = [int(r) for r in rejected]
        check_per_row(rejected, self.row_count, "rollback count")
        for row, (count, length) in enumerate(zip(rejected, self.offsets)):
            if not 0 <= count <= length:
                raise ValueError(f"row {row}: cannot roll back {count} of its {length} tokens")
            if self._converted[row] and length - count < self._points[row]:
                raise ValueError(f"row {row}: cannot roll back below its conversion point {self._points[row]}")
        for group, counts in zip((self._before, self._after), self._split(rejected)):
            if counts:
                group.rollback(counts)
        self._convert_due()

    # -- rows in and out --------------------------------------------------------------------------------
    def extract(self, row: int, **_: Any) -> list:
        """Owned single-row caches of the row (``QuantizedKVCache`` layers record ``converted_at``)."""
        check_row(row, self.row_count)
        if not self._converted[row]:
            return self._before.extract(self._index(row))
        caches = self._after.extract(self._index(row))
        for cache in caches:
            if kind_of(cache).quantized:
                cache.converted_at = self._points[row]
        return caches

    def prepare_append(self, other: "QuantizedTargetRows") -> PreparedStateChange:
        """This group's rows with ``other``'s appended (``other`` is only read: its caches are copied)."""
        if other.model is not self.model:
            raise ValueError("cannot append rows of a different model")
        if not isinstance(other, QuantizedTargetRows) or other.plan != self.plan:
            raise ValueError("cannot append rows of another KV plan")
        changes = [self._before.prepare_append(other._before), self._after.prepare_append(other._after)]
        rows = (self._points + other._points, self._converted + other._converted)

        def put(value: tuple) -> None:
            self._points, self._converted = value

        changes.append(PreparedStateChange.swap(lambda: (self._points, self._converted), put, rows))

        def commit() -> None:
            for change in changes:
                change.commit()

        def dispose() -> None:
            for change in changes:
                change.dispose()

        return PreparedStateChange(commit, dispose)

    def filter_rows(self, keep: Sequence[int]) -> None:
        keep = check_keep(keep, self.row_count)
        for group, done in ((self._before, False), (self._after, True)):
            group.filter_rows([self._index(row) for row in keep if self._converted[row] == done])
        self._points = [self._points[row] for row in keep]
        self._converted = [self._converted[row] for row in keep]

    # -- ports for drafters -----------------------------------------------------------------------------
    def donors(self, layer: int) -> DonorView:
        """K/V of ``layer`` for every row (quantized layers dequantized), right-aligned, with a validity mask."""
        positions = mx.array(self.offsets, dtype=mx.int32)
        views = [group.donors(layer) if group.row_count else None for group in (self._before, self._after)]
        longest = max((view.keys.shape[2] for view in views if view is not None and view.keys is not None),
                      default=0)
        if longest == 0:
            return DonorView(None, None, None, positions)
        heads, head_dim = self.model.kv_geometry(layer)
        parts: list[tuple | None] = []
        for view in views:
            if view is None:
                parts.append(None)
                continue
            rows = int(view.positions.shape[0])
            if view.keys is None:
                empty = mx.zeros((rows, heads, longest, head_dim), dtype=self.model.dtype)
                parts.append((empty, empty, mx.zeros((rows, 1, 1, longest), dtype=mx.bool_)))
                continue
            pad = longest - view.keys.shape[2]
            spread = [(0, 0), (0, 0), (pad, 0), (0, 0)]
            parts.append((mx.pad(view.keys, spread), mx.pad(view.values, spread),
                          mx.pad(view.valid, [(0, 0), (0, 0), (0, 0), (pad, 0)], constant_values=False)))
        early, late = parts
        keys, values, valid = (self._join(None if early is None else early[i], None if late is None else late[i])
                               for i in range(3))
        return DonorView(keys, values, valid, positions)

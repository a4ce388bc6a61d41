"""One phase of quantized KV rows: :class:`PhaseRows`, a group of rows sharing one forward over
``BatchQuantizedKVCache`` layers (mlx-lm's ``BatchKVCache`` mechanics over ``QuantizedKVCache``'s layout).

:class:`PhaseRows` holds per layer a ``BatchKVCache`` (a layer kept in full precision) or a
``BatchQuantizedKVCache``; its round mechanics, and moving rows in and out, are ``batch_rows.BatchRows``' (as
``target.TargetRows``'), each layer's batch cache its kind's in the table of cache kinds (``kv`` / ``qkv``).
``spec_cache.rows.quantized_rows`` keeps the rows before their conversion point in one (all layers full precision)
and the converted rows in another.

``BatchQuantizedKVCache`` itself (the batch cache, its rollback, merge and extract) lives in
``spec_cache.state.batch_caches``, one floor down, where the table reaches it; it is re-exported here.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from spec_cache.rows.batch_rows import BatchRows
from spec_cache.rows.kv_quant import LayerQuant
from spec_cache.rows.protocol import PreparedStateChange, check_window
from spec_cache.rows.target import ForwardOutput, TargetModel
from spec_cache.state.batch_caches import BatchQuantizedKVCache
from spec_cache.state.cache_kinds import kind_of

__all__ = ["BatchQuantizedKVCache", "PhaseRows", "single_arrays"]


class PhaseRows(BatchRows):
    """Rows of one target that share every forward: per layer one left-padded batch cache, a ``BatchKVCache``
    where ``quants[layer]`` is None, else a :class:`BatchQuantizedKVCache` of that layer's bits and group size.

    ``offsets[row]`` is the row's token count. Prefill, per-row rollback, two-phase append, filter and donors are
    ``BatchRows``' (a quantized layer's donor K/V dequantized); membership changes act between rounds.
    """

    def __init__(self, model: TargetModel, quants: Sequence[LayerQuant | None]) -> None:
        if len(quants) != model.num_layers:
            raise ValueError(f"expected {model.num_layers} layer plans, got {len(quants)}")
        # a quantized layer holds a QuantizedKVCache of its plan (the table's qkv kind batches it)
        templates = [template if quant is None else QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
                     for template, quant in zip(model.cache_templates, quants)]
        super().__init__(model, templates)
        self.quants = tuple(quants)

    @classmethod
    def from_row_caches(cls, model: TargetModel, quants: Sequence[LayerQuant | None],
                        rows: Sequence[Sequence[Any] | None]) -> "PhaseRows":
        """Rows from single-row caches (``KVCache`` per full-precision layer, ``QuantizedKVCache`` per quantized
        one; None: an empty row). The caller's caches are only read."""
        built = cls(model, quants)
        built.merge_rows(rows)
        return built

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
        out = self.split_row(row, ring=False)
        mx.eval([part for cache in out for part in single_arrays(cache)])
        return out

    def prepare_append(self, other: "PhaseRows") -> PreparedStateChange:
        """This group's state with ``other``'s rows appended (``other`` is only read: its caches are copied)."""
        if other.model is not self.model or other.quants != self.quants:
            raise ValueError("cannot append rows of another model or another KV layout")
        return super().prepare_append(other)


def single_arrays(cache: Any) -> list[mx.array]:
    """The arrays of a single-row cache (what ``mx.eval`` materializes): its kind's ``arrays``."""
    return kind_of(cache).arrays(cache)

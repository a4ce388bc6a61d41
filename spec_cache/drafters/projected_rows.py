"""Projected-context drafters: the provider (pairing, checkpoint validation) and the grouped rows (context
growth, capture, drafting inputs) that DeepSpec and DFlash share; see ``projected.py`` for the design.

A target-only hit (the target restored without this drafter's context): the row opens cold beside it
(``base.ColdRow``) and its context covers only the tokens the target forwards from then on, projected at their
true positions; the restored prefix is not forwarded again. The context of a full row is the taps at every
token, so such a row drafts from less (acceptance may start lower, tokens never change). Its checkpoints carry
its context in ``deepspec-context-v1``'s (and its kin's) layout with the missing head as zero rows
(``base.padded``), which a restore opens as the same partial row (``base.opened``; issue 38).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from spec_cache.drafters.base import (
    PAIRING,
    BoundDraftRows,
    ColdRow,
    NetworkProvider,
    PartialRowCheckpoint,
    check_opening,
    check_sizes,
    opened_all,
)
from spec_cache.drafters.cache_codec import capture_kv_attachment, restore_kv_caches
from spec_cache.drafters.projected import ContextKV, ProjectedNetwork
from spec_cache.errors import UnsupportedCombination
from spec_cache.rows.protocol import (
    PrefillContext,
    PreparedStateChange,
    RoundContext,
    check_accepted,
    check_per_row,
    check_row,
)
from spec_cache.rows.target import TargetModel, clone_batch_cache
from spec_cache.schemas import DraftRowCheckpoint, SchemaError, validate_checkpoint

__all__ = ["ProjectedProvider", "ProjectedRows"]


class ProjectedProvider(NetworkProvider):
    """A loaded projected-context drafter; subclasses set ``schema``, ``family`` and ``rows_class``."""

    schema = ""
    family = ""
    rows_class: type = None  # type: ignore[assignment]
    supports_target_adapters = False
    #: a cold row needs the target's taps at every token it covers (see ``ProjectedRows``)
    prefill_needs_target_taps = True
    network: ProjectedNetwork

    @property
    def dtype(self) -> mx.Dtype:
        return self.network.fc.weight.dtype

    def bind(self, target: TargetModel) -> None:
        """Check that this drafter fits ``target``: the depth it was trained for, hidden size, vocabulary."""
        config = self.config
        if config.num_target_layers != target.depth:
            raise UnsupportedCombination(
                f"{self.family} drafter was trained for a {config.num_target_layers}-layer target; this model has "
                f"{target.depth} layers - {PAIRING}"
            )
        check_sizes(self.family, (("hidden size", config.hidden_size, target.hidden_size),
                                  ("tapped hidden size", config.target_hidden_size, target.hidden_size),
                                  ("vocabulary", config.vocab_size, target.vocab_size)))

    def validate_checkpoint(self, checkpoint: DraftRowCheckpoint) -> None:
        """Schema rules (alignment of every layer with ``processedTokens``), then this drafter's layer count,
        K/V geometry and dtype; raises SchemaError."""
        validate_checkpoint(checkpoint, expect_schema=self.schema)
        attachment = checkpoint.attachment
        headers = json.loads(attachment.metadata["cacheHeaders"])
        layers = self.config.num_hidden_layers
        if len(headers) != layers:
            raise SchemaError(self.schema, "metadata.cacheHeaders",
                              f"{len(headers)} layer headers for a {layers}-layer {self.family} drafter")
        geometry = (self.config.num_key_value_heads, self.config.head_dim)
        for layer, header in enumerate(headers):
            if header is None:
                continue
            index = header["tensors"][0]
            tensor = attachment.tensors[index]
            shape = tuple(tensor.shape)
            if (shape[1], shape[3]) != geometry:
                raise SchemaError(self.schema, f"tensors[{index}].shape",
                                  f"K/V of {shape[1]} heads x {shape[3]} do not fit drafter layer {layer} "
                                  f"({geometry[0]} x {geometry[1]})")
            dtype = str(getattr(tensor, "dtype", "")).rsplit(".", 1)[-1]
            if dtype != str(self.dtype).rsplit(".", 1)[-1]:
                raise SchemaError(self.schema, f"tensors[{index}].dtype",
                                  f"context dtype {dtype} differs from this drafter's {self.dtype}")


class ProjectedRows(BoundDraftRows):
    """Projected context rows: per drafter layer one ``BatchKVCache`` of K/V context, and each row's coverage.

    Subclasses implement :meth:`draft`.
    """

    prefill_needs_target_taps = True
    supports_external_tokens = True
    opens_beside_target = True
    provider: ProjectedProvider

    # -- membership -------------------------------------------------------------------------------------
    def _init_state(self) -> None:
        self.network = self.provider.network
        self.tap_layers = tuple(self.provider.config.target_layer_ids)
        self._caches: list[BatchKVCache] | None = None
        self._start: list[int] = []  # per row: the first token its context covers (0 but for target-only hits)

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | ColdRow | None]) -> PreparedStateChange:
        checkpoints = opened_all(checkpoints)  # a stored partial row (zero head) opens as the partial row it was
        check_opening(checkpoints, self.provider.validate_checkpoint)
        if not checkpoints:
            return PreparedStateChange(lambda: None, lambda: None)
        layers = self.provider.config.num_hidden_layers
        restored = [None if cp is None or isinstance(cp, ColdRow) else restore_kv_caches(cp.attachment)
                    for cp in checkpoints]
        joining = []
        for layer in range(layers):
            singles = [None if caches is None else caches[layer] for caches in restored]
            joining.append(_merge([c for c in singles]))
        if self._caches is None or not self._processed:
            caches = joining
        else:
            caches = [clone_batch_cache(c) for c in self._caches]
            for mine, theirs in zip(caches, joining):
                mine.extend(theirs)
        processed = self._processed + [0 if cp is None else cp.processed_tokens for cp in checkpoints]
        start = self._start + [_start_of(cp) for cp in checkpoints]

        def put(state: tuple) -> None:
            self._caches, self._processed, self._start = state

        return PreparedStateChange.swap(lambda: (self._caches, self._processed, self._start), put,
                                        (caches, processed, start))

    def _keep_rows(self, keep: list[int]) -> None:
        indices = mx.array(keep, dtype=mx.int32)
        for cache in self._caches or ():
            cache.filter(indices)
        self._processed = [self._processed[row] for row in keep]
        self._start = [self._start[row] for row in keep]

    def lazy_state(self) -> list:
        arrays = []
        for cache in self._caches or ():
            arrays += [cache.offset, cache.left_padding] + ([] if cache.keys is None else [cache.keys, cache.values])
        return arrays

    def materialize(self) -> None:
        mx.eval(self.lazy_state())

    def dispose(self) -> None:
        self._caches = None
        self._processed = []
        self._start = []

    # -- context growth ---------------------------------------------------------------------------------
    def _grow(self, taps: dict, counts: Sequence[int]) -> None:
        """Append the first ``counts[row]`` positions of ``taps`` (``[B, L, H]`` per tap layer) to each row."""
        width = next(iter(taps.values())).shape[1]
        joined = mx.concatenate([taps[layer] for layer in self.tap_layers], axis=-1).astype(self.provider.dtype)
        positions = mx.array(self._processed, dtype=mx.int32)
        rows = self.network.context_kv(joined, positions)
        padding = [width - count for count in counts]
        for cache, (keys, values) in zip(self._caches, rows):
            cache.prepare(right_padding=padding)
            cache.update_and_fetch(keys, values)
            cache.finalize()
        self._processed = [p + c for p, c in zip(self._processed, counts)]

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context: PrefillContext | None) -> None:
        """Project the target's taps at each row's forwarded tokens into its context."""
        counts = [len(tokens) for tokens in tokens_per_row]
        check_per_row(counts, self.row_count, "token list")
        if not any(counts):
            return
        if context is None or not context.taps or list(context.lengths) != counts:
            raise ValueError(f"{self.provider.family} rows need the target's taps at every token they cover; "
                             f"got {None if context is None else context.lengths} for {counts}")
        self._grow(context.taps, counts)

    def consume(self, tokens_per_row: Sequence[Sequence[int]], context: Any, lengths: Sequence[int]) -> None:
        """Project the target's taps at ``lengths[row]`` externally supplied tokens of each row (``context``:
        the ``PrefillContext`` or ``RoundContext`` of the forward that appended them)."""
        check_per_row(lengths, self.row_count, "length")
        for row, (tokens, count) in enumerate(zip(tokens_per_row, lengths)):
            if not 0 <= count <= len(tokens):
                raise ValueError(f"row {row}: consume length {count} for {len(tokens)} tokens")
        if not any(lengths):
            return
        if context is None or not context.taps or any(layer not in context.taps for layer in self.tap_layers):
            raise ValueError(f"{self.provider.family} rows need the target's taps at every consumed token")
        self._grow(context.taps, list(lengths))

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        """Grow each row's context by the pending token and its kept drafts (``accepted + 1`` rows)."""
        check_accepted(accepted, self.row_count, context)
        self._grow(context.taps, [kept + 1 for kept in accepted])

    # -- checkpoints ------------------------------------------------------------------------------------
    def capture(self, row: int) -> DraftRowCheckpoint:
        """The row's context checkpoint (owned); a row opened beside a restored target gives a
        ``PartialRowCheckpoint`` (its context from ``start`` on), which moves between groups as it is and is
        stored through ``base.storable`` (its head as zero rows)."""
        check_row(row, self.row_count)
        processed, start = self._processed[row], self._start[row]
        held = processed - start
        caches = [_extract(cache, row, held) for cache in self._caches]
        attachment = capture_kv_attachment(self.schema, caches, {"processedTokens": held})
        if start:
            return PartialRowCheckpoint(processed, attachment, start=start, base_tokens=held)
        return DraftRowCheckpoint(processed, attachment)

    def _contexts(self) -> list[ContextKV]:
        """Each layer's context for a drafting forward: K/V ``[B, kvHeads, T, D]`` and the rows' valid mask."""
        out = []
        for cache in self._caches:
            if cache.keys is None or cache._idx == 0:
                out.append(ContextKV(None, None, None))
                continue
            keys, values = cache.keys_and_values()
            valid = mx.arange(cache._idx)[None, :] >= cache.left_padding[:, None]
            out.append(ContextKV(keys, values, valid))
        return out

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError


def _start_of(opening: Any) -> int:
    """The first token a joining row's context covers."""
    if isinstance(opening, ColdRow):
        return opening.processed_tokens
    return opening.start if isinstance(opening, PartialRowCheckpoint) else 0


def _merge(caches: Sequence[Any]) -> BatchKVCache:
    from mlx_lm.models.cache import KVCache

    return BatchKVCache.merge([KVCache() if c is None else c for c in caches])


def _extract(cache: BatchKVCache, row: int, processed: int):
    from mlx_lm.models.cache import KVCache

    if processed == 0 or cache.keys is None:
        return KVCache()
    single = cache.extract(row)
    if single.offset != processed:
        raise RuntimeError(f"row {row}: context holds {single.offset} rows, expected {processed}")
    return single

"""Left-padded batch rows: the round mechanics every batched target group shares.

Why a module of its own: ``target.TargetRows`` (float KV, sliding windows; recurrent layers through
``recurrent_rows.HybridTargetRows``) and ``quantized_batch.PhaseRows`` (one phase of quantized rows) hold their
rows the same way: per cache layer one left-padded batch cache (mlx-lm's ``BatchKVCache``, a cache with its
interface such as ``BatchQuantizedKVCache``, or a batched ``ArraysCache``) and a token count per row. Prefill,
per-row rollback, the two-phase append, filtering, the donor view and moving rows in (``merge_rows``) and out
(``split_row``) are therefore one piece of code, :class:`BatchRows`. How each layer's batch cache is made, merged,
split, copied and read is its kind's, looked up in the table of cache kinds (``spec_cache.state.cache_kinds``;
the kind of the layer's single-row cache names the kind whose batch cache it joins): nothing here tests a cache
class. A subclass says which single-row cache each layer holds (``templates``) and brings its own verify.

Rows are right-justified behind left padding, so one forward appends the same number of tokens to every row; a
row that keeps fewer (rejected drafts, a shorter prompt chunk) rolls its discarded tail round to its left padding
(``prepare(right_padding=...)`` + ``finalize()``), exact because padding is masked and kept tokens keep their
RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from spec_cache.errors import RestoreRefused
from spec_cache.rows.logprobs import score
from spec_cache.rows.protocol import PrefillContext, PreparedStateChange, check_keep, check_per_row, check_row
from spec_cache.state.batch_caches import clone_batch_cache
from spec_cache.state.cache_kinds import batch_kind_of
from spec_cache.state.row_caches import row_position

__all__ = ["BatchRows", "DonorView", "clone_batch_cache"]


@dataclass
class DonorView:
    """Read-only view of one target layer's K/V for every row of a group.

    ``keys``/``values`` ``[B, kvHeads, T, D]`` (post-RoPE, full precision) or None when no row has any token;
    ``valid`` ``[B, 1, 1, T]`` marks the keys each row may attend to (its real positions, within the layer's
    window); ``positions`` ``[B]`` is each row's KV length, i.e. the position of its pending token.
    """

    keys: mx.array | None
    values: mx.array | None
    valid: mx.array | None
    positions: mx.array


class BatchRows:
    """A group of rows of one model sharing every forward: per cache layer one left-padded batch cache, and
    ``offsets[row]`` tokens held per row. Membership changes are two-phase (:meth:`prepare_append`);
    :meth:`filter_rows` and the round operations act in place between rounds.
    """

    def __init__(self, model: Any, templates: Sequence[Any] | None = None) -> None:
        """``templates``: per cache layer a single-row cache of the kind the layer holds (only read; default: the
        model's ``cache_templates``, as ``make_caches()`` makes them). Each layer's batch cache is the batch kind
        of its template's kind (``cache_kinds.batch_kind_of``)."""
        self.model = model
        self._windows = model.layer_windows
        self._templates = tuple(model.cache_templates if templates is None else templates)
        self._kinds = tuple(batch_kind_of(template) for template in self._templates)
        self._caches: list | None = None
        self._lengths: list[int] = []

    def _ensure_caches(self) -> list:
        """The live caches, made empty for every row on first use."""
        if self._caches is None:
            self._caches = [kind.empty_batch(template, self.row_count)
                            for kind, template in zip(self._kinds, self._templates)]
        return self._caches

    # -- state ------------------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Tokens held per row (the position of each row's pending token)."""
        return tuple(self._lengths)

    def materialize(self) -> None:
        if self._caches:
            mx.eval(self._arrays(self._caches))

    def dispose(self) -> None:
        self._caches = None
        self._lengths = []

    def _arrays(self, caches: Sequence[Any]) -> list[mx.array]:
        return [a for kind, cache in zip(self._kinds, caches) for a in kind.batch_arrays(cache)]

    def _unpadded(self) -> bool:
        """No row has left padding, read off host-side counts (no device read): a full-attention layer's row holds
        ``_idx - left_padding`` keys, which is its length. Only ports of full-attention models use the answer."""
        first = next((c for c, kind in zip(self._caches or (), self._kinds) if kind.trimmable), None)
        return first is not None and all(n == first._idx for n in self._lengths)

    def _check_rows(self, per_row: Sequence[Sequence[int]]) -> list[int]:
        check_per_row(per_row, self.row_count, "token list")
        return [len(tokens) for tokens in per_row]

    # -- rounds -----------------------------------------------------------------------------------------
    def prefill(
        self, tokens_per_row: Sequence[Sequence[int]], step: int = 512, *, tap_layers: Sequence[int] = (),
        need_hidden: bool = True, scores: Sequence[tuple[Sequence[int], int] | None] | None = None,
    ) -> PrefillContext:
        """Append each row's tokens (rows may differ in length, including zero); one forward per chunk.

        ``scores[row]``: ``(next_tokens, top)`` for a row whose tokens are to be scored (``next_tokens[i]`` is
        the token after ``tokens_per_row[row][i]``), None for the others: the context's ``scores[row]`` is then
        the ``TokenLogprob`` of each next token (``spec_cache.rows.logprobs.score``), from the target's logits
        at each forwarded position (computed for those rows only).

        ``need_hidden=False`` (no drafter reads it): ``last_hidden`` is None and is never computed. Evaluating it
        runs the last layer's attention output and MLP over the whole chunk, which no cache needs (mlx-lm's
        prefill evaluates the cache states only): half the prefill of a 2-layer model, ~3% of a 32-layer one.

        Returns the final hidden at each row's last appended token (zeros where a row appended nothing) and,
        for ``tap_layers``, the residual stream at every appended position (``[B, longest, H]``, row ``r``'s
        tokens at ``[:lengths[r]]``).
        """
        lengths = self._check_rows(tokens_per_row)
        longest = max(lengths, default=0)
        if longest == 0:
            empty = [None if s is None else [] for s in scores] if scores else None
            return PrefillContext(None, lengths, scores=empty)
        caches = self._ensure_caches()
        # read before the chunks move ``_idx``: right padding (shorter rows' tails) sits after each row's real
        # tokens, which a causal mask already hides from them, so only left padding needs an array mask
        unpadded = self._unpadded()
        ids = mx.array([list(t) + [0] * (longest - len(t)) for t in tokens_per_row], dtype=mx.uint32)
        padding = [longest - n for n in lengths]
        for kind, cache in zip(self._kinds, caches):
            kind.start_round(cache, lengths, padding)  # K/V: right padding; recurrent: each row's length
        last_index = mx.array([max(n - 1, 0) for n in lengths])
        has_tokens = mx.array([n > 0 for n in lengths])[:, None, None]
        last_hidden = mx.zeros((len(lengths), 1, self.model.hidden_size), dtype=self.model.dtype)
        taps: dict[int, list[mx.array]] = {layer: [] for layer in tap_layers}
        scored: list = [None if s is None else [] for s in (scores or [None] * len(lengths))]
        for start in range(0, longest, step):
            chunk = ids[:, start : start + step]
            out = self.model.forward(chunk, caches, tap_layers=tap_layers, with_logits=False, unpadded=unpadded)
            for row, wanted_scores in enumerate(scores or ()):
                count = min(max(lengths[row] - start, 0), chunk.shape[1])
                if wanted_scores is not None and count:
                    next_tokens, top = wanted_scores
                    logits = self.model.logits(out.hidden[row : row + 1, :count])[0]
                    scored[row] += score(logits, next_tokens[start : start + count], top)
            local = mx.clip(last_index - start, 0, chunk.shape[1] - 1)
            here = has_tokens & ((last_index >= start) & (last_index < start + chunk.shape[1]))[:, None, None]
            if need_hidden:
                picked = mx.take_along_axis(out.hidden, local[:, None, None], axis=1)
                last_hidden = mx.where(here, picked, last_hidden)
            for layer in taps:
                taps[layer].append(out.taps[layer])
            wanted = [last_hidden] if need_hidden else []
            mx.eval(self._arrays(caches) + wanted + [parts[-1] for parts in taps.values()])
        for cache in caches:
            cache.finalize()
        self._lengths = [a + b for a, b in zip(self._lengths, lengths)]
        self.materialize()
        joined = {layer: mx.concatenate(parts, axis=1) for layer, parts in taps.items()}
        return PrefillContext(last_hidden if need_hidden else None, lengths, joined, scored if scores else None)

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[row]`` tokens of each row (exact; they become left padding)."""
        rejected = [int(r) for r in rejected]
        check_per_row(rejected, self.row_count, "rollback count")
        for row, (count, held) in enumerate(zip(rejected, self._lengths)):
            if not 0 <= count <= held:
                raise ValueError(f"row {row}: cannot roll back {count} of its {held} tokens")
        if not any(rejected):
            return
        for kind, cache in zip(self._kinds, self._caches or ()):
            if not kind.trimmable:
                continue  # HybridTargetRows rolls recurrent state back by replay
            cache.prepare(right_padding=rejected)
            cache.finalize()
        self._lengths = [n - r for n, r in zip(self._lengths, rejected)]

    # -- rows in and out --------------------------------------------------------------------------------
    def merge_rows(self, rows: Sequence[Sequence[Any] | None]) -> None:
        """Hold exactly ``rows`` (per row its single-row caches, one per layer; None: an empty row), each layer
        merged by its batch kind (``CacheKind.merge``: a cache whose kind joins another batch is refused). The
        caches are only read (copied into the batch)."""
        rows = [None if layers is None else list(layers) for layers in rows]
        for row, layers in enumerate(rows):
            if layers is not None and len(layers) != len(self._kinds):
                raise RestoreRefused(f"row {row}: expected {len(self._kinds)} layer caches, got {len(layers)}")
        lengths = [0 if layers is None else row_position(layers, row) for row, layers in enumerate(rows)]
        self._lengths = lengths
        if not rows:
            return
        self._caches = [kind.merge([None if layers is None else layers[layer] for layers in rows], lengths,
                                   template, window, layer)
                        for layer, (kind, template, window) in enumerate(zip(self._kinds, self._templates,
                                                                             self._windows))]

    def split_row(self, row: int, *, ring: bool = True) -> list:
        """Owned single-row caches holding exactly row ``row``'s tokens (each layer's batch kind's ``split``;
        ``ring``: a sliding layer as mlx-lm's ``RotatingKVCache`` snapshot, else a ``KVCache`` of its whole
        history, which the row must hold). Not evaluated: the caller decides when."""
        check_row(row, self.row_count)
        position = self._lengths[row]
        if position == 0 or self._caches is None:
            return [kind.fresh(template) for kind, template in zip(self._kinds, self._templates)]
        return [kind.split(cache, row, position, window, ring=ring, where=f"row {row} layer {layer}")
                for layer, (kind, cache, window) in enumerate(zip(self._kinds, self._caches, self._windows))]

    def prepare_append(self, other: "BatchRows") -> PreparedStateChange:
        """Build this group's state with ``other``'s rows appended (``other`` is only read: its caches are
        copied)."""
        if other.model is not self.model:
            raise ValueError("cannot append rows of a different model")
        if other.row_count == 0:
            return PreparedStateChange(lambda: None, lambda: None)
        if self.row_count == 0 or self._caches is None:
            caches = [kind.clone_batch(c) for kind, c in zip(self._kinds, other._ensure_caches())]
        else:
            caches = [kind.join_batch(mine, self.row_count, theirs, other.row_count)
                      for kind, mine, theirs in zip(self._kinds, self._caches, other._ensure_caches())]
        lengths = self._lengths + other._lengths

        def put(state: tuple) -> None:
            self._caches, self._lengths = state

        return PreparedStateChange.swap(lambda: (self._caches, self._lengths), put, (caches, lengths))

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` in that order; ``[]`` releases everything."""
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
        """Read-only K/V of ``layer`` for every row (full precision), with the mask of the keys each row may
        attend to (its own positions, within the layer's window)."""
        positions = mx.array(self._lengths, dtype=mx.int32)
        kind = self._kinds[layer]
        cache = None if self._caches is None else self._caches[layer]
        if cache is not None and not kind.holds_kv:
            raise ValueError(f"layer {layer} is recurrent: it holds no K/V to donate")
        if cache is None or cache.keys is None or cache._idx == 0:
            return DonorView(None, None, None, positions)
        keys, values = kind.donor_kv(cache)
        index = mx.arange(cache._idx)[None, :]
        valid = index >= cache.left_padding[:, None]
        window = self._windows[layer]
        if window is not None:
            valid = valid & (index >= cache._idx - window)
        return DonorView(keys, values, valid[:, None, None, :], positions)

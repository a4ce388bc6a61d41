"""Classic two-model speculative decoding: a small standalone mlx-lm model with the target's vocabulary.

The draft model keeps its own KV (batched exactly like the target's, through :class:`TargetRows`). Its row
checkpoint is those caches, schema ``standalone-draft-v1``, written through the ``spec-cache-kv-v1`` cache codec
(``cache_codec.py``): one header per draft layer ``{"kind": "kv", "offset": N, "tensors": [k, v]}`` (null for an
empty layer) and K/V sliced to the offset.

Coverage: the draft KV holds the row's tokens up to the target's coverage, or one fewer when every draft of
the last round was accepted; that last accepted draft is then ``pendingLast`` and is fed first next round (as
mlx-lm's ``speculative_generate_step`` does).

Deferred feeding: a round at depth 0 (``draft(pending, 0)``: plain decoding) feeds nothing. Its committed
tokens wait in a per-row backlog and are fed in one batched prefill when the draft KV is next needed: the next
``draft`` at depth > 0 (together with that round's pending token), ``prefill``, ``capture``, ``filter_rows`` and
``prepare_append``. Otherwise the draft model would run its layers on every token the target decodes alone,
which costs a cheap drafter most of what adaptive depth saves. The caught-up KV is the one that feeding token by
token gives (the rows' prefill is exact across chunkings), so checkpoints do not change.

Bounded backlog (``backlog_cap``, default None: unbounded): a row's backlog that reaches the cap is fed at that
depth-0 round (in its draft call). None since issue 39: a depth-0 round costs the draft model nothing, and the
backlog is fed only where the draft KV is needed (a drafting round or probe, a capture for a checkpoint, a join);
rows that leave keep their backlog (no feed for them: ``_keep_rows``). Why: with the cap of 32 the draft model ran
its layers on every token of plain decoding after all (SmolLM2's first 4 layers on the CPU: ~43 ms per 32 tokens at
B=1, ~85 ms at B=8, 0.8-0.9 of a plain round each; 1-2% of a run that never drafted), most of it for nothing where
no probe came before the rows ended. The cost moves to the probe that follows a long plain stretch (its draft call
feeds the whole backlog); the depth controller prices a probe at least as dear as the dearest draft call it
measured. The feed is the same tokens in more or fewer chunks: same KV, same drafts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.drafters.base import BoundDraftRows, OpensRows, directory_namespace
from spec_cache.drafters.cache_codec import capture_kv_attachment, restore_kv_caches
from spec_cache.errors import UnsupportedCombination
from spec_cache.rows.protocol import (
    PrefillContext,
    PreparedStateChange,
    RoundContext,
    check_checkpoints,
    check_per_row,
    check_row,
)
from spec_cache.rows.target import TargetModel, TargetRows
from spec_cache.schemas import STANDALONE_DRAFT_V1, DraftRowCheckpoint, SchemaError, validate_checkpoint

__all__ = ["DraftModelProvider", "DraftModelRows", "METHOD", "capture_kv_attachment", "restore_kv_caches"]

METHOD = "draft-model"
ALIGNMENT = "invalid standalone draft checkpoint alignment"


class DraftModelRows(BoundDraftRows):
    """Draft rows of a standalone draft model: its batched KV, plus per row the coverage and ``pendingLast``."""

    provider: "DraftModelProvider"

    def _init_state(self) -> None:
        self._rows = TargetRows(self.provider.model)
        self._pending_last: list[int | None] = []
        self._fed = 0  # tokens per row the last draft() appended to the draft KV
        #: per row, committed tokens not yet fed to the draft KV (rounds at depth 0), oldest first
        self._backlog: list[list[int]] = []
        self._deferred = False  # the last draft() was at depth 0 and fed nothing

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | None]) -> PreparedStateChange:
        check_checkpoints(checkpoints, self.provider.validate_checkpoint)
        self.catch_up()
        joining = TargetRows.from_row_caches(
            self.provider.model, [None if cp is None else restore_kv_caches(cp.attachment) for cp in checkpoints]
        )
        rows_change = self._rows.prepare_append(joining)
        processed = self._processed + [0 if cp is None else cp.processed_tokens for cp in checkpoints]
        pending = self._pending_last + [_pending_of(cp) for cp in checkpoints]
        backlog = self._backlog + [[] for _ in checkpoints]

        def put(state: tuple) -> None:
            self._processed, self._pending_last, self._backlog = state

        counts = PreparedStateChange.swap(
            lambda: (self._processed, self._pending_last, self._backlog), put, (processed, pending, backlog)
        )

        def commit() -> None:
            rows_change.commit()
            counts.commit()

        def dispose() -> None:
            rows_change.dispose()
            counts.dispose()

        return PreparedStateChange(commit, dispose)

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context: PrefillContext | None) -> None:
        """Forward the draft model over each row's missing tokens (its backlog, then its ``pendingLast``, if
        any, then ``tokens``)."""
        check_per_row(tokens_per_row, self.row_count, "token list")
        feed = []
        for row, tokens in enumerate(tokens_per_row):
            last = self._pending_last[row]
            feed.append(self._backlog[row] + ([] if last is None or not tokens else [last]) + list(tokens))
        if not any(feed):
            return
        self._rows.prefill(feed)
        self._backlog = [[] for _ in feed]
        for row, tokens in enumerate(tokens_per_row):
            if tokens:
                self._processed[row] += len(tokens)
                self._pending_last[row] = None

    #: most backlog tokens a row keeps before they are fed (module doc); None: unbounded (fed when drafting resumes)
    backlog_cap: int | None = None

    def materialize(self) -> None:
        self._rows.materialize()

    def catch_up(self) -> None:
        """Feed every row's backlog (the tokens of rounds at depth 0) in one batched prefill."""
        if any(self._backlog):
            self._rows.prefill(self._backlog, need_hidden=False)
            self._backlog = [[] for _ in self._backlog]

    def _keep_rows(self, keep: list[int]) -> None:
        # the kept rows keep their backlog (fed when their draft KV is next needed): no forward here, and none at all
        # for the rows that leave (catching up every row first fed the leaving rows' backlogs for nothing)
        self._rows.filter_rows(keep)
        self._processed = [self._processed[row] for row in keep]
        self._pending_last = [self._pending_last[row] for row in keep]
        self._backlog = [self._backlog[row] for row in keep]

    def capture(self, row: int) -> DraftRowCheckpoint:
        check_row(row, self.row_count)
        self.catch_up()
        processed, pending = self._processed[row], self._pending_last[row]
        metadata = {"processedTokens": processed, "pendingLast": False if pending is None else pending}
        # sliding-window layers of the draft model keep their whole history here (plain KV), never a ring
        attachment = capture_kv_attachment(self.schema, self._rows.extract(row, rotating=False), metadata)
        return DraftRowCheckpoint(processed, attachment)

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        """Feed the backlog + ``pendingLast`` + pending, then chain ``depth`` greedy/sampled steps of the draft model.

        At depth 0 nothing is fed: ``pendingLast`` and the pending token join the row's backlog (see the module
        docstring) and the round's ``commit`` must keep no draft.
        """
        check_per_row(pending, self.row_count, "pending token")
        if not pending:
            return []
        model = self.provider.model
        feed = [([] if last is None else [last]) + [int(token)] for last, token in zip(self._pending_last, pending)]
        self._pending_last = [None] * self.row_count
        if depth <= 0:
            self._backlog = [held + fed for held, fed in zip(self._backlog, feed)]
            self._fed, self._deferred = 0, True
            if self.backlog_cap is not None and max(map(len, self._backlog)) >= self.backlog_cap:
                self.catch_up()  # bounded backlog (module doc)
            return [[] for _ in pending]
        context = self._rows.prefill([held + fed for held, fed in zip(self._backlog, feed)])
        self._backlog = [[] for _ in feed]
        self._fed, self._deferred = 1, False
        ids = self._sampler(model.logits(context.last_hidden)[:, -1, :]).astype(mx.uint32)
        steps = [ids]
        for _ in range(depth - 1):
            out = self._rows.verify(ids[:, None].tolist())
            self._fed += 1
            ids = self._sampler(out.logits[:, -1, :]).astype(mx.uint32)
            steps.append(ids)
        return mx.stack(steps, axis=1).tolist()

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        """Keep the fed tokens the target kept; if every fed draft was kept, the last kept one becomes pending."""
        check_per_row(accepted, self.row_count, "accepted count")
        if self._deferred:  # a round at depth 0: its pending token is already in the backlog
            for row, kept in enumerate(accepted):
                if kept != 0:
                    raise ValueError(f"row {row}: {kept} accepted but nothing was drafted (depth 0)")
            self._processed = [p + 1 for p in self._processed]
            self._deferred = False
            return
        trims, pending = [], []
        for row, kept in enumerate(accepted):
            if kept < self._fed:
                trims.append(self._fed - kept - 1)
                pending.append(None)
            elif kept == self._fed:  # every fed token was kept; the last kept draft was proposed, never fed
                trims.append(0)
                pending.append(int(context.window[row][kept]))
            else:
                raise ValueError(f"row {row}: {kept} accepted but only {self._fed} tokens were drafted")
        self._rows.rollback(trims)
        self._pending_last = pending
        self._processed = [p + a + 1 for p, a in zip(self._processed, accepted)]
        self._fed = 0

    def dispose(self) -> None:
        self._rows.dispose()
        self._processed = []
        self._pending_last = []
        self._backlog = []
        self._deferred = False


class DraftModelProvider(OpensRows):
    """A loaded standalone draft model; opens :class:`DraftModelRows` groups."""

    schema = STANDALONE_DRAFT_V1
    rows_class = DraftModelRows
    supports_target_adapters = False

    def __init__(self, model: TargetModel, namespace: str, model_dir: Path | None = None) -> None:
        self.model = model
        self.namespace = namespace
        self.model_dir = model_dir

    @classmethod
    def load(cls, model_dir: str | Path) -> "DraftModelProvider":
        """Load an mlx-lm model directory; namespace ``standalone-draft-v1:<model identity>``."""
        path = Path(model_dir)
        model = TargetModel.load(path)
        return cls(model, directory_namespace(cls.schema, path), path)

    def bind(self, target: TargetModel) -> None:
        if self.model.vocab_size != target.vocab_size:
            raise UnsupportedCombination(
                f"draft model vocabulary {self.model.vocab_size} differs from the target's {target.vocab_size}"
            )

    def validate_checkpoint(self, checkpoint: DraftRowCheckpoint) -> None:
        """Schema rules plus exact alignment with this draft model's layers; raises SchemaError."""
        validate_checkpoint(checkpoint, expect_schema=self.schema)
        attachment = checkpoint.attachment
        headers = json.loads(attachment.metadata["cacheHeaders"])
        if len(headers) != self.model.num_layers:
            raise SchemaError(
                self.schema, "metadata.cacheHeaders",
                f"{len(headers)} layer headers for a {self.model.num_layers}-layer draft model",
            )
        pending = attachment.metadata["pendingLast"]
        covered = checkpoint.processed_tokens - (0 if pending is False else 1)
        if covered < 0:
            raise SchemaError(self.schema, "metadata.pendingLast", f"{ALIGNMENT}: a pending token with no tokens processed")
        for layer, header in enumerate(headers):
            field = f"metadata.cacheHeaders[{layer}]"
            offset = 0 if header is None else header["offset"]
            if offset != covered:
                raise SchemaError(self.schema, f"{field}.offset", f"{ALIGNMENT}: layer holds {offset} tokens, expected {covered}")
            if header is None:
                continue
            if header["kind"] != "kv":
                raise SchemaError(self.schema, f"{field}.kind", f"only kv layers are supported, got {header['kind']!r}")
            shape = tuple(attachment.tensors[header["tensors"][0]].shape)
            geometry = self.model.kv_geometry(layer)
            if (shape[1], shape[3]) != geometry:
                raise SchemaError(
                    self.schema, f"tensors[{header['tensors'][0]}].shape",
                    f"K/V of {shape[1]} heads x {shape[3]} do not fit draft layer {layer} ({geometry[0]} x {geometry[1]})",
                )


def _pending_of(checkpoint: DraftRowCheckpoint | None) -> int | None:
    if checkpoint is None:
        return None
    value = checkpoint.attachment.metadata["pendingLast"]
    return None if value is False else int(value)


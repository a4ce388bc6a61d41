"""Prompt-lookup (n-gram) drafting: no weights, only each row's token history.

To propose, a row looks for the most recent earlier occurrence of its last ``n`` tokens (pending token
included), trying ``n = max`` down to ``min``, and proposes the tokens that followed it. Its row checkpoint is
the int32 history of the tokens the target holds, schema ``ngram-history-v1``, metadata ``{max, min}``;
namespace ``ngram-history-v1:<max>:<min>``. N-gram drafting does not depend on the target's weights, so it also
speculates under target adapters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.schemas import (
    NGRAM_HISTORY_V1,
    CheckpointAttachment,
    DraftRowCheckpoint,
    SchemaError,
    validate_checkpoint,
)

from ..rows import PrefillContext, PreparedStateChange, RoundContext, check_checkpoints, check_per_row, check_row, to_mx
from ..sampling import Sampling
from ..target import TargetRows
from .base import DraftRows

__all__ = ["NgramProvider", "NgramRows", "METHOD", "lookup"]

METHOD = "ngram"
MISMATCH = "ngram checkpoint does not match its token coverage or lookup policy"


def lookup(history: Sequence[int], max_n: int, min_n: int, depth: int) -> list[int]:
    """Up to ``depth`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    if depth <= 0:
        return []
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(history[size - n :])
        for start in range(size - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                return list(history[start + n : start + n + depth])
    return []


class NgramProvider:
    """The n-gram lookup policy (``max``/``min`` n-gram sizes); opens :class:`NgramRows` groups."""

    schema = NGRAM_HISTORY_V1
    supports_target_adapters = True

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        from ..namespace import ngram_namespace

        self.namespace = ngram_namespace(max_n, min_n)  # validates 1 <= min_n <= max_n
        self.max_n, self.min_n = max_n, min_n

    @classmethod
    def load(cls, model_dir: str | Path) -> "NgramProvider":
        """Read ``config.json`` ``{"method": "ngram", "max": 3, "min": 1}`` (both keys optional)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config.get("method") != METHOD:
            raise ValueError(f"not an ngram drafter config (method={config.get('method')!r})")
        return cls(config.get("max", 3), config.get("min", 1))

    def validate_checkpoint(self, checkpoint: DraftRowCheckpoint) -> None:
        """Schema rules plus this provider's lookup policy; raises SchemaError."""
        validate_checkpoint(checkpoint, expect_schema=self.schema)
        metadata = checkpoint.attachment.metadata
        for key, mine in (("max", self.max_n), ("min", self.min_n)):
            if metadata[key] != mine:
                raise SchemaError(self.schema, f"metadata.{key}", f"{MISMATCH}: {key}={metadata[key]}, this drafter uses {mine}")

    def open_prefill(self, target: TargetRows, checkpoints: Sequence[DraftRowCheckpoint | None]) -> "NgramRows":
        return NgramRows(self, checkpoints)

    def open(
        self, target: TargetRows, checkpoints: Sequence[DraftRowCheckpoint | None], sampling: Sampling | None = None
    ) -> "NgramRows":
        return NgramRows(self, checkpoints)


class NgramRows(DraftRows):
    """N-gram draft rows: the token history per row (exactly the tokens the target KV holds). They read no
    target state and never sample, so they take neither the target rows nor a sampling."""

    provider: NgramProvider
    supports_external_tokens = True

    def _init_state(self) -> None:
        self._history: list[list[int]] = []

    @property
    def row_count(self) -> int:
        return len(self._history)

    @property
    def processed(self) -> tuple[int, ...]:
        return tuple(len(history) for history in self._history)

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | None]) -> PreparedStateChange:
        check_checkpoints(checkpoints, self.provider.validate_checkpoint)
        joining = [[] if cp is None else _history_of(cp) for cp in checkpoints]

        def put(history: list) -> None:
            self._history = history

        return PreparedStateChange.swap(lambda: self._history, put, self._history + joining)

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context: PrefillContext | None) -> None:
        check_per_row(tokens_per_row, self.row_count, "token list")
        self._history = [history + [int(t) for t in tokens] for history, tokens in zip(self._history, tokens_per_row)]

    def consume(self, tokens_per_row: Sequence[Sequence[int]], context, lengths: Sequence[int]) -> None:
        """Append ``lengths[row]`` externally supplied tokens to each row's history (no target state needed)."""
        check_per_row(lengths, self.row_count, "length")
        for row, (tokens, count) in enumerate(zip(tokens_per_row, lengths)):
            if not 0 <= count <= len(tokens):
                raise ValueError(f"row {row}: consume length {count} for {len(tokens)} tokens")
        self._history = [history + [int(t) for t in tokens[:count]]
                         for history, tokens, count in zip(self._history, tokens_per_row, lengths)]

    def materialize(self) -> None:
        return None

    def _keep_rows(self, keep: list[int]) -> None:
        self._history = [self._history[row] for row in keep]

    def capture(self, row: int) -> DraftRowCheckpoint:
        check_row(row, self.row_count)
        history = mx.array(self._history[row], dtype=mx.int32)
        metadata = {"max": self.provider.max_n, "min": self.provider.min_n}
        return DraftRowCheckpoint(len(self._history[row]), CheckpointAttachment(self.schema, metadata, (history,)))

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        return [
            lookup(history + [int(token)], self.provider.max_n, self.provider.min_n, depth)
            for history, token in zip(self._history, pending)
        ]

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        check_per_row(accepted, self.row_count, "accepted count")
        self._history = [
            history + [int(t) for t in window[: kept + 1]]
            for history, window, kept in zip(self._history, context.window, accepted)
        ]

    def dispose(self) -> None:
        self._history = []


def _history_of(checkpoint: DraftRowCheckpoint) -> list[int]:
    return [int(t) for t in to_mx(checkpoint.attachment.tensors[0]).tolist()]

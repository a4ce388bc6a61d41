"""Prompt-lookup (n-gram) drafting: no weights, only each row's token history.

To propose, a row finds the earlier occurrence of its recent tokens (pending token included) with the longest
match, at least ``min`` tokens, through an index of its history (:class:`MatchIndex`: the positions after each
``min``..``max``-gram, never a scan of the history), and proposes the tokens that followed it. The draft length
follows the match length (``draft_length``): a one-token match proposes little, a long match (text being copied
from the prompt or the output) proposes up to the whole depth. Its row checkpoint is
the int32 history of the tokens the target holds, schema ``ngram-history-v1``, metadata ``{max, min}``;
namespace ``ngram-history-v1:<max>:<min>``. N-gram drafting does not depend on the target's weights, so it also
speculates under target adapters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.drafters.base import DraftRows
from spec_cache.rows import (
    PrefillContext,
    PreparedStateChange,
    RoundContext,
    check_checkpoints,
    check_per_row,
    check_row,
    to_mx,
)
from spec_cache.sampling import Sampling
from spec_cache.schemas import (
    NGRAM_HISTORY_V1,
    CheckpointAttachment,
    DraftRowCheckpoint,
    SchemaError,
    validate_checkpoint,
)
from spec_cache.target import TargetRows

__all__ = ["NgramProvider", "NgramRows", "METHOD", "MatchIndex", "draft_length", "lookup"]

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


#: how far back a candidate match is extended, and how many latest positions an n-gram key keeps
EXTEND_LIMIT = 64
POSITIONS_PER_KEY = 4


def draft_length(match: int, depth: int) -> int:
    """Tokens to propose after a match of ``match`` tokens: twice the match, up to ``depth`` (a copied run of 3+
    tokens drafts 6+; a lone shared token drafts 2, which are cheap to verify and often wrong)."""
    return max(0, min(depth, 2 * match))


class MatchIndex:
    """One row's token history with an index of where each ``min_n``..``max_n``-gram ended (its latest
    ``POSITIONS_PER_KEY`` occurrences). ``propose`` finds the longest earlier match of the history's suffix: the
    ``max_n``-gram candidates (falling back to shorter n-grams), each extended backwards up to ``EXTEND_LIMIT``
    tokens; ties go to the latest. Work per token and per proposal is bounded, whatever the history's length."""

    def __init__(self, max_n: int, min_n: int, tokens=()) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._ends: dict[tuple, list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends = self._ends.setdefault(tuple(self.tokens[end - n:end]), [])
                ends.append(end)
                if len(ends) > POSITIONS_PER_KEY:
                    del ends[0]

    def propose(self, pending: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens that followed the longest earlier match of ``history + [pending]``."""
        if depth <= 0:
            return []
        seq = self.tokens + [int(pending)]
        size = len(seq)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            best_len, best_end = 0, -1
            for end in self._ends.get(tuple(seq[size - n:]), ()):
                if end >= size:
                    continue
                length = n
                while length < EXTEND_LIMIT and end - length - 1 >= 0 and seq[end - length - 1] == seq[size - length - 1]:
                    length += 1
                if length >= best_len:
                    best_len, best_end = length, end
            if best_end >= 0 and best_end < size:
                return seq[best_end:best_end + draft_length(best_len, depth)]
        return []


class NgramProvider:
    """The n-gram lookup policy (``max``/``min`` n-gram sizes); opens :class:`NgramRows` groups."""

    schema = NGRAM_HISTORY_V1
    supports_target_adapters = True

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        from spec_cache.namespace import ngram_namespace

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
        self._history: list[MatchIndex] = []

    def _index(self, tokens=()) -> MatchIndex:
        return MatchIndex(self.provider.max_n, self.provider.min_n, tokens)

    @property
    def row_count(self) -> int:
        return len(self._history)

    @property
    def processed(self) -> tuple[int, ...]:
        return tuple(len(history) for history in self._history)

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | None]) -> PreparedStateChange:
        check_checkpoints(checkpoints, self.provider.validate_checkpoint)
        joining = [self._index([] if cp is None else _history_of(cp)) for cp in checkpoints]

        def put(history: list) -> None:
            self._history = history

        return PreparedStateChange.swap(lambda: self._history, put, self._history + joining)

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context: PrefillContext | None) -> None:
        check_per_row(tokens_per_row, self.row_count, "token list")
        for history, tokens in zip(self._history, tokens_per_row):
            history.extend(tokens)

    def consume(self, tokens_per_row: Sequence[Sequence[int]], context, lengths: Sequence[int]) -> None:
        """Append ``lengths[row]`` externally supplied tokens to each row's history (no target state needed)."""
        check_per_row(lengths, self.row_count, "length")
        for row, (tokens, count) in enumerate(zip(tokens_per_row, lengths)):
            if not 0 <= count <= len(tokens):
                raise ValueError(f"row {row}: consume length {count} for {len(tokens)} tokens")
        for history, tokens, count in zip(self._history, tokens_per_row, lengths):
            history.extend(tokens[:count])

    def materialize(self) -> None:
        return None

    def _keep_rows(self, keep: list[int]) -> None:
        self._history = [self._history[row] for row in keep]

    def capture(self, row: int) -> DraftRowCheckpoint:
        check_row(row, self.row_count)
        history = mx.array(self._history[row].tokens, dtype=mx.int32)
        metadata = {"max": self.provider.max_n, "min": self.provider.min_n}
        return DraftRowCheckpoint(len(self._history[row]), CheckpointAttachment(self.schema, metadata, (history,)))

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        return [history.propose(int(token), depth) for history, token in zip(self._history, pending)]

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        check_per_row(accepted, self.row_count, "accepted count")
        for history, window, kept in zip(self._history, context.window, accepted):
            history.extend(window[: kept + 1])

    def dispose(self) -> None:
        self._history = []


def _history_of(checkpoint: DraftRowCheckpoint) -> list[int]:
    return [int(t) for t in to_mx(checkpoint.attachment.tensors[0]).tolist()]

"""Prompt-lookup (n-gram) drafting: no weights, only each row's token history.

To propose, a row finds the longest earlier match of its recent tokens (pending token included) over its prompt
and output, at least ``min`` tokens, through a suffix automaton of its history (:class:`MatchIndex`: grown one
token at a time, amortised O(1) per token, never a scan of the history), and proposes the tokens that followed
it. The draft length follows the match length (``draft_length``): a one-token match proposes little, a long match
(text being copied from the prompt or the output) proposes up to the whole depth. Its row checkpoint is
the int32 history of the tokens the target holds, schema ``ngram-history-v1``, metadata ``{max, min}``;
namespace ``ngram-history-v1:<max>:<min>`` (the index is rebuilt from the history on restore; ``max`` no longer
caps the match). N-gram drafting does not depend on the target's weights, so it also speculates under target
adapters.

Shadow drafting (:meth:`NgramRows.shadow`): at a round at depth 0 a row still proposes (microseconds) and keeps the
proposal; the tokens the target then emits judge it, position by position, as a drafting round would have
(``(drafted, agreed)``, a new proposal once one is judged). The depth controller reads these as the rows'
acceptance (``DepthController.observe_shadow``), so prompt lookup needs no probe to see a turn to copying.
Tokens never depend on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.drafters.base import DraftRows
from spec_cache.errors import ModelLoadError
from spec_cache.rows.protocol import (
    PrefillContext,
    PreparedStateChange,
    RoundContext,
    check_checkpoints,
    check_per_row,
    check_row,
    to_mx,
)
from spec_cache.rows.sampling import Sampling
from spec_cache.rows.target import TargetRows
from spec_cache.schemas import (
    NGRAM_HISTORY_V1,
    CheckpointAttachment,
    DraftRowCheckpoint,
    SchemaError,
    validate_checkpoint,
)

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


#: matches up to this many tokens draft from their latest occurrence, longer ones from their earliest (measured on
#: SmolLM2's greedy outputs for the copy, chat and random-text workloads: 1 accepts the most overall)
RECENT = 1


def draft_length(match: int, depth: int) -> int:
    """Tokens to propose after a match of ``match`` tokens: twice the match, up to ``depth`` (a copied run of 3+
    tokens drafts 6+; a lone shared token drafts 2, which are cheap to verify and often wrong)."""
    return max(0, min(depth, 2 * match))


class MatchIndex:
    """One row's token history and a suffix automaton over it (prompt + output), grown one token at a time.

    Why an automaton: a copy task's answer repeats long runs of its prompt, and the best draft follows the
    *longest* earlier match of the row's recent tokens, whatever its length; an n-gram hash only finds matches of
    its key sizes, and a scan of the history costs O(history) per draft. The automaton's states are the classes
    of substrings that end at the same positions; each keeps the end of its first occurrence. ``match(pending)``
    walks suffix links from the state of the whole history to the first one that continues with ``pending``:
    that is the longest suffix of ``history + [pending]`` occurring earlier, and where it first ended. The walk
    is the one the next :meth:`extend` of ``pending`` repeats, and both are amortised O(1) per token (the
    pending token is always the next token the history gets). Which occurrence of the longest match drafts: a
    one-token match (up to ``RECENT`` tokens) the latest, from a table of each short n-gram's latest end: a lone
    shared token is a weak signal, and recent text predicts it best (a model repeating its own lines: 138 vs 118
    accepted on the random-text workload); a longer one the earliest (a copied passage: the earliest continues
    longest; 357 vs 344 accepted on the copy workload than the latest).

    ``min_n``: the shortest match that drafts. ``max_n`` is part of the drafter's namespace and checkpoint
    metadata (lookup policy identity); the automaton does not cap the match length.
    """

    def __init__(self, max_n: int, min_n: int, tokens=()) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]  # per state: token -> state
        self._link: list[int] = [-1]  # suffix link (root: -1)
        self._len: list[int] = [0]  # longest substring of the state
        self._first: list[int] = [0]  # end (exclusive) of its first occurrence
        self._last = 0  # the state of the whole history
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram (n <= RECENT) -> end of its latest occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def _state(self, length: int, first: int, link: int, transitions: dict[int, int]) -> int:
        self._next.append(transitions)
        self._link.append(link)
        self._len.append(length)
        self._first.append(first)
        return len(self._len) - 1

    def extend(self, tokens) -> None:
        """Append tokens to the history (the standard online suffix-automaton construction)."""
        nxt, link, size = self._next, self._link, self._len
        for token in tokens:
            token = int(token)
            self.tokens.append(token)
            end = len(self.tokens)
            cur = self._state(end, end, -1, {})
            p = self._last
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = cur
                p = link[p]
            if p == -1:
                link[cur] = 0
            else:
                q = nxt[p][token]
                if size[p] + 1 == size[q]:
                    link[cur] = q
                else:
                    clone = self._state(size[p] + 1, self._first[q], link[q], dict(nxt[q]))
                    while p != -1 and nxt[p].get(token) == q:
                        nxt[p][token] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            self._last = cur
            for n in range(1, min(RECENT, end) + 1):
                self._latest[tuple(self.tokens[end - n:end])] = end

    def match(self, pending: int) -> tuple[int, int]:
        """``(length, end)``: the longest suffix of ``history + [pending]`` that also ends at an earlier position,
        and where (``history[end - length:end]`` equals it; ``end <= len(history)``): the latest such end when
        ``length <= RECENT``, else the earliest; ``(0, 0)`` when ``pending`` never occurred."""
        nxt, link = self._next, self._link
        p = self._last
        while p != -1 and pending not in nxt[p]:
            p = link[p]
        if p == -1:
            return 0, 0
        length = self._len[p] + 1
        if length > RECENT:
            return length, self._first[nxt[p][pending]]
        return length, self._latest[(*self.tokens[len(self.tokens) - length + 1:], pending)]

    def propose(self, pending: int, depth: int) -> list[int]:
        """The ``draft_length(match, depth)`` tokens that followed the longest earlier match of
        ``history + [pending]`` (of at least ``min_n`` tokens; none when it is shorter)."""
        if depth <= 0:
            return []
        pending = int(pending)
        length, end = self.match(pending)
        if length < self.min_n:
            return []
        count = draft_length(length, depth)
        draft = self.tokens[end:end + count]
        if len(draft) < count:  # the continuation reaches the history's end: the pending token follows it
            draft.append(pending)
        return draft


class NgramProvider:
    """The n-gram lookup policy (``max``/``min`` n-gram sizes); opens :class:`NgramRows` groups."""

    schema = NGRAM_HISTORY_V1
    supports_target_adapters = True

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        from spec_cache.naming.namespace import ngram_namespace

        self.namespace = ngram_namespace(max_n, min_n)  # validates 1 <= min_n <= max_n
        self.max_n, self.min_n = max_n, min_n

    @classmethod
    def load(cls, model_dir: str | Path) -> "NgramProvider":
        """Read ``config.json`` ``{"method": "ngram", "max": 3, "min": 1}`` (both keys optional)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config.get("method") != METHOD:
            raise ModelLoadError(f"not an ngram drafter config (method={config.get('method')!r})")
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

    #: judged would-be drafts kept per row until :meth:`shadow` collects them (bounded: nobody may collect)
    SHADOW_KEEP = 64

    def _init_state(self) -> None:
        self._history: list[MatchIndex] = []
        self._shadow_depth = 0  # depth of would-be drafts at depth-0 rounds (0: none until shadow() is called)
        self._outstanding: list = []  # per row: [proposal, positions passed] being judged, "skip", or None
        self._judged: list[list[tuple[int, int]]] = []  # per row: (drafted, agreed) not collected yet

    def _shadow_rows(self) -> None:
        """Per-row shadow lists as long as the history (rows appended since; a dropped append never reaches it)."""
        missing = len(self._history) - len(self._outstanding)
        if missing > 0:
            self._outstanding += [None] * missing
            self._judged += [[] for _ in range(missing)]

    def _shadow_step(self, pending: Sequence[int]) -> None:
        """Judge each row's outstanding would-be draft by ``pending`` (what the target emitted last round), and
        propose anew once it is judged, exactly where a drafting round would have proposed next: after the first
        rejected position (the target's token there is ``pending``), or after the token that follows a draft
        passed whole (the bonus token a drafting round emits with it)."""
        self._shadow_rows()
        for row, (history, token) in enumerate(zip(self._history, pending)):
            state, judged, token = self._outstanding[row], self._judged[row], int(token)
            if state == "skip":  # the last draft passed whole; ``token`` is the bonus token
                state = None
            elif state is not None:
                proposal, passed = state
                if proposal[passed] == token:
                    state[1] = passed = passed + 1
                    if passed == len(proposal):
                        judged.append((len(proposal), passed))
                        self._outstanding[row] = "skip"
                    continue
                judged.append((len(proposal), passed))
            proposal = history.propose(token, self._shadow_depth)
            self._outstanding[row] = [proposal, 0] if proposal else None
            if not proposal:
                judged.append((0, 0))
            del judged[:-self.SHADOW_KEEP]

    def shadow(self, depth: int) -> list[list[tuple[int, int]]]:
        """Per row, the ``(drafted, agreed)`` of its would-be drafts judged since the last call (rounds at depth
        0; module doc); later would-be drafts go up to ``depth`` tokens."""
        self._shadow_rows()
        self._shadow_depth = max(int(depth), 0)
        judged, self._judged = self._judged, [[] for _ in self._judged]
        return judged

    def _forget_shadow(self, rows) -> None:
        """Drop the outstanding would-be drafts of ``rows`` (tokens reached them by another way)."""
        self._shadow_rows()
        for row in rows:
            self._outstanding[row] = None

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
        self._forget_shadow([row for row, tokens in enumerate(tokens_per_row) if len(tokens)])

    def consume(self, tokens_per_row: Sequence[Sequence[int]], context, lengths: Sequence[int]) -> None:
        """Append ``lengths[row]`` externally supplied tokens to each row's history (no target state needed)."""
        check_per_row(lengths, self.row_count, "length")
        for row, (tokens, count) in enumerate(zip(tokens_per_row, lengths)):
            if not 0 <= count <= len(tokens):
                raise ValueError(f"row {row}: consume length {count} for {len(tokens)} tokens")
        for history, tokens, count in zip(self._history, tokens_per_row, lengths):
            history.extend(tokens[:count])
        self._forget_shadow([row for row, count in enumerate(lengths) if count])

    def materialize(self) -> None:
        return None

    def _keep_rows(self, keep: list[int]) -> None:
        self._shadow_rows()
        self._history = [self._history[row] for row in keep]
        self._outstanding = [self._outstanding[row] for row in keep]
        self._judged = [self._judged[row] for row in keep]

    def capture(self, row: int) -> DraftRowCheckpoint:
        check_row(row, self.row_count)
        history = mx.array(self._history[row].tokens, dtype=mx.int32)
        metadata = {"max": self.provider.max_n, "min": self.provider.min_n}
        return DraftRowCheckpoint(len(self._history[row]), CheckpointAttachment(self.schema, metadata, (history,)))

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0:
            if self._shadow_depth:
                self._shadow_step(pending)
            return [[] for _ in pending]
        self._forget_shadow(range(len(self._history)))  # drafting for real: its rounds are observed as they are
        return [history.propose(int(token), depth) for history, token in zip(self._history, pending)]

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        check_per_row(accepted, self.row_count, "accepted count")
        for history, window, kept in zip(self._history, context.window, accepted):
            history.extend(window[: kept + 1])

    def dispose(self) -> None:
        self._history = []
        self._outstanding, self._judged = [], []


def _history_of(checkpoint: DraftRowCheckpoint) -> list[int]:
    return [int(t) for t in to_mx(checkpoint.attachment.tensors[0]).tolist()]

"""A cohort of rows joining a running batch, prefilled chunk by chunk between the batch's decode rounds.

Why: a long prompt prefilled in one go stalls every decoding row for the whole prefill (hundreds of ms on an
8B-shaped model). vLLM and SGLang split the prefill under a per-step token budget and interleave it with decode
steps; ``DecodeSession`` does the same with a ``JoiningCohort``: each step forwards one chunk of
``prefill_step_size`` positions of the cohort's own ``TargetRows`` (separate caches: the decoding rows' state is
never touched), then runs the decoding rows' round. When the last chunk is in, the cohort joins the batch.

Exactness: the cohort's target rows get the very chunks a one-call ``prefill(tokens, step)`` forwards (the same
positions per chunk, counted from each row's first new token); a row that has no tokens left in a chunk appends
nothing, which only moves padding that attention masks out. The decoding rows' tokens cannot change: their caches
are other objects. Only the plain float path is split (no KV quantization, no recurrent layer, a drafter that
does not need the target's taps at every prefilled token); anything else is prefilled in one call, as before.

Checkpoints from the chunks themselves (``stops``): a row may name offsets into its tokens where its state is
wanted (a chat request's message boundaries, a ``cache_control`` breakpoint). A chunk then ends at the row's next
stop, and once it is forwarded ``on_stop(i, offset)`` runs while the row's target state holds exactly its tokens
up to there (``rows.extract(i)`` copies it). Before, each such offset was a prefill *phase* of its own: a row with
``max_tokens=1`` up to the offset, one extra one-token round, its boundary checkpoint, and a restore of it for the
next phase. A chunk that ends early computes the same K/V for its positions (a restored row's chunks start at its
restored length anyway; the exactness tests compare both against a cold run).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from spec_cache.rows.protocol import PrefillContext

__all__ = ["JoiningCohort"]


class JoiningCohort:
    """Rows on their way in: their target rows (``rows``), the tokens each still has to forward and what the
    chunks forwarded so far hand the drafters (each row's last hidden).

    ``members`` are the engine's rows (any objects; kept in order with the target rows); ``tokens[i]`` is what
    row ``i`` forwards (``prompt[target_start:-1]``); ``split``: whether the prefill may be spread over steps.
    """

    def __init__(self, members: list, rows: Any, tokens: Sequence[Sequence[int]], *, step: int,
                 tap_layers: Sequence[int] = (), split: bool = True, need_hidden: bool = True,
                 stops: Sequence[Sequence[int]] | None = None,
                 on_stop: Callable[[int, int], None] | None = None,
                 scores: Sequence[tuple[Sequence[int], int] | None] | None = None) -> None:
        """``stops[i]``: offsets into row ``i``'s tokens (each in ``1..len - 1``) where ``on_stop(i, offset)`` is
        called with the row's state holding exactly that many of its tokens (module doc); only on a cohort that may
        be split (``split``, no taps), else ignored. ``scores[i]``: ``(next_tokens, top)`` for a row whose
        forwarded tokens are scored (``BatchRows.prefill``), None for the others; ``scored[i]`` collects them."""
        self.need_hidden = need_hidden  # False: no drafter reads the last hidden (``BatchRows.prefill``)
        self.members = list(members)
        self.rows = rows
        self.step = step
        self.tap_layers = tuple(tap_layers)
        self.split = split and not self.tap_layers
        self._tokens = [list(t) for t in tokens]
        self._done = [0] * len(self._tokens)  # tokens forwarded per row
        self._stops = [sorted({int(k) for k in s if 0 < int(k) < len(t)}) for s, t in
                       zip(stops or [()] * len(self._tokens), self._tokens)] if self.split and on_stop else \
            [[] for _ in self._tokens]
        self.on_stop = on_stop
        self._scores = list(scores) if scores is not None and any(s is not None for s in scores) else None
        #: per row, the ``TokenLogprob`` of each forwarded token's next token so far (None: not asked)
        self.scored: list = [None if s is None else [] for s in (self._scores or [None] * len(self._tokens))]
        self._last: mx.array | None = None  # [B, 1, H]: each row's hidden at its last forwarded token
        self._context: PrefillContext | None = None

    @property
    def chunks_left(self) -> int:
        """Forwards still to run (0: ready to join)."""
        if self._context is not None:
            return 0
        left = max((len(t) - d for t, d in zip(self._tokens, self._done)), default=0)
        return max(1, -(-left // self.step))

    @property
    def ready(self) -> bool:
        return self._context is not None

    @property
    def joins_next(self) -> bool:
        """Whether one more chunk finishes the prefill: every row's tokens left fit one and no stop is left before
        their end (``chunks_left`` counts chunks, not the stops that end one early)."""
        if self._context is not None:
            return True
        return all(len(t) - d <= self.step and not stops
                   for t, d, stops in zip(self._tokens, self._done, self._stops))

    def advance(self, whole: bool) -> bool:
        """Forward one chunk (``whole``, or a cohort that may not be split: every chunk left, in one ``prefill``
        call); True once the cohort is ready to join (``context()``)."""
        if self._context is not None:
            return True
        stopping = any(self._stops)
        if not any(self._done) and not stopping and (whole or not self.split or self.chunks_left <= 1):
            # nothing forwarded yet and all of it now: exactly the one-call prefill
            extra = {} if self._scores is None else {"scores": self._scores}
            self._context = self.rows.prefill(self._tokens, step=self.step, tap_layers=self.tap_layers,
                                              need_hidden=self.need_hidden, **extra)
            self._collect(self._context.scores)
            return True
        while not self._forwarded():  # (else the rows with tokens left were dropped)
            self._forward_chunk(whole)  # ``whole``: up to the next stop, or everything left
            if not whole:
                break
        if self._forwarded():
            self._context = PrefillContext(self._last, [len(t) for t in self._tokens])
        return self._context is not None

    def _forward_chunk(self, whole: bool) -> None:
        """One forward: each row's next tokens, up to a chunk (all of them when ``whole``), never past its next
        stop; then ``on_stop`` for every row standing on one."""
        ends = []
        for t, d, stops in zip(self._tokens, self._done, self._stops):
            end = len(t) if whole else min(len(t), d + self.step)
            ends.append(min(end, stops[0]) if stops else end)
        chunk = [t[d:e] for t, d, e in zip(self._tokens, self._done, ends)]
        extra = {} if self._scores is None else {"scores": [
            None if s is None else (s[0][d:e], s[1]) for s, d, e in zip(self._scores, self._done, ends)]}
        forwarded = self.rows.prefill(chunk, step=self.step, need_hidden=self.need_hidden, **extra)
        self._collect(forwarded.scores)
        last = forwarded.last_hidden
        moved = [len(c) for c in chunk]
        self._done = [d + n for d, n in zip(self._done, moved)]
        if last is not None:  # None when no drafter reads it
            here = mx.array([n > 0 for n in moved])[:, None, None]
            self._last = last if self._last is None else mx.where(here, last, self._last)
        for i, (d, stops) in enumerate(zip(self._done, self._stops)):
            if stops and d == stops[0]:
                stops.pop(0)
                self.on_stop(i, d)

    def _collect(self, scores) -> None:
        for i, entries in enumerate(scores or ()):
            if entries is not None:
                self.scored[i] += entries

    def _forwarded(self) -> bool:
        """Every row's tokens are in its target rows."""
        return all(d == len(t) for t, d in zip(self._tokens, self._done))

    def context(self) -> PrefillContext:
        if self._context is None:
            raise RuntimeError("the cohort's prefill is not finished")
        return self._context

    def drop(self, positions: Sequence[int]) -> None:
        """Remove the members at ``positions`` (they left before joining; only between chunks)."""
        if self._context is not None:
            raise RuntimeError("a cohort ready to join has no members to drop: it joins in the same step")
        gone = set(positions)
        keep = [i for i in range(len(self.members)) if i not in gone]
        self.rows.filter_rows(keep)
        self.members = [self.members[i] for i in keep]
        self._tokens = [self._tokens[i] for i in keep]
        self._done = [self._done[i] for i in keep]
        self._stops = [self._stops[i] for i in keep]
        self.scored = [self.scored[i] for i in keep]
        if self._scores is not None:
            self._scores = [self._scores[i] for i in keep]
        if self._last is not None:
            self._last = self._last[mx.array(keep, dtype=mx.int32)] if keep else None

    def dispose(self) -> None:
        self.rows.dispose()

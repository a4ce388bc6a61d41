"""Which stored prefix serves a prompt: one candidate ranking for the local store and the shared tier.

A prefix of the prompt is served either by an *entry* (an exact boundary: the node it hangs off plus a tail of
fewer than ``chunk_tokens`` tokens) or by a *chunk boundary* (target state only, usable when every layer of
every checkpoint through that chunk was chunked). Both tiers list candidates along the prompt's chains with
``chain_candidates`` (from what they know of each node: LMDB rows or the server's node hashes) and rank them
with ``longest_first``: longer first, an entry before a chunk boundary of the same length. A candidate turns
into a ``Hit`` once its entry row (local) or manifest (shared) is read; ``first_usable`` returns the longest hit
the caller's ``usable`` predicate accepts, preferring one with the drafter's part at equal length.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

__all__ = ["Hit", "Usable", "Level", "Candidate", "chain_candidates", "longest_first", "first_usable"]


@dataclass(frozen=True)
class Hit:
    """A stored prefix that can serve the prompt: ``length`` tokens, from an entry or from chunks alone."""

    length: int                  # tokens of the prompt it covers
    has_drafter: bool            # the drafter asked for has its part stored with it
    entry: bytes | None          # entry key, or None for a chunk-boundary (target-only) hit
    chain: tuple[bytes, ...]     # root .. the chunk the prefix ends in or hangs off
    minimum_reusable: int = 0    # shortest prefix of it a restore may use (0 = any)


Usable = Callable[[Hit], bool]
"""The caller's rule for a hit it can use (e.g. ``lambda hit: hit.has_drafter and hit.length >= floor``)."""


@dataclass(frozen=True, slots=True)
class Level:
    """What a tier knows about one node of a chain."""

    tails: Sequence[int]         # tail lengths of the entries hanging off the node, longest first
    complete: bool               # every checkpoint through it had all layers chunked
    minimum_reusable: int        # largest minimum-reusable offset of the checkpoints through it


@dataclass(frozen=True, slots=True)
class Candidate:
    """A prefix the index says may be stored; not yet checked against its entry row or manifest."""

    length: int                  # tokens it would cover
    chain: tuple[bytes, ...]     # root .. the node it hangs off (entry) or ends in (chunk boundary)
    is_entry: bool               # an exact-boundary entry (else a chunk boundary)
    minimum_reusable: int = 0    # a chunk boundary's (its node's); an entry's is known once its row is read

    def tail_start(self, chunk_tokens: int) -> int:
        """Where the entry's tail starts in the prompt (the tokens its chunks cover)."""
        return (len(self.chain) - 1) * chunk_tokens


def chain_candidates(chain: Sequence[bytes], level: Callable[[int], Level | None], prompt_tokens: int,
                     chunk_tokens: int, floor: int = 0) -> Iterator[Candidate]:
    """Candidates along one chain (root, chunk 1..K of the prompt present in the index), longest first.

    ``level(j)`` describes node ``j`` (None: nothing usable there); it is called lazily, deepest node first,
    so a caller that stops early reads only the nodes it needed. Only candidates longer than ``floor`` and
    at most ``prompt_tokens`` long are listed.
    """
    for j in range(len(chain) - 1, -1, -1):
        base = j * chunk_tokens
        node = level(j)
        if node is None:
            continue
        for t in node.tails:
            length = base + t
            if floor < length <= prompt_tokens and length >= 1:
                yield Candidate(length, tuple(chain[:j + 1]), True)
        if j > 0 and base > floor and node.complete and node.minimum_reusable <= base:
            yield Candidate(base, tuple(chain[:j + 1]), False, node.minimum_reusable)


def _rank(candidate: Candidate) -> tuple[int, bool]:
    return -candidate.length, not candidate.is_entry


def longest_first(chains: Iterable[Iterable[Candidate]]) -> Iterator[Candidate]:
    """Merge per-chain candidate lists (each longest first) into one: longer first, an entry before a chunk
    boundary of the same length, earlier chains first among equals."""
    return heapq.merge(*chains, key=_rank)


def first_usable(candidates: Iterable[Candidate], resolve: Callable[[Candidate], Hit | None],
                 usable: Usable | None = None) -> Hit | None:
    """The longest hit ``usable`` accepts (any hit when it is None), or None.

    ``resolve`` turns a candidate into a hit (None: its entry is gone, damaged or not usable at that length).
    Among hits of equal length one with the drafter's part comes first, then an entry before a chunk boundary.
    """
    for _length, group in itertools.groupby(candidates, key=lambda c: c.length):
        hits = [hit for hit in map(resolve, group) if hit is not None]
        hits.sort(key=lambda h: (h.has_drafter, h.entry is not None), reverse=True)
        for hit in hits:
            if usable is None or usable(hit):
                return hit
    return None

"""The local lookup: the longest usable stored prefix of a prompt, from the LMDB index alone.

For each layer signature of the namespace the prompt's chain keys are hashed once (``keys.chain``) and walked
on raw node values (existence only) until the first missing or broken node; nodes are decoded lazily, deepest
first, as ``candidates.first_usable`` asks for them, and an entry row is read only for a candidate tail that
could win. Cost: one B-tree get per matched chunk plus one per candidate examined, independent of how many
entries the store holds. Nothing here reads or verifies a record (``read.py`` does that).
"""

from __future__ import annotations

from typing import Collection

import numpy as np

from . import keys
from .candidates import Candidate, Hit, Level, Usable, chain_candidates, first_usable, longest_first
from .index import Index, draft_key
from .values import Node, decode_typed, unpack

__all__ = ["lookup"]


def lookup(index: Index, ns_key: bytes, packed: np.ndarray, chunk_tokens: int, *, drafter: str | None = None,
           usable: Usable | None = None, hidden: Collection[bytes] = ()) -> Hit | None:
    """The longest stored prefix of ``packed`` that ``usable`` accepts (any when None); None on a miss.

    ``hidden``: keys of records known to be corrupt but not yet dropped (a read-only store); no hit uses them.
    A damaged index value met on the way raises ``CorruptIndex``.
    """
    info = index.namespace(ns_key)
    if info is None:
        return None
    chains = [_candidates(index, keys.root_key(ns_key, sig), packed, chunk_tokens, hidden)
              for sig in info.signatures]

    def resolve(candidate: Candidate) -> Hit | None:
        if not candidate.is_entry:
            return Hit(candidate.length, False, None, candidate.chain, candidate.minimum_reusable)
        return _entry_hit(index, candidate, packed, chunk_tokens, drafter, hidden)
    return first_usable(longest_first(chains), resolve, usable)


def _candidates(index: Index, root: bytes, packed: np.ndarray, chunk_tokens: int, hidden: Collection[bytes]):
    nodes_db = index.dbs["nodes"]
    raw_root = index.txn.get(root, db=nodes_db)
    if raw_root is None:
        return iter(())
    # Walk the chain on raw values (existence only); a node is decoded only when its level is examined.
    chain = keys.chain(root, packed, chunk_tokens, max_chunks=len(packed) // chunk_tokens)
    raws = [raw_root]
    for key in chain[1:]:
        raw = index.txn.get(key, db=nodes_db)
        if raw is None or key in hidden:
            break
        raw = bytes(raw)  # a few dozen bytes; the marker test needs bytes, not a memoryview
        if b"broken" in raw and unpack(raw).get("broken"):
            break
        raws.append(raw)
    chain = chain[:len(raws)]

    def level(j: int) -> Level:
        node: Node = decode_typed("nodes", raws[j], chain[j])  # shape-checked: damage is a CorruptIndex
        return Level(node.tail_lengths(), node.complete, node.minimum_reusable)
    return chain_candidates(chain, level, len(packed), chunk_tokens)


def _entry_hit(index: Index, candidate: Candidate, packed: np.ndarray, chunk_tokens: int, drafter: str | None,
               hidden: Collection[bytes]) -> Hit | None:
    length = candidate.length
    key = keys.entry_key(candidate.chain[-1], packed[candidate.tail_start(chunk_tokens):length])
    if key in hidden:
        return None
    entry = index.entry(key)
    if entry is None or entry.length != length or length < entry.minimum_reusable:
        return None
    has_drafter = drafter is not None and drafter in entry.drafters and draft_key(key, drafter) not in hidden
    return Hit(length, has_drafter, key, candidate.chain, entry.minimum_reusable)

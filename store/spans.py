"""Target pieces (store format 1.3): tails and chunks stored as shared, content-addressed spans of tokens.

Before 1.3 every entry record held its whole tail (up to ``chunk_tokens - 1`` tokens of every chunked layer), and
a chunk record held its ``chunk_tokens`` tokens whole. An agentic conversation checkpoints several times a turn
on one growing chain, so the same tail bytes were written once per entry and once more in the chunk: 3.4x-4.8x
the unique KV (``spec_cache/apps/bench/write_amp.py``). From 1.3 a target span (an entry's tail, or a chunk that
earlier entries' tails already covered) is written as a list of *target pieces*:

* a piece holds the tokens ``[start + lo, start + hi)`` of one span (``start`` = the span's first token: the
  entry's tail start, or the chunk's) and every chunked layer's slice of them, named ``tokens`` and ``L{i}.{j}``
  as in chunk records. Its key is a keyed blake3 (namespace key) of its tensor table and bytes (``pieces._piece``):
  equal bytes in one namespace are stored once, never shared across namespaces;
* a new entry cuts its tail where the longest earlier entry hanging off the same node (whose tail is a prefix of
  this one) cut its own, plus one new piece for the rest: the earlier pieces hash equal and are referenced, not
  written again. A new chunk is cut the same way from the entries hanging off its parent node; a chunk nothing
  covered before is written whole, as before. After ``MAX_PIECES`` pieces a span starts over with one piece (a
  restore reads one record per piece: the bound keeps a restore's record count within ``MAX_PIECES`` per chunk),
  and a last piece shorter than ``MIN_PIECE_TOKENS`` is not kept but written again with the next put's new tokens
  (agents checkpoint at n-1, n, n+1: 1-token pieces would make a restore's copies tiny and many);
* a pieced entry or chunk record keeps its tokens (and, for an entry, the untrimmable layers) inline and lists its
  pieces in ``meta["pieces"]`` = ``[[key, lo, hi], ...]`` (contiguous from 0 to the span's length); the index row
  lists them too (``Entry.extra["tpc"]``, ``Node.extra["pcs"]``) so ``verify``/``gc`` count references without
  reading records. Piece records and their ``piece/`` rows are the 1.2 drafter pieces' (``pieces.py``): one
  reference count per piece over drafter parts, entries and nodes; a piece goes with its last reference.

Reading checks every piece (checksum, key, kind, its tokens against the prompt at its position, contiguity); a
damaged or missing piece is reported against the record that names it (the entry is dropped, the chunk's node
marked broken), so it is never served. The shared tier ships whole records (``whole_record``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .codec import Record, encode_record
from .errors import CorruptIndex, CorruptRecord
from .keys import entry_key
from .pieces import Piece, _piece

__all__ = ["SPANS_MINOR", "MAX_PIECES", "WRITE_SPANS", "SpanPiece", "span_list", "span_list_ok", "entry_spans",
           "node_spans", "span_keys", "prior_spans", "cut_span", "span_segments", "whole_record"]

SPANS_MINOR = 3     # store format 1.3: entry tails and chunks may be lists of shared target pieces
SPAN_PREFIX = 8     # bytes of the span's node key a target piece's key starts with (locality in LMDB)
MAX_PIECES = 16     # pieces one span may have; past it the span is written as one new piece
MIN_PIECE_TOKENS = 4   # a span's last piece shorter than this is rewritten by the next put extending it
WRITE_SPANS = True  # False: write whole tails and chunks (the pre-1.3 layout; benchmarks measure "before" so)


@dataclass
class SpanPiece:
    """A target piece of a span being written: the piece and the range of the span it covers."""

    piece: Piece
    lo: int
    hi: int

    def row(self) -> list:
        return [self.piece.key, self.lo, self.hi]


def span_list_ok(v) -> bool:
    """``[[key32, lo, hi], ...]``, contiguous from 0, each non-empty."""
    if type(v) is not list or not v:
        return False
    at = 0
    for item in v:
        if not (type(item) is list and len(item) == 3 and type(item[0]) is bytes and len(item[0]) == 32
                and type(item[1]) is int and type(item[2]) is int and item[1] == at and item[2] > at):
            return False
        at = item[2]
    return True


def span_list(extra: dict, field: str, what: str) -> list:
    """The span list under ``extra[field]`` (``[]`` when absent); a malformed one raises ``CorruptIndex``."""
    v = extra.get(field)
    if v is None:
        return []
    if not span_list_ok(v):
        raise CorruptIndex(f"{what} piece list is malformed; the store is damaged: run 'spec-cache gc'", what)
    return v


def entry_spans(entry) -> list:
    """The target pieces of an entry's tail (``[]``: a whole tail, the pre-1.3 layout)."""
    return span_list(entry.extra, "tpc", "entries")


def node_spans(node) -> list:
    """The target pieces of a node's chunk (``[]``: a whole chunk record)."""
    return span_list(node.extra, "pcs", "nodes")


def span_keys(spans: list) -> list[bytes]:
    return [bytes(s[0]) for s in spans]


def prior_spans(index, node_key: bytes, tokens: np.ndarray) -> list:
    """The pieces of the longest entry hanging off ``node_key`` whose tail is a prefix of ``tokens`` (the span's
    tokens; ``[]``: none, or it is whole). Index reads only: one hash and get per tail length."""
    node = index.node(node_key)
    if node is None or node.broken:
        return []
    for t in node.tail_lengths():
        if not 0 < t <= len(tokens):
            continue
        try:
            entry = index.entry(entry_key(node_key, tokens[:t]))
            spans = entry_spans(entry) if entry is not None and entry.node == node_key else []
        except CorruptIndex:  # gc's to rebuild; write this span fresh
            continue
        if spans:
            return spans
    return []


def cut_span(ns_key: bytes, node_key: bytes, start: int, stop: int, prior: list,
             slices: Callable[[int, int], list]) -> list[SpanPiece]:
    """Pieces of the span ``[start, stop)`` hanging off node ``node_key``: ``prior``'s cuts (``[[key, lo, hi],
    ...]`` of an earlier span off the same node) where they fit, then one piece for the rest. ``slices(a, b)``
    gives the piece's ``(name, dtype, array)`` tensors of the absolute token range ``[a, b)``."""
    n = stop - start
    cuts = [(lo, hi) for _k, lo, hi in prior if hi <= n] if len(prior) < MAX_PIECES else []
    if cuts and cuts[-1][1] < n and cuts[-1][1] - cuts[-1][0] < MIN_PIECE_TOKENS:
        cuts.pop()  # a short last piece is written again with the new tokens: no span keeps many tiny pieces
    at = cuts[-1][1] if cuts else 0
    if at < n:
        cuts.append((at, n))
    return [SpanPiece(_span_piece(ns_key, node_key, slices(start + lo, start + hi)), lo, hi) for lo, hi in cuts]


def _span_piece(ns_key: bytes, node_key: bytes, tensors: list) -> Piece:
    """A target piece keyed ``node_key[:8]`` + 24 bytes of its content key (keyed blake3, ``pieces._piece``).

    The prefix keeps one span's pieces (their records and their ``piece/`` rows) next to each other in LMDB:
    a put that references a span's earlier pieces dirties one leaf page, not one per piece (random keys cost
    ~4 KiB of page writes per piece per put). Equal bytes under another node are not shared (never happens:
    a span's KV depends on the prefix before it)."""
    base = _piece(ns_key, tensors)
    key = bytes(node_key[:SPAN_PREFIX]) + base.key[:32 - SPAN_PREFIX]
    return Piece(key, base.nbytes, lambda: encode_record("piece", tensors, meta={"key": key}))


def span_segments(rec: Record, owner: bytes, start: int, span: int, get_piece: Callable[[bytes, bytes, int, int],
                                                                                        Record]) -> list[Record]:
    """The records holding a pieced record's chunked tensors, in order (``[rec]`` for a whole one).

    ``get_piece(key, owner, lo, hi)`` returns the verified piece (tokens checked); any failure raises
    ``CorruptRecord`` naming ``owner``, the record to drop."""
    spans = rec.meta.get("pieces")
    if spans is None:
        return [rec]
    if not span_list_ok(spans) or spans[-1][2] != span:
        raise CorruptRecord(f"{rec.kind} record: piece list does not cover its {span} tokens", owner)
    return [get_piece(bytes(k), owner, start + lo, start + hi) for k, lo, hi in spans]


def whole_record(rec: Record, kind: str, key: bytes, segments: list[Record]) -> np.ndarray:
    """``rec`` (a pieced entry or chunk record) re-encoded whole from its ``segments``: what the shared tier
    ships, so readers elsewhere need no pieces."""
    meta = {k: v for k, v in rec.meta.items() if k != "pieces"}
    chunked = {f"L{row[0]}.{j}": row[3] for row in meta.get("layers", []) if row[3] is not None
               for j in range(len(row[4]))}

    def tensors():
        for name, t in rec.tensors.items():
            if name not in chunked:
                yield name, t.dtype, t.array()
        for name, axis in chunked.items():
            parts = [s.tensors[name] for s in segments]
            yield name, parts[0].dtype, np.concatenate([p.array() for p in parts], axis=axis)
    try:
        return encode_record(kind, list(tensors()), meta=meta)
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise CorruptRecord(f"{kind} record: pieces do not fit its layer table ({exc})", key) from None

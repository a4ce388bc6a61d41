"""The first half of a put: a checkpoint checked, keyed and encoded, before any transaction starts.

``prepare_checkpoint`` validates the arguments (token values, layer shapes, the drafter attachment against its
schema), computes the layer signature, the chain keys and the entry key, and encodes the entry record and the
drafter record. Chunk records are encoded lazily (``Checkpoint.chunk_record``): inside the transaction, only for
the chunks the store does not hold yet. Every record names the key it is stored under (checked on read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from spec_cache.schemas import CheckpointAttachment, validate_attachment

from . import keys
from . import spans as S
from .codec import encode_record
from .errors import ChunkNotCopied, InvalidInput
from .index import draft_key
from .pieces import Piece, split_tensors, token_axes
from .tensors import LayerState, Tensor
from .values import pack

__all__ = ["Checkpoint", "prepare_checkpoint", "layer_signature"]


@dataclass
class Checkpoint:
    """A checkpoint ready to commit: its keys and encoded records."""

    ns_key: bytes                     # namespace key
    packed: np.ndarray                # the tokens, little-endian uint32
    arrays: list[list[np.ndarray]]    # each layer's tensors as numpy arrays (views where possible)
    layer_table: list                 # [index, kind, meta, token axis, [[dtype, shape], ...]] per layer
    signature: bytes                  # layer signature of the chunked layers (b"": none is chunked)
    chunked: list[int]                # indices of the chunked (token-sliceable) layers
    chunk_tokens: int                 # the store's chunk size
    chain: list[bytes]                # root, chunk 1..K (the full chunks the chunked layers are split into)
    entry_key: bytes                  # key of the exact-boundary entry
    complete: bool                    # every layer is chunked (a chunk boundary of it can serve alone)
    minimum_reusable: int             # shortest prefix of it a restore may use
    entry_record: np.ndarray          # encoded entry record (tail tokens, tails of chunked layers, other layers)
    drafter: str | None               # drafter namespace of the drafter part, or None
    draft_record: np.ndarray | None   # encoded drafter record, or None
    draft_pieces: list[Piece] = None  # shared pieces the drafter record refers to (store format 1.2)
    #: write tails and chunks whole (no target pieces): the retry of a put refused for the budget, since a pieced
    #: chunk may keep an evicted entry's pieces alive beside it (``Store._put_one``)
    whole: bool = False
    #: the caller copied only tokens from here on (``Store.put(copied_from=...)``): the chunks before it must be
    #: in the store already; needing one raises ``ChunkNotCopied`` and the put writes nothing
    copied_from: int = 0

    @property
    def length(self) -> int:
        return len(self.packed)

    @property
    def tail_start(self) -> int:
        """Where the entry's tail starts: the tokens the chain's chunks cover."""
        return (len(self.chain) - 1) * self.chunk_tokens

    @property
    def own_bytes(self) -> int:
        """Bytes of the entry and drafter records (chunks not counted)."""
        return (self.entry_record.nbytes + (self.draft_record.nbytes if self.draft_record is not None else 0)
                + sum(p.nbytes for p in self.draft_pieces or ()))

    @property
    def _spans(self) -> bool:
        return S.WRITE_SPANS and not self.whole

    def _copied(self, lo: int) -> None:
        if lo < self.copied_from:
            raise ChunkNotCopied(f"tokens from {lo} are needed but only those from {self.copied_from} were copied")

    def piece_slices(self, lo: int, hi: int) -> list:
        """The tensors of a target piece of tokens ``[lo, hi)`` (store format 1.3, ``spans.py``)."""
        self._copied(lo)
        out = [("tokens", "uint32", self.packed[lo:hi])]
        for i in self.chunked:
            _, _, _, axis, specs = self.layer_table[i]
            out += [(f"L{i}.{j}", specs[j][0], _slice(arr, axis, lo, hi)) for j, arr in enumerate(self.arrays[i])]
        return out

    def chunk_write(self, index, k: int):
        """Chunk ``k``'s record, pieced (``(record, [SpanPiece])``) when entries hanging off its parent already
        wrote a prefix of it as pieces (format 1.3), else whole (a record)."""
        lo, hi = (k - 1) * self.chunk_tokens, k * self.chunk_tokens
        self._copied(lo)
        prior = S.prior_spans(index, self.chain[k - 1], self.packed[lo:hi]) if self._spans else []
        if not prior:
            return self.chunk_record(k)
        cut = S.cut_span(self.ns_key, self.chain[k - 1], lo, hi, prior, self.piece_slices)
        return encode_record("chunk", [("tokens", "uint32", self.packed[lo:hi])], meta={
            "depth": k, "start": lo, "chunk_tokens": self.chunk_tokens,
            "layers": [self.layer_table[i] for i in self.chunked], "key": self.chain[k],
            "complete": self.complete, "pieces": [p.row() for p in cut]}), cut

    def entry_write(self, index) -> tuple[np.ndarray, list]:
        """The entry record and the target pieces its tail is cut into (format 1.3; ``[]``: a whole tail)."""
        start, n = self.tail_start, self.length
        if not (self._spans and self.chunked and n > start):
            return self.entry_record, []
        prior = S.prior_spans(index, self.chain[-1], self.packed[start:])
        cut = S.cut_span(self.ns_key, self.chain[-1], start, n, prior, self.piece_slices)

        def tensors():
            yield "tokens", "uint32", self.packed[start:]
            for i, row in enumerate(self.layer_table):
                if row[3] is None:
                    for j, arr in enumerate(self.arrays[i]):
                        yield f"L{i}.{j}", row[4][j][0], arr
        meta = {"layers": self.layer_table, "length": n, "chunk_tokens": self.chunk_tokens,
                "min_reusable": self.minimum_reusable, "key": self.entry_key, "pieces": [p.row() for p in cut]}
        return encode_record("entry", tensors(), meta=meta), cut

    def chunk_record(self, k: int) -> np.ndarray:
        """Encode chunk ``k`` (1-based): its tokens and the chunked layers' slices of it."""
        lo, hi = (k - 1) * self.chunk_tokens, k * self.chunk_tokens
        self._copied(lo)

        def tensors():
            yield "tokens", "uint32", self.packed[lo:hi]
            for i in self.chunked:
                _, _, _, axis, specs = self.layer_table[i]
                for j, arr in enumerate(self.arrays[i]):
                    yield f"L{i}.{j}", specs[j][0], _slice(arr, axis, lo, hi)
        # "complete": the writing checkpoint had every layer chunked (a chunk-boundary hit needs that)
        return encode_record("chunk", tensors(), meta={
            "depth": k, "start": lo, "chunk_tokens": self.chunk_tokens,
            "layers": [self.layer_table[i] for i in self.chunked], "key": self.chain[k],
            "complete": self.complete})


def prepare_checkpoint(ns_key: bytes, tokens, layers: Sequence[LayerState], *, chunk_tokens: int,
                       drafter: tuple[str, CheckpointAttachment] | None = None,
                       minimum_reusable: int = 0, copied_from: int = 0) -> Checkpoint:
    """Check, key and encode a checkpoint; raises ``InvalidInput`` or ``SchemaError`` (nothing is written).
    ``copied_from``: see ``Store.put``."""
    packed = keys.pack_tokens(tokens)
    layers = _checked_layers(packed, layers, minimum_reusable)
    n = len(packed)
    signature, chunked = layer_signature(layers)
    full = n // chunk_tokens if chunked else 0
    if not isinstance(copied_from, int) or not 0 <= copied_from <= full * chunk_tokens \
            or copied_from % chunk_tokens:
        raise InvalidInput(f"copied_from must be a chunk boundary within the checkpoint's full chunks, got "
                           f"{copied_from!r}")
    chain = keys.chain(keys.root_key(ns_key, signature), packed, chunk_tokens, max_chunks=full)
    tail_start = full * chunk_tokens
    entry_key = keys.entry_key(chain[-1], packed[tail_start:])
    draft_record, dns, pieces = None, None, []
    if drafter is not None:
        dns, attachment = drafter
        draft_record, pieces = _draft_record(ns_key, dns, attachment, n, entry_key, chunk_tokens)
    arrays = [[t.array() for t in layer.tensors] for layer in layers]
    table = _layer_table(layers)

    def entry_tensors():
        yield "tokens", "uint32", packed[tail_start:]
        for i, layer in enumerate(layers):
            for j, arr in enumerate(arrays[i]):
                dtype = layer.tensors[j].dtype
                yield f"L{i}.{j}", dtype, arr if layer.token_axis is None else _slice(arr, layer.token_axis,
                                                                                      tail_start, n)

    entry_record = encode_record("entry", entry_tensors(), meta={
        "layers": table, "length": n, "chunk_tokens": chunk_tokens, "min_reusable": minimum_reusable,
        "key": entry_key})
    return Checkpoint(ns_key, packed, arrays, table, signature, chunked, chunk_tokens, chain, entry_key,
                      len(chunked) == len(layers), minimum_reusable, entry_record, dns, draft_record, pieces,
                      copied_from=copied_from)


def _checked_layers(packed: np.ndarray, layers: Sequence[LayerState], minimum_reusable: int) -> list[LayerState]:
    n = len(packed)
    if n < 1:
        raise InvalidInput("a checkpoint must cover at least one token")
    if not isinstance(minimum_reusable, int) or not 0 <= minimum_reusable <= n:
        raise InvalidInput("minimum_reusable must be an int in [0, len(tokens)]")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, LayerState):
            raise InvalidInput(f"layer {i} is not a LayerState")
        if layer.token_axis is not None and any(t.shape[layer.token_axis] != n for t in layer.tensors):
            raise InvalidInput(f"layer {i} covers {layer.tokens} tokens along its token axis, checkpoint has {n}")
    return layers


def _draft_record(ns_key: bytes, dns, attachment: CheckpointAttachment, n: int, entry_key: bytes,
                  chunk_tokens: int) -> tuple[np.ndarray, list[Piece]]:
    """The drafter record and the shared pieces it refers to (``pieces.py``; none: the whole pre-1.2 layout)."""
    if not isinstance(dns, str) or not dns:
        raise InvalidInput("drafter namespace must be a non-empty string")
    validate_attachment(attachment, n)
    tensors = [(t.dtype, t.array()) for t in _as_tensors(attachment.tensors)]
    axes = token_axes(attachment.schema, dict(attachment.metadata), [a.shape for _d, a in tensors])
    inline, manifest, pieces = split_tensors(ns_key, tensors, axes, chunk_tokens)
    meta = {"metadata": dict(attachment.metadata), "processed_tokens": n, "key": draft_key(entry_key, dns)}
    if manifest is not None:
        meta["pieced"] = manifest
    return encode_record("draft", inline, schema=attachment.schema, meta=meta), pieces


def layer_signature(layers: Sequence[LayerState]) -> tuple[bytes, list[int]]:
    """Layer signature of the chunked layers (kinds, scalars, dtypes, shapes without the token axis) and
    their indices; b"" when no layer is chunked."""
    sig, chunked = [], []
    for i, layer in enumerate(layers):
        if layer.token_axis is None:
            continue
        chunked.append(i)
        shapes = [[t.dtype, [(-1 if a == layer.token_axis else d) for a, d in enumerate(t.shape)]]
                  for t in layer.tensors]
        sig.append([i, layer.kind, layer.meta, layer.token_axis, shapes])
    return (pack(sig) if sig else b""), chunked


def _layer_table(layers: Sequence[LayerState]) -> list:
    return [[i, layer.kind, layer.meta, layer.token_axis, [[t.dtype, list(t.shape)] for t in layer.tensors]]
            for i, layer in enumerate(layers)]


def _slice(arr: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * arr.ndim
    index[axis] = slice(start, stop)
    return arr[tuple(index)]


def _as_tensors(tensors) -> list[Tensor]:
    out = []
    for t in tensors:
        if isinstance(t, Tensor):
            out.append(t)
        elif isinstance(t, np.ndarray):
            out.append(Tensor.from_numpy(t))
        else:
            raise InvalidInput(f"attachment tensors must be store.Tensor or numpy arrays, got {type(t).__name__}")
    return out

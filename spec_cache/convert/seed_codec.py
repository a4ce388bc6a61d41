"""Reading the seed's (mlx-bun) drafter attachments: its ``mlx-cache-v3`` cache headers and its ``.mlxkv`` files.

mlx-bun writes a projected or standalone drafter's state through its SSD cache codecs (provider id
``mlx-cache-v3``): ``metadata.cacheHeaders`` is ``JSON.stringify`` of one header per drafter layer, ``null`` for an
empty layer, else ``{kind, offset, [idx, maxSize, groupSize, bits, ...], tensors: [{off, bytes, shape, dtype,
hash}], [minimumReusableOffset]}`` where ``off`` indexes ``attachment.tensors``, ``dtype`` is MLX's numeric dtype
enum (mlx-c ``mlx_dtype``: bool 0 ... float64 11, bfloat16 12, complex64 13) and ``hash`` is ``""``. spec-cache
writes the same tensors under its own codec id ``spec-cache-kv-v1`` with plain index lists (``cache_codec.py``).
``from_seed_attachment`` converts one into the other, tensors unchanged (no copy of their bytes):

* readable: ``kv`` (K, V ``[1, heads, offset, dim]``) and ``qkv`` (K's packed/scales/biases then V's, the same
  order and slicing as ours, with ``groupSize``/``bits``/``minimumReusableOffset``), i.e. every layer a projected
  drafter (DeepSpec, DFlash, DFlash2) writes and the plain or quantized KV layers of a draft model; schemas
  without cache headers (``gemma-assistant-v1``, ``qwen-mtp-v1``, ``glm52-native-mtp-v1``, ``ngram-history-v1``)
  have the same layout in both and pass through as they are;
* refused (``SeedFormatError`` naming the layer and why): ``rotating`` and ``rotating-qkv`` (spec-cache's codec
  restores no ring layers), ``ssm`` (mlx-bun's conv/recurrent layout is not proven equal to mlx-lm's
  ``ArraysCache``), ``turboquant``, ``paged``, ``mla``/``mla-dsa``/``mtp-mla`` (no such cache in mlx-lm).

``read_mlxkv`` reads a seed ``.mlxkv`` file (format 3 or 4: ``"MLXBUNKV2\\n"``, u32 LE header length, u32 LE data
start, u64 LE ``Bun.hash`` (wyhash) of the JSON header, the header, tensors at ``data start + off``) and returns
its tokens and its attachments converted; the header hash is always checked and each tensor's 16-hex wyhash too
(``verify``). Format 5 (tensors split into content-addressed blocks in a ``blocks/`` folder next to the file) is
refused: its block table is not part of the documented layout.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from spec_cache.schemas import CACHE_CODECS_V1, CheckpointAttachment, encode_cache_headers, validate_attachment
from spec_cache.store.tensors import Tensor, numpy_dtype

__all__ = ["SEED_CODECS", "SeedFormatError", "SeedEntry", "from_seed_attachment", "read_mlxkv", "wyhash",
           "MLX_DTYPES"]

SEED_CODECS = "mlx-cache-v3"
MAGIC = b"MLXBUNKV2\n"
PREFIX = struct.Struct("<10sIIQ")  # magic, header length, data start, header hash
#: mlx-c's ``mlx_dtype`` enum as mlx-bun's FFI numbers it
MLX_DTYPES = {0: "bool", 1: "uint8", 2: "uint16", 3: "uint32", 4: "uint64", 5: "int8", 6: "int16", 7: "int32",
              8: "int64", 9: "float16", 10: "float32", 11: "float64", 12: "bfloat16", 13: "complex64"}
_READABLE = {"kv": 2, "qkv": 6}
_WHY = {"rotating": "spec-cache's drafter codec restores no ring layers",
        "rotating-qkv": "spec-cache's drafter codec restores no ring layers",
        "ssm": "mlx-bun's conv/recurrent state layout is not proven equal to mlx-lm's ArraysCache",
        "turboquant": "mlx-lm has no TurboQuant cache", "paged": "mlx-lm has no paged cache",
        "mla": "mlx-lm has no GLM compressed (MLA) cache", "mla-dsa": "mlx-lm has no GLM compressed (MLA) cache",
        "mtp-mla": "mlx-lm has no GLM compressed (MLA) cache"}


class SeedFormatError(ValueError):
    """Seed data spec-cache cannot read (a layer kind it has no equivalent for, a damaged file, a bad header)."""


# --- wyhash (Bun.hash: Zig's std.hash.Wyhash, wyhash final 4) -------------------------------------------------

_S = (0xa0761d6478bd642f, 0xe7037ed1a0b428db, 0x8ebc6af09c88c6e3, 0x589965cc75374cc3)
_M64 = (1 << 64) - 1


def _mum(a: int, b: int) -> tuple[int, int]:
    r = a * b
    return r & _M64, r >> 64


def _mix(a: int, b: int) -> int:
    lo, hi = _mum(a, b)
    return lo ^ hi


def _r(p, i: int, n: int) -> int:
    return int.from_bytes(p[i:i + n], "little")


def wyhash(data, seed: int = 0) -> int:
    """64-bit wyhash of ``data`` as ``Bun.hash(data, seed)`` computes it (pure Python: ~1 MB/s, headers only
    unless tensors are verified)."""
    p = bytes(data)
    n = len(p)
    seed ^= _mix(seed ^ _S[0], _S[1])
    if n <= 16:
        if n >= 4:
            q = (n >> 3) << 2
            a = (_r(p, 0, 4) << 32) | _r(p, q, 4)
            b = (_r(p, n - 4, 4) << 32) | _r(p, n - 4 - q, 4)
        elif n > 0:
            a, b = (p[0] << 16) | (p[n >> 1] << 8) | p[n - 1], 0
        else:
            a = b = 0
    else:
        i, at = n, 0
        if i > 48:
            s1 = s2 = seed
            while True:
                seed = _mix(_r(p, at, 8) ^ _S[1], _r(p, at + 8, 8) ^ seed)
                s1 = _mix(_r(p, at + 16, 8) ^ _S[2], _r(p, at + 24, 8) ^ s1)
                s2 = _mix(_r(p, at + 32, 8) ^ _S[3], _r(p, at + 40, 8) ^ s2)
                at += 48
                i -= 48
                if i <= 48:
                    break
            seed ^= s1 ^ s2
        while i > 16:
            seed = _mix(_r(p, at, 8) ^ _S[1], _r(p, at + 8, 8) ^ seed)
            i -= 16
            at += 16
        a, b = _r(p, at + i - 16, 8), _r(p, at + i - 8, 8)
    a, b = _mum(a ^ _S[1], b ^ seed)
    return _mix(a ^ _S[0] ^ n, b ^ _S[1])


# --- attachments ---------------------------------------------------------------------------------------------

def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _layer(index: int, entry: Any, tensors: Sequence[Any]) -> dict | None:
    """Our header for the seed's layer header ``entry`` (tensor slots checked against ``tensors``)."""
    where = f"cacheHeaders[{index}]"
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        raise SeedFormatError(f"{where}: expected an object with a kind, got {entry!r}")
    kind = entry["kind"]
    if kind not in _READABLE:
        raise SeedFormatError(f"{where}: seed cache kind {kind!r} is not readable: "
                              f"{_WHY.get(kind, 'unknown to mlx-cache-v3 as documented')}")
    offset, slots = entry.get("offset"), entry.get("tensors")
    if not _int(offset) or offset < 0 or not isinstance(slots, list) or len(slots) != _READABLE[kind]:
        raise SeedFormatError(f"{where}: {kind} needs an offset and {_READABLE[kind]} tensor slots")
    indices = []
    for j, slot in enumerate(slots):
        if not isinstance(slot, dict) or not _int(slot.get("off")) or not 0 <= slot["off"] < len(tensors):
            raise SeedFormatError(f"{where}.tensors[{j}]: slot does not index the attachment's tensors")
        tensor = tensors[slot["off"]]
        name = MLX_DTYPES.get(slot.get("dtype"))
        shape = list(getattr(tensor, "shape", ()))
        if name is None:
            raise SeedFormatError(f"{where}.tensors[{j}]: unknown MLX dtype {slot.get('dtype')!r}")
        if slot.get("shape") != shape or _dtype_name(tensor) != name:
            raise SeedFormatError(f"{where}.tensors[{j}]: slot says {name}{slot.get('shape')}, tensor is "
                                  f"{_dtype_name(tensor)}{shape}")
        if len(shape) != 4 or shape[2] != offset:
            raise SeedFormatError(f"{where}.tensors[{j}]: expected [1, heads, {offset}, ...], got {shape}")
        indices.append(slot["off"])
    out: dict = {"kind": kind, "offset": offset, "tensors": indices}
    if kind == "qkv":
        if not (_int(entry.get("groupSize")) and _int(entry.get("bits"))):
            raise SeedFormatError(f"{where}: qkv needs integer groupSize and bits")
        out["groupSize"], out["bits"] = entry["groupSize"], entry["bits"]
    minimum = entry.get("minimumReusableOffset")
    if minimum is not None:
        if not _int(minimum) or not 0 <= minimum <= offset:
            raise SeedFormatError(f"{where}: minimumReusableOffset {minimum!r} outside [0, {offset}]")
        if kind == "qkv" and minimum:  # ours records a conversion point on quantized layers only
            out["minimumReusableOffset"] = minimum
    return out


def _dtype_name(tensor) -> str:
    dtype = getattr(tensor, "dtype", None)
    if isinstance(dtype, str):
        return dtype
    from spec_cache.schemas.dtypes import dtype_name

    return dtype_name(dtype)


def from_seed_attachment(attachment: CheckpointAttachment, processed_tokens: int | None = None,
                         ) -> CheckpointAttachment:
    """The spec-cache checkpoint attachment for a seed attachment (same schema, metadata and tensors; cache
    headers rewritten from ``mlx-cache-v3`` to ``spec-cache-kv-v1``). An attachment without cache headers is
    returned as it is. With ``processed_tokens`` the result is validated against its schema for that row.

    Raises ``SeedFormatError`` for what cannot be read (see the module docstring), ``SchemaError`` when the
    converted attachment breaks its schema."""
    metadata = dict(attachment.metadata)
    if "cacheHeaders" in metadata or "cacheCodecs" in metadata:
        if metadata.get("cacheCodecs") != SEED_CODECS:
            raise SeedFormatError(f"cacheCodecs is {metadata.get('cacheCodecs')!r}, expected {SEED_CODECS!r}")
        try:
            headers = json.loads(metadata["cacheHeaders"])
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise SeedFormatError(f"cacheHeaders is not the seed's JSON list ({exc})") from None
        if not isinstance(headers, list):
            raise SeedFormatError("cacheHeaders is not a JSON list")
        ours = [_layer(i, entry, attachment.tensors) for i, entry in enumerate(headers)]
        metadata.update(cacheCodecs=CACHE_CODECS_V1, cacheHeaders=encode_cache_headers(ours))
    out = CheckpointAttachment(attachment.schema, metadata, attachment.tensors)
    if processed_tokens is not None:
        validate_attachment(out, processed_tokens)
    return out


# --- .mlxkv files --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SeedEntry:
    """What a seed ``.mlxkv`` file holds that spec-cache reads: its tokens, its drafter attachments (converted,
    validated for ``len(tokens)``) and the raw header (target caches, identity fields) for the caller."""

    tokens: list[int]
    attachments: list[CheckpointAttachment]
    header: dict


def read_mlxkv(path_or_bytes, *, verify: bool = True, vocab_size: int | None = None) -> SeedEntry:
    """Read a seed ``.mlxkv`` file (a path, or its bytes). ``verify`` also checks every attachment tensor's wyhash
    (pure Python: slow for large tensors). ``vocab_size``: token ids must be below it (else below 2**32, what the
    store's uint32 keys hold). Raises ``SeedFormatError`` with a one-line message for anything it cannot read: the
    file comes from elsewhere, so a hostile header (nesting that would exhaust the recursion limit, ids of 10**100,
    negative offsets, slots of the wrong type) is refused, never raised as a bare Python error or coerced."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = memoryview(path_or_bytes).cast("B")
    else:
        with open(path_or_bytes, "rb") as f:
            data = memoryview(f.read())
    try:
        return _read_mlxkv(data, verify, vocab_size)
    except SeedFormatError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:  # SchemaError too
        text = " ".join(str(exc).split())[:200]
        raise SeedFormatError(f"unreadable seed cache file ({type(exc).__name__}: {text})") from None


def _read_mlxkv(data: memoryview, verify: bool, vocab_size: int | None) -> SeedEntry:
    if len(data) < PREFIX.size:
        raise SeedFormatError("not an mlx-bun KV v2 cache file (too short)")
    magic, header_len, data_start, header_hash = PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise SeedFormatError("not an mlx-bun KV v2 cache file")
    raw = data[PREFIX.size:PREFIX.size + header_len]
    if len(raw) != header_len or wyhash(raw) != header_hash:
        raise SeedFormatError("header hash mismatch (truncated or corrupt)")
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        raise SeedFormatError("header is not JSON (or nests too deeply)") from None
    version = header.get("formatVersion") if isinstance(header, dict) else None
    if version not in (3, 4) or isinstance(version, bool):
        raise SeedFormatError(f"unsupported formatVersion {version!r} (spec-cache reads 3 and 4; 5 keeps tensors "
                              f"in a blocks/ folder whose table is not documented)")
    tokens = header.get("tokens")
    top = (vocab_size if vocab_size is not None else 2**32) - 1
    if not isinstance(tokens, list) or not all(_int(t) and 0 <= t <= top for t in tokens):
        raise SeedFormatError(f"header tokens are not a list of token ids in 0..{top}")
    items = header.get("attachments") or []
    if not isinstance(items, list):
        raise SeedFormatError("header attachments are not a list")
    attachments = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("schema"), str) \
                or not isinstance(item.get("metadata") or {}, dict) or not isinstance(item.get("tensors") or [], list):
            raise SeedFormatError(f"attachments[{k}] is malformed")
        tensors = [_read_slot(data, data_start, slot, f"attachments[{k}].tensors[{j}]", verify)
                   for j, slot in enumerate(item.get("tensors") or [])]
        seed = CheckpointAttachment(item["schema"], item.get("metadata") or {}, tensors)
        attachments.append(from_seed_attachment(seed, len(tokens)))
    return SeedEntry(list(tokens), attachments, header)


#: the most dimensions a tensor slot may have (K/V tensors have 4)
_MAX_NDIM = 8


def _read_slot(data: memoryview, data_start: int, slot: Any, where: str, verify: bool) -> Tensor:
    if not isinstance(slot, dict) or not all(_int(slot.get(k)) for k in ("off", "bytes", "dtype")):
        raise SeedFormatError(f"{where}: malformed tensor slot")
    if slot["off"] < 0 or slot["bytes"] < 0:
        raise SeedFormatError(f"{where}: negative offset or byte length")
    name = MLX_DTYPES.get(slot["dtype"])
    shape = slot.get("shape")
    if name is None or not isinstance(shape, list) or len(shape) > _MAX_NDIM \
            or not all(_int(d) and d >= 0 for d in shape):
        raise SeedFormatError(f"{where}: unknown dtype {slot['dtype']!r} or bad shape")
    start, nbytes = data_start + slot["off"], slot["bytes"]
    elements = 1
    for d in shape:  # Python ints: numpy's int64 product would wrap around for hostile dims
        elements *= d
    if nbytes != elements * numpy_dtype(name).itemsize or start + nbytes > len(data):
        raise SeedFormatError(f"{where}: tensor byte-length drift or past the end of the file")
    raw = data[start:start + nbytes]
    if verify and slot.get("hash") and format(wyhash(raw), "016x") != slot["hash"]:
        raise SeedFormatError(f"{where}: tensor hash mismatch at offset {slot['off']}")
    arr = np.frombuffer(bytes(raw), dtype=numpy_dtype(name)).reshape(shape)
    return Tensor(name, tuple(shape), arr)

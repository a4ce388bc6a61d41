"""Reading the seed's (mlx-bun) drafter attachments: its ``mlx-cache-v3`` cache headers and its ``.mlxkv`` files.

Why one file: reading a seed header, its ``.mlxkv`` framing and importing one share the seed's dtype and kind maps
and its hash checks; split, they would import each other.

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

``import_seed`` (``spec-cache import-seed FILE.mlxkv --model DIR``) stores a file's *target* caches as a spec-cache
entry under the model's no-drafter prefix namespace (which every drafter of the target reaches through the
target-only namespace), after checking the whole file against the model first, as ``import-mlx-lm`` does: ``kv``,
``qkv`` (its ``minimumReusableOffset`` as the conversion point) and a ``rotating`` layer whose ring has not wrapped
are converted to mlx-lm caches; a wrapped ring, ``rotating-qkv``, ``ssm``, ``turboquant``, ``paged`` and ``mla``
are refused in one line, and a refused file stores nothing. The drafter attachments are not imported (their
rows open cold beside the target prefix).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from spec_cache.schemas import CACHE_CODECS_V1, CheckpointAttachment, encode_cache_headers, validate_attachment
from spec_cache.store import Tensor, numpy_dtype

__all__ = ["SEED_CODECS", "SeedFormatError", "SeedEntry", "SeedImport", "SeedLayer", "from_seed_attachment",
           "import_seed", "read_mlxkv", "wyhash", "MLX_DTYPES"]

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
class SeedLayer:
    """One of the target caches of a seed ``.mlxkv`` file (``header.caches[i]``), its tensors read and checked
    against their slots. ``kind`` is the seed's (``kv``, ``qkv``, ``rotating``, ...); ``tensors`` are read for the
    kinds :func:`import_seed` converts (``kv``, ``qkv``, ``rotating``) and empty for the others; ``params`` holds
    the header's integer fields (``idx``, ``maxSize``, ``groupSize``, ``bits``, ``minimumReusableOffset``)."""

    kind: str
    offset: int
    tensors: list[Tensor]
    params: dict


@dataclass(frozen=True)
class SeedEntry:
    """What a seed ``.mlxkv`` file holds that spec-cache reads: its tokens, its drafter attachments (converted,
    validated for ``len(tokens)``), its target caches (:class:`SeedLayer`, one per layer) and the raw header
    (identity fields: ``ns``, ``tokenizerHash``, ``configFingerprint``, ``modelId``) for the caller."""

    tokens: list[int]
    attachments: list[CheckpointAttachment]
    header: dict
    caches: list[SeedLayer] = field(default_factory=list)


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
    layers = header.get("caches") or []
    if not isinstance(layers, list):
        raise SeedFormatError("header caches are not a list")
    caches = [_target_layer(i, entry, data, data_start, verify) for i, entry in enumerate(layers)]
    return SeedEntry(list(tokens), attachments, header, caches)


#: the target cache kinds :func:`import_seed` converts, and their tensor count (K, V; qkv: K's packed, scales,
#: biases then V's, the attachment codec's order)
_TARGET_READABLE = {"kv": 2, "qkv": 6, "rotating": 2}
_TARGET_PARAMS = ("idx", "maxSize", "groupSize", "bits", "minimumReusableOffset")


def _target_layer(index: int, entry: Any, data: memoryview, data_start: int, verify: bool) -> SeedLayer:
    where = f"caches[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        raise SeedFormatError(f"{where}: expected an object with a kind")
    kind, offset, slots = entry["kind"], entry.get("offset"), entry.get("tensors")
    if not _int(offset) or offset < 0:
        raise SeedFormatError(f"{where}: offset {offset!r} is not a non-negative integer")
    params = {}
    for name in _TARGET_PARAMS:
        value = entry.get(name)
        if value is not None:
            if not _int(value) or value < 0:
                raise SeedFormatError(f"{where}: {name} {value!r} is not a non-negative integer")
            params[name] = value
    if kind not in _TARGET_READABLE:  # refused by import_seed, with its reason; read_mlxkv itself reads on
        return SeedLayer(kind, offset, [], params)
    if not isinstance(slots, list) or len(slots) != _TARGET_READABLE[kind]:
        raise SeedFormatError(f"{where}: {kind} needs {_TARGET_READABLE[kind]} tensor slots")
    tensors = [_read_slot(data, data_start, slot, f"{where}.tensors[{j}]", verify) for j, slot in enumerate(slots)]
    return SeedLayer(kind, offset, tensors, params)


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


# --- importing a seed file's target caches -------------------------------------------------------------------

#: why a target cache kind is not imported (``kv``, ``qkv`` and a ``rotating`` layer that has not wrapped are)
_TARGET_WHY = {**_WHY,
               "rotating-qkv": "mlx-lm has no quantized rotating (sliding-window) cache",
               "ssm": "mlx-bun's conv/recurrent state layout is not proven equal to mlx-lm's ArraysCache"}
#: the seed's namespace of generation checkpoints (a replayable answer, not a prefix)
_GENERATION_NS = "__generation_checkpoint__:"
_FINGERPRINT = re.compile(r"[0-9a-f]{16}-(bf16|kv(\d+)(?:-g(\d+))?(?:-start(\d+))?|config(?:-start\d+)?|"
                          r"turbo-k\d+v\d+(?:-start\d+)?)-[0-9a-f]+(?:-[0-9a-f]{64})?")


@dataclass(frozen=True)
class SeedImport:
    """What :func:`import_seed` stored: the namespace key and prefix namespace, the tokens, and how many drafter
    attachments the file carried (not imported: a drafter's row opens cold beside the imported target prefix)."""

    ns_key: bytes
    prefix_namespace: str
    tokens: int
    attachments_skipped: int


def import_seed(cache, file, model_dir, *, kv: Any = None, adapters: Any = "", tenant: str | None = None,
                verify: bool = True) -> SeedImport:
    """Store the target caches of a seed (mlx-bun) ``.mlxkv`` file as the checkpoint of its tokens for the model
    in ``model_dir``, under the prefix namespace ``Generator.load(model_dir, kv=kv, adapters=adapters)`` uses
    (no drafter: every drafter of this target, adapters and KV options restores it through the target-only
    namespace, its own rows opening cold).

    Everything is read and checked before anything is stored (the shape of ``import-mlx-lm``, issue 37): the
    framing and header hash, every tensor's wyhash (``verify``), the header's ``codecProvider``, its ``ns``
    (a generation checkpoint is refused; a prefix namespace must name the same adapters and KV options as this
    import), its ``tokenizerHash`` against ``model_dir/tokenizer.json`` (``Bun.hash`` of its bytes), the KV
    scheme its ``configFingerprint`` names (when it has the documented shape), the token ids against the
    vocabulary, and every layer against the model (``prefix_files.check_fits``: kind, K/V shapes, dtype, length,
    a ring's window, a quantized layer's bits and group size against the KV plan).

    Converted: ``kv`` (``KVCache``), ``qkv`` (``QuantizedKVCache``, its ``minimumReusableOffset`` as the
    conversion point) and ``rotating`` before its ring wraps (``RotatingKVCache``, offset <= maxSize). Refused,
    one line naming the layer and why: a wrapped ring, ``rotating-qkv``, ``ssm``, ``turboquant``, ``paged``,
    ``mla``. Raises ``SeedFormatError`` (a ValueError; nothing stored)."""
    from spec_cache.convert.interop import import_prefix_namespace
    from spec_cache.naming.identity import model_identity
    from spec_cache.naming.namespace import check_runnable
    from spec_cache.rows.kv_quant import plan_kv
    from spec_cache.rows.target import TargetModel
    from spec_cache.tiers.prefix_files import BadPrefixFile, check_fits

    model_dir = Path(model_dir)
    try:
        options = check_runnable(kv if kv is not None else {})
        memo = cache.store.memo()
        prefix_ns = import_prefix_namespace(None, None, adapters, options, memo)
        identity = model_identity(model_dir, memo=memo)
        target = TargetModel.load(model_dir, lazy=True)
        head_dims = [target.kv_geometry(layer)[1] for layer in range(target.num_layers)]
        plan = plan_kv(options, target.num_layers, head_dims, target.layer_windows)
    except (OSError, ValueError, TypeError, NotImplementedError) as exc:
        raise SeedFormatError(f"cannot import into {model_dir}: {_one_line(exc)}") from None
    entry = read_mlxkv(file, verify=verify, vocab_size=target.vocab_size)
    _check_header(entry.header, prefix_ns, options, model_dir)
    if not entry.tokens:
        raise SeedFormatError("the file covers no tokens")
    if len(entry.caches) != target.num_layers:
        raise SeedFormatError(f"the file holds {len(entry.caches)} target cache layers; {model_dir} has "
                              f"{target.num_layers}")
    caches = [_to_cache(i, layer, len(entry.tokens)) for i, layer in enumerate(entry.caches)]
    try:
        check_fits(target, caches, len(entry.tokens), quantized=plan is not None, plan=plan)
    except BadPrefixFile as exc:
        raise SeedFormatError(str(exc)) from None
    points = {c.converted_at for c in caches if hasattr(c, "converted_at")}
    if len(points) > 1:
        raise SeedFormatError(f"quantized layers were converted at different offsets: {sorted(points)}")
    ns_key = cache.namespace(identity, prefix_ns, tenant)
    put = cache.save(ns_key, entry.tokens, caches, minimum_reusable=points.pop() if points else 0)
    if put is None:  # LMDB refused it (budget, quota): no trace left in the memory tier either
        cache.memory.discard(ns_key, entry.tokens)
        raise SeedFormatError("the store refused the entry (see the warning above)")
    return SeedImport(ns_key, prefix_ns, len(entry.tokens), len(entry.attachments))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _check_header(header: dict, prefix_ns: str, options, model_dir: Path) -> None:
    """The header's identity fields against this import: codec provider, namespace, tokenizer, KV scheme."""
    from spec_cache.naming.namespace import target_namespace_of

    provider = header.get("codecProvider")
    if provider != SEED_CODECS:
        raise SeedFormatError(f"codecProvider is {str(provider)[:40]!r}, expected {SEED_CODECS!r}")
    ns = header.get("ns", "")
    if not isinstance(ns, str):
        raise SeedFormatError("header ns is not a string")
    if ns.startswith(_GENERATION_NS):
        raise SeedFormatError("the file is a generation checkpoint (a replayable answer), not a prompt prefix")
    if ns:  # a drafter's prefix namespace: its adapters and KV options must be this import's
        theirs, ours = target_namespace_of(ns), target_namespace_of(prefix_ns)
        if theirs is None:
            raise SeedFormatError(f"header ns {ns[:80]!r} is not a prefix namespace")
        if theirs != ours:
            raise SeedFormatError(f"the file was made with other adapters or KV options: its namespace "
                                  f"{theirs[theirs.index('{'):][:120]}, this import's {ours[ours.index('{'):][:120]}")
    _check_tokenizer(header.get("tokenizerHash"), model_dir)
    _check_scheme(header.get("configFingerprint"), options)


def _check_tokenizer(recorded: Any, model_dir: Path) -> None:
    tokenizer = model_dir / "tokenizer.json"
    if not tokenizer.is_file():
        return
    try:
        theirs = int(str(recorded), 16)
    except ValueError:
        raise SeedFormatError(f"header tokenizerHash {str(recorded)[:40]!r} is not a hex hash") from None
    ours = wyhash(tokenizer.read_bytes())
    if theirs != ours:
        raise SeedFormatError(f"the file was made with another tokenizer (tokenizerHash {theirs:x}; "
                              f"{tokenizer} hashes to {ours:x})")


def _check_scheme(fingerprint: Any, options) -> None:
    """The KV scheme ``configFingerprint`` names (``<16 hex>-<scheme>-<hex>``, scheme ``bf16``,
    ``kv<bits>[-g<group>][-start<n>]``, ...) against the import's options; a fingerprint of another shape (an older
    seed) says nothing and is not checked."""
    match = _FINGERPRINT.fullmatch(fingerprint) if isinstance(fingerprint, str) else None
    if match is None:
        return
    scheme, bits, group, start = match.groups()
    if scheme == "bf16":
        theirs = (None, None, None)
    elif bits is not None:
        theirs = (int(bits), int(group or 64), int(start) if start is not None else 5000)
    else:
        raise SeedFormatError(f"the file's KV scheme {scheme!r} (kvConfig or TurboQuant) is not imported")
    ours = (None, None, None) if options.kv_bits is None and not options.kv_config else (
        options.kv_bits, options.kv_group_size or 64,
        options.quantized_kv_start if options.quantized_kv_start is not None else 5000)
    if theirs != ours:
        def show(s):
            return "full precision" if s[0] is None else f"{s[0]}-bit, group {s[1]}, start {s[2]}"
        raise SeedFormatError(f"the file's KV scheme is {show(theirs)}; this import's is {show(ours)}")


def _to_cache(index: int, layer: SeedLayer, length: int):
    """The mlx-lm cache of one seed target layer (its tensors as owned MLX arrays)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    from spec_cache.state.cache_state import to_mx

    where = f"caches[{index}]"
    if layer.kind not in _TARGET_READABLE:
        raise SeedFormatError(f"{where}: seed cache kind {layer.kind[:40]!r} is not imported: "
                              f"{_TARGET_WHY.get(layer.kind, 'unknown to mlx-cache-v3 as documented')}")
    if layer.offset != length:
        raise SeedFormatError(f"{where} holds {layer.offset} tokens; the file's token list has {length}")
    arrays = [to_mx(t) for t in layer.tensors]
    if any(a.ndim != 4 or a.shape[0] != 1 for a in arrays):
        raise SeedFormatError(f"{where}: expected tensors [1, heads, tokens, ...], got "
                              f"{[list(a.shape) for a in arrays]}")
    if layer.kind == "rotating":
        size, idx = layer.params.get("maxSize"), layer.params.get("idx")
        if size is None or idx is None:
            raise SeedFormatError(f"{where}: rotating layer without maxSize and idx")
        if layer.offset > size or idx != layer.offset:
            raise SeedFormatError(f"{where}: rotating layer past its window (offset {layer.offset}, maxSize {size}, "
                                  f"idx {idx}): a wrapped ring's order is not in the documented layout")
        keys, values = arrays
        if keys.shape[2] < length or values.shape[2] < length:
            raise SeedFormatError(f"{where}: rotating layer holds {keys.shape[2]} positions for offset {length}")
        c = RotatingKVCache(max_size=size, keep=0)
        c.keys, c.values = keys[..., :length, :], values[..., :length, :]
        c.offset, c._idx = length, length
        return c
    if any(a.shape[2] != length for a in arrays):
        raise SeedFormatError(f"{where}: tensors hold {[a.shape[2] for a in arrays]} positions for offset {length}")
    if layer.kind == "kv":
        c = KVCache()
        c.keys, c.values, c.offset = arrays[0], arrays[1], length
        return c
    bits, group, point = (layer.params.get(k) for k in ("bits", "groupSize", "minimumReusableOffset"))
    if not bits or not group:
        raise SeedFormatError(f"{where}: qkv layer without bits and groupSize")
    if not point:
        raise SeedFormatError(f"{where}: qkv layer without minimumReusableOffset: where it was converted is "
                              "unknown, so no request can tell it equals its own")
    c = QuantizedKVCache(group_size=group, bits=bits)
    c.keys, c.values, c.offset = tuple(arrays[:3]), tuple(arrays[3:]), length
    c.converted_at = point
    return c

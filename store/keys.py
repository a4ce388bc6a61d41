"""Content keys of the prefix index: chain hashes over fixed token chunks.

A namespace key (32 bytes, computed by ``spec_cache.naming.namespace.namespace_key`` from the target identity, the
prefix namespace and an optional tenant salt) roots one tree per *layer signature* (the kinds and scalars of
the chunked layers: a prefix stored as plain KV and the same prefix after quantized-KV conversion are
different bytes, so they are different chains). Every full chunk of ``chunk_tokens`` tokens extends its
parent's hash; an entry (an exact boundary) hangs off the deepest full chunk at or below its length:

    root    = blake3("spec-cache/root/v1\\0"  || ns_key(32) || u64 len(sig) || sig)
    chunk_k = blake3("spec-cache/chunk/v1\\0" || chunk_{k-1} || u32le tokens of chunk k)
    entry   = blake3("spec-cache/entry/v1\\0" || chunk_j || u32 t || u32le the t tail tokens)

A namespace's *tenant label* (``tenant_id``, store format 1.1) is what per-tenant byte accounting and quotas
group namespaces by: ``blake3.derive_key("spec-cache 2026 tenant-id v1", tenant)[:16]``. It is a one-way
digest, never the tenant string (an API key's digest or a ``cache_salt``); it reveals no more than the
namespace key, which already hashes the same tenant with public inputs.

Tokens are packed as unsigned 32-bit little-endian words, so hashing a 32k-token prompt is one pass over
128 KiB. Keys are 32 bytes; LRU keys are ``u64be(last_use_ns) || entry key``.
"""

from __future__ import annotations

import struct
from array import array
from typing import Sequence

import blake3
import numpy as np

from .errors import InvalidInput

_ROOT = b"spec-cache/root/v1\x00"
_CHUNK = b"spec-cache/chunk/v1\x00"
_ENTRY = b"spec-cache/entry/v1\x00"
KEY_BYTES = 32


def pack_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a little-endian uint32 array; refuses negatives, non-integers and values >= 2**32."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise InvalidInput(f"tokens must be one-dimensional, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidInput(f"tokens must be integers, got dtype {arr.dtype}")
    else:
        try:  # array('Q') converts a list of ints 2x faster than numpy and refuses negatives and floats
            arr = np.frombuffer(array("Q", tokens), dtype=np.uint64) if len(tokens) else np.zeros(0, np.uint64)
        except OverflowError:
            raise InvalidInput("token ids must lie in [0, 2**32)") from None
        except TypeError:
            raise InvalidInput("tokens must be a sequence of integers") from None
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise InvalidInput("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def root_key(ns_key: bytes, signature: bytes) -> bytes:
    if len(ns_key) != KEY_BYTES:
        raise InvalidInput("namespace key must be 32 bytes")
    return blake3.blake3(_ROOT + ns_key + struct.pack("<Q", len(signature)) + signature).digest()


def entry_key(node: bytes, tail_tokens: np.ndarray) -> bytes:
    h = blake3.blake3(_ENTRY)
    h.update(node)
    h.update(struct.pack("<I", len(tail_tokens)))
    h.update(tail_tokens.view(np.uint8))
    return h.digest()


def chain(root: bytes, tokens: np.ndarray, chunk_tokens: int, max_chunks: int | None = None) -> list[bytes]:
    """[root, chunk_1, ..., chunk_K] for the full chunks of ``tokens`` (K capped by ``max_chunks``).

    ``chunk_k`` of the module docstring for k = 1..K, one blake3 call per chunk (the lookup's hot loop).
    """
    count = len(tokens) // chunk_tokens
    if max_chunks is not None:
        count = min(count, max_chunks)
    data = tokens[: count * chunk_tokens].tobytes()
    step = 4 * chunk_tokens
    keys = [root]
    for k in range(count):
        keys.append(blake3.blake3(_CHUNK + keys[-1] + data[k * step:(k + 1) * step]).digest())
    return keys


TENANT_ID_CONTEXT = "spec-cache 2026 tenant-id v1"
TENANT_ID_BYTES = 16


def tenant_id(tenant: str | bytes) -> bytes:
    """The 16-byte tenant label of ``tenant`` (a str is its UTF-8 bytes, as in ``namespace_key``)."""
    if isinstance(tenant, str):
        tenant = tenant.encode("utf-8")
    elif isinstance(tenant, (bytearray, memoryview)):
        tenant = bytes(tenant)
    if not isinstance(tenant, bytes):
        raise InvalidInput(f"tenant must be a str or bytes, not {type(tenant).__name__}")
    return blake3.blake3(tenant, derive_key_context=TENANT_ID_CONTEXT).digest()[:TENANT_ID_BYTES]


def lru_key(last_use_ns: int, key: bytes) -> bytes:
    return struct.pack(">Q", last_use_ns) + key

"""Deterministic drafter checkpoints for the drafter-dedup tests (and for the golden pre-1.2 store they read).

Conversations share a system prompt; every drafter position's row depends only on the tokens up to it (as a
causal drafter's KV does), so equal prefixes give equal bytes. ``write_store`` uses only the API every store
format 1.x version has, so the golden store ``tests/golden/store_1_1_drafters.tar.gz`` was written by it with
the code before format 1.2 (whole drafter records).
"""

from __future__ import annotations

import json
import zlib

import numpy as np

CHUNK = 16
SYSTEM = 40
HEADS, DIM = 2, 8
NS = bytes(range(32))
DRAFTER = "standalone-draft-v1:golden"
PROJECTED = "deepspec-context-v1:golden"


def system_prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(7).integers(0, 30000, SYSTEM)]


def conversation(i: int, extra: int = 6) -> list[int]:
    return system_prompt() + [30000 + 7 * i + j for j in range(extra)]


def rows(tokens, dtype=np.float16) -> np.ndarray:
    """``[1, HEADS, len(tokens), DIM]``: row p is a function of tokens[:p+1] only."""
    out = np.empty((1, HEADS, len(tokens), DIM), dtype=dtype)
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    for p in range(len(tokens)):
        seed = zlib.crc32(packed[:4 * (p + 1)])
        out[0, :, p, :] = np.random.default_rng(seed).standard_normal((HEADS, DIM))
    return out


def _headers(headers) -> str:
    return json.dumps(list(headers), separators=(",", ":"), sort_keys=True, allow_nan=False)


def standalone(tokens):
    """A draft-model checkpoint: a KV layer (token-sliceable), a ring layer and a recurrent layer (whole)."""
    from spec_cache.schemas import CheckpointAttachment

    n = len(tokens)
    k = rows(tokens)
    v = k * 2
    ring = rows(tokens[-4:])
    state = np.full((1, 3, 512), float(n % 3), dtype=np.float32)  # equal at every boundary with n % 3 equal
    headers = [{"kind": "kv", "offset": n, "tensors": [0, 1]},
               {"kind": "rotating", "offset": n, "tensors": [2, 3], "maxSize": 4, "idx": n % 4, "keep": 0},
               {"kind": "arrays", "offset": 0, "tensors": [4], "present": "1"}]
    metadata = {"processedTokens": n, "pendingLast": False, "cacheCodecs": "spec-cache-kv-v1",
                "cacheHeaders": _headers(headers)}
    return CheckpointAttachment("standalone-draft-v1", metadata,
                                [np.ascontiguousarray(k), np.ascontiguousarray(v), ring, ring * 3, state])


def projected(tokens, layers: int = 2):
    """A projected drafter's context (DeepSpec layout): per layer K and V of every processed token."""
    from spec_cache.schemas import CheckpointAttachment

    n = len(tokens)
    tensors, headers = [], []
    for layer in range(layers):
        headers.append({"kind": "kv", "offset": n, "tensors": [2 * layer, 2 * layer + 1]})
        tensors += [rows(tokens) + layer, rows(tokens) - layer]
    return CheckpointAttachment("deepspec-context-v1", {"processedTokens": n, "cacheCodecs": "spec-cache-kv-v1",
                                                         "cacheHeaders": _headers(headers)}, tensors)


def target_layers(tokens):
    """The target's state: one plain KV layer (chunked by the store as always)."""
    from spec_cache.store.tensors import LayerState, Tensor

    kv = rows(tokens, np.float32)
    return [LayerState("kv", {}, [Tensor.from_numpy(kv), Tensor.from_numpy(kv * 0.5)], 2)]


def write_store(S, path: str, conversations: int = 3) -> None:
    """Three conversations sharing the system prompt, each with a draft-model part (API of every 1.x)."""
    store = S.Store.open(path, chunk_tokens=CHUNK)
    try:
        store.register_namespace(NS, target="golden-target", prefix_namespace="golden")
        for i in range(conversations):
            tokens = conversation(i)
            store.put(NS, tokens, target_layers(tokens), drafter=(DRAFTER, standalone(tokens)))
    finally:
        store.close()

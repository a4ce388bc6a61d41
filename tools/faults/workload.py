"""A deterministic checkpoint workload whose expected state is known exactly, for fault harnesses.

A checkpoint is named by ``(namespace index, family, length)``: its tokens are the first ``length`` tokens of
a family prompt, and its state is a pure function of the namespace key and the *whole* prefix (a rolling hash
per position, like real KV: position p depends on tokens[0..p]). So any record served for the wrong prefix,
namespace or key — even one whose own tokens match — differs from the expectation, and ``check`` finds it.

Families share a common run of tokens after a unique head, so different prompts have entries with identical
tail tokens and identical record sizes (the hard case for a misdirected read). Structures: ``small`` (float32
KV), ``large`` (bfloat16 KV of ~16 KiB per token: MiB-sized records), ``mixed`` (float16 KV plus an
untrimmable ring layer). Drafter parts are ``gemma-assistant-v1`` hidden rows (fixed size).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from spec_cache.naming.namespace import namespace_key
from spec_cache.schemas import CheckpointAttachment
from spec_cache.schemas.names import GEMMA_ASSISTANT_V1
from spec_cache.store import LayerState, Store, Tensor

CHUNK_TOKENS = 16
TARGET_A, TARGET_B = "a" * 64, "b" * 64
PREFIX_NS = ('{"method":"assistant","adapters":""}', '{"method":null,"adapters":""}')
# (target, prefix namespace, tenant): a shared namespace, the same under a tenant salt, another target
NAMESPACES = ((TARGET_A, PREFIX_NS[0], None), (TARGET_A, PREFIX_NS[0], "tenant-1"), (TARGET_B, PREFIX_NS[1], None))
NS_KEYS = tuple(namespace_key(*ns) for ns in NAMESPACES)
DRAFTER = GEMMA_ASSISTANT_V1 + ":" + "d" * 64
FAMILIES = 48
HEAD, COMMON = 48, 40
FAMILY_TOKENS = 256
LENGTHS = (3, 16, 31, 48, 60, 64, 70, 88, 100, 131, 160, 200, 256)
STRUCTURES = ("small", "large", "mixed")
LARGE_MAX = 200  # large checkpoints stop at 200 tokens (~3 MiB)
HIDDEN = 64

_COMMON_RUN = np.random.default_rng(999).integers(0, 32000, COMMON)


def family_tokens(family: int) -> list[int]:
    rng = np.random.default_rng(1000 + family)
    head = rng.integers(0, 32000, HEAD)
    rest = rng.integers(0, 32000, FAMILY_TOKENS - HEAD - COMMON)
    return np.concatenate([head, _COMMON_RUN, rest]).astype(np.int64).tolist()


_FAMILY = [family_tokens(f) for f in range(FAMILIES)]


@dataclass(frozen=True)
class Spec:
    """One checkpoint of the workload."""

    ns: int
    family: int
    length: int

    @property
    def ns_key(self) -> bytes:
        return NS_KEYS[self.ns]

    @property
    def structure(self) -> str:
        return structure_of(self.ns, self.family)

    @property
    def tokens(self) -> list[int]:
        return _FAMILY[self.family][:self.length]

    @property
    def drafter(self) -> bool:
        return _bit(b"drafter", self.ns, self.family, self.length)

    def name(self) -> str:
        return f"{self.ns}/{self.family}/{self.length}"

    @classmethod
    def parse(cls, text: str) -> "Spec":
        ns, family, length = (int(x) for x in text.split("/"))
        return cls(ns, family, length)


def _bit(tag: bytes, *xs: int) -> bool:
    return hashlib.blake2b(tag + repr(xs).encode(), digest_size=1).digest()[0] & 1 == 1


def structure_of(ns: int, family: int) -> str:
    return STRUCTURES[(ns + family) % len(STRUCTURES)]


def all_specs() -> list[Spec]:
    return [Spec(ns, f, n) for ns in range(len(NAMESPACES)) for f in range(FAMILIES) for n in LENGTHS
            if not (structure_of(ns, f) == "large" and n > LARGE_MAX)]


def random_spec(rng: np.random.Generator, *, large: float = 0.2) -> Spec:
    """A random checkpoint; about ``large`` of them are MiB-sized."""
    want_large = rng.random() < large
    while True:
        ns, family = int(rng.integers(len(NAMESPACES))), int(rng.integers(FAMILIES))
        if (structure_of(ns, family) == "large") == want_large:
            break
    lengths = [n for n in LENGTHS if not (want_large and n > LARGE_MAX)]
    return Spec(ns, family, int(lengths[rng.integers(len(lengths))]))


# --- expected state ----------------------------------------------------------------------------------------------
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (uint64 wraps)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def prefix_hashes(ns_key: bytes, tokens) -> np.ndarray:
    """One uint64 per position, depending on the namespace key and every token up to that position."""
    h = int.from_bytes(hashlib.blake2b(ns_key, digest_size=8).digest(), "little")
    out = np.empty(len(tokens), dtype=np.uint64)
    for p, t in enumerate(tokens):
        h = ((h ^ (int(t) + 1)) * 0x100000001B3 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        out[p] = h
    return out


def _field(h: np.ndarray, salt: int, heads: int, dim: int) -> np.ndarray:
    """uint64 noise of shape [1, heads, len(h), dim] from per-position hashes."""
    lanes = (np.arange(heads, dtype=np.uint64)[:, None, None] * np.uint64(0x10001)
             + np.arange(dim, dtype=np.uint64)[None, None, :] + np.uint64(salt) * np.uint64(0x1000193))
    return _mix(h[None, :, None] ^ _mix(lanes))[None]


def _float(bits: np.ndarray, dtype) -> np.ndarray:
    return ((bits >> np.uint64(41)).astype(np.float64) / float(1 << 23) - 0.5).astype(dtype)


def layers_for(ns_key: bytes, structure: str, tokens) -> list[LayerState]:
    h = prefix_hashes(ns_key, tokens)
    if structure == "small":
        return [LayerState("kv", {"step": 256}, [Tensor.from_numpy(_float(_field(h, 10 * i + j, 2, 8), np.float32))
                                                 for j in range(2)], token_axis=2) for i in range(2)]
    if structure == "large":
        return [LayerState("kv", {}, [Tensor("bfloat16", (1, 8, len(h), 256),
                                             (_field(h, 10 * i + j, 8, 256) >> np.uint64(48)).astype(np.uint16)
                                             & np.uint16(0x7F7F))
                                      for j in range(2)], token_axis=2) for i in range(2)]
    if structure == "mixed":
        kv = LayerState("kv", {}, [Tensor.from_numpy(_float(_field(h, 100 + j, 2, 16), np.float16))
                                   for j in range(2)], token_axis=2)
        last = h[-8:]
        ring = _float(_field(last, 200, 2, 16), np.float32)
        ring_state = LayerState("rotating", {"max_size": 8, "keep": 0},
                                [Tensor.from_numpy(ring), Tensor.from_numpy(np.array(len(h), np.int64))])
        return [kv, ring_state]
    raise ValueError(structure)


def attachment_for(ns_key: bytes, tokens) -> CheckpointAttachment:
    h = prefix_hashes(ns_key, tokens)
    hidden = _float(_field(h[-1:], 300, 1, HIDDEN), np.float32).reshape(1, 1, HIDDEN)
    return CheckpointAttachment(GEMMA_ASSISTANT_V1, {"processedTokens": len(tokens)}, (hidden,))


# --- store helpers -----------------------------------------------------------------------------------------------
def register(store: Store) -> None:
    for key, (target, prefix, tenant) in zip(NS_KEYS, NAMESPACES):
        store.register_namespace(key, target=target, prefix_namespace=prefix, tenant=tenant is not None)


def put_spec(store: Store, spec: Spec, *, pin: bool = False):
    tokens = spec.tokens
    drafter = (DRAFTER, attachment_for(spec.ns_key, tokens)) if spec.drafter else None
    return store.put(spec.ns_key, tokens, layers_for(spec.ns_key, spec.structure, tokens), drafter=drafter,
                     pin=pin)


def check(restored, spec: Spec) -> str | None:
    """None when ``restored`` (a ``Store.fetch`` result for ``spec.tokens``) is exactly the stored state of a
    prefix of them — every layer bit-identical, the drafter row (if any) that of the same prefix — else what
    differs. A miss (None) is not wrong."""
    if restored is None:
        return None
    n = restored.length
    if not 1 <= n <= spec.length:
        return f"length {n} outside 1..{spec.length}"
    tokens = spec.tokens[:n]
    want = layers_for(spec.ns_key, spec.structure, tokens)
    if len(restored.layers) != len(want):
        return f"{len(restored.layers)} layers, expected {len(want)}"
    for i, (got, exp) in enumerate(zip(restored.layers, want)):
        if (got.kind, dict(got.meta), got.token_axis) != (exp.kind, dict(exp.meta), exp.token_axis):
            return f"layer {i}: kind/meta/axis differ"
        if len(got.tensors) != len(exp.tensors):
            return f"layer {i}: tensor count differs"
        for j, (a, b) in enumerate(zip(got.tensors, exp.tensors)):
            if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
                return f"layer {i} tensor {j}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
            if a.array().tobytes() != b.array().tobytes():
                return f"layer {i} tensor {j}: different bytes"
    if restored.attachment is not None:
        exp = attachment_for(spec.ns_key, tokens)
        att = restored.attachment
        if att.schema != exp.schema or dict(att.metadata) != dict(exp.metadata) or len(att.tensors) != 1:
            return "drafter part: schema/metadata differ"
        t = att.tensors[0]
        data = t.array() if hasattr(t, "array") else np.asarray(t)
        if data.tobytes() != exp.tensors[0].tobytes():
            return "drafter part: different bytes"
        if not Spec(spec.ns, spec.family, n).drafter:
            return "drafter part served for a checkpoint stored without one"
    return None

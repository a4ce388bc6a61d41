"""Crafted GGUF files for the fuzz test (issue 37 item 5): a small valid llama GGUF, parsed here independently of
the converter (every field's byte offset recorded), and mutations of it that an attacker tried: truncations, counts
and lengths larger than the file, huge / zero / overflowing dims, offsets out of the file or misaligned, bad type
ids, a zero alignment, invalid UTF-8, duplicate names, and config values (block_count 1e9, zero heads, ...) that
disagree with the tensors present.

Why a parser of its own: the mutations patch bytes at known places, so each case is the one hostile field and
nothing else, and the test's idea of the format does not come from the code it tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass
class KV:
    key: str
    key_len_at: int
    type_at: int
    value_at: int  # the value's first byte (a string's length, an array's item type)
    type: int
    item_type: int | None = None
    count_at: int | None = None  # an array's count
    first_item_at: int | None = None


@dataclass
class TensorInfo:
    name: str
    name_len_at: int
    n_dims_at: int
    dims_at: list[int]
    dims: list[int]
    type_at: int
    type: int
    offset_at: int
    offset: int


@dataclass
class Layout:
    data: bytes
    kvs: dict[str, KV] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    infos_end: int = 0
    data_start: int = 0


def parse(data: bytes) -> Layout:
    """Every field's offset in a well-formed little-endian GGUF v3 (the base file; not a validator)."""
    layout = Layout(data)
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    at = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8:at + 8 + n].decode(), at + 8 + n

    def value(kind: int, at: int) -> int:
        if kind == STRING:
            return string(at)[1]
        if kind == ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            for _ in range(count):
                at = value(item, at)
            return at
        return at + _SCALARS[kind]

    for _ in range(n_kv):
        key_at = at
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        kv = KV(key, key_at, at, at + 4, kind)
        if kind == ARRAY:
            kv.item_type, _ = struct.unpack_from("<IQ", data, at + 4)
            kv.count_at, kv.first_item_at = at + 8, at + 16
        at = value(kind, at + 4)
        layout.kvs[key] = kv
    for _ in range(n_tensors):
        name_at = at
        name, at = string(at)
        (n_dims,) = struct.unpack_from("<I", data, at)
        dims_at = [at + 4 + 8 * i for i in range(n_dims)]
        dims = [struct.unpack_from("<Q", data, d)[0] for d in dims_at]
        at += 4 + 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", data, at)
        layout.tensors.append(TensorInfo(name, name_at, dims_at[0] - 4, dims_at, dims, at, kind, at + 4, offset))
        at += 12
    layout.infos_end = at
    layout.data_start = (at + 31) // 32 * 32
    return layout


def _patch(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def mutations(base: bytes) -> dict[str, bytes]:
    """Name -> crafted file, every one of which a converter must refuse with one line (never crash or hang)."""
    L = parse(base)
    kv, t0 = L.kvs, L.tensors[0]
    q = next(t for t in L.tensors if t.name.endswith("attn_q.weight"))
    n_tensors, n_kv = len(L.tensors), len(L.kvs)
    cases: dict[str, bytes] = {}
    # truncated at every header field and through the tensor infos and the data
    points = sorted({0, 3, 4, 7, 8, 15, 16, 23, 24, 30, kv["general.architecture"].value_at + 9,
                     kv["tokenizer.ggml.tokens"].first_item_at + 3, kv["tokenizer.ggml.merges"].count_at + 4,
                     t0.name_len_at, t0.n_dims_at + 2, t0.type_at, t0.offset_at + 1, L.infos_end, L.data_start,
                     L.data_start + 100, len(base) // 2, len(base) - 1})
    for p in points:
        cases[f"truncated-at-{p}"] = base[:p]
    cases["empty"] = b""
    cases["bad-magic"] = b"GGML" + base[4:]
    for version in (0, 1, 4, 0x03000000):  # 0x03000000: a big-endian file's version read little-endian
        cases[f"version-{version}"] = _patch(base, 4, "<I", version)
    # counts larger than the file holds
    for name, value in (("plus-one", n_kv + 1), ("2^32", 1 << 32), ("2^63", 1 << 63), ("max", (1 << 64) - 1)):
        cases[f"kv-count-{name}"] = _patch(base, 16, "<Q", value)
    for name, value in (("plus-one", n_tensors + 1), ("2^40", 1 << 40), ("max", (1 << 64) - 1)):
        cases[f"tensor-count-{name}"] = _patch(base, 8, "<Q", value)
    cases["counts-swapped"] = _patch(_patch(base, 8, "<Q", n_kv), 16, "<Q", n_tensors)
    # string lengths
    arch, template = kv["general.architecture"], kv["tokenizer.chat_template"]
    for name, value in (("file", len(base)), ("2^62", 1 << 62), ("max", (1 << 64) - 1)):
        cases[f"key-length-{name}"] = _patch(base, arch.key_len_at, "<Q", value)
        cases[f"string-length-{name}"] = _patch(base, template.value_at, "<Q", value)
        cases[f"tensor-name-length-{name}"] = _patch(base, t0.name_len_at, "<Q", value)
    cases["token-length-huge"] = _patch(base, kv["tokenizer.ggml.tokens"].first_item_at, "<Q", 1 << 40)
    cases["key-length-zero"] = _patch(base, arch.key_len_at, "<Q", 0)
    cases["invalid-utf8-string"] = base.replace(b"synthetic", b"synth\xff\xfeic")
    cases["invalid-utf8-key"] = base.replace(b"general.name", b"general.n\xffme")
    # arrays
    tokens, merges = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"]
    for name, value in (("plus-one", 1 << 10), ("2^40", 1 << 40), ("max", (1 << 64) - 1)):
        cases[f"array-count-{name}"] = _patch(base, tokens.count_at, "<Q", value)
    cases["array-count-zero"] = _patch(base, merges.count_at, "<Q", 0)
    for item in (9, 13, 0xFFFFFFFF):
        cases[f"array-item-type-{item}"] = _patch(base, tokens.value_at, "<I", item)
    for kind in (13, 99, 0xFFFFFFFF):
        cases[f"value-type-{kind}"] = _patch(base, arch.type_at, "<I", kind)
    cases["value-type-string-as-u64"] = _patch(base, template.type_at, "<I", 10)
    # tensor infos
    for n_dims in (0, 5, 0xFFFFFFFF):
        cases[f"n-dims-{n_dims}"] = _patch(base, t0.n_dims_at, "<I", n_dims)
    for name, value in (("zero", 0), ("2^31", 1 << 31), ("2^63", 1 << 63), ("max", (1 << 64) - 1)):
        cases[f"dim-{name}"] = _patch(base, q.dims_at[1], "<Q", value)
    cases["dims-overflow-product"] = _patch(_patch(base, q.dims_at[0], "<Q", 1 << 32), q.dims_at[1], "<Q", 1 << 32)
    up = next(t for t in L.tensors if t.name.endswith("ffn_up.weight"))
    cases["dims-swapped"] = _patch(_patch(base, up.dims_at[0], "<Q", up.dims[1]), up.dims_at[1], "<Q", up.dims[0])
    cases["dim-row-larger"] = _patch(base, q.dims_at[1], "<Q", q.dims[1] * 2)
    for kind in (4, 5, 31, 99, 0xFFFFFFFF):  # 4, 5: Q4_2 / Q4_3, removed from ggml
        cases[f"tensor-type-{kind}"] = _patch(base, q.type_at, "<I", kind)
    cases["tensor-type-q4_0-odd-row"] = _patch(_patch(base, q.type_at, "<I", 2), q.dims_at[0], "<Q", 33)
    cases["tensor-type-q4_k"] = _patch(base, q.type_at, "<I", 12)  # Q4_K rows of 128 values: not a 256 multiple
    last = L.tensors[-1]
    for name, value in (("file", len(base)), ("misaligned", last.offset + 1), ("max", (1 << 64) - 1),
                        ("past-end", last.offset + 64)):
        cases[f"tensor-offset-{name}"] = _patch(base, last.offset_at, "<Q", value)
    cases["tensor-offsets-overlap"] = _patch(base, last.offset_at, "<Q", L.tensors[-2].offset)
    q1 = next(t for t in L.tensors if t.name == q.name.replace("blk.0.", "blk.1."))
    cases["tensor-name-duplicate"] = _patch(base, q1.name_len_at + 8, f"<{len(q.name)}s", q.name.encode())
    cases["tensor-name-unknown"] = base.replace(b"blk.1.attn_q.weight", b"blk.9.attn_q.weight")
    cases["tensor-missing-block"] = base.replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_xx.weight")
    cases["key-duplicate"] = base.replace(b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.bos_token_id")
    return cases


def metadata_cases() -> dict[str, dict]:
    """Name -> metadata overrides for ``write_synthetic_gguf``: values the header parses but that break the model."""
    import mlx.core as mx

    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "block-count-1e9": {"llama.block_count": u32(10**9)},
        "block-count-0": {"llama.block_count": u32(0)},
        "block-count-3": {"llama.block_count": u32(3)},
        "head-count-0": {"llama.attention.head_count": u32(0)},
        "head-count-1e9": {"llama.attention.head_count": u32(10**9)},
        "head-count-3": {"llama.attention.head_count": u32(3)},
        "head-count-kv-0": {"llama.attention.head_count_kv": u32(0)},
        "head-count-kv-more": {"llama.attention.head_count_kv": u32(4)},
        "embedding-length-0": {"llama.embedding_length": u32(0)},
        "embedding-length-1e9": {"llama.embedding_length": u32(10**9)},
        "feed-forward-1e9": {"llama.feed_forward_length": u32(10**9)},
        "context-length-0": {"llama.context_length": u32(0)},
        "context-length-max": {"llama.context_length": u32(2**32 - 1)},
        "key-length-0": {"llama.attention.key_length": u32(0)},
        "rope-dims-1e9": {"llama.rope.dimension_count": u32(10**9)},
        "vocab-size-1e9": {"llama.vocab_size": u32(10**9)},
        "rms-eps-nan": {"llama.attention.layer_norm_rms_epsilon": mx.array(float("nan"))},
        "rope-base-0": {"llama.rope.freq_base": mx.array(0.0)},
        "rope-base-inf": {"llama.rope.freq_base": mx.array(float("inf"))},
        "rope-scaling-factor-0": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": mx.array(0.0)},
        "block-count-string": {"llama.block_count": "many"},
        "head-count-string": {"llama.attention.head_count": "2"},
        "tokens-not-strings": {"tokenizer.ggml.tokens": mx.arange(262, dtype=mx.int32)},
        "tokens-empty": {"tokenizer.ggml.tokens": [""]},
        "token-type-short": {"tokenizer.ggml.token_type": mx.array([3, 3], dtype=mx.int32)},
        "merges-no-space": {"tokenizer.ggml.merges": ["Ġt"]},
        "merges-not-in-vocab": {"tokenizer.ggml.merges": ["x y"]},
        "bos-1e9": {"tokenizer.ggml.bos_token_id": u32(10**9)},
        # the attacker's pass: an unknown token past the vocabulary (260), a token string twice
        "unk-99999": {"tokenizer.ggml.unknown_token_id": u32(99999)},
        "tokens-duplicate": {"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + ["a"] * 254 + ["Ġ", "t", "Ġt"]},
        "tokens-duplicate-one": {"tokenizer.ggml.tokens": ["<unk>", "<s>", "<s>"] + [f"c{i}" for i in range(254)]
                                 + ["Ġ", "t", "Ġt"]},
        "alignment-0": {"general.alignment": u32(0)},
        "alignment-3": {"general.alignment": u32(3)},
        "alignment-2^31": {"general.alignment": u32(1 << 31)},
        "architecture-int": {"general.architecture": u32(7)},
    }


def write_corpus(root: Path, base: Path) -> list[Path]:
    """Every byte-level mutation of ``base`` as a file under ``root``; returns the paths."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in mutations(base.read_bytes()).items():
        path = root / f"{name}.gguf"
        path.write_bytes(data)
        paths.append(path)
    return paths

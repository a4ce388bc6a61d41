"""Reading the seed's drafter attachments (issue 24 row 3): ``mlx-cache-v3`` headers and ``.mlxkv`` files.

The files here are built byte for byte from the seed's documented layout (``persistence.ts``: magic, u32 header
length, u32 data start, u64 ``Bun.hash`` of the JSON header, tensors at 16 KiB-aligned offsets after it;
attachment cache headers as ``JSON.stringify`` writes them, slots ``{off, bytes, shape, dtype, hash}`` with MLX's
numeric dtype and ``off`` indexing the attachment's tensors). Restores are compared bit for bit.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.convert.seed_codec import SeedFormatError, from_seed_attachment, read_mlxkv, wyhash
from spec_cache.drafters.cache_codec import restore_kv_caches
from spec_cache.schemas import CACHE_CODECS_V1, CheckpointAttachment, SchemaError
from spec_cache.state.cache_state import checkpoint_from_store
from spec_cache.store import Store
from spec_cache.store.tensors import LayerState, Tensor

ALIGN = 16384
BF16, F32, U32 = 12, 10, 3  # mlx-c mlx_dtype numbers as mlx-bun's FFI has them
N = 5


def js(value) -> bytes:
    """``JSON.stringify`` for these plain values (no spaces, insertion order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def bf16(shape, seed) -> Tensor:
    """bfloat16 values (held as their uint16 words: the upper half of float32s)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return Tensor("bfloat16", shape, (x.view(np.uint32) >> 16).astype(np.uint16))


def raw(t) -> bytes:
    return np.ascontiguousarray(t.array() if isinstance(t, Tensor) else t).tobytes()


def projected_seed(n=N):
    """A DeepSpec context in the seed's layout: two kv layers, bf16 ``[1, 2, n, 8]``."""
    tensors, headers = [], []
    for layer in range(2):
        slots = []
        for part in range(2):
            arr = bf16((1, 2, n, 8), 10 * layer + part)
            slots.append({"off": len(tensors), "bytes": arr.nbytes, "shape": list(arr.shape), "dtype": BF16,
                          "hash": ""})
            tensors.append(arr)
        headers.append({"kind": "kv", "offset": n, "tensors": slots})
    metadata = {"processedTokens": n, "cacheCodecs": "mlx-cache-v3", "cacheHeaders": js(headers).decode()}
    return "deepspec-context-v1", metadata, tensors, [BF16] * 4


def standalone_seed(n=N, kind="qkv"):
    """A draft model's caches: layer 0 empty (null), layer 1 quantized KV (or another kind)."""
    parts = [Tensor.from_numpy(np.random.default_rng(s).integers(0, 2**32, (1, 2, n, 2), dtype=np.uint32))
             if s % 3 == 0 else bf16((1, 2, n, 1), s) for s in range(6)]
    dtypes = [U32 if p.dtype == "uint32" else BF16 for p in parts]
    slots = [{"off": i, "bytes": p.nbytes, "shape": list(p.shape), "dtype": d, "hash": ""}
             for i, (p, d) in enumerate(zip(parts, dtypes))]
    layer = {"kind": kind, "offset": n, "groupSize": 64, "bits": 4, "tensors": slots, "minimumReusableOffset": 2}
    if kind == "rotating":
        layer = {"kind": "rotating", "offset": n, "idx": 1, "maxSize": 4, "tensors": slots[:2]}
        parts, dtypes = parts[:2], dtypes[:2]
    metadata = {"processedTokens": n, "pendingLast": False, "cacheCodecs": "mlx-cache-v3",
                "cacheHeaders": js([None, layer]).decode()}
    return "standalone-draft-v1", metadata, parts, dtypes


def mlxkv(tokens, attachments, *, version=4, corrupt_tensor=False) -> bytes:
    """A seed ``.mlxkv`` file: one target kv layer, then each attachment's tensors (its planKvCache layout)."""
    target = [np.random.default_rng(99).standard_normal((1, 1, len(tokens), 4)).astype(np.float32)] * 2
    blobs, cursor = [], 0

    def place(arr, dtype, align_first):
        nonlocal cursor
        off = -(-cursor // ALIGN) * ALIGN if align_first else cursor
        data = raw(arr)
        blobs.append((off, data))
        cursor = off + len(data)
        return {"off": off, "bytes": len(data), "shape": list(arr.shape), "dtype": dtype,
                "hash": format(wyhash(data), "016x")}
    caches = [{"kind": "kv", "offset": len(tokens), "tensors": [place(t, F32, True) for t in target]}]
    out_attachments = []
    for schema, metadata, tensors, dtypes in attachments:
        slots = []
        for arr, dtype in zip(tensors, dtypes):
            slots.append(place(arr, dtype, False))
            cursor = -(-cursor // ALIGN) * ALIGN  # the attachment plan aligns after each tensor
        out_attachments.append({"schema": schema, "metadata": metadata, "tensors": slots})
    header = {"formatVersion": version, "createdAt": 1767225600000, "modelId": "tiny", "configFingerprint": "f",
              "ns": "", "tokenizerHash": "0", "attachments": out_attachments, "codecProvider": "mlx-cache-v3",
              "tokens": list(tokens), "caches": caches}
    head = js(header)
    data_start = -(-(26 + len(head)) // ALIGN) * ALIGN
    out = bytearray(data_start + cursor)
    out[:26] = b"MLXBUNKV2\n" + len(head).to_bytes(4, "little") + data_start.to_bytes(4, "little") + \
        wyhash(head).to_bytes(8, "little")
    out[26:26 + len(head)] = head
    for off, data in blobs:
        out[data_start + off:data_start + off + len(data)] = data
    if corrupt_tensor:
        out[data_start + blobs[-1][0]] ^= 1
    return bytes(out)


def test_wyhash_is_bun_hash():
    """The vectors Zig's std.hash.Wyhash pins (Bun.hash is it, seed 0 by default)."""
    vectors = [(0, 0x409638ee2bde459, ""), (1, 0xa8412d091b5fe0a9, "a"), (2, 0x32dd92e4b2915153, "abc"),
               (3, 0x8619124089a3a16b, "message digest"), (4, 0x7a43afb61d7f5f40, "abcdefghijklmnopqrstuvwxyz"),
               (5, 0xff42329b90e50d58, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"),
               (6, 0xc39cab13b115aad3, "1234567890" * 8)]
    for seed, expected, text in vectors:
        assert wyhash(text.encode(), seed) == expected


def _words(array: mx.array) -> bytes:
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array).tobytes()


@pytest.mark.parametrize("make", [projected_seed, standalone_seed])
def test_a_seed_file_restores_bit_for_bit(make, tmp_path):
    tokens = list(range(100, 100 + N))
    schema, metadata, tensors, dtypes = make()
    path = tmp_path / "entry.mlxkv"
    path.write_bytes(mlxkv(tokens, [(schema, metadata, tensors, dtypes)]))
    entry = read_mlxkv(path)
    assert entry.tokens == tokens
    (attachment,) = entry.attachments
    assert attachment.schema == schema and attachment.metadata["cacheCodecs"] == CACHE_CODECS_V1
    assert attachment.metadata["processedTokens"] == N
    caches = restore_kv_caches(checkpoint_from_store(N, attachment).attachment)  # as the runtime restores one
    if schema == "standalone-draft-v1":  # the null layer stays empty; the conversion point survives
        assert caches[0].offset == 0 and caches[1].offset == N
        assert caches[1].converted_at == 2 and (caches[1].bits, caches[1].group_size) == (4, 64)
        restored = [*caches[1].keys, *caches[1].values]
    else:
        assert [c.offset for c in caches] == [N, N]
        restored = [a for c in caches for a in (c.keys, c.values)]
    assert [_words(a) for a in restored] == [raw(t) for t in tensors]
    with Store.open(tmp_path / "store") as store:  # and it stores and reads back as any spec-cache attachment
        ns = bytes(32)
        store.register_namespace(ns, target="t", prefix_namespace="p")
        layer = LayerState("kv", {}, [Tensor.from_numpy(np.zeros((1, 1, N, 4), np.float32))] * 2, 2)
        store.put(ns, tokens, [layer], drafter=(f"{schema}:seed", attachment))
        got = store.fetch(ns, tokens, drafter=f"{schema}:seed").attachment
        assert [raw(t) for t in got.tensors] == [raw(t) for t in tensors]
        assert dict(got.metadata) == dict(attachment.metadata)


def test_headers_without_a_codec_pass_through():
    hidden = bf16((1, 1, 8), 3)
    seed = CheckpointAttachment("gemma-assistant-v1", {"processedTokens": 4}, [hidden])
    assert from_seed_attachment(seed, 4) == seed


@pytest.mark.parametrize("kind,why", [("rotating", "ring"), ("ssm", "ArraysCache"), ("turboquant", "TurboQuant")])
def test_kinds_without_an_equivalent_are_refused_with_the_reason(kind, why):
    schema, metadata, tensors, _ = standalone_seed(kind="rotating" if kind == "rotating" else "qkv")
    if kind != "rotating":
        headers = json.loads(metadata["cacheHeaders"])
        headers[1]["kind"] = kind
        metadata = dict(metadata, cacheHeaders=js(headers).decode())
    with pytest.raises(SeedFormatError, match=why):
        from_seed_attachment(CheckpointAttachment(schema, metadata, tensors))


def test_damage_and_other_formats_are_refused(tmp_path):
    tokens = list(range(N))
    good = mlxkv(tokens, [projected_seed()])
    bad_header = bytearray(good)
    bad_header[40] ^= 1
    with pytest.raises(SeedFormatError, match="header hash"):
        read_mlxkv(bytes(bad_header))
    with pytest.raises(SeedFormatError, match="tensor hash"):
        read_mlxkv(mlxkv(tokens, [projected_seed()], corrupt_tensor=True))
    with pytest.raises(SeedFormatError, match="formatVersion 5"):
        read_mlxkv(mlxkv(tokens, [projected_seed()], version=5))
    with pytest.raises(SeedFormatError, match="not an mlx-bun"):
        read_mlxkv(b"MLXBUNKV1\n" + good[10:])
    schema, metadata, tensors, _ = projected_seed()
    with pytest.raises(SeedFormatError, match="expected 'mlx-cache-v3'"):
        from_seed_attachment(CheckpointAttachment(schema, dict(metadata, cacheCodecs=CACHE_CODECS_V1), tensors))
    wrong = json.loads(metadata["cacheHeaders"])
    wrong[0]["tensors"][0]["dtype"] = F32
    with pytest.raises(SeedFormatError, match="slot says float32"):
        from_seed_attachment(CheckpointAttachment(schema, dict(metadata, cacheHeaders=js(wrong).decode()), tensors))
    with pytest.raises(SchemaError):  # converted, then held to its schema: 5 tokens of context for 6
        from_seed_attachment(CheckpointAttachment(schema, dict(metadata), tensors), N + 1)

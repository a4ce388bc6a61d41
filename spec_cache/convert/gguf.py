"""GGUF -> mlx-lm model directory: quantized weights kept quantized, tokenizer and chat template from the metadata.

Why one file: one conversion: both readers, the re-packing and the per-architecture config and tokenizer writers
share the GGUF metadata helpers; its command line lives in ``spec_cache.apps.gguf_cli``.

``convert(gguf_path, out_dir)`` writes what ``mlx_lm.utils.load`` (and so ``TargetModel.load`` /
``Generator.load``) reads: ``config.json`` (with mlx-lm's ``quantization`` block), ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` (with the GGUF's chat template).

Weights. ``mx.load`` reads GGUF: Q4_0, Q4_1 and Q8_0 tensors come back in MLX's affine quantized layout (packed
``weight`` + ``scales`` + ``biases``, group size 32) and are written as they are, so the converted model computes
with exactly the values llama.cpp dequantizes (``d * q + m``); any other tensor type comes back dequantized and is
written as a float tensor (a linear layer then stays unquantized). The ``quantization`` block names the most
common (group size, bits) and lists every quantized module that differs (mlx-lm's per-module entries), e.g. a
Q4_1 file's 8-bit ``token_embd`` (Q8_0).

RoPE. llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` per head so that its interleaved-pair
rotation (MLX's ``traditional=True``) computes the Hugging Face half-split rotation. The rows are permuted back
here (a permutation of whole rows, so exact for packed weights, scales and biases alike) and the config keeps
mlx-lm's default ``rope_traditional: false``: the directory is the Hugging Face layout mlx-lm expects.
``tests/library/test_gguf.py`` proves it against the GGUF's own layout run with ``rope_traditional=True``.

Files ``mx.load`` cannot read (K-quants, Q5_0/Q5_1: e.g. Gemma 3 270M Q4_K_M) are read with the ``gguf``
package instead (``pip install gguf``): block types that are affine in groups of 32 (Q4_0/1, Q5_0/1, Q8_0, Q4_K,
Q5_K: ``value = scale * q + bias`` per 32 values) are re-packed into MLX's affine layout *exactly* (the integers
are recovered from the package's dequantized values and the block headers and checked against them), so the
model stays 4/5/8-bit with llama.cpp's values; Q6_K (groups of 16, MLX's smallest is 32) and the other types are
written as float weights (dequantized, the same values). Re-quantizing with ``mx.quantize`` instead would round
every weight a second time. Reading the 262144-token vocabulary through the ``gguf`` package is slow (~40 s).

Supported: ``general.architecture`` ``llama`` (llama, SmolLM, Mistral-style dense llama) and ``gemma3`` (text;
mlx-lm's ``gemma3_text``: norms stored by llama.cpp as ``w + 1`` shifted back, no Q/K permutation, llama.cpp's
hard-coded sliding-window pattern 6, local RoPE base 10000 and ``query_pre_attn_scalar``, tied embeddings);
byte-level BPE tokenizers (``tokenizer.ggml.model == "gpt2"``) with a known pre-tokenizer (``PRE_TOKENIZERS``) and
SentencePiece BPE (``"llama"``: merges rebuilt from the scores, byte fallback). Anything else is refused with
:class:`UnsupportedGGUF`, naming what is unsupported.

Speed on MLX's CPU backend (2 shared cores, SmolLM2-135M): a forward of 1 / 5 / 16 tokens takes 0.36 / 1.0 /
5.0 s with 4-bit weights (0.22 / 0.85 / 2.3 s dequantized to float32), so a verify window of ``k`` tokens costs
about ``k`` one-token steps; the quantized kernel computes each row on its own (batched, windowed and one-token
logits are bit-identical) and is far slower with float16 inputs: hence float32 scales by default, and
``dequantize=True`` for float weights.

CLI: ``spec-cache convert-gguf FILE OUT_DIR`` or ``python -m spec_cache.apps.gguf_cli FILE OUT_DIR`` (the
application imports this library module, never the other way round).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

from spec_cache.errors import InvalidRequest, ModelLoadError

__all__ = [
    "ARCHITECTURES",
    "InvalidGGUF",
    "PRE_TOKENIZERS",
    "UnsupportedGGUF",
    "check_gguf",
    "convert",
    "read_gguf",
    "unpermute_rows",
]

#: GGUF general.architecture values this converter handles
ARCHITECTURES = ("llama", "gemma3")

_DIGITS = {"type": "Digits", "individual_digits": True}
_BYTE_LEVEL_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)

#: tokenizer.ggml.pre -> the Hugging Face pre-tokenizer llama.cpp's pre-type stands for
PRE_TOKENIZERS: dict[str, list[dict]] = {
    # SmolLM / StarCoder: every digit alone, then GPT-2's byte-level split
    "smollm": [_DIGITS, _BYTE_LEVEL_REGEX],
    "starcoder": [_DIGITS, _BYTE_LEVEL_REGEX],
    "gpt-2": [_BYTE_LEVEL_REGEX],
    "default": [_BYTE_LEVEL_REGEX],
    # Llama 3
    "llama-bpe": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}

# GGUF tensor names (llama family) -> mlx-lm parameter paths (without the .weight/.scales/.biases/.bias suffix)
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: gemma3's block tensors (llama.cpp's GEMMA3 names) -> mlx-lm gemma3_text paths
_GEMMA3_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCKS = {"llama": _BLOCK, "gemma3": _GEMMA3_BLOCK}
_SUFFIXES = ("weight", "scales", "biases", "bias")
_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_TOKEN_USER_DEFINED = 4


class UnsupportedGGUF(ModelLoadError):
    """The GGUF file uses something this converter does not handle (the message names it)."""


class InvalidGGUF(UnsupportedGGUF):
    """The file is not a well-formed GGUF, or its model description contradicts itself (a count, length, offset,
    dimension, type id or config value out of bounds or disagreeing with the tensors present). A subclass of
    :class:`UnsupportedGGUF` so every caller that refuses an unsupported file refuses a hostile one the same way."""


# -- structure: checked in Python, bounded by the file's length, before any native reader sees the file ----------
#
# Why: ``mx.load``'s GGUF reader (gguflib, C) trusts the header: a metadata count larger than the file, a tensor
# with 0 or 5 dimensions, a zero alignment, a string length of 2^62 or a removed type id crash the process (SIGSEGV,
# SIGFPE) or make it allocate without bound; the ``gguf`` package fails with bare numpy errors. ``check_gguf``
# walks the header with ``struct`` against the file's size, so every count and length is bounded by the bytes that
# are really there before anything is allocated from it, and refuses with :class:`InvalidGGUF` (one line).

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # v1 (32-bit counts) predates every file llama.cpp writes today; v2 and v3 share a layout
#: GGUF metadata value types -> (struct format, size) for the fixed-size ones
_GGUF_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
                 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_GGUF_FLOAT_TYPES = (6, 12)
#: ggml tensor type id -> (name, values per block, bytes per block): the types ggml still defines
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
#: bounds no real model comes near (the largest vocabularies are ~262k tokens, the largest tensors ~2^31 values):
#: they stop a hostile header from making the reader loop or allocate for hours before the file runs out
GGUF_MAX_KV = 1 << 16
GGUF_MAX_TENSORS = 1 << 16
GGUF_MAX_KEY = 1 << 16  # the spec's own limit on a key's length
GGUF_MAX_STRING = 1 << 26  # 64 MiB: a chat template is kilobytes
GGUF_MAX_ARRAY = 1 << 24  # 16M items: a vocabulary is ~10^5
GGUF_MAX_NAME = 256  # ggml's GGML_MAX_NAME is 64
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
GGUF_MAX_ELEMENTS = 1 << 40
GGUF_MAX_ALIGNMENT = 1 << 16


class _Cursor:
    """Bounded reads over the file's bytes: every read names what it reads, so a short file says where it ends."""

    def __init__(self, data, path: Path) -> None:
        self.data, self.at, self.path = data, 0, path

    def fail(self, message: str) -> InvalidGGUF:
        return InvalidGGUF(f"{self.path}: not a valid GGUF file: {message}")

    def take(self, size: int, what: str) -> int:
        start = self.at
        if size < 0 or start + size > len(self.data):
            raise self.fail(f"{what} at byte {start} needs {size} bytes, the file has {len(self.data) - start} left")
        self.at = start + size
        return start

    def scalar(self, kind: int, what: str):
        fmt, size = _GGUF_SCALARS[kind]
        return struct.unpack_from(fmt, self.data, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str, limit: int = GGUF_MAX_STRING) -> str:
        size = self.u64(f"{what}'s length")
        if size > limit:
            raise self.fail(f"{what} claims {size} bytes (at most {limit})")
        start = self.take(size, what)
        try:
            return self.data[start:start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start} is not UTF-8") from None

    def value(self, kind: int, what: str):
        if kind in _GGUF_SCALARS:
            return self.scalar(kind, what)
        if kind == _GGUF_STRING:
            return self.string(what)
        if kind != _GGUF_ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        item = self.u32(f"{what}'s item type")
        count = self.u64(f"{what}'s length")
        if item == _GGUF_ARRAY:
            raise self.fail(f"{what} is an array of arrays (not supported)")
        if item not in _GGUF_SCALARS and item != _GGUF_STRING:
            raise self.fail(f"{what} has unknown item type {item}")
        smallest = 8 if item == _GGUF_STRING else _GGUF_SCALARS[item][1]
        if count > GGUF_MAX_ARRAY or count * smallest > len(self.data) - self.at:
            raise self.fail(f"{what} claims {count} items, more than the file holds")
        if item == _GGUF_STRING:
            return [self.string(f"{what}[{i}]") for i in range(count)]
        fmt, size = _GGUF_SCALARS[item]
        start = self.take(count * size, what)
        return list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, start))


def check_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    """Check the file's whole structure before any native reader sees it; returns its metadata (plain Python
    values) and its tensors (name -> (type name, dims innermost first, as GGUF lists them)).

    Checked against the file's length: the magic and version; the metadata and tensor counts (each entry needs
    bytes that must be there); every key, string and array length; value and item type ids (no nested arrays);
    UTF-8; each tensor's name (unique), number of dims (1-4), dims (>= 1, product bounded, rows a whole number of
    the type's blocks), type id (a type ggml defines), offset (aligned, inside the data section) and byte size (to
    the end of the file), with no two tensors' bytes overlapping; ``general.alignment`` a power of two. Raises
    :class:`InvalidGGUF` (one line) for the first problem, ``FileNotFoundError`` when there is no file."""
    import mmap

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 24:
            raise InvalidGGUF(f"{path}: not a valid GGUF file: {size} bytes, shorter than a GGUF header (24)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _check_structure(_Cursor(data, path))


def _check_structure(cursor: _Cursor) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    data, size = cursor.data, len(cursor.data)
    try:
        if data[:4] != _GGUF_MAGIC:
            raise cursor.fail(f"magic {data[:4]!r}, not {_GGUF_MAGIC!r}")
        cursor.take(4, "magic")
        version = cursor.u32("version")
        if version not in _GGUF_VERSIONS:
            raise cursor.fail(f"version {version} (readable: {', '.join(map(str, _GGUF_VERSIONS))}; a big-endian "
                              "file reads as a huge version)")
        n_tensors, n_kv = cursor.u64("tensor count"), cursor.u64("metadata count")
        if n_kv > GGUF_MAX_KV or n_kv * 13 > size - cursor.at:  # a key length, a value type, a 1-byte value
            raise cursor.fail(f"header claims {n_kv} metadata entries, more than the file holds")
        if n_tensors > GGUF_MAX_TENSORS or n_tensors * 24 > size - cursor.at:  # name length, n_dims, type, offset
            raise cursor.fail(f"header claims {n_tensors} tensors, more than the file holds")
        metadata: dict[str, Any] = {}
        types: dict[str, int] = {}
        for index in range(n_kv):
            key = cursor.string(f"metadata key {index}", GGUF_MAX_KEY)
            if not key:
                raise cursor.fail(f"metadata key {index} is empty")
            if key in metadata:
                raise cursor.fail(f"metadata key {key!r} appears twice")
            types[key] = kind = cursor.u32(f"{key}'s value type")
            metadata[key] = cursor.value(kind, key)
        alignment = metadata.get("general.alignment", 32)
        if "general.alignment" in metadata and (types["general.alignment"] != 4 or not (
                0 < alignment <= GGUF_MAX_ALIGNMENT and alignment & (alignment - 1) == 0)):
            raise cursor.fail(f"general.alignment {alignment!r} is not a uint32 power of two up to "
                              f"{GGUF_MAX_ALIGNMENT}")
        infos = []
        for index in range(n_tensors):
            name = cursor.string(f"tensor {index}'s name", GGUF_MAX_NAME)
            n_dims = cursor.u32(f"tensor {name!r}'s number of dims")
            if not 1 <= n_dims <= GGUF_MAX_DIMS:
                raise cursor.fail(f"tensor {name!r} has {n_dims} dims (1 to {GGUF_MAX_DIMS})")
            dims = tuple(cursor.u64(f"tensor {name!r}'s dims") for _ in range(n_dims))
            kind, offset = cursor.u32(f"tensor {name!r}'s type"), cursor.u64(f"tensor {name!r}'s offset")
            if kind not in GGML_TYPES:
                raise cursor.fail(f"tensor {name!r} has unknown type id {kind}")
            type_name, block, block_bytes = GGML_TYPES[kind]
            elements = 1
            for dim in dims:
                if not 1 <= dim <= GGUF_MAX_ELEMENTS:
                    raise cursor.fail(f"tensor {name!r} has dims {list(dims)} (each 1 to {GGUF_MAX_ELEMENTS})")
                elements *= dim  # exact (Python ints): no overflow to wrap around the bound below
            if elements > GGUF_MAX_ELEMENTS:
                raise cursor.fail(f"tensor {name!r} has {elements} values (at most {GGUF_MAX_ELEMENTS})")
            if dims[0] % block:
                raise cursor.fail(f"tensor {name!r}: rows of {dims[0]} values are not whole {type_name} blocks "
                                  f"of {block}")
            infos.append((name, type_name, dims, offset, elements // block * block_bytes))
        names = [info[0] for info in infos]
        if len(set(names)) != len(names):
            raise cursor.fail(f"tensor {next(n for n in names if names.count(n) > 1)!r} appears twice")
        data_start = -(-cursor.at // alignment) * alignment
        if data_start > size:
            raise cursor.fail(f"the tensor data would start at byte {data_start}, past the end ({size})")
        end_of_previous, previous = 0, None
        for name, _, _, offset, nbytes in sorted(infos, key=lambda info: info[3]):
            if offset % alignment:
                raise cursor.fail(f"tensor {name!r}'s offset {offset} is not a multiple of the alignment {alignment}")
            if offset + nbytes > size - data_start:
                raise cursor.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}) runs past the end of "
                                  f"the file ({size - data_start} data bytes)")
            if offset < end_of_previous:
                raise cursor.fail(f"tensors {previous!r} and {name!r} overlap")
            end_of_previous, previous = offset + nbytes, name
    except struct.error as error:  # defensive: every read is bounded above, so this is not expected
        raise cursor.fail(str(error)) from None
    return metadata, {name: (type_name, dims) for name, type_name, dims, _, _ in infos}


def _plain(value: Any) -> Any:
    """A metadata value as a Python scalar / str / list (``mx.load`` gives scalars as 0-d arrays)."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors (MLX layout; Q4_0/Q4_1/Q8_0 as packed weight + scales + biases) and plain metadata of a GGUF, after
    :func:`check_gguf` has checked its whole structure (a hostile file is refused before a native reader sees it)."""
    check_gguf(path)
    return _read_checked(Path(path))


def _read_checked(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``read_gguf`` for a file ``check_gguf`` has passed: ``mx.load``, or the ``gguf`` package for the tensor
    types mx.load cannot read. A reader's own error (numpy's, the package's) becomes one :class:`InvalidGGUF` line."""
    try:
        weights, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except Exception as error:  # mlx raises for tensor types it cannot read (Q4_K, Q5_0, Q6_K, ...)
        if importlib.util.find_spec("gguf") is None:
            raise UnsupportedGGUF(
                f"{path}: mlx cannot read this GGUF ({error}) and the 'gguf' package is not installed "
                "(pip install gguf: it reads K-quant and Q5 tensors)"
            ) from error
        try:
            return _read_with_gguf_package(path)
        except UnsupportedGGUF:
            raise
        except Exception as error:  # noqa: BLE001 - any reader failure is the file's fault: one line
            raise InvalidGGUF(f"{path}: cannot read its tensors: {type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}") from None
    return weights, {key: _plain(value) for key, value in metadata.items()}


#: tensor types mx.load reads (Q4_0/Q4_1/Q8_0 as packed MLX tensors, the float ones as they are)
READABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")


def _describe(path: Path) -> str:
    """What the file holds, for a refusal: architecture and tensor types (needs the optional ``gguf`` package)."""
    try:
        import gguf as reader  # the gguf package (not this module)

        file = reader.GGUFReader(str(path))
        arch = file.fields["general.architecture"].contents() if "general.architecture" in file.fields else "?"
        types = Counter(t.tensor_type.name for t in file.tensors)
    except Exception:
        return ""
    other = ", ".join(f"{name} x{count}" for name, count in sorted(types.items()) if name not in READABLE_TYPES)
    return f"; architecture {arch!r}, tensor types mx.load may not read: {other or 'none'}"


#: GGUF block types whose every 32-value group is affine (``scale * q + bias``, q unsigned): type -> (bits,
#: a function from the raw blocks (n_blocks, type_size) uint8 to per-group (scales, biases), float32)
def _affine_groups() -> dict[str, tuple[int, Any]]:
    import numpy as np

    def f16(blocks, start):
        return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)

    def k_scales(blocks):  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 groups of 32
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        return f16(blocks, 0) * sc.astype(np.float32), -(f16(blocks, 2) * m.astype(np.float32))

    return {
        "Q4_0": (4, lambda b: (f16(b, 0), -8 * f16(b, 0))),
        "Q4_1": (4, lambda b: (f16(b, 0), f16(b, 2))),
        "Q5_0": (5, lambda b: (f16(b, 0), -16 * f16(b, 0))),
        "Q5_1": (5, lambda b: (f16(b, 0), f16(b, 2))),
        "Q8_0": (8, lambda b: (f16(b, 0), -128 * f16(b, 0))),
        "Q4_K": (4, k_scales),
        "Q5_K": (5, k_scales),
    }


def _pack_affine(data, tensor_type, rows: int, columns: int) -> tuple[mx.array, mx.array, mx.array] | None:
    """A GGUF block tensor as MLX's affine layout (packed uint32 weight, scales, biases; group size 32), exact:
    the integers ``q = (value - bias) / scale`` are recovered from the ``gguf`` package's dequantized values and
    the block headers, and checked against them. None when the type is not affine in groups of 32 (Q6_K's groups
    are 16 wide, MLX's smallest is 32) or a check fails: the caller keeps the tensor as floats."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    kind = _affine_groups().get(tensor_type.name)
    if kind is None or columns % 32:
        return None
    bits, groups_of = kind
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    raw = np.asarray(data).reshape(rows, -1)
    packed_rows, scale_rows, bias_rows = [], [], []
    for start in range(0, rows, 8192):  # bounded memory for a 262144-row embedding
        chunk = raw[start:start + 8192]
        n = chunk.shape[0]
        values = dequantize(chunk, tensor_type).astype(np.float32).reshape(n, columns // 32, 32)
        scales, biases = groups_of(chunk.reshape(-1, type_size))
        scales, biases = scales.reshape(n, columns // 32, 1), biases.reshape(n, columns // 32, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(scales == 0, 0, np.rint((values - biases) / scales))
        if q.min() < 0 or q.max() > 2**bits - 1:
            return None
        q = q.astype(np.uint8)
        if np.abs(scales * q + biases - values).max() > 1e-5 * max(1.0, float(np.abs(values).max())):
            return None
        q = q.reshape(n, columns)
        if bits == 8:
            packed = q.view(np.uint32)
        elif bits == 4:
            packed = (q[:, 0::2] | (q[:, 1::2] << np.uint8(4))).view(np.uint32)
        else:  # MLX packs 3/5/6-bit values as one little-endian bit stream per row
            stream = np.unpackbits(q[..., None], axis=-1, bitorder="little")[..., :bits]
            packed = np.packbits(stream.reshape(n, -1), axis=-1, bitorder="little").view(np.uint32)
        packed_rows.append(np.ascontiguousarray(packed))
        scale_rows.append(scales.reshape(n, -1))
        bias_rows.append(biases.reshape(n, -1))
    return (mx.array(np.concatenate(packed_rows)), mx.array(np.concatenate(scale_rows)),
            mx.array(np.concatenate(bias_rows)))


def _read_with_gguf_package(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """What ``read_gguf`` gives, for files ``mx.load`` cannot read, through the ``gguf`` package: block types that
    are affine in groups of 32 (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K) in MLX's packed layout, exactly; every other
    type (Q6_K, Q2_K, Q3_K, IQ*) dequantized to float32 (the same values, unquantized)."""
    import gguf as reader
    import numpy as np

    file = reader.GGUFReader(str(path))
    metadata: dict[str, Any] = {}
    for key, field in file.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        metadata[key] = value
    tensors: dict[str, mx.array] = {}
    float_types = (reader.GGMLQuantizationType.F32, reader.GGMLQuantizationType.F16,
                   reader.GGMLQuantizationType.BF16)
    for tensor in file.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dimension first
        stem = tensor.name[: -len(".weight")] if tensor.name.endswith(".weight") else None
        if tensor.tensor_type not in float_types and stem is not None and len(shape) == 2:
            affine = _pack_affine(tensor.data, tensor.tensor_type, shape[0], shape[1])
            if affine is not None:
                tensors[tensor.name], tensors[f"{stem}.scales"], tensors[f"{stem}.biases"] = affine
                continue
        values = reader.quants.dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = mx.array(np.asarray(values, dtype=np.float32).reshape(shape))
    return tensors, metadata


def unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp maps the Hugging Face row order ``[head][half][i]`` to ``[head][i][half]`` so that rotating
    interleaved pairs equals rotating halves; this maps it back. Rows are whole (packed weight rows, their scales
    and biases, or bias entries), so the inverse is exact for quantized tensors too.
    """
    rows = w.shape[0]
    if rows % (2 * heads):
        raise UnsupportedGGUF(f"cannot un-permute {rows} rows over {heads} heads")
    rest = tuple(w.shape[1:])
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _meta(metadata: dict, key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in metadata:
        return metadata[key]
    if required:
        raise UnsupportedGGUF(f"GGUF metadata has no {key!r}")
    return default


#: sane bounds on config values (far beyond any released model; a value outside them is a hostile or broken file)
_LIMITS = {
    "block_count": (1, 1024),
    "attention.head_count": (1, 1024),
    "attention.head_count_kv": (1, 1024),
    "embedding_length": (1, 1 << 17),
    "feed_forward_length": (1, 1 << 20),
    "attention.key_length": (1, 4096),
    "attention.value_length": (1, 4096),
    "rope.dimension_count": (1, 4096),
    "context_length": (1, 1 << 24),
    "vocab_size": (1, GGUF_MAX_ARRAY),
    "attention.sliding_window": (1, 1 << 24),
    "expert_count": (0, 1 << 16),
}


def _int_meta(metadata: dict, key: str, default: Any = None, *, required: bool = False,
              bounds: tuple[int, int] | None = None) -> Any:
    """An integer metadata value (not a string, float or bool), within ``bounds`` (default: ``_LIMITS`` by the
    key's name after the architecture) else :class:`InvalidGGUF`; ``default`` when absent."""
    value = _meta(metadata, key, None, required=required)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidGGUF(f"GGUF metadata {key} is {value!r}, not an integer")
    lo, hi = bounds or _LIMITS.get(key.split(".", 1)[-1], (0, 1 << 62))
    if not lo <= value <= hi:
        raise InvalidGGUF(f"GGUF metadata {key} is {value} (expected {lo} to {hi})")
    return value


def _float_meta(metadata: dict, key: str, default: float, *, low: float = 0.0, high: float = 1e15) -> float:
    """A finite number in ``(low, high]`` (a zero RoPE base or a NaN epsilon makes every logit NaN)."""
    value = _meta(metadata, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
            low < value <= high):
        raise InvalidGGUF(f"GGUF metadata {key} is {value!r} (expected a number above {low:g}, at most {high:g})")
    return float(value)


def _epsilon(metadata: dict, arch: str, default: float) -> float:
    """The RMSNorm epsilon, rounded to 6 digits (the GGUF stores it as float32: 1e-5 reads as 9.99999974e-06)."""
    return float(f"{_float_meta(metadata, f'{arch}.attention.layer_norm_rms_epsilon', default, high=1.0):.6g}")


def _str_meta(metadata: dict, key: str, default: Any = None, *, required: bool = False) -> Any:
    value = _meta(metadata, key, default, required=required)
    if value is not None and not isinstance(value, str):
        raise InvalidGGUF(f"GGUF metadata {key} is {value!r}, not a string")
    return value


def _expected_dims(arch: str, config: dict) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> dims (innermost first, as GGUF lists them) that the config implies, for every tensor a
    model of ``arch`` may carry; each block's required ones are in ``_REQUIRED``."""
    hidden, ff = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    vocab = config["vocab_size"]
    dims = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,), "output.weight": (hidden, vocab)}
    block = {
        "attn_q.weight": (hidden, q_out), "attn_k.weight": (hidden, kv_out), "attn_v.weight": (hidden, kv_out),
        "attn_output.weight": (q_out, hidden), "attn_q.bias": (q_out,), "attn_k.bias": (kv_out,),
        "attn_v.bias": (kv_out,), "attn_output.bias": (hidden,), "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,), "ffn_gate.weight": (hidden, ff), "ffn_up.weight": (hidden, ff),
        "ffn_down.weight": (ff, hidden), "ffn_gate.bias": (ff,), "ffn_up.bias": (ff,), "ffn_down.bias": (hidden,),
        "attn_q_norm.weight": (config["head_dim"],), "attn_k_norm.weight": (config["head_dim"],),
        "post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,),
    }
    for layer in range(config["num_hidden_layers"]):
        dims.update({f"blk.{layer}.{name}": shape for name, shape in block.items()})
    return dims


_REQUIRED = {
    "llama": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_norm.weight",
              "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"),
    "gemma3": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_norm.weight",
               "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
               "post_ffw_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"),
}


def _check_model(arch: str, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The config agrees with the tensors present: heads divide evenly, ``block_count`` is the number of blocks
    there are (a block_count of 10^9 would make the loader build 10^9 layers), and every tensor has the dims the
    config implies (so no reshape or matmul downstream meets a size it did not expect)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if kv_heads > heads or heads % kv_heads:
        raise InvalidGGUF(f"head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    layers = config["num_hidden_layers"]
    present = {int(name.split(".")[1]) for name in tensors
               if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if present != set(range(layers)):
        raise InvalidGGUF(f"block_count is {layers} but the file holds blocks {_ranges(sorted(present))}")
    expected = _expected_dims(arch, config)
    for name in ("token_embd.weight", "output_norm.weight") + tuple(
            f"blk.{layer}.{part}" for layer in range(layers) for part in _REQUIRED[arch]):
        if name not in tensors:
            raise InvalidGGUF(f"tensor {name!r} is missing")
    for name, (_, dims) in tensors.items():
        if name in expected and tuple(dims) != expected[name]:
            raise InvalidGGUF(f"tensor {name!r} has dims {list(dims)}, the config implies {list(expected[name])}")


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    return f"{values[0]}..{values[-1]} ({len(values)} of them)" if len(values) > 1 else str(values[0])


def _mlx_name(name: str, arch: str = "llama") -> str:
    parts = name.split(".")
    block = _BLOCKS[arch]
    if parts[-1] not in _SUFFIXES:
        raise UnsupportedGGUF(f"tensor {name!r}: unknown suffix")
    stem, suffix = ".".join(parts[:-1]), parts[-1]
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{suffix}"
    raise UnsupportedGGUF(f"tensor {name!r} has no place in an mlx-lm {arch} model (unsupported tensor)")


def _llama_config(metadata: dict, weights: dict) -> dict:
    arch = "llama"
    heads = _int_meta(metadata, f"{arch}.attention.head_count", required=True)
    kv_heads = _int_meta(metadata, f"{arch}.attention.head_count_kv", heads)
    hidden = _int_meta(metadata, f"{arch}.embedding_length", required=True)
    head_dim = _int_meta(metadata, f"{arch}.attention.key_length", max(1, hidden // heads))
    value_dim = _int_meta(metadata, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedGGUF(f"llama with key_length {head_dim} != value_length {value_dim} is not supported")
    rope_dims = _int_meta(metadata, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedGGUF(f"partial rotary embedding (rope.dimension_count {rope_dims} of head_dim {head_dim})")
    if "rope_freqs.weight" in weights:
        raise UnsupportedGGUF("per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) are not supported")
    if _int_meta(metadata, f"{arch}.expert_count", 0):
        raise UnsupportedGGUF("mixture-of-experts llama (expert_count > 0) is not supported")
    tokens = _tokens(metadata)
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _int_meta(metadata, f"{arch}.block_count", required=True),
        "intermediate_size": _int_meta(metadata, f"{arch}.feed_forward_length", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _epsilon(metadata, arch, 1e-5),
        "vocab_size": _int_meta(metadata, f"{arch}.vocab_size", len(tokens)),
        "rope_theta": _float_meta(metadata, f"{arch}.rope.freq_base", 10000.0),
        "rope_traditional": False,  # Q/K rows are un-permuted to the Hugging Face layout
        "max_position_embeddings": _int_meta(metadata, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = _str_meta(metadata, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedGGUF(f"RoPE scaling type {scaling!r} is not supported (only linear)")
        config["rope_scaling"] = {"type": "linear",
                                  "factor": _float_meta(metadata, f"{arch}.rope.scaling.factor", 1.0, high=1e6)}
    _special_ids(metadata, config, len(tokens))
    return config


def _special_ids(metadata: dict, config: dict, vocab: int) -> None:
    """BOS / EOS / padding ids into ``config``: each an integer inside the vocabulary."""
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = _int_meta(metadata, f"tokenizer.ggml.{meta_key}", bounds=(0, vocab - 1))
        if value is not None:
            config[key] = value


def _tokens(metadata: dict) -> list[str]:
    """``tokenizer.ggml.tokens``: a non-empty list of strings (the vocabulary every other tokenizer key indexes)."""
    tokens = _meta(metadata, "tokenizer.ggml.tokens", required=True)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InvalidGGUF("GGUF metadata tokenizer.ggml.tokens is not a non-empty list of strings")
    return tokens


#: llama.cpp's gemma3 constants the GGUF does not carry (src/llama-model.cpp): every 6th layer attends globally,
#: the sliding-window layers rotate with base 10000
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE = 10_000.0


def _gemma3_config(metadata: dict, weights: dict) -> dict:
    """mlx-lm ``gemma3_text`` config from llama.cpp's gemma3 keys. Not in the file, as llama.cpp hard-codes them:
    the sliding-window pattern (6), the local RoPE base (10000) and ``query_pre_attn_scalar`` (head_dim; the
    27B model, hidden 5376 over 32 heads, uses hidden / heads). RoPE is the Hugging Face half-split layout (llama.cpp
    runs gemma3 with NEOX rotation; its converter does not permute Q/K), embeddings are tied."""
    arch = "gemma3"
    heads = _int_meta(metadata, f"{arch}.attention.head_count", required=True)
    hidden = _int_meta(metadata, f"{arch}.embedding_length", required=True)
    head_dim = _int_meta(metadata, f"{arch}.attention.key_length", 256)
    if _int_meta(metadata, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedGGUF("gemma3 with key_length != value_length is not supported")
    if _meta(metadata, f"{arch}.final_logit_softcapping") or _meta(metadata, f"{arch}.attn_logit_softcapping"):
        raise UnsupportedGGUF("gemma3 logit soft-capping is not supported (mlx-lm's gemma3_text has none)")
    if "output.weight" in weights:
        raise UnsupportedGGUF("gemma3 with an untied output head is not supported (mlx-lm's gemma3_text ties it)")
    layers = _int_meta(metadata, f"{arch}.block_count", required=True)
    tokens = _tokens(metadata)
    config: dict[str, Any] = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": _int_meta(metadata, f"{arch}.feed_forward_length", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": _int_meta(metadata, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _epsilon(metadata, arch, 1e-6),
        "vocab_size": _int_meta(metadata, f"{arch}.vocab_size", len(tokens)),
        "rope_theta": _float_meta(metadata, f"{arch}.rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE,
        "query_pre_attn_scalar": hidden // heads if (hidden, heads) == (5376, 32) else head_dim,
        "sliding_window": _int_meta(metadata, f"{arch}.attention.sliding_window", 512),
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": _int_meta(metadata, f"{arch}.context_length", 32768),
        "tie_word_embeddings": True,
    }
    scaling = _str_meta(metadata, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedGGUF(f"RoPE scaling type {scaling!r} is not supported (only linear)")
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": _float_meta(metadata, f"{arch}.rope.scaling.factor", 1.0, high=1e6)}
    _special_ids(metadata, config, len(tokens))
    return config


def _in_features(mlx_name: str, config: dict) -> int:
    """The input size of a linear / embedding module (needed to read bits and group size off packed shapes)."""
    if mlx_name.endswith("o_proj"):
        return config["num_attention_heads"] * config["head_dim"]
    if mlx_name.endswith("down_proj"):
        return config["intermediate_size"]
    return config["hidden_size"]


def _model_weights(
    raw: dict[str, mx.array], config: dict, dtype: mx.Dtype | None, dequantize: bool = False, arch: str = "llama"
) -> tuple[dict, dict]:
    """mlx-lm weights and the ``quantization`` block ({} when nothing stays quantized). llama: Q/K rows
    un-permuted. gemma3: llama.cpp stores every RMSNorm weight as ``w + 1`` (its converter adds Gemma's ``1 +``);
    mlx-lm's gemma3_text adds it at run time, so 1 is subtracted here."""
    weights: dict[str, mx.array] = {}
    for name, value in raw.items():
        target = _mlx_name(name, arch)
        if arch == "llama" and name.startswith("blk.") and (".attn_q." in name or ".attn_k." in name):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            value = unpermute_rows(value, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value.astype(mx.float32) - 1.0
        if dtype is not None and value.dtype in (mx.float16, mx.bfloat16, mx.float32):
            value = value.astype(dtype)
        weights[target] = value
    if dequantize:
        weights = _dequantized(weights, config, dtype or mx.float32)
    # per quantized module: (group_size, bits) read off the packed shapes
    shapes: dict[str, dict] = {}
    for name in weights:
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed, scales = weights[f"{module}.weight"], weights[name]
        if packed.dtype != mx.uint32 or f"{module}.biases" not in weights:
            raise UnsupportedGGUF(f"{module}: quantized tensor not in MLX's affine layout")
        in_features = _in_features(module, config)
        bits = packed.shape[-1] * 32 // in_features
        group_size = in_features // scales.shape[-1]
        if bits * in_features != packed.shape[-1] * 32 or group_size * scales.shape[-1] != in_features:
            raise UnsupportedGGUF(f"{module}: packed shape {packed.shape} does not fit {in_features} inputs")
        shapes[module] = {"group_size": int(group_size), "bits": int(bits)}
    if not shapes:
        return weights, {}
    common = Counter((s["group_size"], s["bits"]) for s in shapes.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": common[0], "bits": common[1], "mode": "affine"}
    for module, setting in sorted(shapes.items()):
        if (setting["group_size"], setting["bits"]) != common:
            quantization[module] = setting
    # modules stored as float while others are quantized: name them explicitly so no loader quantizes them
    for name in weights:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module and module not in shapes and weights[name].ndim == 2:
            quantization[module] = False
    return weights, quantization


def _dequantized(weights: dict[str, mx.array], config: dict, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Every packed module as a float ``weight`` (``mx.dequantize``: the exact values the quantized kernels use)."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module and f"{module}.scales" in weights:
            scales, biases = weights[f"{module}.scales"], weights[f"{module}.biases"]
            in_features = _in_features(module, config)
            bits = value.shape[-1] * 32 // in_features
            value = mx.dequantize(value, scales.astype(mx.float32), biases.astype(mx.float32),
                                  group_size=in_features // scales.shape[-1], bits=bits)
        out[name] = value.astype(dtype) if value.dtype in (mx.float16, mx.bfloat16, mx.float32) else value
        mx.eval(out[name])
    return out


def _tokenizer_config(metadata: dict, added: list[dict], add_bos: bool, **special: str | None) -> dict:
    """``tokenizer_config.json`` (both tokenizer kinds write the same one): the added tokens, BOS/EOS handling,
    the special tokens present (``special``: ``bos``, ``eos``, ``unk``, ``pad`` -> token text or None) and the
    GGUF's chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(_meta(metadata, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(metadata, f"{_meta(metadata, 'general.architecture')}.context_length", 4096)),
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in added
        },
    }
    for name in ("bos", "eos", "unk", "pad"):
        if special.get(name) is not None:
            config[f"{name}_token"] = special[name]
    template = _meta(metadata, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _check_tokenizer(metadata: dict, vocab_size: int) -> None:
    """The tokenizer keys are what ``tokenizer.json`` needs, so the ``tokenizers`` library (Rust) is never handed a
    vocabulary it rejects at load time: tokens fit the embedding, token types and scores match them one for one,
    every merge is two tokens whose concatenation is a token, the chat template is a string, no token string twice
    (``tokenizer.json``'s vocabulary maps a string to one id: a repeated one would leave ids nothing encodes to;
    llama.cpp's converter never writes one, and neither real file tested has one), the unknown token's id inside
    the vocabulary (as BOS / EOS / padding: ``_special_ids``)."""
    tokens = _tokens(metadata)
    if len(tokens) > vocab_size:
        raise InvalidGGUF(f"{len(tokens)} tokens but an embedding of {vocab_size} rows")
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        index, repeated = next((i, t) for i, t in enumerate(tokens) if t in seen or seen.add(t))
        raise InvalidGGUF(f"GGUF metadata tokenizer.ggml.tokens holds {str(repeated)[:40]!r} twice (again at id "
                          f"{index}): every token string must be distinct")
    _int_meta(metadata, "tokenizer.ggml.unknown_token_id", bounds=(0, len(tokens) - 1))
    model = _str_meta(metadata, "tokenizer.ggml.model", required=True)
    _str_meta(metadata, "tokenizer.ggml.pre")
    _str_meta(metadata, "tokenizer.chat_template")
    for key, kinds in (("tokenizer.ggml.token_type", (int,)), ("tokenizer.ggml.scores", (int, float))):
        values = _meta(metadata, key)
        if values is None:
            continue
        if not isinstance(values, list) or len(values) != len(tokens) or not all(
                isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise InvalidGGUF(f"GGUF metadata {key} is not {len(tokens)} numbers, one per token")
    if model == "gpt2":
        merges = _meta(metadata, "tokenizer.ggml.merges", required=True)
        vocab = set(tokens)
        if not isinstance(merges, list):
            raise InvalidGGUF("GGUF metadata tokenizer.ggml.merges is not a list of strings")
        for index, merge in enumerate(merges):
            parts = merge.split(" ") if isinstance(merge, str) else []
            if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab or "".join(parts) not in vocab:
                raise InvalidGGUF(f"tokenizer.ggml.merges[{index}] ({str(merge)[:40]!r}) is not two tokens whose "
                                  "concatenation is a token")


def _tokenizer_files(metadata: dict) -> tuple[dict, dict]:
    """``tokenizer.json`` and ``tokenizer_config.json`` contents from the GGUF tokenizer metadata."""
    model = _meta(metadata, "tokenizer.ggml.model", required=True)
    if model == "llama":
        return _sentencepiece_tokenizer_files(metadata)
    if model != "gpt2":
        raise UnsupportedGGUF(
            f"tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece BPE 'llama')"
        )
    pre = _meta(metadata, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedGGUF(f"pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = list(_meta(metadata, "tokenizer.ggml.tokens", required=True))
    merges = list(_meta(metadata, "tokenizer.ggml.merges", required=True))
    types = list(_meta(metadata, "tokenizer.ggml.token_type", [1] * len(tokens)))
    added = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] == _TOKEN_CONTROL}
        for i, token in enumerate(tokens) if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]

    def token(key: str) -> str | None:
        index = _meta(metadata, f"tokenizer.ggml.{key}")
        return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

    bos, eos, unk, pad = token("bos_token_id"), token("eos_token_id"), token("unknown_token_id"), token(
        "padding_token_id")
    add_bos = bool(_meta(metadata, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}},
        }
    else:
        post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": PRE_TOKENIZERS[pre]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre == "llama-bpe",
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    return tokenizer, _tokenizer_config(metadata, added, add_bos, bos=bos, eos=eos, unk=unk, pad=pad)


_TOKEN_NORMAL, _TOKEN_BYTE = 1, 6


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges rebuilt from a SentencePiece BPE vocabulary (GGUF keeps tokens and scores, not merges): every
    split of a normal token into two normal tokens is a merge, ranked by the merged token's score (SentencePiece
    merges the highest-scoring pair first), ties by the parts' ids (the rule of Hugging Face's
    ``SentencePieceExtractor``)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == _TOKEN_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, index in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[index], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_tokenizer_files(metadata: dict) -> tuple[dict, dict]:
    """``tokenizer.json`` / ``tokenizer_config.json`` for a SentencePiece BPE vocabulary (``tokenizer.ggml.model
    == "llama"``, e.g. Gemma 3): spaces as ``▁``, byte fallback through the ``<0xNN>`` tokens, control tokens
    special, user-defined tokens (Gemma's newline and tab runs, image markers) matched whole before BPE, as
    SentencePiece does."""
    tokens = list(_meta(metadata, "tokenizer.ggml.tokens", required=True))
    scores = [float(x) for x in _meta(metadata, "tokenizer.ggml.scores", required=True)]
    types = [int(x) for x in _meta(metadata, "tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise UnsupportedGGUF("tokenizer.ggml.scores / token_type do not match tokenizer.ggml.tokens in length")
    if _meta(metadata, "tokenizer.ggml.add_space_prefix", False):
        raise UnsupportedGGUF("SentencePiece add_space_prefix is not supported (Gemma 3 files have it off)")
    added = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] == _TOKEN_CONTROL}
        for i, token in enumerate(tokens) if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]

    def token(key: str) -> str | None:
        index = _meta(metadata, f"tokenizer.ggml.{key}")
        return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

    bos, eos, unk, pad = (token(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"))
    add_bos = bool(_meta(metadata, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    post = None
    if add_bos:
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}},
        }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [list(m) for m in sentencepiece_merges(tokens, scores, types)],
        },
    }
    return tokenizer, _tokenizer_config(metadata, added, add_bos, bos=bos, eos=eos, unk=unk, pad=pad)


def convert(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: str | None = "float32", dequantize: bool = False,
    force: bool = False,
) -> Path:
    """Write an mlx-lm model directory for ``gguf_path`` into ``out_dir`` and return it.

    ``dtype`` (``float16``, ``bfloat16``, ``float32``; None: as stored, float16 scales/biases next to the
    GGUF's float32 norms, a mixed model) casts every float tensor, quantization scales and biases included.
    The default ``float32`` keeps the quantized values exact (fp16 -> fp32 is lossless; logits match a float32
    dequantized reference to ~1e-4) and computes in float32: MLX's CPU quantized kernels are also far slower
    with float16 inputs. ``float16`` is the usual choice on Apple GPUs (+-0.07 on logits of scale ~40).
    ``dequantize`` writes every packed tensor as a float weight (default float32), the same values, no
    ``quantization`` block: much faster on MLX's CPU backend, whose quantized kernels do not batch. Refuses an
    existing non-empty ``out_dir`` unless ``force``. Raises :class:`UnsupportedGGUF` naming what it cannot convert.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (force=True overwrites)")
    cast = None if dtype is None else getattr(mx, dtype, None)
    if dtype is not None and cast not in (mx.float16, mx.bfloat16, mx.float32):
        raise InvalidRequest(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")
    # everything the file says is checked before mx.load (C) or the gguf package reads a tensor
    metadata, tensors = check_gguf(gguf_path)
    arch = _str_meta(metadata, "general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUF(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    config = _llama_config(metadata, tensors) if arch == "llama" else _gemma3_config(metadata, tensors)
    _check_model(arch, config, tensors)
    _check_tokenizer(metadata, config["vocab_size"])
    raw, metadata = _read_checked(Path(gguf_path))
    tokenizer, tokenizer_config = _tokenizer_files(metadata)
    weights, quantization = _model_weights(raw, config, cast, dequantize, arch)
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    floats = [v.dtype for v in weights.values() if v.dtype in (mx.float16, mx.bfloat16, mx.float32)]
    config["torch_dtype"] = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}[
        Counter(floats).most_common(1)[0][0]] if floats else "float16"
    config["gguf"] = {
        "source": Path(gguf_path).name,
        "file_type": _meta(metadata, "general.file_type"),
        "name": _meta(metadata, "general.name"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    try:
        staging.chmod(0o755)  # (mkdtemp makes it 0700: the model directory is read as any other)
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False)
                                                       + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _publish(staging, out)
    except BaseException:  # a failed or interrupted conversion leaves no staging directory of its own behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _publish(staging: Path, out: Path) -> None:
    """Move the finished conversion ``staging`` to ``out`` by renames, replacing what is there.

    Why a staging directory of this call's own and renames: two processes converting the same file at once (two
    servers started on one GGUF, the test suite's workers) each write their own, and ``out`` is never seen half
    written: it is the old directory, nothing for an instant, or the new one. A process that finds ``out`` filled
    by another in that instant keeps the other's (the same conversion) and drops its own."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=out.name + ".old-", dir=out.parent))
        try:
            out.rename(old / "replaced")
        except FileNotFoundError:  # another process moved it first
            pass
    try:
        staging.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

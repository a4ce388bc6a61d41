"""GGUF -> mlx-lm model directory: quantized weights kept quantized, tokenizer and chat template from the metadata.

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
``tests/test_gguf.py`` proves it against the GGUF's own layout run with ``rope_traditional=True``.

Supported: ``general.architecture`` ``llama`` (llama, SmolLM, Mistral-style dense llama), byte-level BPE
tokenizers (``tokenizer.ggml.model == "gpt2"``) with a known pre-tokenizer (``PRE_TOKENIZERS``). Anything else is
refused with :class:`UnsupportedGGUF`, naming what is unsupported. Not yet: ``gemma3`` (the registry's Gemma 3
270M Q4_K_M file holds Q4_K / Q5_0 / Q6_K tensors that ``mx.load`` (mlx 0.32.4) fails to read, and a SentencePiece
tokenizer, ``tokenizer.ggml.model == "llama"``, which needs merges rebuilt from scores).

Speed on MLX's CPU backend (2 shared cores, SmolLM2-135M): a forward of 1 / 5 / 16 tokens takes 0.36 / 1.0 /
5.0 s with 4-bit weights (0.22 / 0.85 / 2.3 s dequantized to float32), so a verify window of ``k`` tokens costs
about ``k`` one-token steps; the quantized kernel computes each row on its own (batched, windowed and one-token
logits are bit-identical) and is far slower with float16 inputs: hence float32 scales by default, and
``dequantize=True`` for float weights.

CLI: ``python -m spec_cache.gguf FILE OUT_DIR`` (``add_arguments`` / ``main`` for ``spec-cache convert-gguf``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_cli import add_arguments

__all__ = [
    "ARCHITECTURES",
    "PRE_TOKENIZERS",
    "UnsupportedGGUF",
    "convert",
    "read_gguf",
    "unpermute_rows",
    "add_arguments",
    "main",
]

#: GGUF general.architecture values this converter handles
ARCHITECTURES = ("llama",)

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
_SUFFIXES = ("weight", "scales", "biases", "bias")
_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_TOKEN_USER_DEFINED = 4


class UnsupportedGGUF(ValueError):
    """The GGUF file uses something this converter does not handle (the message names it)."""


def _plain(value: Any) -> Any:
    """A metadata value as a Python scalar / str / list (``mx.load`` gives scalars as 0-d arrays)."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors (MLX layout; Q4_0/Q4_1/Q8_0 as packed weight + scales + biases) and plain metadata of a GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        weights, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except Exception as error:  # mlx raises for tensor types it cannot read
        raise UnsupportedGGUF(f"{path}: mlx cannot read this GGUF ({error}){_describe(path)}") from error
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


def _mlx_name(name: str) -> str:
    parts = name.split(".")
    if parts[-1] not in _SUFFIXES:
        raise UnsupportedGGUF(f"tensor {name!r}: unknown suffix")
    stem, suffix = ".".join(parts[:-1]), parts[-1]
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{suffix}"
    raise UnsupportedGGUF(f"tensor {name!r} has no place in an mlx-lm llama model (unsupported tensor)")


def _llama_config(metadata: dict, weights: dict) -> dict:
    arch = "llama"
    heads = int(_meta(metadata, f"{arch}.attention.head_count", required=True))
    kv_heads = int(_meta(metadata, f"{arch}.attention.head_count_kv", heads))
    hidden = int(_meta(metadata, f"{arch}.embedding_length", required=True))
    head_dim = int(_meta(metadata, f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(_meta(metadata, f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedGGUF(f"llama with key_length {head_dim} != value_length {value_dim} is not supported")
    rope_dims = int(_meta(metadata, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedGGUF(f"partial rotary embedding (rope.dimension_count {rope_dims} of head_dim {head_dim})")
    if "rope_freqs.weight" in weights:
        raise UnsupportedGGUF("per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) are not supported")
    if _meta(metadata, f"{arch}.expert_count", 0):
        raise UnsupportedGGUF("mixture-of-experts llama (expert_count > 0) is not supported")
    tokens = _meta(metadata, "tokenizer.ggml.tokens", required=True)
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(metadata, f"{arch}.block_count", required=True)),
        "intermediate_size": int(_meta(metadata, f"{arch}.feed_forward_length", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{float(_meta(metadata, f'{arch}.attention.layer_norm_rms_epsilon', 1e-5)):.6g}"),
        "vocab_size": int(_meta(metadata, f"{arch}.vocab_size", len(tokens))),
        "rope_theta": float(_meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": False,  # Q/K rows are un-permuted to the Hugging Face layout
        "max_position_embeddings": int(_meta(metadata, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = _meta(metadata, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedGGUF(f"RoPE scaling type {scaling!r} is not supported (only linear)")
        config["rope_scaling"] = {"type": "linear", "factor": float(_meta(metadata, f"{arch}.rope.scaling.factor"))}
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = _meta(metadata, f"tokenizer.ggml.{meta_key}")
        if value is not None:
            config[key] = int(value)
    return config


def _in_features(mlx_name: str, config: dict) -> int:
    """The input size of a linear / embedding module (needed to read bits and group size off packed shapes)."""
    if mlx_name.endswith("o_proj"):
        return config["num_attention_heads"] * config["head_dim"]
    if mlx_name.endswith("down_proj"):
        return config["intermediate_size"]
    return config["hidden_size"]


def _llama_weights(
    raw: dict[str, mx.array], config: dict, dtype: mx.Dtype | None, dequantize: bool = False
) -> tuple[dict, dict]:
    """mlx-lm weights (Q/K rows un-permuted) and the ``quantization`` block ({} when nothing stays quantized)."""
    weights: dict[str, mx.array] = {}
    for name, value in raw.items():
        target = _mlx_name(name)
        if name.startswith("blk.") and (".attn_q." in name or ".attn_k." in name):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            value = unpermute_rows(value, heads)
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


def _tokenizer_files(metadata: dict) -> tuple[dict, dict]:
    """``tokenizer.json`` and ``tokenizer_config.json`` contents from the GGUF tokenizer metadata."""
    model = _meta(metadata, "tokenizer.ggml.model", required=True)
    if model != "gpt2":
        raise UnsupportedGGUF(
            f"tokenizer model {model!r} is not supported (only byte-level BPE, tokenizer.ggml.model == 'gpt2')"
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
    for key, value in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if value is not None:
            config[key] = value
    template = _meta(metadata, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tokenizer, config


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
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")
    raw, metadata = read_gguf(gguf_path)
    arch = _meta(metadata, "general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUF(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    config = _llama_config(metadata, raw)
    tokenizer, tokenizer_config = _tokenizer_files(metadata)
    weights, quantization = _llama_weights(raw, config, cast, dequantize)
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
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def main(args: argparse.Namespace) -> int:
    """Run ``convert-gguf``; 0 on success, 2 for an unsupported or missing file (message on stderr)."""
    import sys

    try:
        out = convert(args.file, args.out_dir, dtype=args.dtype, dequantize=args.dequantize, force=args.force)
    except (UnsupportedGGUF, FileNotFoundError, FileExistsError) as error:
        print(f"convert-gguf: {error}", file=sys.stderr)
        return 2
    config = json.loads((out / "config.json").read_text())
    q = config.get("quantization") or {}
    print(f"wrote {out}: {config['model_type']} {config['num_hidden_layers']} layers, "
          f"{'%s-bit group %s' % (q['bits'], q['group_size']) if q else 'unquantized'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(add_arguments(argparse.ArgumentParser(prog="python -m spec_cache.gguf")).parse_args()))

"""``spec-cache convert-gguf``: its options, MLX-free (the ``spec-cache`` parser is built without loading MLX), and
``main``, which runs the conversion of the library module ``spec_cache.convert.gguf`` (imported only when it runs).

``python -m spec_cache.apps.gguf_cli FILE OUT_DIR`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``convert-gguf FILE OUT_DIR``."""
    parser.add_argument("file", metavar="FILE",
                        help="a GGUF file (llama family or gemma3; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K stay "
                             "quantized; K-quants and Q5 need the gguf package)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the mlx-lm model directory to write")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float32",
                        help="float tensors and quantization scales/biases (default float32: exact values, and "
                             "fast on MLX's CPU backend; float16 for Apple GPUs)")
    parser.add_argument("--dequantize", action="store_true",
                        help="write float weights (float32 unless --dtype): faster on MLX's CPU backend")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty OUT_DIR")
    return parser


def main(args: argparse.Namespace) -> int:
    """Run ``convert-gguf``; 0 on success, 2 for an unsupported or missing file (message on stderr)."""
    from spec_cache.convert.gguf import UnsupportedGGUF, convert  # loads MLX

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
    raise SystemExit(main(add_arguments(
        argparse.ArgumentParser(prog="python -m spec_cache.apps.gguf_cli")).parse_args()))

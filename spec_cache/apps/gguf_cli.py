"""``convert-gguf``'s options, MLX-free (the ``spec-cache`` parser is built without loading MLX; the conversion
itself lives in ``spec_cache.gguf``)."""

from __future__ import annotations

import argparse


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

#!/bin/bash
# First call on a fresh H200: stash part-00 of the MLX CUDA tarball (carried in .whl/p1) under /tmp/parts, where
# it stays while the machine is warm, and print what the image holds.
mkdir -p /tmp/parts && cp .whl/p1/* /tmp/parts/ && ls -la /tmp/parts
python3 --version; which python3
python3 -m pip list 2>/dev/null | grep -iE "^(transformers|tokenizers|msgpack|safetensors|numpy|tqdm|sentencepiece|protobuf|pyyaml|jinja2|nvidia-[a-z0-9-]+) "
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

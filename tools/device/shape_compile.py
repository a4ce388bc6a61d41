"""How much a forward at a new token count costs the first time on MLX CUDA (kernels compiled per shape class).

Usage (on the lent H200, MLX CUDA installed as tools/device/bench_drafting.sh does):
``python3 tools/device/shape_compile.py MODEL_DIR``. Each length runs three times on a fresh cache after a
64-token prefill; the first time includes any kernel NVRTC compiles for that class. Measured with SmolLM2-135M
4-bit, MLX 0.32.4: 23 tokens took 36.5 s the first time, 8.6 ms after (see spec_cache/decode/warmup.py).
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

LENGTHS = (1, 2, 3, 5, 7, 11, 16, 23, 31, 47, 64, 100)


def main(model_dir: str) -> None:
    model, _ = load(model_dir)
    for length in LENGTHS:
        times = []
        for _ in range(3):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([[5 + i % 100 for i in range(64)]]), cache=cache))
            tokens = mx.array([[7 + i % 50 for i in range(length)]])
            started = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            times.append((time.perf_counter() - started) * 1000)
        print(f"L={length}: first {times[0]:.1f} ms, then {times[1]:.1f}, {times[2]:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

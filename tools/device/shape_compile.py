"""How much a forward at a new token length costs the first time on MLX CUDA (kernels compiled per shape?)."""
import sys, time
import mlx.core as mx
from mlx_lm.utils import load
model, tok = load(sys.argv[1])
from mlx_lm.models.cache import make_prompt_cache
for L in [1, 2, 3, 5, 7, 11, 16, 23, 31, 47, 64, 100]:
    ts = []
    for rep in range(3):
        cache = make_prompt_cache(model)
        x = mx.array([[5 + i % 100 for i in range(64)]])
        mx.eval(model(x, cache=cache))
        y = mx.array([[7 + i % 50 for i in range(L)]])
        t = time.perf_counter(); mx.eval(model(y, cache=cache)); ts.append((time.perf_counter() - t) * 1000)
    print(f"L={L}: first {ts[0]:.1f} ms, then {ts[1]:.1f}, {ts[2]:.1f}", flush=True)

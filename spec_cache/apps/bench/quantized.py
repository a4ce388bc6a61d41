"""Batched vs per-row quantized KV: 4 rows decoded through the engine with ``kv_bits``, rows sharing one forward per
phase (``QuantizedTargetRows``) vs one forward per row (``quantized_baseline.PerRowQuantizedTargetRows``, the
previous path), tokens asserted identical. Also the same rows in full precision (batched ``TargetRows``) for scale.

``quantized_batch_speedup`` is the 4-bit figure for plain decoding (depth 0: the target's forwards alone);
``*_drafted`` figures run the draft-model drafter at a fixed depth (its own forwards are batched either way).
Batching saves per-forward overhead, not arithmetic: with mlx's bundled reference BLAS (no OpenBLAS preloaded) the
CPU is compute-bound even for these tiny models and batched == per-row (measured 0.85-1.08x); with OpenBLAS
preloaded (README) the batched rows run at the float32 batch's speed (2.08x per-row at 4-bit, measured).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np


def _engine_classes():
    from spec_cache.apps.bench.quantized_baseline import per_row_engine
    from spec_cache.decode.engine import SpeculativeEngine

    return SpeculativeEngine, per_row_engine()


def run(*, hidden: int = 512, layers: int = 4, vocab: int = 4096, prompt_tokens: int = 128, new_tokens: int = 48,
        rows: int = 4, bits: tuple = (4, 8), group_size: int = 64, depth: int = 3, drafted: bool = True,
        reps: int = 3) -> dict:
    """Figures for ``rows`` rows of ``new_tokens`` each (see module doc); ``drafted=False`` skips the drafter runs.
    Raises AssertionError when batched and per-row rows disagree on a token."""
    from spec_cache.decode.engine import RowRequest
    from spec_cache.drafters import load_provider
    from spec_cache.naming.namespace import KVOptions
    from spec_cache.rows.target import TargetModel
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    work = tempfile.mkdtemp(prefix="bench-quantized-")
    target_dir = write_tiny_target(os.path.join(work, "target"), hidden_size=hidden, num_layers=layers,
                                   num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
                                   intermediate_size=hidden * 2, vocab_size=vocab, tokenizer=False)
    drafter_dir = write_tiny_drafter(os.path.join(work, "draft-model"), "draft-model", target_dir, seed=1)
    target = TargetModel.load(target_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, prompt_tokens + 8 * i).tolist() for i in range(rows)]  # different lengths
    batched_cls, per_row_cls = _engine_classes()

    def engine(cls, kv, provider, draft_depth):
        built = cls(target, provider, draft_depth=draft_depth, kv=kv, adaptive=False)  # fixed work
        built.run([RowRequest(prompts[0][:16], max_tokens=2, stop_at_eos=False)])  # warm-up
        return built

    def timed(built) -> tuple[float, list]:
        start = time.perf_counter()
        results = built.run([RowRequest(p, max_tokens=new_tokens, stop_at_eos=False) for p in prompts])
        return time.perf_counter() - start, [r.tokens for r in results]

    def compare(kv, provider, draft_depth) -> tuple[float, float, list, list]:
        """Tokens/s of the batched and the per-row engine, runs interleaved (a loaded machine slows both)."""
        engines = [engine(cls, kv, provider, draft_depth) for cls in (batched_cls, per_row_cls)]
        times: list[list[float]] = [[], []]
        tokens: list = [None, None]
        for _ in range(reps):
            for index, built in enumerate(engines):
                seconds, tokens[index] = timed(built)
                times[index].append(seconds)
        rates = [sum(len(t) for t in tokens[i]) / statistics.median(times[i]) for i in range(2)]
        return rates[0], rates[1], tokens[0], tokens[1]

    from spec_cache.apps.bench.ttft import blas_in_use

    out: dict = {"rows": rows, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "hidden": hidden,
                 "layers": layers, "group_size": group_size, "depth": depth, "blas": blas_in_use()}
    fp32 = engine(batched_cls, None, None, 0)
    out["fp32_batch_tok_s"] = new_tokens * rows / statistics.median([timed(fp32)[0] for _ in range(reps)])
    provider = load_provider(drafter_dir)
    for bit in bits:
        kv = KVOptions(kv_bits=bit, kv_group_size=group_size, quantized_kv_start=0)  # converts at the prompt's end
        for label, drafter, draft_depth in (("", None, 0), ("_drafted", provider, depth))[: 2 if drafted else 1]:
            batched, per_row, batched_tokens, per_row_tokens = compare(kv, drafter, draft_depth)
            if batched_tokens != per_row_tokens:
                raise AssertionError(f"{bit}-bit{label}: batched and per-row quantized rows disagree")
            out[f"q{bit}_batch_tok_s{label}"] = batched
            out[f"q{bit}_per_row_tok_s{label}"] = per_row
            out[f"q{bit}_batch_speedup{label}"] = batched / per_row
    out["quantized_batch_speedup"] = out[f"q{bits[0]}_batch_speedup"]
    return out


if __name__ == "__main__":  # pragma: no cover - manual run
    import json
    import sys

    sizes = {"hidden": 256, "layers": 2, "vocab": 1024, "prompt_tokens": 64, "new_tokens": 12, "reps": 1,
             "drafted": False} if "--quick" in sys.argv else {}
    print(json.dumps(run(**sizes), indent=2))

"""DeepSpec draft cost per round: token by token vs one block forward (``block_size``), on tiny local models.

Why: the seed drafts DeepSpec as one block (``gamma = block_size``) sliced to the round's depth; this project
drafted token by token. For two tiny llama targets (hidden 128 / 2 layers, and hidden 512 / 4 layers / 8 heads /
2 KV heads) it writes a tiny DeepSpec drafter and the same with ``set_block_size(dir, 4, 0)``, opens 4 rows with
63-token contexts and times ``group.draft(pending, depth)`` for depth 1, 2, 4, interleaved in random order,
printing the medians. Measure on the CPU with OpenBLAS preloaded (``LD_PRELOAD=.../libopenblas.so.0``,
``OPENBLAS_NUM_THREADS=1``): with the mlx wheel's reference BLAS a 4-wide forward is much slower than a 1-wide one.
Usage: ``python tools/bench_block_deepspec.py [--reps 80]`` (figures in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from spec_cache.drafters import load_provider
from spec_cache.rows.target import TargetModel, TargetRows
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from spec_cache.testing.tiny_writers import set_block_size

TARGETS = [("hidden 128, 2 layers", {}),
           ("hidden 512, 4 layers", {"hidden_size": 512, "num_layers": 4, "intermediate_size": 1024, "num_heads": 8,
                                     "num_kv_heads": 2})]
DEPTHS = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=80, help="timed draft calls per (drafter, depth)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="block-deepspec-"))
    for label, options in TARGETS:
        work = root / label.replace(" ", "_").replace(",", "")
        target_dir = write_tiny_target(work / "target", "llama", seed=0, tokenizer=False, **options)
        target = TargetModel.load(target_dir)
        paths = {"token by token": write_tiny_drafter(work / "step", "deepspec", target_dir),
                 "block_size 4": set_block_size(write_tiny_drafter(work / "block", "deepspec", target_dir), 4, 0)}
        prompts = [[(7 * i + j) % 200 + 3 for j in range(64)] for i in range(4)]
        groups = {}
        for name, path in paths.items():
            rows = TargetRows.from_row_caches(target, [None] * len(prompts))
            group = load_provider(path).open(rows, [None] * len(prompts))
            heads = [p[:-1] for p in prompts]
            group.prefill(heads, rows.prefill(heads, tap_layers=group.tap_layers))
            groups[name] = group
        pending = [p[-1] for p in prompts]
        times: dict[tuple[str, int], list[float]] = {(n, d): [] for n in groups for d in DEPTHS}
        keys = list(times)
        for name, depth in keys:  # one untimed call each (first-call costs)
            groups[name].draft(pending, depth)
        for _ in range(args.reps):
            random.shuffle(keys)
            for name, depth in keys:
                started = time.perf_counter()
                groups[name].draft(pending, depth)
                times[(name, depth)].append(time.perf_counter() - started)
        for name in groups:
            cells = ", ".join(f"depth {d} {statistics.median(times[(name, d)]) * 1e3:.1f} ms" for d in DEPTHS)
            print(f"{label} | {name} | {cells}")


if __name__ == "__main__":
    main()

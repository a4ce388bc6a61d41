"""Target-only hits for the tap-reading drafters: what the old re-forward cost and what the tail context costs.

For each (tiny target, drafter): restore ``prefix`` tokens of each prompt target-only (no drafter row) and
generate; compare with a cold row, which is what a target-only hit did before (the whole prefix forwarded again
for the drafter's context). Prints prefix tokens forwarded again, acceptance (accepted / drafted), mean TTFT
and the whole run's seconds; asserts the tokens are identical.
Usage: ``python tools/target_only_hits.py [--prefix 190] [--prompt 200] [--max-tokens 64] [--drafters deepspec]``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.drafters import load_provider
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

DRAFTERS = [("deepspec", {}), ("dflash", {"gamma": 4}), ("dflash2", {"gamma": 4}), ("qwen-mtp", {})]


def target_only_requests(target, prompts, prefix, max_tokens):
    """Requests restored ``prefix`` tokens deep from a drafter-less run (target part only)."""
    calls = []
    SpeculativeEngine(target, None).run([RowRequest(p[:prefix + 1], max_tokens=1) for p in prompts],
                                        on_checkpoint=lambda row, tokens, caches, draft: calls.append(
                                            (row, tokens, caches)))
    boundary = {row: (tokens, caches) for row, tokens, caches in reversed(calls)}
    return [RowRequest(p, restored_caches=boundary[i][1], restored_tokens=len(boundary[i][0]), max_tokens=max_tokens)
            for i, p in enumerate(prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--prefix", type=int, default=190)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--drafters", nargs="*", default=[name for name, _ in DRAFTERS])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    print("| target | drafter | prefix forwarded again: before -> after | acceptance before -> after | TTFT ms | "
          "run s |")
    print("|---|---|---|---|---|---|")
    for arch in ("llama", "qwen2"):
        target_dir = write_tiny_target(root / arch / "target", arch, seed=0, tokenizer=False)
        target = TargetModel.load(target_dir)
        rnd = random.Random(0)
        prompts = [[rnd.randrange(256) for _ in range(args.prompt)] for _ in range(3)]
        for method, options in (d for d in DRAFTERS if d[0] in args.drafters):
            drafter = write_tiny_drafter(root / arch / method, method, target_dir, seed=0, **options)
            engine = SpeculativeEngine(target, load_provider(drafter), draft_depth=3, adaptive=False)
            engine.run([RowRequest(p[:40], max_tokens=4) for p in prompts])  # warm-up: not in either TTFT
            started = time.perf_counter()
            before = engine.run([RowRequest(p, max_tokens=args.max_tokens) for p in prompts])
            requests = target_only_requests(target, prompts, args.prefix, args.max_tokens)
            middle = time.perf_counter()
            after = engine.run(requests)
            seconds = [middle - started, time.perf_counter() - middle]
            assert [r.tokens for r in before] == [r.tokens for r in after], "tokens changed"
            again = [sum(min(args.prefix, len(p) - 1) - r.cached_tokens for p, r in zip(prompts, rs))
                     for rs in (before, after)]
            rates = [f"{sum(r.accepted for r in rs)}/{sum(r.drafted for r in rs)}" for rs in (before, after)]
            ttft = [1000 * sum(r.ttft_s for r in rs) / len(rs) for rs in (before, after)]
            print(f"| {arch} | {method} | {again[0]} -> {again[1]} | {rates[0]} -> {rates[1]} | "
                  f"{ttft[0]:.1f} -> {ttft[1]:.1f} | {seconds[0]:.2f} -> {seconds[1]:.2f} |")


if __name__ == "__main__":
    main()

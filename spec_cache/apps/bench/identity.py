"""Benchmark model_identity against raw blake3 on the same bytes (warm page cache).

Builds a throwaway model directory (config.json + a few *.safetensors shards of random bytes),
then reports, as medians over --repeat runs:
  raw       one multithreaded blake3 hasher, update_mmap() over every file (the speed ceiling)
  identity  model_identity(dir, memo=False): framing, stat checks, mmap'd 256 MiB slices
  memo hit  model_identity(dir, memo=FileMemo) once the digest is memoized (stats + one read)

    python -m spec_cache.apps.bench.identity [--size-mib 1024] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import blake3

from spec_cache.apps.bench.timing import median_time
from spec_cache.naming.identity import FileMemo, model_identity

CHUNK = 64 << 20


def make_model_dir(root: Path, size: int, shards: int) -> list[Path]:
    (root / "config.json").write_text('{"model_type": "bench", "hidden_size": 4096}')
    paths = [root / "config.json"]
    per_shard = size // shards
    for i in range(shards):
        path = root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        left = per_shard if i < shards - 1 else size - per_shard * (shards - 1)
        with open(path, "wb") as fh:
            while left:
                n = min(CHUNK, left)
                fh.write(os.urandom(n))
                left -= n
        paths.append(path)
    return paths


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(CHUNK):
                pass


def run(size_mib: int, repeat: int, shards: int, directory: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-identity-", dir=directory) as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        paths = make_model_dir(model, size_mib << 20, shards)
        total = sum(p.stat().st_size for p in paths)
        warm(paths)

        def raw():
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            for p in paths:
                h.update_mmap(p)
            return h.hexdigest()

        raw()  # one untimed run each, so both start equally warm
        model_identity(model, memo=False)
        raw_times, ident_times = [], []
        for _ in range(repeat):  # interleaved, so load from other processes hits both alike
            raw_times.append(median_time(raw, 1))
            ident_times.append(median_time(lambda: model_identity(model, memo=False), 1))
        raw_s, ident_s = statistics.median(raw_times), statistics.median(ident_times)

        memo = FileMemo(Path(tmp) / "memo")
        first = model_identity(model, memo=memo)
        hit_s = median_time(lambda: model_identity(model, memo=memo), max(repeat, 21))
        assert model_identity(model, memo=memo) == first

    gib = total / (1 << 30)
    return {
        "bytes": total,
        "files": len(paths),
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "raw_update_mmap_s": raw_s,
        "identity_s": ident_s,
        "raw_gib_per_s": gib / raw_s,
        "identity_gib_per_s": gib / ident_s,
        "identity_over_raw_time": ident_s / raw_s,
        "memo_hit_ms": hit_s * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="total weight bytes (default 1024)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per median (default 5)")
    ap.add_argument("--shards", type=int, default=4, help="number of *.safetensors files (default 4)")
    ap.add_argument("--dir", default=None, help="where to create the temporary model directory")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.repeat < 1 or args.shards < 1:
        ap.error("--size-mib, --repeat and --shards must be positive")
    r = run(args.size_mib, args.repeat, args.shards, args.dir)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['bytes'] / (1 << 20):.0f} MiB in {r['files']} files, {r['cpus']} CPUs, median of {r['repeat']}")
    print(f"raw blake3 update_mmap : {r['raw_update_mmap_s'] * 1000:8.1f} ms  {r['raw_gib_per_s']:5.2f} GiB/s")
    print(f"model_identity         : {r['identity_s'] * 1000:8.1f} ms  {r['identity_gib_per_s']:5.2f} GiB/s")
    print(f"identity / raw time    : {r['identity_over_raw_time']:8.3f}")
    print(f"memoized call          : {r['memo_hit_ms']:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

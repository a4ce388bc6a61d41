"""Run every fault harness at its full size (or ``--quick``) and print one JSON object per harness, then a
summary table: ``python -m tools.faults [--quick] [--only crash,corruption,...]``. Exit 1 if any recorded a
failure."""

from __future__ import annotations

import argparse
import json
import sys
import time

FULL = {
    "crash": lambda: __import__("tools.faults.crash", fromlist=["run"]).run(200),
    "corruption": lambda: __import__("tools.faults.corruption", fromlist=["run"]).run(1000),
    "concurrency": lambda: __import__("tools.faults.concurrency", fromlist=["run"]).run(60, 4),
    "space": lambda: __import__("tools.faults.space", fromlist=["run"]).run(400),
    "hostile": lambda: __import__("tools.faults.hostile", fromlist=["run"]).run(20000),
    "timing": lambda: __import__("tools.faults.timing", fromlist=["run"]).run(4000),
}
QUICK = {
    "crash": lambda: __import__("tools.faults.crash", fromlist=["run"]).run(5, epoch=5, max_run_s=0.8),
    "corruption": lambda: __import__("tools.faults.corruption", fromlist=["run"]).run(30),
    "concurrency": lambda: __import__("tools.faults.concurrency", fromlist=["run"]).run(
        8, hold_every_s=2.5, writer_kill_every_s=4, roles=("writer", "mixed", "operator")),
    "space": lambda: __import__("tools.faults.space", fromlist=["run"]).run(120),
    "hostile": lambda: __import__("tools.faults.hostile", fromlist=["run"]).run(2000),
    "timing": lambda: __import__("tools.faults.timing", fromlist=["run"]).run(300),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=",".join(FULL))
    args = p.parse_args(argv)
    table = QUICK if args.quick else FULL
    rows, failed = [], False
    for name in args.only.split(","):
        start = time.monotonic()
        result = table[name]()
        print(json.dumps(result, sort_keys=True, default=str), flush=True)
        failures = result.get("failures", [])
        failed |= bool(failures)
        rows.append((name, len(failures), round(time.monotonic() - start, 1)))
    print("\n| harness | failures | seconds |\n|---|---|---|")
    for name, n, s in rows:
        print(f"| {name} | {n} | {s} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

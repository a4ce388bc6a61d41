"""Crash harness: a writer storing checkpoints through the real store API is killed with SIGKILL at random
moments; after each kill the store must open, ``verify`` must find no corrupt record, the index must be
consistent (nothing half-written is visible), and every checkpoint whose ``put`` returned must be there and
bit-identical (with its drafter part). The checkpoint in flight at the kill is either absent or whole.

Half the kills come at a uniformly random moment, half within 20 ms after a random put began (so more of them
land inside a commit). Trials run in epochs on one store (state accumulates across kills); odd epochs give the
writer a byte budget, so evictions, ``evict --to-size`` and ``gc`` run (and can be killed) too — there a
committed checkpoint may have been evicted, so it must be whole *or* missing, never different.

    python -m tools.faults.crash --trials 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from spec_cache.store import Store, maintenance
from tools.faults import workload as W
from tools.faults.common import LineReader, parser, python, report

BUDGET = 24 << 20


def writer(path: str, seed: int, budget: bool) -> None:
    """The process that gets killed: puts (80%), fetches, flushes, pins; with a budget also evict/gc."""
    rng = np.random.default_rng(seed)
    store = Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=True, max_bytes=BUDGET if budget else None)
    W.register(store)
    print("ready", flush=True)
    while True:
        r = rng.random()
        spec = W.random_spec(rng)
        if r < 0.8:
            tokens = spec.tokens  # state first: the window between B and C is the put itself
            layers = W.layers_for(spec.ns_key, spec.structure, tokens)
            drafter = (W.DRAFTER, W.attachment_for(spec.ns_key, tokens)) if spec.drafter else None
            print(f"B {spec.name()}", flush=True)
            store.put(spec.ns_key, tokens, layers, drafter=drafter)
            print(f"C {spec.name()}", flush=True)
        elif r < 0.88:
            store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
        elif r < 0.92:
            store.flush()
        elif not budget:
            store.pin(spec.ns_key, spec.tokens, bool(rng.random() < 0.5))
        elif r < 0.97:
            maintenance.evict(store, to_size=BUDGET // 2)
        else:
            maintenance.gc(store)


def _check(path: str, committed: set[str], in_flight: str | None, budget: bool) -> tuple[list[str], dict]:
    """Everything a crash must not break; returns (failures, counts)."""
    failures: list[str] = []
    counts = {"checked": 0, "in_flight_new": 0, "in_flight_present": 0}
    with Store.open(path, durable=False) as store:
        report_ = maintenance.verify(store)
        if report_.corrupt:
            failures.append(f"verify: {report_.corrupt} corrupt records: {report_.corrupt_keys[:2]}")
        failures += [f"index: {p}" for p in maintenance.index_problems(store)]
        if budget:
            total = maintenance.stats(store)["bytes"]
            if total > BUDGET:
                failures.append(f"{total} bytes stored over the budget {BUDGET}")
        for name in sorted(committed):
            spec = W.Spec.parse(name)
            restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
            counts["checked"] += 1
            wrong = W.check(restored, spec)
            if wrong:
                failures.append(f"committed {name}: WRONG STATE: {wrong}")
            elif not budget and (restored is None or restored.length != spec.length):
                failures.append(f"committed {name}: lost (got {None if restored is None else restored.length})")
            elif not budget and spec.drafter and restored.attachment is None:
                failures.append(f"committed {name}: drafter part lost")
        if in_flight is not None:
            spec = W.Spec.parse(in_flight)
            restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
            wrong = W.check(restored, spec)
            if wrong:
                failures.append(f"in-flight {in_flight}: WRONG STATE: {wrong}")
            elif in_flight not in committed:  # a new checkpoint: whole or absent, never half
                counts["in_flight_new"] += 1
                counts["in_flight_present"] += restored is not None and restored.length == spec.length
    return failures, counts


def run(trials: int = 200, *, seed: int = 0, epoch: int = 10, max_run_s: float = 1.2,
        workdir: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    base = tempfile.mkdtemp(prefix="faults-crash-", dir=workdir)
    result = {"harness": "crash", "trials": 0, "kills_mid_put": 0, "kills_mid_new_put": 0,
              "new_put_found_whole": 0,
              "committed_checked": 0, "puts_committed": 0, "budget_trials": 0, "failures": []}
    started = time.monotonic()
    committed: set[str] = set()
    path = ""
    try:
        for trial in range(trials):
            budget = (trial // epoch) % 2 == 1
            if trial % epoch == 0:
                path = os.path.join(base, f"store{trial // epoch}")
                committed = set()
            proc = python("-m", "tools.faults.crash", "--writer", path, "--seed", str(seed * 100_003 + trial),
                          *(["--budget"] if budget else []), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
            lines = LineReader(proc.stdout)
            if not lines.wait_for("ready", 120):
                proc.kill()
                proc.wait()
                result["failures"].append(f"trial {trial}: writer never got ready: {proc.stderr.read()[-500:]}")
                continue
            if trial % 2:  # a random moment
                time.sleep(float(rng.uniform(0, max_run_s)))
            else:  # a random moment shortly after the k-th put began: kills inside the commit more often
                lines.wait_count("B ", int(rng.integers(1, 40)), max_run_s * 4)
                time.sleep(float(rng.uniform(0, 0.02)))
            if proc.poll() is not None:
                result["failures"].append(f"trial {trial}: writer died by itself: {proc.stderr.read()[-800:]}")
                continue
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            out = lines.finish()
            proc.stderr.close()
            in_flight = None
            for line in out:
                kind, _, name = line.partition(" ")
                if kind == "B":
                    in_flight = name
                elif kind == "C":
                    committed.add(name)
                    result["puts_committed"] += 1
                    in_flight = None
            result["trials"] += 1
            result["budget_trials"] += budget
            result["kills_mid_put"] += in_flight is not None
            try:
                failures, counts = _check(path, committed, in_flight, budget)
            except Exception as exc:  # the store did not even open or check: a failure, keep going
                failures, counts = [f"check raised {type(exc).__name__}: {exc}"], {}
            result["committed_checked"] += counts.get("checked", 0)
            result["kills_mid_new_put"] += counts.get("in_flight_new", 0)
            result["new_put_found_whole"] += counts.get("in_flight_present", 0)
            result["failures"] += [f"trial {trial}: {f}" for f in failures]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--epoch", type=int, default=10, help="trials per store before starting a fresh one")
    p.add_argument("--max-run", type=float, default=1.2, help="longest time a writer runs before the kill (s)")
    p.add_argument("--workdir", default=None, help="where the temporary stores go (default: $TMPDIR)")
    p.add_argument("--writer", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--budget", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.writer:
        writer(args.writer, args.seed, args.budget)
        return 0
    return report(run(args.trials, seed=args.seed, epoch=args.epoch, max_run_s=args.max_run,
                      workdir=args.workdir), args.json)


if __name__ == "__main__":
    sys.exit(main())

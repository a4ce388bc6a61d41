"""Concurrency harness: several processes read and write one store at once, with a byte budget (so puts evict),
an operator process running ``evict --to-size``, ``gc`` and ``verify``, readers that hold transactions open, a
holder process SIGKILLed while it holds a read transaction (every few seconds), and the main writer SIGKILLed
and restarted now and then.

What must hold: no worker raises anything; no read returns state that is not exactly a stored prefix's; every
pinned checkpoint whose put returned is there at the end, bit-identical; no deadlock (every worker keeps
reporting progress); after each killed holder the writers keep committing; the store verifies clean at the end
and did not grow without bound (pages a killed reader pinned are reclaimed).

    python -m tools.faults.concurrency --seconds 60 --procs 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from tools.faults import workload as W
from tools.faults.common import LineReader, parser, python, report

BUDGET = 48 << 20
ROLES = ("writer", "mixed", "reader", "operator")
HOLDER = """
import sys, time
from spec_cache.store import Store
store = Store.open(sys.argv[1], durable=False)
txn = store.env.read()
txn.__enter__()
txn.get(b"format", db=store.env.dbs["meta"])
print("ready", flush=True)
time.sleep(600)
"""


def kill_reader_holder(path: str, cwd: str) -> int:
    """Start a process that opens the store at ``path`` and holds a read transaction, then SIGKILL it: the
    situation a dead engine leaves behind (its reader slot stays in the lock table). Returns its pid."""
    import os
    import signal
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], cwd=cwd, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready", "the holder process did not start"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    return holder.pid


def _say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def worker(path: str, role: str, seed: int, seconds: float, operator: str = "evict,gc,verify") -> None:
    """One process of the run; prints JSON lines: commits, heartbeats, errors."""
    from spec_cache.store import Store, maintenance

    rng = np.random.default_rng(seed)
    end = time.monotonic() + seconds
    ops = wrong = 0
    last_beat = 0.0
    try:
        with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False, max_bytes=BUDGET) as store:
            W.register(store)
            _say(ready=True)
            while time.monotonic() < end:
                spec = W.random_spec(rng, large=0.25)
                if role in ("writer", "mixed") and rng.random() < (0.7 if role == "writer" else 0.35):
                    pin = spec.structure == "small" and rng.random() < 0.03
                    W.put_spec(store, spec, pin=pin)
                    _say(put=spec.name(), pin=pin)
                elif role == "operator":
                    task = rng.choice(operator.split(","))
                    if task == "evict":
                        maintenance.evict(store, to_size=BUDGET // 2)
                    elif task == "gc":
                        maintenance.gc(store)
                    else:
                        v = maintenance.verify(store)
                        if v.damaged:
                            _say(error=f"verify under load: {v.corrupt} corrupt, index {v.index_problems[:3]}, "
                                       f"structure {v.structure_problems[:3]}")
                    time.sleep(0.2)
                else:
                    if role == "reader" and rng.random() < 0.05:  # a long reader: pins a snapshot for a while
                        with store.env.read() as txn:
                            txn.get(b"format", db=store.env.dbs["meta"])
                            time.sleep(float(rng.uniform(0.05, 0.5)))
                    restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
                    why = W.check(restored, spec)
                    if why:
                        wrong += 1
                        _say(error=f"WRONG STATE for {spec.name()}: {why}")
                ops += 1
                if time.monotonic() - last_beat > 0.5:
                    last_beat = time.monotonic()
                    _say(beat=ops)
        _say(done=ops, wrong=wrong)
    except BaseException as exc:
        _say(error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-2000:])


class _Proc:
    def __init__(self, path: str, role: str, seed: int, seconds: float, operator: str):
        self.role = role
        self.proc = python("-m", "tools.faults.concurrency", "--worker", role, "--dir", path, "--seed", str(seed),
                           "--seconds", str(seconds), "--operator", operator, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        self.lines = LineReader(self.proc.stdout)

    def events(self) -> list[dict]:
        out = []
        for line in list(self.lines.lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"error": f"unparsable output: {line[:200]}"})
        return out


def run(seconds: float = 60, procs: int = 4, *, seed: int = 0, hold_every_s: float = 4.0,
        writer_kill_every_s: float = 15.0, workdir: str | None = None, operator: str = "evict,gc,verify",
        roles: tuple[str, ...] | None = None) -> dict:
    base = tempfile.mkdtemp(prefix="faults-conc-", dir=workdir)
    path = os.path.join(base, "store")
    rng = np.random.default_rng(seed)
    result = {"harness": "concurrency", "seconds": seconds, "processes": procs, "ops": 0, "puts": 0,
              "pinned_checked": 0, "holders_killed": 0, "writers_killed": 0, "failures": []}
    roles = list(roles) if roles else [ROLES[i % len(ROLES)] for i in range(procs)]
    procs = len(roles)
    result["processes"] = procs
    result["roles"] = ",".join(roles)
    started = time.monotonic()
    end = started + seconds
    workers: list[_Proc] = []
    retired: list[_Proc] = []
    try:
        # create the store once so that the workers race on puts, not on creating it
        from spec_cache.store import Store
        with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
            W.register(store)
        workers = [_Proc(path, role, seed * 1000 + i, seconds, operator) for i, role in enumerate(roles)]
        next_hold = time.monotonic() + hold_every_s
        next_kill = time.monotonic() + writer_kill_every_s
        beats: dict[int, tuple[int, float]] = {}

        def owed() -> bool:  # a writer still at work that no kill reached yet (a loaded machine ran late)
            return result["writers_killed"] == 0 and any(w.role == "writer" and w.proc.poll() is None
                                                         for w in workers)

        while time.monotonic() < end or owed():
            time.sleep(0.25)
            now = time.monotonic()
            for i, w in enumerate(workers):  # deadlock watch: every live worker keeps printing
                count = len(w.lines.lines)
                if beats.get(i, (None,))[0] != count:
                    beats[i] = (count, now)
                elif now - beats[i][1] > 30 and w.proc.poll() is None:
                    result["failures"].append(f"{w.role} made no progress for 30 s (deadlock?)")
                    beats[i] = (count, now + 1e9)
            # the first writer kill happens however late a loaded machine gets here (while the writer still runs)
            victim = next((i for i, w in enumerate(workers) if w.role == "writer"), None)
            if victim is not None and now >= next_kill and workers[victim].proc.poll() is None and (
                    now < end - 2 or result["writers_killed"] == 0):
                next_kill = now + writer_kill_every_s
                os.kill(workers[victim].proc.pid, signal.SIGKILL)
                workers[victim].proc.wait()
                retired.append(workers[victim])
                remaining = max(1.0, end - time.monotonic())
                workers[victim] = _Proc(path, "writer", seed * 1000 + 100 + result["writers_killed"], remaining,
                                         operator)
                result["writers_killed"] += 1
            if now >= next_hold and now < end - 3:
                next_hold = now + hold_every_s
                _hold_and_kill(path, rng, workers, result)
        for w in workers:
            try:
                w.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                result["failures"].append(f"{w.role} did not finish (deadlock?)")
        pinned = set()
        for w in workers + retired:
            w.lines.finish()
            killed = w in retired
            finished = False
            for e in w.events():
                if "error" in e:
                    result["failures"].append(f"{w.role}: {e['error']}" + (f"\n{e['tb']}" if "tb" in e else ""))
                if "put" in e:
                    result["puts"] += 1
                    if e["pin"]:
                        pinned.add(e["put"])
                if "done" in e:
                    result["ops"] += e["done"]
                    finished = True
                elif "beat" in e and killed:
                    pass
            if killed:
                result["ops"] += max([e.get("beat", 0) for e in w.events()] or [0])
            elif not finished and w.proc.returncode not in (0, None):
                err = w.proc.stderr.read()[-800:] if w.proc.stderr else ""
                result["failures"].append(f"{w.role} exited with {w.proc.returncode}: {err}")
        result["failures"] += _final_check(path, pinned, result)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        shutil.rmtree(base, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _hold_and_kill(path: str, rng, workers: list[_Proc], result: dict) -> None:
    """A process takes a read transaction and is SIGKILLed holding it; writers must commit afterwards."""
    holder = python("-c", HOLDER, path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = LineReader(holder.stdout)
    if not lines.wait_for("ready", 60):
        holder.kill()
        holder.wait()
        return
    time.sleep(float(rng.uniform(0.2, 1.0)))
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    result["holders_killed"] += 1
    writers = [w for w in workers if w.role in ("writer", "mixed") and w.proc.poll() is None]
    before = sum(sum(1 for line in w.lines.lines if '"put"' in line) for w in writers)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if sum(sum(1 for line in w.lines.lines if '"put"' in line) for w in writers) > before:
            return
        time.sleep(0.1)
    if writers:
        result["failures"].append("no put committed within 15 s after a reader was killed holding a transaction")


def _final_check(path: str, pinned: set[str], result: dict) -> list[str]:
    from spec_cache.store import Store, maintenance

    failures = []
    with Store.open(path, durable=False) as store:
        v = maintenance.verify(store)
        if v.damaged:
            failures.append(f"final verify: {v.corrupt} corrupt, index {v.index_problems[:3]}, "
                            f"structure {v.structure_problems[:3]}")
        readers = [line for line in store.env.env.readers().splitlines()[1:] if line.strip()]
        result["stale_reader_slots_at_end"] = len(readers)
        stats = maintenance.stats(store)
        result["file_mib_at_end"] = round(stats["file_bytes"] / 2**20, 1)
        result["stored_mib_at_end"] = round(stats["bytes"] / 2**20, 1)
        for name in sorted(pinned):
            spec = W.Spec.parse(name)
            restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
            result["pinned_checked"] += 1
            why = W.check(restored, spec)
            if why:
                failures.append(f"pinned {name}: WRONG STATE: {why}")
            elif restored is None or restored.length != spec.length:
                failures.append(f"pinned {name}: lost (a committed pinned checkpoint is gone)")
    return failures


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--workdir", default=None)
    p.add_argument("--hold-every", type=float, default=4.0, help="seconds between killed read-holders")
    p.add_argument("--operator", default="evict,gc,verify", help="what the operator process runs")
    p.add_argument("--worker", choices=ROLES, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.dir, args.worker, args.seed, args.seconds, args.operator)
        return 0
    return report(run(args.seconds, args.procs, seed=args.seed, workdir=args.workdir, hold_every_s=args.hold_every,
                      operator=args.operator), args.json)


if __name__ == "__main__":
    sys.exit(main())

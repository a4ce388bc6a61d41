"""Space harness: a map that cannot grow, a full disk (a small size-limited tmpfs, filled by the store itself and
by another file), and a file-size limit (``RLIMIT_FSIZE``, which needs no privileges). In each, checkpoints
(mixed sizes, a few pinned) are written until the space runs out and well beyond.

What must hold: every put either succeeds (evicting LRU entries when it must) or raises ``StoreFullError`` with
a message naming the cause — nothing else; the store stays readable and writable (after ``evict`` or once the
space is back, puts succeed again); every pinned checkpoint whose put returned is there and bit-identical; every
other committed checkpoint is there bit-identical or was evicted (a miss), never different; ``verify`` is clean.

    python -m tools.faults.space            # map, map-pinned, rlimit, and tmpfs when mounting works (root)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from tools.faults import workload as W
from tools.faults.common import parser, python, report


def fill(path: str, *, puts: int, seed: int, map_size: int | None = None, max_map: int | None = None,
         ballast: str | None = None, ballast_bytes: int = 0, pin_all: bool = False) -> dict:
    """Write ``puts`` random checkpoints into the store at ``path`` and check everything; returns counts and
    failures. ``max_map`` caps map growth (a map that cannot grow); ``ballast`` is a file filling the disk,
    written after a third of the puts and deleted after two thirds; ``pin_all`` pins every checkpoint, so once
    the space is full nothing can be evicted and puts must fail cleanly."""
    import spec_cache.store.env as store_env
    from spec_cache.store import Store, StoreError, StoreFullError, maintenance

    if max_map is not None:
        store_env.MAX_MAP_SIZE = max_map
    rng = np.random.default_rng(seed)
    out = {"puts_ok": 0, "puts_full": 0, "full_messages": [], "failures": [],
           "pinned": 0}
    committed: dict[str, bool] = {}
    with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False, map_size=map_size) as store:
        W.register(store)
        for i in range(puts):
            if ballast and i == puts // 3:
                _write_ballast(ballast, ballast_bytes)
            if ballast and i == 2 * puts // 3:
                os.remove(ballast)
            spec = W.random_spec(rng, large=0.35)
            pin = pin_all or (spec.structure == "small" and rng.random() < 0.1 and out["pinned"] < 12)
            try:
                W.put_spec(store, spec, pin=pin)
                committed[spec.name()] = committed.get(spec.name(), False) or pin
                out["puts_ok"] += 1
                out["pinned"] += pin
            except StoreFullError as exc:
                out["puts_full"] += 1
                if len(out["full_messages"]) < 3 and str(exc) not in out["full_messages"]:
                    out["full_messages"].append(str(exc))
            except Exception as exc:  # anything else is a failure
                out["failures"].append(f"put {spec.name()}: {type(exc).__name__}: {exc}")
            if i % 25 == 0:  # readable all along
                probe = W.random_spec(rng)
                try:
                    why = W.check(store.fetch(probe.ns_key, probe.tokens, drafter=W.DRAFTER), probe)
                except Exception as exc:
                    why = f"{type(exc).__name__}: {exc}"
                if why:
                    out["failures"].append(f"read while full, {probe.name()}: {why}")
        out.update(_check(store, committed))
        # usable again once space is made: unpin, evict half, then a put must succeed
        step = "unpin"
        try:
            if pin_all:
                for name in committed:
                    spec = W.Spec.parse(name)
                    store.pin(spec.ns_key, spec.tokens, False)
            step = "evict"
            maintenance.evict(store, to_size=maintenance.stats(store)["bytes"] // 2)
        except StoreError as exc:
            out["failures"].append(f"{step} on the full store failed: {type(exc).__name__}: {exc}")
        spec = W.Spec(0, 47, 60)
        try:
            W.put_spec(store, spec)
            if W.check(store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER), spec) is not None:
                out["failures"].append("the put after evict did not read back exactly")
        except StoreError as exc:
            out["failures"].append(f"the store is not writable after evict: {exc}")
    return out


def _write_ballast(path: str, nbytes: int) -> None:
    """Fill the disk with another file (as much of ``nbytes`` as fits)."""
    block = b"\0" * (1 << 20)
    with open(path, "wb") as f:
        try:
            for _ in range(nbytes >> 20):
                f.write(block)
                f.flush()
        except OSError:
            pass


def _check(store, committed: dict[str, bool]) -> dict:
    from spec_cache.store import maintenance

    failures, present = [], 0
    for name, pinned in sorted(committed.items()):
        spec = W.Spec.parse(name)
        restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
        why = W.check(restored, spec)
        whole = restored is not None and restored.length == spec.length
        present += whole
        if why:
            failures.append(f"committed {name}: WRONG STATE: {why}")
        elif pinned and not whole:
            failures.append(f"pinned {name} was lost")
    v = maintenance.verify(store)
    if v.damaged:
        failures.append(f"verify: {v.corrupt} corrupt, index {v.index_problems[:3]}, "
                        f"structure {v.structure_problems[:3]}")
    stats = maintenance.stats(store)
    return {"committed": len(committed), "committed_present": present, "failures_check": failures,
            "file_mib": round(stats["file_bytes"] / 2**20, 1), "stored_mib": round(stats["bytes"] / 2**20, 1)}


def _merge(out: dict) -> dict:
    out["failures"] = out.get("failures", []) + out.pop("failures_check", [])
    return out


# --- scenarios ------------------------------------------------------------------------------------------------------
def scenario_map(workdir: str, puts: int, seed: int) -> dict:
    """The map starts at 1 MiB and may not grow past 24 MiB (disk space is plenty)."""
    path = os.path.join(workdir, "map")
    return _merge(fill(path, puts=puts, seed=seed, map_size=1 << 20, max_map=24 << 20))


def scenario_map_pinned(workdir: str, puts: int, seed: int) -> dict:
    """As ``map``, but every checkpoint pinned: once the map is full, puts must fail with StoreFullError."""
    path = os.path.join(workdir, "map-pinned")
    out = _merge(fill(path, puts=puts, seed=seed, map_size=1 << 20, max_map=24 << 20, pin_all=True))
    if not out["puts_full"]:
        out["failures"].append("no put was refused although everything was pinned")
    return out


def scenario_rlimit(workdir: str, puts: int, seed: int) -> dict:
    """A child process whose files may not exceed 32 MiB (RLIMIT_FSIZE: writes past it fail with EFBIG)."""
    path = os.path.join(workdir, "rlimit")
    code = ("import json, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 20, 32 << 20)); "
            "from tools.faults.space import fill, _merge; "
            "print(json.dumps(_merge(fill(sys.argv[1], puts=int(sys.argv[2]), seed=int(sys.argv[3])))))")
    proc = python("-c", code, path, str(puts), str(seed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        return {"failures": [f"rlimit child exited {proc.returncode}: {err[-1500:]}"]}
    result = json.loads(out.strip().splitlines()[-1])
    if result.get("file_mib", 0) > 32:
        result["failures"].append(f"data.mdb is {result['file_mib']} MiB past the 32 MiB limit")
    return result


def can_mount_tmpfs() -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    probe = tempfile.mkdtemp(prefix="faults-probe-")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True)
        ok = mounted.returncode == 0
        if ok:
            subprocess.run(["umount", probe], capture_output=True)
        return ok
    finally:
        os.rmdir(probe)


def scenario_tmpfs(workdir: str, puts: int, seed: int, size_mib: int = 64) -> dict:
    """A real full disk: a ``size_mib`` tmpfs filled by the store, then also by another file (freed later)."""
    mnt = os.path.join(workdir, "tmpfs")
    os.makedirs(mnt)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", mnt],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return {"skipped": f"mount failed: {mounted.stderr.strip()}", "failures": []}
    try:
        out = _merge(fill(os.path.join(mnt, "store"), puts=puts, seed=seed, ballast=os.path.join(mnt, "ballast"),
                          ballast_bytes=size_mib << 20))
        out["disk_mib"] = size_mib
        store_dir = os.path.join(mnt, "store")
        shutil.rmtree(store_dir)
        pinned = _merge(fill(store_dir, puts=puts, seed=seed + 1, pin_all=True))
        if not pinned["puts_full"]:
            pinned["failures"].append("no put was refused although everything was pinned")
        out["failures"] += [f"pinned: {f}" for f in pinned.pop("failures")]
        out["pinned_run"] = pinned
        return out
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


SCENARIOS = ("map", "map-pinned", "rlimit", "tmpfs")


def run(puts: int = 400, *, seed: int = 0, scenarios=SCENARIOS, workdir: str | None = None) -> dict:
    base = tempfile.mkdtemp(prefix="faults-space-", dir=workdir)
    result = {"harness": "space", "puts_per_scenario": puts, "failures": []}
    started = time.monotonic()
    try:
        for name in scenarios:
            if name == "tmpfs" and not can_mount_tmpfs():
                result["tmpfs"] = {"skipped": "cannot mount a tmpfs here (needs root and mount)"}
                continue
            fn = {"map": scenario_map, "map-pinned": scenario_map_pinned, "rlimit": scenario_rlimit,
                  "tmpfs": scenario_tmpfs}[name]
            out = fn(base, puts, seed) if name != "tmpfs" else fn(base, puts, seed, 64 if puts >= 300 else 24)
            result["failures"] += [f"{name}: {f}" for f in out.pop("failures", [])]
            result[name] = out
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--puts", type=int, default=400, help="checkpoints written per scenario")
    p.add_argument("--scenario", action="append", choices=SCENARIOS)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    return report(run(args.puts, seed=args.seed, scenarios=tuple(args.scenario or SCENARIOS),
                      workdir=args.workdir), args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Corruption harness: random damage to a store's ``data.mdb`` (bit flips, byte runs, whole pages, truncation
anywhere in the file; flips aimed at record values and at index values; records swapped between keys; index
values rewritten with a wrong field). Each trial damages a fresh copy of one pristine store and then, in a
child process (so a crash inside liblmdb is observed, not suffered), runs ``spec-cache verify``, fetches every
stored checkpoint, runs ``gc``, verifies and fetches again, and stores new checkpoints.

What must hold: a fetch returns the exact stored state of a prefix or a miss (never different tensors); only
typed ``StoreError``s come out of the store; after ``gc`` ``verify`` finds nothing corrupt. The outcome of every
trial is counted: clean (damage hit nothing live), detected (misses/warnings/typed errors), refused at open,
silent miss, and the failures: wrong state, untyped exception, crash (signal), hang.

    python -m tools.faults.corruption --trials 1000
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter

MODES = {"flip": 24, "run": 12, "page": 10, "truncate": 10, "record": 12, "index": 12, "swap": 10, "mutate": 10}
INDEX_MARKERS = (b"\xa5tails", b"\xa8complete", b"\xa4minr", b"\xa8drafters", b"\xa6pinned", b"\xa4sigs",
                 b"\xa7entries", b"\xa6format", b"\xa5major", b"\xa4refs", b"\xa6parent")
TRIAL_TIMEOUT_S = 90


def _specs():
    from tools.faults import workload as W
    return [s for s in W.all_specs() if s.family < 4 and not (s.structure == "large" and s.length > 64)]


def build_pristine(path: str) -> dict:
    """The store every trial starts from: ~130 checkpoints over 3 namespaces, drafter parts, pins."""
    from spec_cache.store import Store, maintenance
    from tools.faults import workload as W

    specs = _specs()
    with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
        W.register(store)
        for i, spec in enumerate(specs):
            W.put_spec(store, spec, pin=(i % 17 == 0))
        stats = maintenance.stats(store)
    return {"specs": len(specs), "file_bytes": stats["file_bytes"], "entries": stats["entries"],
            "chunks": stats["chunks"], "drafter_parts": stats["drafter_parts"]}


# --- damage -------------------------------------------------------------------------------------------------------
def _flip_bits(data: bytearray, offsets, rnd: random.Random) -> list[int]:
    done = []
    for off in offsets:
        if 0 <= off < len(data):
            data[off] ^= 1 << rnd.randrange(8)
            done.append(off)
    return done


def damage_file(path: str, mode: str, rnd: random.Random) -> str:
    """Damage ``path``/data.mdb in place (byte-level modes); returns what was done."""
    data_path = os.path.join(path, "data.mdb")
    with open(data_path, "rb") as f:
        data = bytearray(f.read())
    size = len(data)
    if mode == "truncate":
        at = rnd.randrange(size)
        with open(data_path, "r+b") as f:
            f.truncate(at)
        return f"truncated {size} -> {at}"
    if mode == "flip":
        offs = _flip_bits(data, [rnd.randrange(size) for _ in range(rnd.randint(1, 8))], rnd)
        what = f"flipped bits at {offs}"
    elif mode == "run":
        at, n = rnd.randrange(size), rnd.randint(1, 64)
        data[at:at + n] = bytes(rnd.randrange(256) for _ in range(min(n, size - at)))
        what = f"random run of {n} bytes at {at}"
    elif mode == "page":
        page = rnd.randrange(size // 4096)
        fill = bytes(4096) if rnd.random() < 0.5 else bytes(rnd.randrange(256) for _ in range(4096))
        data[page * 4096:(page + 1) * 4096] = fill
        what = f"page {page} {'zeroed' if not any(fill) else 'garbage'}"
    elif mode == "record":
        starts = _find_all(data, b"SPCR\x01\x00")
        at = rnd.choice(starts)
        offs = _flip_bits(data, [at + rnd.randrange(4096 if rnd.random() < 0.7 else 65536)
                                 for _ in range(rnd.randint(1, 3))], rnd)
        what = f"flipped bits in a record value at {offs}"
    elif mode == "index":
        marker = rnd.choice([m for m in INDEX_MARKERS if data.find(m) >= 0])
        hits = _find_all(data, marker)
        at = rnd.choice(hits)
        offs = _flip_bits(data, [at + rnd.randrange(-40, 60) for _ in range(rnd.randint(1, 2))], rnd)
        what = f"flipped bits near index key {marker[1:].decode()} at {offs}"
    else:
        raise ValueError(mode)
    with open(data_path, "r+b") as f:
        f.write(data)
    return what


def _find_all(data: bytearray, needle: bytes) -> list[int]:
    out, at = [], data.find(needle)
    while at >= 0:
        out.append(at)
        at = data.find(needle, at + 1)
    return out


def damage_logical(path: str, mode: str, rnd: random.Random) -> str:
    """Damage through LMDB itself: swap two records between keys, or rewrite one index value wrongly."""
    import lmdb
    import msgpack

    env = lmdb.open(path, max_dbs=16, subdir=True)
    try:
        with env.begin(write=True) as txn:
            if mode == "swap":
                db_name = rnd.choice([b"edata", b"edata", b"chunks", b"drafts"])
                db = env.open_db(db_name, txn=txn, create=False)
                rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                by_size: dict[int, list] = {}
                for k, v in rows:
                    by_size.setdefault(len(v), []).append((k, v))
                groups = [g for g in by_size.values() if len(g) >= 2]
                (k1, v1), (k2, v2) = rnd.sample(rnd.choice(groups) if groups else rows, 2)
                txn.put(k1, v2, db=db)
                txn.put(k2, v1, db=db)
                return f"swapped two {db_name.decode()} records ({len(v1)}/{len(v2)} bytes)"
            db_name = rnd.choice([b"nodes", b"nodes", b"entries", b"entries", b"nsinfo", b"meta"])
            db = env.open_db(db_name, txn=txn, create=False)
            rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
            key, raw = rnd.choice(rows)
            value, how = _mutate(msgpack.unpackb(raw, raw=False, strict_map_key=False), raw, rnd)
            txn.put(key, value, db=db)
            return f"{db_name.decode()} value {key[:8]!r}: {how}"
    finally:
        env.close()


def _mutate(obj, raw: bytes, rnd: random.Random) -> tuple[bytes, str]:
    import msgpack

    choice = rnd.random()
    if choice < 0.1:
        return raw[:rnd.randrange(len(raw))], "truncated"
    if choice < 0.15:
        return bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 40))), "random bytes"
    if choice < 0.2 or not isinstance(obj, dict) or not obj:
        return msgpack.packb(rnd.choice([[1, 2], 7, "x", None, {"a": 1}, True])), "replaced by another type"
    field = rnd.choice(sorted(obj, key=str))
    old = obj[field]
    r = rnd.random()
    if r < 0.15:
        del obj[field]
        how = f"deleted {field}"
    elif isinstance(old, bool):
        obj[field] = not old
        how = f"{field}: {old} -> {not old}"
    elif isinstance(old, int):
        new = rnd.choice([old + 1, old - 1, 0, -1, old * 2 + 5, 2 ** 40, rnd.randrange(1 << 20)])
        obj[field] = new
        how = f"{field}: {old} -> {new}"
    elif isinstance(old, dict) and old and r < 0.6:
        k = rnd.choice(list(old))
        obj[field][k] = rnd.choice([None, "x", -3, 10 ** 6, [1]])
        how = f"{field}[{k!r}] -> {obj[field][k]!r}"
    elif isinstance(old, bytes) and old:
        b = bytearray(old)
        b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        obj[field] = bytes(b)
        how = f"{field}: one bit flipped"
    else:
        obj[field] = rnd.choice([None, "x", 3, [], {}, b"\x00" * 32])
        how = f"{field}: {type(old).__name__} -> {obj[field]!r}"
    return msgpack.packb(obj, use_bin_type=True), how


# --- the trial (runs in a child process) --------------------------------------------------------------------------
def trial(pristine: str, workdir: str, seed: int, mode: str, log_path: str) -> None:
    """Damage a copy of the pristine store and exercise it; appends JSON lines to ``log_path`` as it goes."""
    log = open(log_path, "a", buffering=1)

    def note(**kw):
        log.write(json.dumps(kw) + "\n")

    import logging
    logging.getLogger("spec_cache").setLevel(logging.CRITICAL)
    rnd = random.Random(seed)
    path = os.path.join(workdir, "store")
    shutil.copytree(pristine, path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, "lock.mdb"))
    try:
        what = damage_logical(path, mode, rnd) if mode in ("swap", "mutate") else damage_file(path, mode, rnd)
    except Exception as exc:
        what = f"damage step failed ({type(exc).__name__}: {exc})"
    note(stage="damaged", what=what)

    from spec_cache.apps.cli import main as cli_main
    from spec_cache.store import Store, StoreError, maintenance
    from tools.faults import workload as W

    specs = _specs()
    counts = Counter()

    def cli(*args) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["--cache", path, "--json", *args])
        return code, out.getvalue(), err.getvalue()

    code, out, err = cli("verify")
    note(stage="cli-verify", code=code, one_line=len(err.strip().splitlines()) <= 1 and "Traceback" not in err,
         corrupt=(json.loads(out)["corrupt"] if code in (0, 1) and out.strip() else None), err=err.strip()[-300:])

    def fetch_all(store, phase: str) -> None:
        for spec in specs:
            notes: list[str] = []
            try:
                restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER, warnings=notes)
            except StoreError:
                counts[f"{phase}_typed_error"] += 1
                counts["reported"] += 1
                continue
            wrong = W.check(restored, spec)
            if wrong:
                counts[f"{phase}_wrong"] += 1
                note(stage="WRONG", phase=phase, spec=spec.name(), why=wrong)
            elif restored is not None and restored.length == spec.length:
                counts[f"{phase}_exact"] += 1
            else:
                counts[f"{phase}_miss"] += 1
                counts["reported" if notes else f"{phase}_silent_miss"] += 1

    try:
        try:
            store = Store.open(path, durable=False)
        except StoreError as exc:
            note(stage="open-refused", error=str(exc)[:300])
            return
        with store:
            fetch_all(store, "before")
            rep = maintenance.verify(store)
            note(stage="verify", corrupt=rep.corrupt, records=rep.records, index=len(rep.index_problems))
            gc = maintenance.gc(store)
            after = maintenance.verify(store)
            note(stage="gc", removed=gc.corrupt_removed, broken=gc.broken_subtrees, orphans=gc.orphans_removed,
                 index_removed=gc.index_rows_removed, fixed=gc.counters_fixed, corrupt_after=after.corrupt,
                 index_after=after.index_problems[:3])
            fetch_all(store, "after")
            fresh = [W.Spec(ns, 40 + i, 70) for i, ns in enumerate((0, 1, 2))]
            for spec in fresh:
                W.put_spec(store, spec)
            usable = all(W.check(r := store.fetch(s.ns_key, s.tokens, drafter=W.DRAFTER), s) is None
                         and r is not None and r.length == s.length for s in fresh)
            note(stage="usable", ok=usable)
        note(stage="done", **counts)
    except StoreError as exc:
        note(stage="typed-error", error=f"{type(exc).__name__}: {exc}"[:300], **counts)
    except Exception as exc:
        note(stage="UNTYPED", error=f"{type(exc).__name__}: {exc}"[:300], tb=traceback.format_exc()[-1500:],
             **counts)
    finally:
        log.close()


# --- the parent ----------------------------------------------------------------------------------------------------
def _classify(events: list[dict], exitcode: int | None) -> tuple[str, list[str]]:
    """(outcome, failures) of one trial from its log and exit code."""
    failures = [f"wrong state: {e['spec']} ({e['phase']}): {e['why']}" for e in events if e["stage"] == "WRONG"]
    by = {e["stage"]: e for e in events}
    cli = by.get("cli-verify")
    if cli is not None and (cli["code"] not in (0, 1, 2) or not cli["one_line"]):
        failures.append(f"cli verify: exit {cli['code']}, stderr {cli['err']!r}")
    if exitcode is None:
        return "hang", failures + ["hang: no result within the time limit"]
    if exitcode < 0:
        return "crash", failures
    if "UNTYPED" in by:
        return "untyped", failures + [f"untyped exception: {by['UNTYPED']['error']}\n{by['UNTYPED']['tb']}"]
    if "open-refused" in by:
        return "refused_at_open", failures
    gc = by.get("gc")
    if gc is not None and gc["corrupt_after"]:
        failures.append(f"verify after gc still finds {gc['corrupt_after']} corrupt records")
    if gc is not None and gc["index_after"]:
        failures.append(f"verify after gc still finds index problems: {gc['index_after']}")
    if "typed-error" in by:
        return "typed_error", failures
    done = by.get("done", {})
    if "usable" in by and not by["usable"]["ok"]:
        failures.append("store not usable after gc: new checkpoints did not come back")
    if failures:
        return "wrong", failures
    reported = bool(done.get("reported") or by.get("verify", {}).get("corrupt") or by.get("verify", {}).get("index")
                    or (cli or {}).get("code") in (1, 2) or (gc or {}).get("removed") or (gc or {}).get("broken")
                    or (gc or {}).get("index_removed"))
    if reported:
        return "detected", failures
    if done.get("before_miss"):  # stored checkpoints missed and nothing anywhere said why
        return "silent_miss", failures
    return "clean", failures


def run(trials: int = 1000, *, seed: int = 0, workdir: str | None = None, modes: dict | None = None,
        progress: bool = False, only: set[int] | None = None, keep: bool = False) -> dict:
    modes = modes or MODES
    base = tempfile.mkdtemp(prefix="faults-corrupt-", dir=workdir)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "lmdb", "msgpack", "blake3", "spec_cache.store", "spec_cache.schemas", "spec_cache.apps.cli",
                                "tools.faults.workload"])
    rnd = random.Random(seed)
    started = time.monotonic()
    result = {"harness": "corruption", "trials": 0, "outcomes": Counter(), "by_mode": {}, "failures": [],
              "crash_examples": [], "silent_examples": [], "fetches_exact": 0, "fetches_missed": 0, "fetches_wrong": 0,
              "cli_verify_exit": Counter()}
    try:
        pristine = os.path.join(base, "pristine")
        result["store"] = build_pristine(pristine)
        names, weights = zip(*modes.items())
        for t in range(trials):
            mode = rnd.choices(names, weights)[0]
            if only is not None and t not in only:
                continue
            tdir = os.path.join(base, f"t{t}")
            os.makedirs(tdir)
            log_path = os.path.join(tdir, "log.jsonl")
            from tools.faults import corruption as this
            proc = ctx.Process(target=this.trial, args=(pristine, tdir, seed * 1_000_003 + t, mode, log_path))
            proc.start()
            proc.join(TRIAL_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
                exitcode = None
            else:
                exitcode = proc.exitcode
            events = []
            with contextlib.suppress(FileNotFoundError):
                with open(log_path) as f:
                    events = [json.loads(line) for line in f if line.strip()]
            outcome, failures = _classify(events, exitcode)
            damaged = next((e["what"] for e in events if e["stage"] == "damaged"), "?")
            result["trials"] += 1
            result["outcomes"][outcome] += 1
            result["by_mode"].setdefault(mode, Counter())[outcome] += 1
            for e in events:
                if e["stage"] == "cli-verify":
                    result["cli_verify_exit"][str(e["code"])] += 1
                if e["stage"] in ("done", "typed-error", "UNTYPED"):
                    for phase in ("before", "after"):
                        result["fetches_exact"] += e.get(f"{phase}_exact", 0)
                        result["fetches_missed"] += e.get(f"{phase}_miss", 0) + e.get(f"{phase}_typed_error", 0)
                        result["fetches_wrong"] += e.get(f"{phase}_wrong", 0)
            if outcome == "crash" and len(result["crash_examples"]) < 10:
                last = events[-1]["stage"] if events else "?"
                result["crash_examples"].append(f"trial {t}: signal {-exitcode} after stage {last}: {mode}: {damaged}")
            result["failures"] += [f"trial {t} ({mode}: {damaged}): {f}" for f in failures]
            if outcome == "silent_miss" and len(result["silent_examples"]) < 10:
                result["silent_examples"].append(f"trial {t}: {mode}: {damaged}")
            if not keep:
                shutil.rmtree(tdir, ignore_errors=True)
            if progress and (t + 1) % 50 == 0:
                print(f"  {t + 1}/{trials} {dict(result['outcomes'])}", file=sys.stderr, flush=True)
    finally:
        if keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    result["outcomes"] = dict(result["outcomes"])
    result["by_mode"] = {m: dict(c) for m, c in sorted(result["by_mode"].items())}
    result["cli_verify_exit"] = dict(result["cli_verify_exit"])
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main(argv=None) -> int:
    from tools.faults.common import parser, report

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--mode", action="append", choices=sorted(MODES), help="only these damage modes")
    p.add_argument("--workdir", default=None)
    p.add_argument("--only", type=int, action="append", help="run only these trial numbers (to reproduce one)")
    p.add_argument("--keep", action="store_true", help="keep the damaged stores (to inspect one)")
    args = p.parse_args(argv)
    modes = {m: MODES[m] for m in args.mode} if args.mode else None
    return report(run(args.trials, seed=args.seed, workdir=args.workdir, modes=modes, progress=True,
                      only=set(args.only) if args.only else None, keep=args.keep), args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Issue 27's GPU serving bench: ``tools/bench_serve.py``'s workload (``bench_mlx_lm_server.bench``, one server at a
time) for mlx_lm.server, ``spec-cache serve`` and the launcher (``spec-cache mlx-lm-server``) at several client
counts, within a deadline, resumable over several calls, into one JSON.

    python tools/device/serve_8b_bench.py --model DIR --clients "1 4 8" --deadline-at EPOCH --json OUT.json

Why a driver around the tool: a lent GPU call lasts at most 600 s and the whole session ~25 minutes, so the
measurement must split over calls and stop cleanly at a deadline. A *unit* is one server kind at one client count
(start, warm up, the turns, restart, warm up, the last turns again); each finished unit is saved in
``--work``/state.json at once, so a later call (``--clients "4 8"``) adds to it, and the JSON written after every
unit holds everything finished so far (this call's and earlier ones'). Before a unit starts the time left is
checked against the longest finished unit at that client count (else ``--min-unit-s``); at the deadline itself the
running unit's servers are killed and the unit is recorded as aborted. Per client count, mlx_lm.server runs first:
the ratios need it.

The JSON: ``figures`` (``gpu_{serve,launcher}_{warm_ttft,tok_s,restart_ttft}_c<clients>``; TTFT ratio =
mlx_lm.server p50 / ours, tok/s ratio = ours / mlx_lm.server; > 1: ours faster), ``identical_replies``
(``{serve,launcher}_c<clients>``: replies equal to mlx_lm.server's), and per client count ``ttft_ms`` (p50/p95/p99
per phase), ``decode_tok_s`` (per request: tokens after the first / time after the first), ``tok_s`` (aggregate),
``stages`` (serve's ``/metrics`` breakdown over the turns), ``ratios`` and the tool's full ``results``; ``units``
(wall per unit, skipped and aborted ones with the reason).

Conversations per client count: at least ``--clients`` (4 conversations at 8 clients would be 4 clients).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_mlx_lm_server as bench  # noqa: E402

ORDER = ("mlx-lm", "serve", "spec-cache")  # the baseline first: every ratio needs it
FIGURE_NAMES = bench.FIGURE_NAMES
STATE_VERSION = 1


class Deadline(BaseException):
    """The call's time is up (raised from SIGALRM in the main thread, wherever it waits)."""


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", default="1 4 8", help="client counts, space- or comma-separated")
    p.add_argument("--servers", default=",".join(ORDER))
    p.add_argument("--conversations", type=int, default=4, help="per client count: at least the clients")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--user-words", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--warmup", choices=("tiny", "shapes"), default="shapes")
    p.add_argument("--warmup-settle", type=float, default=2.0)
    p.add_argument("--serve-args", default="--warmup on", help="appended to serve's command line (one string)")
    p.add_argument("--launcher-args", default="", help="appended to the launcher's command line (one string)")
    p.add_argument("--cwd", help="where the servers start (a directory where `python -m spec_cache...` resolves)")
    p.add_argument("--work", default="/tmp/serve-8b/work", help="state, stores, logs (kept between calls)")
    p.add_argument("--json", help="the combined JSON (default WORK/serve-8b.json)")
    p.add_argument("--deadline-at", type=float, default=0.0, help="epoch seconds; 0: none")
    p.add_argument("--min-unit-s", type=float, default=60.0, help="time a unit needs when none has finished yet")
    p.add_argument("--prefix", default="gpu_", help="prefix of the figure keys")
    p.add_argument("--fresh", action="store_true", help="forget the units earlier calls finished")
    p.add_argument("--resume-from", help="an earlier call's combined JSON: its finished units count as done here "
                                         "(when this machine's state is empty: a fresh machine)")
    args = p.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.replace(",", " ").split()]
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ORDER]
    if bad or not kinds or not args.client_counts or min(args.client_counts) < 1:
        p.error(f"--servers of {', '.join(ORDER)}; --clients positive integers (got {bad or args.clients})")
    args.kinds = [k for k in ORDER if k in kinds]
    args.json = args.json or str(Path(args.work) / "serve-8b.json")
    return args


def workload(args) -> dict:
    """What must match for units of different calls to be compared (else the state starts afresh)."""
    return {"version": STATE_VERSION, "model": str(Path(args.model).resolve()), "turns": args.turns,
            "conversations": args.conversations, "system_words": args.system_words, "user_words": args.user_words,
            "max_tokens": args.max_tokens, "warmup": args.warmup, "serve_args": args.serve_args,
            "launcher_args": args.launcher_args}


def bench_args(args, clients: int) -> SimpleNamespace:
    """The tool's argument namespace for one client count."""
    return SimpleNamespace(
        model=args.model, kinds=args.kinds, conversations=max(args.conversations, clients), turns=args.turns,
        clients=clients, system_words=args.system_words, user_words=args.user_words, max_tokens=args.max_tokens,
        paired=False, warmup=args.warmup, warmup_settle=args.warmup_settle,
        server_args={"serve": shlex.split(args.serve_args), "spec-cache": shlex.split(args.launcher_args)})


class State:
    """Finished units by client count, in ``work/state.json`` (rewritten whole after every unit)."""

    def __init__(self, work: Path, load: dict, fresh: bool, resume_from: str | None = None):
        self.path = work / "state.json"
        got = {}
        if self.path.exists() and not fresh:
            with contextlib.suppress(ValueError, OSError):
                got = json.loads(self.path.read_text())
        if got.get("workload") != load:
            if got:
                print("state: an earlier call measured another workload; starting afresh", flush=True)
            got = {"workload": load, "units": {}, "events": []}
        self.data = got
        if resume_from and not any(self.data["units"].values()):
            self.resume(Path(resume_from), load)

    def resume(self, path: Path, load: dict) -> None:
        """Take the finished units of an earlier call's combined JSON (a machine given back lost /tmp)."""
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            self.event(f"resume: {path} not read ({e})")
            return
        if old.get("workload") != load:
            self.event(f"resume: {path} measured another workload; not used")
            return
        n = 0
        for c, section in old.get("clients", {}).items():
            for kind, result in section.get("results", {}).items():
                if result.get("status") == "done":
                    self.units(int(c))[kind] = result
                    n += 1
        self.event(f"resume: {n} finished units from {path}")

    def units(self, clients: int) -> dict:
        return self.data["units"].setdefault(str(clients), {})

    def event(self, text: str) -> None:
        print(text, flush=True)
        self.data["events"].append(f"{time.strftime('%H:%M:%S')} {text}")

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def estimate(units: dict, all_units: dict, floor: float) -> float:
    """Seconds the next unit may take: 1.1x the longest finished unit at this client count, else 1.1x the median
    finished unit at any count, and never under ``floor``."""
    here = [u["unit_wall_s"] for u in units.values() if u.get("status") == "done"]
    if here:
        return max(floor, 1.1 * max(here))
    anywhere = [u["unit_wall_s"] for by in all_units.values() for u in by.values() if u.get("status") == "done"]
    return max(floor, 1.1 * statistics.median(anywhere)) if anywhere else floor


def log_tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_bytes()[-limit:].decode("utf-8", "replace")
    except OSError:
        return ""


def run_unit(kind: str, args, clients: int, tmp: Path, state: State) -> None:
    units = state.units(clients)
    system = bench.words(args.system_words, 999)
    started = time.monotonic()
    try:
        result = bench.bench(kind, args.model, bench_args(args, clients), system, tmp)
    except Deadline:
        units[kind] = {"status": "aborted", "reason": "deadline", "unit_wall_s": time.monotonic() - started}
        state.event(f"c{clients} {kind}: aborted at the deadline after {time.monotonic() - started:.0f} s")
        raise
    except (Exception, SystemExit) as e:  # a server that would not start or answer: the others still run
        logs = {p.name: log_tail(p) for p in sorted(tmp.glob(f"{kind}-*.log"))}
        units[kind] = {"status": "error", "reason": f"{type(e).__name__}: {e}", "logs": logs,
                       "unit_wall_s": time.monotonic() - started}
        state.event(f"c{clients} {kind}: error {type(e).__name__}: {e}")
    else:
        result.update(status="done", unit_wall_s=time.monotonic() - started)
        units[kind] = json.loads(json.dumps(result))  # as a later call reads it back (turn numbers as strings)
        state.event(f"c{clients} {kind}: done in {result['unit_wall_s']:.0f} s")
    finally:
        shutil.rmtree(tmp / f"store-{kind}", ignore_errors=True)  # the disk holds a 15 GB model already
        state.save()


def ms(s: dict) -> dict:
    return {q: s[q] * 1e3 for q in ("p50", "p95", "p99")} | {"n": s["n"], "cached_mean": s["cached_mean"]}


def per_clients(clients: int, units: dict, args) -> tuple[dict, dict, dict]:
    """One client count's section, its figures and identical-reply counts (from the tool's own report)."""
    results = {k: units[k] for k in ORDER if units.get(k, {}).get("status") == "done"}
    kinds = list(results)
    section: dict = {"conversations": max(args.conversations, clients), "servers": kinds,
                     "units": {k: {key: v for key, v in u.items() if key in ("status", "reason", "unit_wall_s")}
                               for k, u in units.items()}}
    if not kinds:
        return section, {}, {}
    ns = bench_args(args, clients)
    report_text = io.StringIO()
    with contextlib.redirect_stdout(report_text):
        rep = bench.report(results, kinds, ns)
    section["report"] = report_text.getvalue()
    section["ttft_ms"] = {k: {**{f"turn {t}": ms(s) for t, s in r["turns"].items()},
                              "warm turns": ms(r["warm_turns"]), "after restart": ms(r["after_restart"])}
                          for k, r in results.items()}
    section["decode_tok_s"] = {k: {phase: {"p50": r[key]["decode_tok_s_p50"], "mean": r[key]["decode_tok_s_mean"],
                                           "n": r[key]["decode_requests"]}
                                   for phase, key in (("turns", "all_turns"), ("after restart", "after_restart"))}
                               for k, r in results.items()}
    section["tok_s"] = {k: {"turns": r["all_turns"]["tokens_per_s"],
                            "after restart": r["after_restart"]["tokens_per_s"]} for k, r in results.items()}
    section.update(ratios=rep["ratios"], identical_replies=rep["identical_replies"], stages=rep["stages"],
                   results=results)
    figures = {args.prefix + k: v for k, v in rep["figures"].items()}
    same = {f"{FIGURE_NAMES[k]}_c{clients}": {key: v[key] for key in ("identical", "identical_visible", "total")}
            | ({"after_restart": {key: v["after_restart"][key] for key in ("identical", "identical_visible", "total")}}
               if "after_restart" in v else {})
            for k, v in rep["identical_replies"].items()}
    return section, figures, same


def machine() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("mlx", "mlx-cuda-13", "mlx-lm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        got = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if got.returncode == 0:
            out["gpu"] = got.stdout.strip()
    out["cpus"] = os.cpu_count()
    return out


def combined(state: State, args) -> dict:
    out = {"machine": machine(), "model": json.loads((Path(args.model) / "config.json").read_text()),
           "workload": state.data["workload"], "figures": {}, "identical_replies": {}, "clients": {},
           "events": state.data["events"]}
    for c in sorted(state.data["units"], key=int):
        section, figures, same = per_clients(int(c), state.data["units"][c], args)
        out["clients"][c] = section
        out["figures"].update(figures)
        out["identical_replies"].update(same)
    return out


def write_json(state: State, args) -> dict:
    out = combined(state, args)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    return out


def arm(deadline_at: float) -> None:
    """SIGALRM at the deadline: kill every server still up, then raise :class:`Deadline` in the main thread."""
    if not deadline_at:
        return

    def expired(signum, frame):
        for s in list(bench.Server.live):
            s.kill()
        threading.excepthook = lambda _: None  # client threads die on their killed server's socket: expected
        raise Deadline()

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, deadline_at - time.time()))


def main(argv=None) -> int:
    args = parse(argv)
    if args.cwd:
        bench.REPO = Path(args.cwd)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "identity-memo").mkdir(exist_ok=True)  # the model's digest is computed once, not per server start
    state = State(work, workload(args), args.fresh, args.resume_from)
    arm(args.deadline_at)
    try:
        for clients in args.client_counts:
            tmp = work / f"c{clients}"
            tmp.mkdir(exist_ok=True)
            memo = tmp / "identity-memo"
            if not memo.exists():
                memo.symlink_to(work / "identity-memo")
            units = state.units(clients)
            for kind in args.kinds:
                if units.get(kind, {}).get("status") == "done":
                    continue
                need = estimate(units, state.data["units"], args.min_unit_s)
                left = args.deadline_at - time.time() if args.deadline_at else float("inf")
                if left < need:
                    state.event(f"c{clients} {kind}: skipped, {left:.0f} s left, a unit needs ~{need:.0f} s")
                    units[kind] = {"status": "skipped", "reason": f"{left:.0f} s left < {need:.0f} s",
                                   "unit_wall_s": 0.0}
                    state.save()
                    continue
                state.event(f"c{clients} {kind}: start ({left:.0f} s left)")
                run_unit(kind, args, clients, tmp, state)
                write_json(state, args)
    except Deadline:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s in list(bench.Server.live):
            s.kill()
    out = write_json(state, args)
    for c, section in out["clients"].items():
        if section.get("report"):
            print(f"== {c} client(s), {section['conversations']} conversations\n{section['report']}", end="")
    print("figures:", json.dumps(out["figures"], indent=1))
    print("identical replies:", json.dumps(out["identical_replies"]))
    print("units:", {c: {k: f"{u['status']} {u.get('unit_wall_s', 0):.0f}s" for k, u in s["units"].items()}
                     for c, s in out["clients"].items()})
    print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

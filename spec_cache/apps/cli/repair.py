"""``spec-cache repair --to DIR``: salvage a damaged store into a new one (``maintenance.repair``). Never imports MLX.

The salvage reads the damaged store through liblmdb, which can abort on a damaged page; so it runs in a child
process, and if that dies the command still reports how far it got (what was copied is committed in DIR).
Exit codes: 0 every checkpoint copied, 1 some were lost or the salvage stopped early, 2 usage error or
nothing readable at all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from spec_cache.apps.cli.common import EXIT_OK, EXIT_PROBLEMS, CliError, emit, require_store
from spec_cache.store import StoreError, maintenance

CHILD = "import sys; from spec_cache.apps.cli.repair import child_main; child_main(sys.argv[1], sys.argv[2])"


def child_main(src: str, dst: str) -> None:
    """The child process: run the salvage, one JSON line per copied checkpoint and one with the result."""
    def say(kind, value):
        sys.stdout.write(json.dumps([kind, value]) + "\n")
        sys.stdout.flush()
    try:
        report = maintenance.repair(src, dst, on_copied=lambda n: say("copied", n))
    except (StoreError, OSError) as exc:
        say("error", str(exc))
        return
    say("done", report.as_dict())


def _salvage(src: str, dst: str) -> tuple[int, dict | None, str | None, int]:
    """Run ``child_main`` in a child process: (checkpoints copied, result or None, error or None, exit code)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, src, dst], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    copied, result, error = 0, None, None
    for line in child.stdout:
        try:
            kind, value = json.loads(line)
        except ValueError:
            continue
        if kind == "copied":
            copied = value
        elif kind == "done":
            result = value
        elif kind == "error":
            error = value
    child.wait()
    return copied, result, error, child.returncode


def cmd_repair(args) -> int:
    src, dst = os.path.abspath(args.cache), os.path.abspath(args.repair_to)
    require_store(src)
    if src == dst:
        raise CliError("--to must name a new directory, not the damaged store itself")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise CliError(f"destination {dst} exists and is not empty")
    copied, result, error, returncode = _salvage(src, dst)
    if error is not None:
        raise CliError(f"nothing could be salvaged: {error}")
    if result is None:
        signal = -returncode if returncode < 0 else None
        d = {"source": src, "destination": dst, "entries_copied": copied, "stopped": True, "signal": signal}
        died = f" on signal {signal}" if signal else f" with exit code {returncode}"
        emit(args, d, f"salvage stopped early (the reader died{died}) after copying {copied} checkpoints into "
                      f"{dst}; those are whole and verified")
        return EXIT_PROBLEMS
    result["stopped"] = False
    human = (f"copied {result['entries_copied']} of {result['entries_seen']} checkpoints "
             f"({result['drafter_parts_copied']} drafter parts) into {dst}; {result['entries_lost']} lost"
             + (f"; LMDB structure of the source: {result['structure_problems']} problems"
                if result["structure_problems"] else "")
             + (f"; the source file was {result['truncated_bytes']} bytes short" if result["truncated_bytes"] else ""))
    emit(args, result, human)
    return EXIT_PROBLEMS if result["entries_lost"] or result["drafter_parts_lost"] else EXIT_OK


def register(sub, common: argparse.ArgumentParser) -> None:
    """Add ``repair --to DIR`` (the damaged store is ``--cache``)."""
    s = sub.add_parser("repair", parents=[common],
                       help="copy every checkpoint that still reads back whole into a new store",
                       description="Salvage a damaged store (--cache): copy every checkpoint that still reads back "
                                   "whole into a new store; exit 1 if some were lost.")
    s.add_argument("--to", dest="repair_to", required=True, metavar="DIR",
                   help="the new store directory (must not exist or be empty)")
    s.set_defaults(fn=cmd_repair)

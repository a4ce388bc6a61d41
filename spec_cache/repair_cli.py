"""``spec-cache repair --to DIR``: salvage a damaged store into a new one (``store.repair``). Never imports MLX.

The salvage reads the damaged store through liblmdb, which can abort on a damaged page; so it runs in a child
process, and if that dies the command still reports how far it got (what was copied is committed in DIR).
Exit codes: 0 every checkpoint copied, 1 some were lost or the salvage stopped early, 2 usage error or
nothing readable at all.
"""

from __future__ import annotations

import argparse
import os


def _child_main(src: str, dst: str) -> None:
    """The child process: run the salvage, one JSON line per copied checkpoint and one with the result."""
    import json
    import sys

    from spec_cache.store import StoreError
    from spec_cache.store.repair import repair

    def say(kind, value):
        sys.stdout.write(json.dumps([kind, value]) + "\n")
        sys.stdout.flush()
    try:
        report = repair(src, dst, on_copied=lambda n: say("copied", n))
    except (StoreError, OSError) as exc:
        say("error", str(exc))
        return
    say("done", report.as_dict())


def cmd_repair(args) -> int:
    import json
    import subprocess
    import sys

    from .cli import EXIT_OK, EXIT_PROBLEMS, CliError, _emit

    src, dst = os.path.abspath(args.cache), os.path.abspath(args.repair_to)
    if not os.path.exists(os.path.join(src, "data.mdb")):
        raise CliError(f"no spec-cache store at {src} (set --cache or SPEC_CACHE_DIR)")
    if src == dst:
        raise CliError("--to must name a new directory, not the damaged store itself")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise CliError(f"destination {dst} exists and is not empty")
    code = "import sys; from spec_cache.repair_cli import _child_main; _child_main(sys.argv[1], sys.argv[2])"
    child = subprocess.Popen([sys.executable, "-c", code, src, dst], stdout=subprocess.PIPE,
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
    if error is not None:
        raise CliError(f"nothing could be salvaged: {error}")
    if result is None:
        signal = -child.returncode if child.returncode < 0 else None
        d = {"source": src, "destination": dst, "entries_copied": copied, "stopped": True, "signal": signal}
        died = f" on signal {signal}" if signal else f" with exit code {child.returncode}"
        _emit(args, d, f"salvage stopped early (the reader died{died}) after copying {copied} checkpoints into "
                       f"{dst}; those are whole and verified")
        return EXIT_PROBLEMS
    result["stopped"] = False
    human = (f"copied {result['entries_copied']} of {result['entries_seen']} checkpoints "
             f"({result['drafter_parts_copied']} drafter parts) into {dst}; {result['entries_lost']} lost"
             + (f"; LMDB structure of the source: {result['structure_problems']} problems"
                if result["structure_problems"] else "")
             + (f"; the source file was {result['truncated_bytes']} bytes short" if result["truncated_bytes"] else ""))
    _emit(args, result, human)
    return EXIT_PROBLEMS if result["entries_lost"] or result["drafter_parts_lost"] else EXIT_OK


def register(subparsers, common: argparse.ArgumentParser) -> None:
    """Add ``repair --to DIR`` (the damaged store is ``--cache``)."""
    s = subparsers.add_parser("repair", parents=[common],
                              help="copy every checkpoint that still reads back whole into a new store")
    s.add_argument("--to", dest="repair_to", required=True, metavar="DIR",
                   help="the new store directory (must not exist or be empty)")
    s.set_defaults(fn=cmd_repair)

"""The ``spec-cache`` command: a thin layer over the public API.

One module per kind of command, each with a ``register(subparsers, common)`` that adds its subcommands:

- ``common``  the one-line error (``CliError``), exit codes, argument types, output helpers, opening a store;
- ``inspect`` ls, show, stats, verify, evict, pin, unpin, gc, compact, identity (``spec_cache.store.maintenance``,
  ``store.compact``, ``identity``);
- ``shared``  the ``--shared URL`` option, shared-stats, the shared section of stats;
- ``repair``  repair --to DIR, the salvage run in a child process;
- ``runtime`` demo, bench, generate, serve, export-mlx-lm, import-mlx-lm, import-seed (these load MLX when they
  run).

Dependencies go one way: this module -> inspect/shared/repair/runtime -> common. Inspection commands never
import MLX. Exit codes: 0 ok, 1 problems found (verify, repair, shared-stats), 2 usage error or unreadable store,
130 interrupted, 141 output pipe closed (``spec-cache ls | head``: quiet). Errors are one line on stderr, no
traceback (``SPEC_CACHE_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from spec_cache import __version__
from spec_cache.apps import mlx_lm_server
from spec_cache.apps.cli import inspect, repair, runtime, shared
from spec_cache.apps.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CliError,
    _Parser,
    default_cache_dir,
    error_line,
    exit_code,
    human_age,
    human_bytes,
    parse_duration,
    parse_size,
    table,
)
from spec_cache.apps.cli.runtime import DRAFTER_METHODS
from spec_cache.apps.cuda_env import relax_cache_checks

__all__ = ["DRAFTER_METHODS", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "CliError", "build_parser",
           "default_cache_dir", "human_age", "human_bytes", "main", "parse_duration", "parse_size", "table"]

EXIT_BROKEN_PIPE = 128 + 13  # what a command killed by SIGPIPE returns to the shell


def build_parser() -> argparse.ArgumentParser:
    """The whole ``spec-cache`` parser; each parsed namespace has ``fn``, the command to run."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=argparse.SUPPRESS,
                        help="store directory (default: $SPEC_CACHE_DIR, else ~/.cache/spec-cache/store)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    shared.add_shared_option(common)
    p = _Parser(prog="spec-cache", parents=[common],
                description="Prefix cache for MLX speculative decoding: run and serve models through it; inspect, "
                            "verify, evict, pin and compact its store.")
    p.add_argument("--version", action="version", version=f"spec-cache {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    inspect.register(sub, common)
    shared.register(sub, common)
    repair.register(sub, common)
    runtime.register(sub, common)
    mlx_lm_server.register(sub, common)  # MLX-free until it runs
    for action in sub._choices_actions:  # every subcommand's --help opens with a description
        parser = sub.choices[action.dest]
        if not parser.description and action.help:
            parser.description = action.help[0].upper() + action.help[1:] + "."
    return p


def _quiet_broken_pipe() -> int:
    """The reader went away (``| head``): say nothing, and keep the interpreter's exit flush from failing too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured, closed)
        pass
    return EXIT_BROKEN_PIPE


def _failed(args, exc: BaseException) -> int:
    """The one error line on stderr; under ``--json`` also ``{"error": {"message", "exit_code"}}`` on stdout, so a
    machine reading stdout gets JSON whatever happened."""
    line, code = error_line(exc), exit_code(exc)
    print(f"spec-cache: error: {line}", file=sys.stderr)
    if getattr(args, "json", False) is True:
        print(json.dumps({"error": {"message": line, "exit_code": code}}))
    return code


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """How a warning reads on the CLI: one line naming it, never the Python source line that raised it."""
    return f"spec-cache: warning: {' '.join(str(message).split())}\n"


def main(argv: list[str] | None = None) -> int:
    relax_cache_checks()  # before anything runs on a GPU (spec_cache.apps.cuda_env)
    warnings.formatwarning = _warning_line
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        args.cache_given = getattr(args, "cache", None) is not None
        args.cache = getattr(args, "cache", None) or default_cache_dir()
        args.json = getattr(args, "json", False)
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except CliError as exc:
        return _failed(args, exc)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except Exception as exc:  # typed errors, unreadable files: one line, never a traceback (common.EXIT_CODES)
        if os.environ.get("SPEC_CACHE_DEBUG"):
            raise
        return _failed(args, exc)
    except KeyboardInterrupt as exc:
        print("spec-cache: interrupted", file=sys.stderr)
        return exit_code(exc)

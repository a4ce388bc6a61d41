"""Connection guard: read deadlines and a connection cap enforced in uvicorn's HTTP protocol (h11).

Why at the protocol level: uvicorn has no header timeout (a client trickling one header byte every few seconds
holds its connection for ever) and ``limit_concurrency`` only counts requests that finished their headers, so a
slowloris attack fills the descriptor table; then asyncio's accept loop logs a traceback per attempt and
nobody is served. Here every connection counts against ``max_connections`` from the moment it is accepted, and a
connection that is waiting on its client is dropped after ``header_timeout_s`` (request line and headers,
answered 408) or ``body_timeout_s`` (the request body). At the cap a new connection first evicts the connection
that has waited longest on its client (a slow or idle one); only when every connection is being served (the app
is working on its request) is the newcomer answered 503 at once. A connection whose response writes are stalled
(the transport's buffer above its high-water mark: the client does not read) waits on its client too: it is
evicted first at the cap, and dropped (aborted: its unsent bytes go) after ``write_timeout_s`` without the client
reading its buffer down (issue 37, third attacker pass: streams that nobody read held their connections as
"served" for ever, and enough of them answered every other tenant 503). So a normal client (which sends its request in
one go) is served during a slowloris attack, and the server never holds more sockets than the cap (plus one
accept backlog).

``guarded_protocol(guard)`` returns the ``asyncio.Protocol`` class to pass as ``uvicorn.Config(http=...)``.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionGuard", "guarded_protocol"]

log = logging.getLogger("spec_cache.apps.server.guard")

_HEADERS, _BODY, _SERVED, _WRITE = "headers", "body", "served", "write"
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
_LINGER_S = 1.0  # a refused connection reads (and drops) its request this long so the client sees the 503


def _busy_response() -> bytes:
    body = json.dumps({"error": {"message": "the server has too many open connections; retry shortly",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    return head + body


@dataclass
class ConnectionGuard:
    """Limits shared by every connection of one server, and counters of what it did (for logs and tests)."""

    max_connections: int
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    #: a response whose writes stay stalled this long (the client reads nothing) is dropped
    write_timeout_s: float = 60.0
    #: refused connections that may linger (for their 503 to be read) at once; beyond, they are closed at once
    max_lingering: int = 64
    #: connections waiting on their client, oldest first, per phase (dicts keep insertion order)
    waiting: dict = field(default_factory=lambda: {_HEADERS: collections.OrderedDict(),
                                                   _BODY: collections.OrderedDict(),
                                                   _WRITE: collections.OrderedDict()})
    lingering: int = 0
    closing: int = 0  # dropped connections whose transport has not reported connection_lost yet
    timed_out: int = 0
    evicted: int = 0
    refused: int = 0
    _sweeping: bool = False

    def track(self, conn: "H11Protocol", phase: str) -> None:
        """Record ``conn``'s phase; a connection entering a waiting phase goes to the back of its queue."""
        if getattr(conn, "_guard_phase", None) == phase:
            return
        old = getattr(conn, "_guard_phase", None)
        if old in self.waiting:
            self.waiting[old].pop(conn, None)
        conn._guard_phase = phase
        if phase in self.waiting:
            self.waiting[phase][conn] = time.monotonic()

    def forget(self, conn) -> None:
        for queue in self.waiting.values():
            queue.pop(conn, None)
        conn._guard_phase = None

    def oldest_waiting(self, exclude) -> "H11Protocol | None":
        best, best_since = None, None
        for queue in self.waiting.values():
            for conn, since in queue.items():
                if conn is exclude:
                    continue
                if best_since is None or since < best_since:
                    best, best_since = conn, since
                break
        return best

    def sweep(self, loop) -> None:
        """Drop connections past their phase's deadline; runs every second while any connection is open."""
        now = time.monotonic()
        for phase, limit in ((_HEADERS, self.header_timeout_s), (_BODY, self.body_timeout_s),
                             (_WRITE, self.write_timeout_s)):
            queue = self.waiting[phase]
            while queue:
                conn, since = next(iter(queue.items()))
                if now - since < limit:
                    break
                self.timed_out += 1
                conn._guard_drop(phase)
        if any(self.waiting.values()):
            loop.call_later(1.0, self.sweep, loop)
        else:
            self._sweeping = False

    def ensure_sweeping(self, loop) -> None:
        if not self._sweeping:
            self._sweeping = True
            loop.call_later(1.0, self.sweep, loop)


def _phase_of(conn: H11Protocol) -> str:
    if conn.flow is not None and conn.flow.write_paused:
        return _WRITE
    state = conn.conn.their_state
    if state is h11.IDLE:
        return _HEADERS
    if state is h11.SEND_BODY:
        return _BODY
    return _SERVED


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's h11 protocol with ``guard``'s deadlines and connection cap."""

    class GuardedH11Protocol(H11Protocol):
        _guard_phase = None
        _refused = False
        _lingering = False
        _closing = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) - guard.closing > guard.max_connections:
                victim = guard.oldest_waiting(exclude=self)
                if victim is None:
                    self._refuse()
                    return
                guard.evicted += 1
                victim._guard_drop("evicted")
            guard.track(self, _HEADERS)
            guard.ensure_sweeping(self.loop)

        def _refuse(self) -> None:
            """Answer 503 before reading anything; read and drop the request briefly so the client gets it."""
            guard.refused += 1
            log.warning("connection refused: %d connections open (--max-connections %d)",
                        len(self.connections), guard.max_connections)
            self._refused = True
            self.transport.write(_busy_response())
            if guard.lingering >= guard.max_lingering:
                self.transport.close()
                return
            guard.lingering += 1
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(_LINGER_S, self.transport.abort)

        def _guard_drop(self, why: str) -> None:
            guard.forget(self)
            if self.transport.is_closing():
                return
            self._closing = True
            guard.closing += 1
            if why == _HEADERS and self.conn.our_state is h11.IDLE:
                self.transport.write(_TIMEOUT_408)
            stalled = self.flow is not None and self.flow.write_paused
            if why == "evicted":
                log.warning("connection dropped: evicted at the connection cap (it was the one waiting longest on "
                            "its client)")
            elif why == _HEADERS:
                log.warning("connection dropped: no complete request headers within --header-timeout")
            elif why == _WRITE:
                log.warning("connection dropped: its client read none of the response for %.0f s",
                            guard.write_timeout_s)
            else:
                log.warning("connection dropped: no complete request body within --body-timeout")
            if stalled:  # close() would wait for the client to read what is buffered: never
                self.transport.abort()
            else:
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            self._retrack()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._retrack()

        def pause_writing(self) -> None:
            super().pause_writing()
            self._retrack()

        def resume_writing(self) -> None:
            super().resume_writing()
            self._retrack()

        def _retrack(self) -> None:
            if self._guard_phase is not None and not self.transport.is_closing():
                guard.track(self, _phase_of(self))
                guard.ensure_sweeping(self.loop)

        def connection_lost(self, exc) -> None:
            if self._lingering:
                self._lingering = False
                guard.lingering -= 1
            if self._closing:
                self._closing = False
                guard.closing -= 1
            guard.forget(self)
            super().connection_lost(exc)

    return GuardedH11Protocol

"""How to reach the shared tier and how patient to be with it: ``SharedConfig``.

The URL is redis-py's (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, ``unix:///path?db=N``);
Valkey speaks the same protocol. Everything else is ours: the read timeout that bounds every lookup round trip
(a slow or hung server costs a decoding request at most that long, then counts as a miss), the write-behind
queue's byte cap, and the back-off after a failure (while it runs, the tier is not asked at all).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlsplit, urlunsplit

from ..errors import InvalidInput

SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class SharedConfig:
    """Settings of one shared tier. Only ``url`` is required; the defaults suit a server on the same LAN."""

    url: str
    #: every socket read of a lookup or fetch waits at most this long (a flowing transfer is never cut)
    timeout_s: float = 0.05
    connect_timeout_s: float = 0.1
    #: the background publisher's read timeout (a publish carries megabytes; it never blocks decoding)
    publish_timeout_s: float = 2.0
    #: bytes of checkpoints waiting to be published; a checkpoint that does not fit is dropped, never waited for
    queue_bytes: int = 256 << 20
    #: key prefix on the server: one fleet per prefix (``sc:1:`` is format 1 of the layout in docs/SHARED_TIER.md)
    prefix: str = "sc:1:"
    #: entry candidates probed per lookup (longest first), and fetch attempts before giving up
    max_candidates: int = 8
    max_attempts: int = 2
    #: back-off after a failure: first wait, doubling up to the cap; no requests are sent meanwhile
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    #: seconds a chunk uploaded ahead of its checkpoint lives if the checkpoint is never committed
    orphan_ttl_s: int = 600
    #: how long ``close()`` waits for queued publishes
    close_timeout_s: float = 2.0

    def __post_init__(self):
        if not isinstance(self.url, str) or urlsplit(self.url).scheme not in SCHEMES:
            raise InvalidInput(f"shared tier URL must start with redis://, rediss:// or unix://, got "
                               f"{redact(self.url) if isinstance(self.url, str) else type(self.url).__name__!r}")
        for name in ("timeout_s", "connect_timeout_s", "publish_timeout_s", "backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise InvalidInput(f"shared tier {name} must be a positive number, got {value!r}")
        for name in ("queue_bytes", "max_candidates", "max_attempts", "orphan_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"shared tier {name} must be a positive int, got {value!r}")
        if not isinstance(self.prefix, str) or not self.prefix or not self.prefix.isascii():
            raise InvalidInput("shared tier prefix must be a non-empty ASCII string")

    @classmethod
    def of(cls, value: "str | SharedConfig", **overrides) -> "SharedConfig":
        """A config from a URL string or an existing config, with keyword overrides."""
        if isinstance(value, SharedConfig):
            return replace(value, **overrides) if overrides else value
        return cls(value, **overrides)

    @property
    def safe_url(self) -> str:
        return redact(self.url)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs, health reports and error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))

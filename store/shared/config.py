"""How to reach the shared tier and how patient to be with it: ``SharedConfig``.

One server: redis-py's URL (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, ``unix:///path?db=N``).
A Redis / Valkey Cluster: ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://`` for
TLS); the nodes listed are only where the client starts, it learns the rest (and every failover) from the cluster.
Valkey speaks the same protocol. Everything else is ours: the read timeout that bounds every lookup round trip
(a slow or hung server costs a decoding request at most that long, then counts as a miss), the write-behind
queue's byte cap, and the back-off after a failure (while it runs, the tier is not asked at all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import InvalidInput

SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: key layout of one server (``keys.py``: format 1) and of a cluster (format 2: every name carries a hash tag)
DEFAULT_PREFIX = {False: "sc:1:", True: "sc:2:"}
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


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
    #: key prefix on the server: one fleet per prefix. Default ``sc:1:`` on one server (format 1 of the layout in
    #: docs/SHARED_TIER.md), ``sc:2:`` on a cluster (format 2, hash-tagged names)
    prefix: str | None = None
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
    #: cluster only: a checkpoint's keys share the hash slot of its chain at this many chunks (fewer for shorter
    #: checkpoints). 1 keeps every conversation that shares a first chunk in one slot (chunks stored once);
    #: larger values spread conversations sharing a long system prompt over slots, each slot holding its own copy
    #: of the shared chunks. Hosts of one fleet should agree (mixing is safe, it only shares less).
    spread_chunks: int = 1

    def __post_init__(self):
        if not isinstance(self.url, str) or urlsplit(self.url).scheme not in SCHEMES + CLUSTER_SCHEMES:
            raise InvalidInput(f"shared tier URL must start with redis://, rediss://, unix:// or "
                               f"redis+cluster://, got "
                               f"{redact(self.url) if isinstance(self.url, str) else type(self.url).__name__!r}")
        if self.cluster:
            self.cluster_nodes  # noqa: B018 -- validates the node list now, not at the first request
        for name in ("timeout_s", "connect_timeout_s", "publish_timeout_s", "backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise InvalidInput(f"shared tier {name} must be a positive number, got {value!r}")
        for name in ("queue_bytes", "max_candidates", "max_attempts", "orphan_ttl_s", "spread_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"shared tier {name} must be a positive int, got {value!r}")
        if self.prefix is None:
            object.__setattr__(self, "prefix", DEFAULT_PREFIX[self.cluster])
        if (not isinstance(self.prefix, str) or not self.prefix or not self.prefix.isascii()
                or "{" in self.prefix or "}" in self.prefix):
            raise InvalidInput("shared tier prefix must be a non-empty ASCII string without { or } "
                               f"(braces would change the cluster's hash tags), got {self.prefix!r}")

    @classmethod
    def of(cls, value: "str | SharedConfig", **overrides) -> "SharedConfig":
        """A config from a URL string or an existing config, with keyword overrides."""
        if isinstance(value, SharedConfig):
            return replace(value, **overrides) if overrides else value
        return cls(value, **overrides)

    @property
    def safe_url(self) -> str:
        return redact(self.url)

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis / Valkey Cluster (``redis+cluster://``)."""
        return urlsplit(self.url).scheme in CLUSTER_SCHEMES

    @property
    def cluster_nodes(self) -> list[tuple[str, int]]:
        """The startup nodes of a cluster URL as ``(host, port)``; raises ``InvalidInput`` naming a bad one."""
        parts = urlsplit(self.url)
        hosts = parts.netloc.rpartition("@")[2]
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InvalidInput(f"cluster URL {self.safe_url} takes no database, path or options "
                               "(a cluster has only database 0)")
        nodes = []
        for item in hosts.split(","):
            match = _HOST_PORT.match(item.strip())
            if match is None or not 0 < int(match.group(2)) < 65536:
                raise InvalidInput(f"cluster URL {self.safe_url}: {item.strip()!r} is not host:port "
                                   "(write redis+cluster://host:port[,host:port...])")
            nodes.append((match.group(1).strip("[]"), int(match.group(2))))
        return nodes

    @property
    def credentials(self) -> tuple[str | None, str | None]:
        """``(username, password)`` from the URL's user part (None where absent)."""
        userinfo, at, _ = urlsplit(self.url).netloc.rpartition("@")
        if not at:
            return None, None
        user, colon, password = userinfo.partition(":")
        return (unquote(user) or None), (unquote(password) if colon else None)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs, health reports and error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hosts}", parts.path, parts.query, parts.fragment))

"""How to reach the shared tier and how patient to be with it: ``SharedConfig``.

One server: redis-py's URL (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, ``unix:///path?db=N``).
A Redis / Valkey Cluster: ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://`` for
TLS); the nodes listed are only where the client starts, it learns the rest (and every failover) from the cluster.
Valkey speaks the same protocol. Everything else is ours: the read timeout that bounds every lookup round trip,
the total budget of one lookup (a slow or hung server costs a decoding request at most that long, then counts as
a miss), the write-behind queue's byte cap, and the back-off after a failure (while it runs, the tier is not asked
at all).

The fleet secret (``secret``, ``secret_file`` or ``$SPEC_CACHE_SHARED_SECRET``, in that order) keys everything the
tier writes (``auth.py``): key names, sealed records, manifest MACs. Without one the tier refuses to start unless
told it runs on a trusted network (``trusted_network=True`` or ``$SPEC_CACHE_SHARED_TRUSTED=1``), where it uses the
unkeyed layouts 1 and 2.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from ..errors import InvalidInput

SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: key layout of one server (``keys.py``: format 1) and of a cluster (format 2: every name carries a hash tag),
#: both unkeyed (a trusted network only); formats 3 and 4 are the same layouts keyed by the fleet secret
DEFAULT_PREFIX = {False: "sc:1:", True: "sc:2:"}
KEYED_PREFIX = {False: "sc:3:", True: "sc:4:"}
SECRET_ENV = "SPEC_CACHE_SHARED_SECRET"
TRUSTED_ENV = "SPEC_CACHE_SHARED_TRUSTED"
MIN_SECRET_BYTES = 16
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
#: RFC 3986's generic split (scheme://netloc path ?query #fragment), without urllib's checks of the host part
_GENERIC = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)([^?#]*)(?:\?([^#]*))?(?:#(.*))?$", re.DOTALL)


def split_url(url: str) -> SplitResult:
    """``url`` split into scheme, netloc, path, query, fragment; ``InvalidInput`` (never a bare ``ValueError``)
    when it cannot be.

    A cluster URL's netloc is a comma-separated host list that urllib was not written for: some builds (Debian's
    3.11.2, with a backported host check) reject ``h:1,[::1]:2`` as an "Invalid IPv6 URL", so cluster URLs are split
    here and their hosts checked by ``cluster_nodes``; other URLs go through ``urlsplit`` as redis-py will.
    """
    if not isinstance(url, str):
        raise InvalidInput(f"shared tier URL must be a string, got {type(url).__name__}")
    match = _GENERIC.match(url)
    if match is not None and match.group(1).lower() in CLUSTER_SCHEMES:
        scheme, netloc, path, query, fragment = match.groups()
        return SplitResult(scheme.lower(), netloc, path, query or "", fragment or "")
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise InvalidInput(f"shared tier URL {redact(url)} cannot be parsed ({exc}); write redis://host:port/db, "
                           "rediss://..., unix:///path?db=N or redis+cluster://host:port[,host:port...]") from None


@dataclass(frozen=True)
class SharedConfig:
    """Settings of one shared tier. ``url`` and a fleet secret (or ``trusted_network``) are required; the other
    defaults suit a server on the same LAN."""

    url: str
    #: every socket read of a lookup or fetch waits at most this long
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
    #: all reads of one lookup (round trips, transfers, reconnects) together take at most this long; past it the
    #: lookup is a miss (counted ``over_budget``). Cover the largest checkpoint's transfer time on your network.
    lookup_budget_s: float = 0.5
    #: the fleet secret (str or bytes, >= 16 bytes): keys the names, records and manifests (``auth.py``).
    #: Default: the contents of ``secret_file``, else ``$SPEC_CACHE_SHARED_SECRET``.
    secret: str | bytes | None = field(default=None, repr=False, compare=False)
    #: a file holding the fleet secret (surrounding whitespace stripped); read once, when the config is made
    secret_file: str | None = None
    #: no secret: run unkeyed (formats 1 and 2: anyone who can write the server can poison entries, anyone who
    #: can read it sees every tenant's tokens). Also ``$SPEC_CACHE_SHARED_TRUSTED=1``. Ignored with a secret.
    trusted_network: bool = False
    #: the secret in effect (from ``secret``, ``secret_file`` or the environment), None without one
    key_material: bytes | None = field(default=None, init=False, repr=False, compare=False)
    #: whether ``prefix`` was left to its default (it then follows the secret when ``of`` replaces fields)
    default_prefix: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.url, str) or split_url(self.url).scheme not in SCHEMES + CLUSTER_SCHEMES:
            raise InvalidInput(f"shared tier URL must start with redis://, rediss://, unix:// or "
                               f"redis+cluster://, got "
                               f"{redact(self.url) if isinstance(self.url, str) else type(self.url).__name__!r}")
        if self.cluster:
            self.cluster_nodes  # noqa: B018 -- validates the node list now, not at the first request
        for name in ("timeout_s", "connect_timeout_s", "publish_timeout_s", "backoff_s", "backoff_max_s",
                     "lookup_budget_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise InvalidInput(f"shared tier {name} must be a positive number, got {value!r}")
        for name in ("queue_bytes", "max_candidates", "max_attempts", "orphan_ttl_s", "spread_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"shared tier {name} must be a positive int, got {value!r}")
        if not isinstance(self.trusted_network, bool):
            raise InvalidInput(f"shared tier trusted_network must be True or False, got {self.trusted_network!r}")
        object.__setattr__(self, "key_material", self._resolve_secret())
        object.__setattr__(self, "default_prefix", self.prefix is None)
        if self.prefix is None:
            object.__setattr__(self, "prefix", (KEYED_PREFIX if self.keyed else DEFAULT_PREFIX)[self.cluster])
        if (not isinstance(self.prefix, str) or not self.prefix or not self.prefix.isascii()
                or "{" in self.prefix or "}" in self.prefix):
            raise InvalidInput("shared tier prefix must be a non-empty ASCII string without { or } "
                               f"(braces would change the cluster's hash tags), got {self.prefix!r}")

    def _resolve_secret(self) -> bytes | None:
        """The fleet secret as bytes: ``secret``, else ``secret_file``'s contents, else the environment's."""
        secret, source = self.secret, "secret"
        if secret is None and self.secret_file is not None:
            source = f"secret_file {self.secret_file}"
            try:
                with open(self.secret_file, "rb") as f:
                    secret = f.read().strip()
            except (OSError, TypeError) as exc:
                raise InvalidInput(f"shared tier secret_file {self.secret_file!r} cannot be read: "
                                   f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
        if secret is None and os.environ.get(SECRET_ENV):
            secret, source = os.environ[SECRET_ENV], f"${SECRET_ENV}"
        if secret is None:
            return None
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if not isinstance(secret, (bytes, bytearray)):
            raise InvalidInput(f"shared tier secret must be a str or bytes, got {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise InvalidInput(f"shared tier secret ({source}) is {len(secret)} bytes: use at least "
                               f"{MIN_SECRET_BYTES} random bytes (e.g. `openssl rand -hex 32`)")
        return bytes(secret)

    @property
    def keyed(self) -> bool:
        """Whether a fleet secret is in effect (formats 3 and 4: keyed names, sealed records)."""
        return self.key_material is not None

    @property
    def trusted(self) -> bool:
        """Whether running without a secret was allowed (``trusted_network`` or ``$SPEC_CACHE_SHARED_TRUSTED``)."""
        return self.trusted_network or os.environ.get(TRUSTED_ENV, "").strip().lower() in ("1", "true", "yes")

    @classmethod
    def of(cls, value: "str | SharedConfig", **overrides) -> "SharedConfig":
        """A config from a URL string or an existing config, with keyword overrides."""
        if isinstance(value, SharedConfig):
            if not overrides:
                return value
            if value.default_prefix and "prefix" not in overrides:
                overrides["prefix"] = None  # the default follows the (possibly new) secret
            return replace(value, **overrides)
        return cls(value, **overrides)

    @property
    def safe_url(self) -> str:
        return redact(self.url)

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis / Valkey Cluster (``redis+cluster://``)."""
        return split_url(self.url).scheme in CLUSTER_SCHEMES

    @property
    def cluster_nodes(self) -> list[tuple[str, int]]:
        """The startup nodes of a cluster URL as ``(host, port)``; raises ``InvalidInput`` naming a bad one."""
        parts = split_url(self.url)
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
        userinfo, at, _ = split_url(self.url).netloc.rpartition("@")
        if not at:
            return None, None
        user, colon, password = userinfo.partition(":")
        return (unquote(user) or None), (unquote(password) if colon else None)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs, health reports and error messages)."""
    match = _GENERIC.match(url) if isinstance(url, str) else None
    if match is not None and match.group(1).lower() in CLUSTER_SCHEMES:
        parts = SplitResult(match.group(1), match.group(2), match.group(3), match.group(4) or "", match.group(5) or "")
    else:
        try:
            parts = urlsplit(url)
        except ValueError:
            return "<unparseable URL>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hosts}", parts.path, parts.query, parts.fragment))

"""``SharedTier``: prefixes shared by many hosts through Redis or Valkey, behind the local LMDB store.

The tier owns two redis-py clients (lookups with the short ``timeout_s`` and every lookup's total
``lookup_budget_s`` enforced on its sockets, ``deadline.py``; publishing with ``publish_timeout_s``; redis-py's
own retries off; ``RedisCluster`` clients for a ``redis+cluster://`` URL, which follow ``MOVED`` /
``ASK`` redirections and learn the new topology after a failover themselves), the write-behind queue, the
health counters and breaker, and the server probe for the CLI. The read path is ``lookup.LookupMixin``, the
write path ``publish.PublishMixin``.

Failures open a breaker (``Health``): for the back-off period the tier is not asked at all. Nothing here raises
to the caller on a server problem: lookups return None, publishes are counted and dropped.

The fleet secret (``auth.py``) keys names and seals what is written; without one the tier refuses to start unless
the config says the network is trusted (then it logs a warning at every start and uses the unkeyed formats).
"""

from __future__ import annotations

import logging
import os
import socket
import time

from ..background import TenantShares, WriteBehind
from ..errors import StoreError
from .auth import auth_for
from .config import DEFAULT_PREFIX, KEYED_PREFIX, SECRET_ENV, TRUSTED_ENV, SharedConfig
from .deadline import Budget, cluster_hook, single_server_hook
from .health import Health
from .keys import KeyNames
from .lookup import Incoming, LookupMixin
from .publish import PublishJob, PublishMixin
from .scripts import COMMIT, DELETE_IF_UNCHANGED

__all__ = ["SharedTier", "Incoming", "PublishJob"]

log = logging.getLogger("spec_cache.shared")

#: the first redis-py whose RedisCluster runs MULTI/EXEC pipelines (keys of one slot), which lookups use
CLUSTER_REDIS_PY = (6, 1)
#: an unauthenticated value's warning is repeated at most this often per cause (it is counted every time)
WARN_EVERY_S = 600.0


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class SharedTier(LookupMixin, PublishMixin):
    """A client of one shared server. ``store`` (a local ``Store``) is needed to publish; lookups work without.

    Raises ``StoreError`` without a fleet secret unless ``config.trusted`` (``probe_only``: a tier that only
    ``probe``s the server, for ``shared-stats``, needs neither).
    """

    def __init__(self, config: SharedConfig | str, store=None, *, probe_only: bool = False):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        #: what a server problem raises: redis-py errors, socket errors, and the cluster client's own exceptions
        #: (a slot no primary serves yet, the topology not readable) which do not derive from RedisError
        self._failures = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
        self.config = SharedConfig.of(config)
        if not self.config.keyed and not probe_only:
            if not self.config.trusted:
                raise StoreError(
                    f"shared tier {self.config.safe_url}: no fleet secret. Anyone who can write to the server could "
                    f"poison this host's cache and anyone who can read it sees every tenant's tokens. Give every "
                    f"host of the fleet the same secret (${SECRET_ENV}, secret_file / --shared-secret-file, or "
                    f"shared_options={{'secret': ...}}), or, on a network you trust, set trusted_network=True "
                    f"(${TRUSTED_ENV}=1) to run unkeyed")
            log.warning("shared tier %s runs WITHOUT a fleet secret (trusted_network): entries are unauthenticated "
                        "and readable by anyone who can reach the server", self.config.safe_url)
        self.keys = KeyNames(self.config.prefix, self.config.cluster, self.config.spread_chunks,
                             auth_for(self.config.key_material))
        self.health = Health(self.config.backoff_s, self.config.backoff_max_s)
        self.host_id = f"{socket.gethostname()}:{os.getpid()}"
        self._budget = Budget()  # the running lookup's deadline, per thread (lookups may run on several)
        self._warned: dict[str, float] = {}

        if self.config.cluster and _version(redis.__version__) < CLUSTER_REDIS_PY:
            raise StoreError(f"shared tier {self.config.safe_url}: a cluster needs redis-py >= "
                             f"{'.'.join(map(str, CLUSTER_REDIS_PY))} (transactions in cluster pipelines), "
                             f"installed: {redis.__version__}")

        def client(timeout: float, budgeted: bool):
            # no retries: a failure is reported at once and handled by the breaker, never multiplied
            options = dict(socket_timeout=timeout, socket_connect_timeout=self.config.connect_timeout_s,
                           retry=Retry(NoBackoff(), 0), socket_read_size=1 << 20)  # records are MBs: large reads
            if self.config.cluster:  # connects when first used: a cluster down at start is a miss, not a crash
                if budgeted:
                    options["redis_connect_func"] = cluster_hook(self._budget)
                return LazyClient(lambda: cluster_client(self.config, **options), self._failures)
            if budgeted:
                options["redis_connect_func"] = single_server_hook(self._budget)
            return redis.Redis.from_url(self.config.url, health_check_interval=0, **options)
        try:
            self._read = client(self.config.timeout_s, True)
            self._write = client(self.config.publish_timeout_s, False)
        except (ValueError, redis.RedisError, OSError) as exc:
            raise StoreError(f"shared tier URL {self.config.safe_url} is not usable: {exc}") from None
        self._commit = self._write.register_script(COMMIT)
        self._delete_if_unchanged = self._read.register_script(DELETE_IF_UNCHANGED)
        self._sigs: dict[bytes, list[bytes]] = {}
        self._store = store
        # the publisher drops what the queue refuses (``enqueue``): the local store keeps it
        self._shares = TenantShares()  # each tenant's bytes queued or in flight (its share of the cap)
        self._queue = (WriteBehind(self.config.queue_bytes, self._publish, name="spec-cache-shared-publish")
                       if store is not None else None)

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Publish what is queued (up to ``close_timeout_s``), then drop the rest and disconnect."""
        if self._queue is not None:
            left = self._queue.close(self.config.close_timeout_s)
            if left:
                self.health.add("dropped_close", left)
            self._queue = None
        for c in (self._read, self._write):
            try:
                c.close()
            except Exception:
                pass

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until queued publishes are done; True if nothing is left."""
        return True if self._queue is None else self._queue.drain(timeout)

    def status(self) -> dict:
        """This process's view of the tier: state, counters, queue (no request is sent)."""
        jobs, nbytes = self._queue.queued if self._queue is not None else (0, 0)
        return {"url": self.config.safe_url, "prefix": self.config.prefix, "timeout_s": self.config.timeout_s,
                "lookup_budget_s": self.config.lookup_budget_s, "keyed": self.config.keyed, "queue_jobs": jobs,
                "queue_bytes": nbytes, "queue_cap_bytes": self.config.queue_bytes,
                **self.health.snapshot()}

    def _failed(self, exc: BaseException, what: str, warnings: list[str] | None) -> None:
        timeout = isinstance(exc, (self._redis.TimeoutError, socket.timeout, TimeoutError))
        self.health.fail(exc, timeout=timeout)
        message = (f"shared tier {self.config.safe_url} {'timed out' if timeout else 'failed'} during {what} "
                   f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); not asked again for "
                   f"{self.health.snapshot()['retry_in_s']:.1f} s")
        log.warning(message)
        if warnings is not None:
            warnings.append(message)

    def _warn_once(self, cause: str, message: str, warnings: list[str] | None) -> None:
        """Log (and hand the caller) ``message`` the first time ``cause`` happens, then at most every
        ``WARN_EVERY_S``: a poisoned entry met by every lookup must not flood the log."""
        now = time.monotonic()
        last = self._warned.get(cause)
        if last is not None and now - last < WARN_EVERY_S:
            log.debug(message)
            return
        self._warned[cause] = now
        log.warning(message)
        if warnings is not None:
            warnings.append(message)

    # --- server health (for the CLI) ---------------------------------------------------------------
    def _secret_problems(self, out: dict) -> list[str]:
        """One line per sign that this host's secret is not its fleet's: a host with another secret computes
        other key names and misses silently, which nothing else shows. Signs: publishes under our prefix counted
        for other fingerprints (``fp:<it>`` in ``stats``) and none for ours; nothing under our (default) prefix
        but checkpoints under the other default prefix of this server kind (keyed vs unkeyed)."""
        problems = []
        ours = out["fingerprint"]
        others = {fp: n for fp, n in out["secrets"].items() if fp != ours and n > 0}
        if others:
            shown = ", ".join(f"{fp} ({n})" for fp, n in sorted(others.items())[:3])
            if ours is None:  # a custom prefix shared by keyed hosts and this unkeyed one
                problems.append(f"secret mismatch? {sum(others.values())} checkpoints under {self.config.prefix} "
                                f"were published with a fleet secret (fingerprints {shown}) and this host has none: "
                                f"give it the fleet's (--shared-secret-file FILE or ${SECRET_ENV})")
            elif out["secrets"].get(ours):
                problems.append(f"another fleet secret publishes under {self.config.prefix} too (fingerprints "
                                f"{shown}; this host's is {ours}): hosts with different secrets never share; give "
                                "every host of the fleet the same one")
            else:
                problems.append(f"secret mismatch? {sum(others.values())} checkpoints under {self.config.prefix} "
                                f"were published with another fleet secret (fingerprints {shown}), none with this "
                                f"host's ({ours}): this host misses everything they publish")
        if self.config.default_prefix and not out["published_checkpoints"]:
            other = (DEFAULT_PREFIX if self.config.keyed else KEYED_PREFIX)[self.config.cluster]
            there = _int_or_0(self._write.hget(other.encode("ascii") + b"stats", "checkpoints"))
            if there:
                fix = ("the fleet runs without a secret (trusted network): drop this host's secret, or give every "
                       "host one" if self.config.keyed else
                       "the fleet is keyed: give this host its secret (--shared-secret-file FILE or "
                       f"${SECRET_ENV})")
                problems.append(f"secret mismatch? nothing published under {self.config.prefix} but {there} "
                                f"checkpoints under {other}: {fix}")
        return problems

    def probe(self) -> dict:
        """Ask the server how it is: reachability, round-trip time, version, memory, eviction policy, keys.

        Never raises for a server problem: ``reachable`` is False and ``error`` says why.
        """
        out: dict = {"url": self.config.safe_url, "prefix": self.config.prefix, "reachable": False}
        try:
            if self.config.cluster:
                self._write.ping()  # builds the client (reads the slot map): not part of the round trip
            start = time.perf_counter()
            self._write.ping()
            out["rtt_ms"] = round((time.perf_counter() - start) * 1e3, 3)
            if self.config.cluster:
                infos = self._write.info(target_nodes=self._redis.RedisCluster.PRIMARIES)
                out["cluster"] = cluster_summary(self._write.cluster_info(), infos)
                info = merged_info(infos)
            else:
                info = self._write.info()
            stats = self._write.hgetall(self.keys.stats())
        except self._failures as exc:
            out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            return out
        out["reachable"] = True
        server = "valkey" if info.get("server_name") == "valkey" or "valkey_version" in info else "redis"
        out["server"] = f"{server} {info.get('valkey_version') or info.get('redis_version')}"
        for name in ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys", "keyspace_hits",
                     "keyspace_misses", "connected_clients"):
            out[name] = info.get(name)
        db = 0 if self.config.cluster else self._write.connection_pool.connection_kwargs.get("db", 0)
        out["keys"] = (info.get(f"db{db}") or {}).get("keys", 0)
        out["published_checkpoints"] = int(stats.get(b"checkpoints", 0))
        out["published_bytes"] = int(stats.get(b"bytes", 0))
        out["keyed"] = self.config.keyed
        out["fingerprint"] = self.keys.auth.fingerprint()
        out["secrets"] = {k[3:].decode("ascii", "replace"): _int_or_0(v) for k, v in stats.items()
                          if isinstance(k, bytes) and k.startswith(b"fp:")}
        try:
            out["problems"] = self._secret_problems(out)
        except self._failures as exc:
            out["problems"] = [f"could not compare fleet secrets: {type(exc).__name__}: {exc}"]
        policy = str(out.get("maxmemory_policy") or "")
        out["warnings"] = []
        if not out.get("maxmemory"):
            out["warnings"].append("maxmemory is 0: the server grows without bound (set maxmemory)")
        if not policy.startswith("allkeys-"):
            out["warnings"].append(f"maxmemory-policy {policy} does not evict spec-cache keys (they carry no "
                                   "TTL); use allkeys-lru")
        return out


def _int_or_0(raw) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def cluster_client(config: SharedConfig, **options):
    """A redis-py ``RedisCluster`` for a ``redis+cluster://`` URL: the startup nodes, credentials and TLS from
    the URL. It follows ``MOVED``/``ASK`` itself and re-reads the slot map after a connection error (failover)."""
    from redis.cluster import ClusterNode, RedisCluster

    username, password = config.credentials
    if config.url.startswith("rediss+"):
        options["ssl"] = True
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in config.cluster_nodes],
                        username=username, password=password, require_full_coverage=False,
                        **options)


def merged_info(infos: dict) -> dict:
    """One INFO view of a cluster's primaries (``{node: info}``): sums of the counters, the first node's
    settings (version, policy), ``maxmemory`` 0 if any primary is unbounded."""
    nodes = [i for i in infos.values() if isinstance(i, dict)] if isinstance(infos, dict) else []
    if not nodes or not isinstance(next(iter(infos.values())), dict):
        nodes = [infos] if isinstance(infos, dict) else []
    out = dict(nodes[0]) if nodes else {}
    for name in ("used_memory", "evicted_keys", "keyspace_hits", "keyspace_misses", "connected_clients"):
        out[name] = sum(int(i.get(name) or 0) for i in nodes)
    out["maxmemory"] = 0 if any(not i.get("maxmemory") for i in nodes) else sum(int(i["maxmemory"]) for i in nodes)
    out["db0"] = {"keys": sum(int((i.get("db0") or {}).get("keys", 0)) for i in nodes)}
    return out


def cluster_summary(cluster_info, infos) -> dict:
    """State, slots covered and primaries of a cluster (for ``shared-stats``)."""
    info = cluster_info if isinstance(cluster_info, dict) else {}
    return {"state": info.get("cluster_state"), "slots_ok": info.get("cluster_slots_ok"),
            "known_nodes": info.get("cluster_known_nodes"), "size": info.get("cluster_size"),
            "primaries": sorted(infos) if isinstance(infos, dict) else []}


class LazyClient:
    """A client built on first use (``RedisCluster`` reads the topology when constructed, and fails if the node
    it asks first is down). A failure to build it raises ``ConnectionError`` to the caller, whose breaker backs
    off; the next use tries again. Scripts registered on it are registered on the real client when first run."""

    def __init__(self, factory, failures: tuple):
        import threading

        self._factory = factory
        self._failures = failures
        self._client = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._client is None:
                import redis
                try:
                    self._client = self._factory()
                except self._failures as exc:
                    raise redis.ConnectionError(f"cluster not reachable: {type(exc).__name__}: {exc}") from exc
            return self._client

    def __getattr__(self, name):
        return getattr(self.get(), name)

    def register_script(self, source: str) -> "LazyScript":
        return LazyScript(self, source)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class LazyScript:
    """A Lua script of a ``LazyClient``, called like redis-py's ``Script`` (``script(keys=..., args=...)``)."""

    def __init__(self, client: LazyClient, source: str):
        self._client = client
        self._source = source
        self._script = None

    def __call__(self, keys=(), args=()):
        if self._script is None:
            self._script = self._client.get().register_script(self._source)
        return self._script(keys=keys, args=args)

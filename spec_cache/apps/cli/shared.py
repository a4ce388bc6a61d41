"""The CLI side of the shared tier: the ``--shared URL`` option, ``spec-cache shared-stats``, and the shared
section of ``spec-cache stats``. Nothing here imports MLX.

``shared-stats`` asks the server (or every primary of a ``redis+cluster://`` cluster) how it is (reachable, round
trip, version, memory, eviction policy, keys, checkpoints published; a cluster's state and slots) under the prefix
of the fleet secret it is given (``--shared-secret-file`` / ``$SPEC_CACHE_SHARED_SECRET``, as ``serve``), and exits
0 when it answers, 1 when it does not or a problem is found (a "secret mismatch?": this host's secret is not the
one its fleet publishes with), 2 on a usage error (no URL, bad URL, unreadable secret file).
"""

from __future__ import annotations

import argparse
import json
import os

from spec_cache.apps.cli.common import EXIT_OK, EXIT_PROBLEMS, CliError, human_bytes
from spec_cache.store import StoreError
from spec_cache.store.shared import SharedConfig, SharedTier

ENV = "SPEC_CACHE_SHARED"
#: the shared tier's Redis password, when the URL given on the command line carries none (it must not: see shared_url)
PASSWORD_ENV = "SPEC_CACHE_SHARED_PASSWORD"
PROBE_TIMEOUT_S = 1.0


def add_shared_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--shared URL`` (default ``$SPEC_CACHE_SHARED``) to a parser, unless it already has it."""
    if any("--shared" in action.option_strings for action in parser._actions):
        return
    parser.add_argument("--shared", default=argparse.SUPPRESS, metavar="URL",
                        help="shared tier, a Redis/Valkey URL such as redis://host:6379/0, or a cluster: "
                             "redis+cluster://host:port[,host:port...] "
                             f"(default: ${ENV}; none: local store only)")
    add_shared_secret_options(parser)


def add_shared_secret_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--shared-secret-file FILE`` and ``--shared-trusted-network`` (unless the parser has them)."""
    if any("--shared-secret-file" in action.option_strings for action in parser._actions):
        return
    parser.add_argument("--shared-secret-file", default=argparse.SUPPRESS, metavar="FILE",
                        help="the shared tier's fleet secret, in a file (default: $SPEC_CACHE_SHARED_SECRET); "
                             "every host of a fleet holds the same one")
    parser.add_argument("--shared-password-file", default=argparse.SUPPRESS, metavar="FILE",
                        help="the shared tier's Redis/Valkey password, in a file (default: $SPEC_CACHE_SHARED_PASSWORD"
                             "); a password in --shared URL is refused, as every local user can read a command line")
    parser.add_argument("--shared-trusted-network", action="store_true", default=argparse.SUPPRESS,
                        help="run the shared tier without a fleet secret (unkeyed, unauthenticated entries: only "
                             "where every Redis writer and reader is trusted; also $SPEC_CACHE_SHARED_TRUSTED=1)")


def shared_options(args) -> dict:
    """``SharedConfig`` fields from the shared-tier flags (``SharedConfig`` itself reads the environment)."""
    options: dict = {}
    if getattr(args, "shared_secret_file", None):
        options["secret_file"] = args.shared_secret_file
    if getattr(args, "shared_trusted_network", False):
        options["trusted_network"] = True
    if getattr(args, "shared_budget", None) is not None:
        options["lookup_budget_s"] = args.shared_budget
    return options


def _netloc_and_query(url: str) -> tuple[str, str]:
    """A URL's netloc and query, split by hand: a cluster URL's comma-separated hosts are not for ``urlsplit``."""
    rest = url.partition("://")[2]
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    return netloc, rest.partition("?")[2]


def url_has_password(url: str) -> bool:
    """Whether ``url`` carries a password (``redis://user:PASSWORD@host``, or a ``password=`` query option)."""
    from urllib.parse import parse_qs

    netloc, query = _netloc_and_query(url)
    userinfo = netloc.rpartition("@")[0]
    return ":" in userinfo or "password" in parse_qs(query)


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its userinfo's password (percent-encoded; redis-py decodes it), keeping a
    username it names; a ``unix://`` socket URL takes it as the ``password`` query option."""
    from urllib.parse import quote

    scheme, _, rest = url.partition("://")
    netloc, query = _netloc_and_query(url)
    if scheme == "unix":  # redis-py: unix://[username@]/path?db=N&password=...
        return f"{url}{'&' if query else '?'}password={quote(password, safe='')}"
    userinfo, at, hosts = netloc.rpartition("@")
    user = userinfo.split(":", 1)[0] if at else ""
    return f"{scheme}://{user}:{quote(password, safe='')}@{hosts}{rest[len(netloc):]}"


def shared_url(args) -> str | None:
    """The shared tier URL from ``--shared`` or ``$SPEC_CACHE_SHARED`` (None when neither is set), with the password
    of ``--shared-password-file`` / ``$SPEC_CACHE_SHARED_PASSWORD`` when one is given.

    A password inside ``--shared`` is refused (``CliError``): secrets come from files or the environment only, as
    every local user reads any process's command line (/proc/PID/cmdline, ps); ``$SPEC_CACHE_SHARED`` may carry one."""
    given = getattr(args, "shared", None)
    if given and url_has_password(given):
        raise CliError("--shared URL carries a password, which every local user can read on the command line "
                       f"(/proc/PID/cmdline, ps): give it with --shared-password-file FILE or ${PASSWORD_ENV}, or "
                       f"the whole URL in ${ENV}")
    url = given or os.environ.get(ENV) or None
    password = _password(args)
    return with_password(url, password) if url and password else url


def _password(args) -> str | None:
    """The password of ``--shared-password-file`` (its first line) or ``$SPEC_CACHE_SHARED_PASSWORD``."""
    path = getattr(args, "shared_password_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.readline().rstrip("\r\n") or None
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read --shared-password-file {path}: {getattr(exc, 'strerror', None) or exc}") \
                from None
    return os.environ.get(PASSWORD_ENV) or None


def shared_health(url: str, timeout_s: float = PROBE_TIMEOUT_S, options: dict | None = None) -> dict:
    """Probe the server at ``url`` (see ``SharedTier.probe``) with the fleet secret of ``options``
    (``shared_options``; else ``$SPEC_CACHE_SHARED_SECRET``), so the prefix read is the one this host's tier
    uses; a bad URL or an unreadable secret file raises ``CliError``."""
    options = {k: v for k, v in (options or {}).items() if k in ("secret", "secret_file", "trusted_network")}
    try:
        tier = SharedTier(SharedConfig(url, timeout_s=timeout_s, connect_timeout_s=timeout_s,
                                       publish_timeout_s=timeout_s, **options), probe_only=True)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    try:
        return tier.probe()
    finally:
        tier.close()


def format_health(d: dict) -> str:
    """Human lines for a ``shared_health`` result."""
    if not d.get("reachable"):
        return f"shared        {d['url']}: unreachable ({d.get('error', 'no answer')})"
    limit = human_bytes(d["maxmemory"]) if d["maxmemory"] else "unlimited"
    lines = [f"shared        {d['url']} (prefix {d['prefix']})"]
    if d.get("cluster"):
        c = d["cluster"]
        lines.append(f"  cluster     state {c['state']}, {c['slots_ok']} of 16384 slots served, "
                     f"{len(c['primaries'])} primaries, {c['known_nodes']} nodes known")
    lines += [f"  server      {d['server']}, round trip {d['rtt_ms']:.2f} ms, {d['connected_clients']} clients",
              f"  memory      {human_bytes(d['used_memory'])} of {limit}"
              f", policy {d['maxmemory_policy']}, {d['evicted_keys']} keys evicted",
              f"  keys        {d['keys']} in the database; {d['published_checkpoints']} checkpoints "
              f"({human_bytes(d['published_bytes'])}) published so far"]
    lines += [f"  warning     {w}" for w in d.get("warnings", [])]
    lines += [f"  problem     {p}" for p in d.get("problems", [])]
    return "\n".join(lines)


def extend_stats(args, stats: dict) -> str:
    """For ``stats``: add ``stats["shared"]`` when a shared tier is configured; returns extra human text."""
    url = shared_url(args)
    if url is None:
        return ""
    stats["shared"] = shared_health(url, options=shared_options(args))
    return "\n" + format_health(stats["shared"])


def cmd_shared_stats(args) -> int:
    url = shared_url(args)
    if url is None:
        raise CliError(f"shared-stats needs --shared URL (or ${ENV})")
    d = shared_health(url, options=shared_options(args))
    print(json.dumps(d, sort_keys=True) if getattr(args, "json", False) else format_health(d))
    return EXIT_OK if d.get("reachable") and not d.get("problems") else EXIT_PROBLEMS


def register(subparsers, common: argparse.ArgumentParser) -> None:
    """Add the ``shared-stats`` command (its ``--shared`` comes from ``common`` when that has it)."""
    s = subparsers.add_parser("shared-stats", parents=[common],
                              help="health of the shared tier (exit 1 if the server does not answer)",
                              description="Ask the shared tier (one Redis/Valkey server, or every primary of a "
                              "redis+cluster:// cluster) how it is: reachable, round trip, memory, keys and this "
                              "tier's figures. Exit 1 if it does not answer.")
    add_shared_option(s)
    s.set_defaults(fn=cmd_shared_stats)

"""The descriptor limit the server runs under, and the connection budget sized from it.

Why: importing ``mlx_lm.utils`` calls ``resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))``. Where the hard limit is
below 4096 and the process may not raise it (many containers: 1024:1024), that import raises "not allowed to
raise maximum limit" and ``serve`` never starts; where it is above, the import lowers it. ``import_mlx_lm()``
does that import with a tolerant ``setrlimit`` in place: the soft limit goes up to mlx-lm's 2048 where the hard
limit allows, never down, the hard limit is left alone, and a limit that cannot be raised is a warning.
``connection_budget(soft)`` then sizes the connection cap and the accept backlog so that sockets can never use
the descriptors the model files, LMDB and the shared tier need.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys

__all__ = ["TenantTurns", "import_mlx_lm", "raise_nofile_limit", "nofile_limit", "connection_budget",
           "default_store_budget", "MLX_LM_WANTS"]

log = logging.getLogger("spec_cache.apps.server")

MLX_LM_WANTS = 2048  # the soft limit mlx_lm.utils asks for at import


def nofile_limit() -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE; RLIM_INFINITY as a large number."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    big = 1 << 20
    return (big if soft == resource.RLIM_INFINITY else soft), (big if hard == resource.RLIM_INFINITY else hard)


def _tolerant_setrlimit(real, warn: bool = True):
    def setrlimit(which, limits):
        if which != resource.RLIMIT_NOFILE:
            return real(which, limits)
        soft, hard = resource.getrlimit(which)
        if soft == resource.RLIM_INFINITY:
            return None
        want = limits[0]
        target = max(soft, want if hard == resource.RLIM_INFINITY else min(want, hard))
        if target > soft:
            try:
                real(which, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        if soft < want and warn:
            log.warning("the descriptor limit is %d (hard %s) and cannot be raised to the %d mlx-lm asks for; "
                        "serving with %d (connections are capped to fit)", soft,
                        "unlimited" if hard == resource.RLIM_INFINITY else hard, want, soft)
        return None
    return setrlimit


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft descriptor limit to what mlx-lm asks for where the hard limit allows (never lower it; a
    warning where it cannot be raised); returns (soft, hard) afterwards. Cheap: no MLX import."""
    _tolerant_setrlimit(resource.setrlimit)(resource.RLIMIT_NOFILE, (MLX_LM_WANTS, 2 * MLX_LM_WANTS))
    return nofile_limit()


def import_mlx_lm() -> tuple[int, int]:
    """Import ``mlx_lm.utils`` without letting its ``setrlimit`` fail or lower the limit; returns (soft, hard)
    afterwards. A no-op (but for the return) when it was imported already."""
    if "mlx_lm.utils" not in sys.modules:
        real = resource.setrlimit
        resource.setrlimit = _tolerant_setrlimit(real, warn=False)  # raise_nofile_limit warned already
        try:
            import mlx_lm.utils  # noqa: F401
        finally:
            resource.setrlimit = real
    return nofile_limit()


def connection_budget(soft: int, asked: int | None = None) -> tuple[int, int]:
    """(max_connections, backlog) for a soft descriptor limit. Besides the connections it keeps a reserve of
    64 + soft/16 descriptors for everything else (model and tokenizer files, LMDB, the shared tier, pipes) and
    three accept backlogs: asyncio accepts up to ``backlog`` sockets in one go before any of them is looked at,
    as many victims of the cap may still be closing, and as many refused ones may linger for their 503 (measured:
    with one backlog only, a 2100-socket attack under a 1024 limit still hit EMFILE once). Connections get the
    rest (at most 8192 by default). ``asked`` (``--max-connections``) above what fits is lowered, with a warning.
    Raises ValueError when the limit leaves no room at all."""
    backlog = max(16, min(1024, soft // 16))
    room = soft - (64 + soft // 16) - 3 * backlog
    if room < 8:
        raise ValueError(f"the descriptor limit ({soft}) leaves no room for connections; raise it (ulimit -n)")
    if asked is None:
        return min(room, 8192), backlog
    if asked > room:
        log.warning("--max-connections %d does not fit the descriptor limit %d; using %d", asked, soft, room)
        return room, backlog
    return asked, backlog


def default_store_budget(path) -> tuple[int, str]:
    """``serve``'s default ``--max-bytes`` for the store at ``path``: half of the disk room the store could have
    (free space + what the store and its damaged copies set aside hold; ``spec_cache.store.default_budget``),
    so the store can never fill the disk (a tmpfs went to 100% without a budget). It used to be "the store's bytes
    + half the free space", which grew at every restart of a full store and shrank with every copy set aside
    (issue 37 item 7). Returns (bytes, how it was computed)."""
    from spec_cache.store import default_budget

    return default_budget(path)


class TenantTurns:
    """One at a time per tenant (an ``anyio.Lock`` each, dropped once nobody waits on it): a tenant's requests
    take their turn in a queue all tenants share (the tokenizer's worker, the scheduler's cache calls), so one
    tenant's flood waits behind itself, never in front of another tenant (issue 37, third attacker pass)."""

    def __init__(self) -> None:
        self.locks: dict = {}  # tenant -> [anyio.Lock, users]

    @contextlib.asynccontextmanager
    async def turn(self, tenant):
        import anyio

        entry = self.locks.setdefault(tenant, [anyio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                self.locks.pop(tenant, None)

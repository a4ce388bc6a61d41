"""API keys and tenants.

With keys configured, every ``/v1`` request (and ``/metrics``) needs ``Authorization: Bearer KEY``; the key is
compared with every configured key in constant time (``hmac.compare_digest``, no early exit). Each key is its own
tenant: ``tenant_for`` returns a salt derived from the key (a hash, never the key itself), which the server passes
to ``SpecCache.namespace(..., tenant=...)``, so stored prefixes never cross keys. A request's ``cache_salt``
(as in vLLM) further splits its tenant's namespace.

Who may look at ``/metrics`` and ``/health``'s details (``viewer``): an operator key (``--operator-key-file``) sees
everything; an API key sees its own tenant's series (and ``/health``'s ``model``, never the server-wide counters,
which would show when another tenant decodes); nobody else sees more than ``/health``'s ``{"status": ...}``. With
no API key and no operator key configured the server is open: every caller is an operator (the default bind
address, 127.0.0.1, keeps that to this machine).

Keys come from files (``read_keys_file``) or the environment, never the command line: every local user reads any
process's command line in /proc/PID/cmdline (``serve`` refuses ``--api-key`` / ``--operator-key``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from spec_cache.apps.server.protocol import APIError

__all__ = ["Auth", "Viewer", "read_keys_file", "salted_tenant", "tenant_label"]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _match(keys: list[bytes], authorization: str | None) -> bytes | None:
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode("utf-8") if scheme.lower() == "bearer" else b""
    matched = None
    for key in keys:  # every key, whatever matched: the time does not say which one did
        if hmac.compare_digest(given, key):
            matched = key
    return matched if given else None


def tenant_label(tenant: str | None) -> str:
    """The ``tenant`` label of a key's tenant in ``/metrics``: 8 hex digits of its digest (never the key), or
    ``open`` without keys."""
    return "open" if tenant is None else tenant.split("|", 1)[0].removeprefix("key:")[:8]


@dataclass(frozen=True)
class Viewer:
    """Who asks for ``/metrics`` or ``/health``: an operator, a tenant (its label), or nobody known."""

    operator: bool = False
    tenant: str | None = None  # a tenant's label (``tenant_label``) when an API key was given

    @property
    def known(self) -> bool:
        return self.operator or self.tenant is not None


class Auth:
    """``check(authorization_header) -> tenant`` (None without keys); raises ``APIError(401)``.
    ``viewer(authorization_header) -> Viewer`` for the monitoring routes."""

    def __init__(self, keys: Iterable[str] = (), operator_keys: Iterable[str] = ()) -> None:
        self.keys = [key.encode("utf-8") for key in keys if key]
        self.operator_keys = [key.encode("utf-8") for key in operator_keys if key]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @property
    def open(self) -> bool:
        """No key of either kind: everyone is an operator."""
        return not self.keys and not self.operator_keys

    def check(self, authorization: str | None) -> str | None:
        if not self.keys:
            return None
        matched = _match(self.keys, authorization)
        if matched is None:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return "key:" + _digest(matched.decode("utf-8"))

    def viewer(self, authorization: str | None) -> Viewer:
        if self.open:
            return Viewer(operator=True)
        if self.operator_keys and _match(self.operator_keys, authorization) is not None:
            return Viewer(operator=True)
        if self.keys:
            matched = _match(self.keys, authorization)
            if matched is not None:
                return Viewer(tenant=tenant_label("key:" + _digest(matched.decode("utf-8"))))
        return Viewer()


def salted_tenant(tenant: str | None, cache_salt: str | None) -> str | None:
    """The namespace tenant for a key's tenant (or None) and a request's ``cache_salt`` (or None)."""
    if cache_salt is None:
        return tenant
    return f"{tenant or 'open'}|salt:{_digest(cache_salt)}"


def read_keys_file(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]

"""API keys and tenants.

With keys configured, every ``/v1`` request (and ``/metrics``) needs ``Authorization: Bearer KEY``; the key is
compared with every configured key in constant time (``hmac.compare_digest``, no early exit). Each key is its own
tenant: ``tenant_for`` returns a salt derived from the key (a hash, never the key itself), which the server passes
to ``SpecCache.namespace(..., tenant=...)``, so stored prefixes never cross keys. A request's ``cache_salt``
(as in vLLM) further splits its tenant's namespace.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Iterable

from .protocol import APIError

__all__ = ["Auth", "read_keys_file", "salted_tenant"]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class Auth:
    """``check(authorization_header) -> tenant`` (None without keys); raises ``APIError(401)``."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = [key.encode("utf-8") for key in keys if key]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str | None:
        if not self.keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode("utf-8") if scheme.lower() == "bearer" else b""
        matched = None
        for key in self.keys:  # every key, whatever matched: the time does not say which one did
            if hmac.compare_digest(given, key):
                matched = key
        if not given or matched is None:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return "key:" + _digest(matched.decode("utf-8"))


def salted_tenant(tenant: str | None, cache_salt: str | None) -> str | None:
    """The namespace tenant for a key's tenant (or None) and a request's ``cache_salt`` (or None)."""
    if cache_salt is None:
        return tenant
    return f"{tenant or 'open'}|salt:{_digest(cache_salt)}"


def read_keys_file(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]

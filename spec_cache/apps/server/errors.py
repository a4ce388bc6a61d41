"""The one place that turns a library error into the HTTP error a client sees (OpenAI and Anthropic routes alike).

The library raises by name (``spec_cache.errors``, the store's ``StoreError`` family, the cache controls'
``NotStored`` / ``PinQuotaExceeded`` / ``BadPrefixFile``); the scheduler (a request the engine refuses) and the
``/v1/cache/...`` routes pass what they catch to ``api_error``. Both servers answer the ``APIError`` it returns:
``/v1/chat/completions`` and ``/v1/completions`` as OpenAI's error JSON, ``/v1/messages`` as Anthropic's.

Statuses: bad input (``InvalidRequest``, the store's ``InvalidInput``) is 400; an unsupported model / drafter /
KV combination is 400 too (not 501: the OpenAI and Anthropic clients retry 5xx, and retrying cannot help);
no such stored prefix 404; a pin over quota 409; a store that fails 503 (retry later); a model that cannot be
loaded 500. ``RestoreRefused`` never reaches a client (the scheduler prefills cold, the cache counts a miss): if
it does, that is a bug, so 500.
"""

from __future__ import annotations

from spec_cache.apps.server.protocol import APIError
from spec_cache.errors import ModelLoadError, RestoreRefused, UnsupportedCombination
from spec_cache.store import InvalidInput, StoreError
from spec_cache.tiers.cache_controls import BadPrefixFile, NotStored, PinQuotaExceeded

__all__ = ["STATUSES", "api_error"]

# (class, HTTP status, error code, param, message prefix): the first class the error is an instance of wins
STATUSES: tuple[tuple[type[BaseException], int, str | None, str | None, str | None], ...] = (
    (NotStored, 404, "not_found", None, None),
    (PinQuotaExceeded, 409, "pin_quota_exceeded", None, None),
    (BadPrefixFile, 400, "invalid_prefix_file", "file", None),
    (InvalidInput, 400, None, None, None),  # InvalidRequest too (it is an InvalidInput)
    (UnsupportedCombination, 400, "unsupported_combination", None, None),
    (RestoreRefused, 500, "restore_refused", None, None),
    (ModelLoadError, 500, "model_error", None, None),
    (StoreError, 503, "cache_unavailable", None, "the cache failed"),
)


def api_error(exc: BaseException, *, context: str | None = None, fallback: int = 500) -> APIError:
    """The ``APIError`` a client gets for ``exc``: by ``STATUSES``, else ``fallback`` (an ``APIError`` passes
    through). ``context`` leads the message (``"<context>: <message>"``)."""
    if isinstance(exc, APIError):
        return exc
    status, code, param, prefix = fallback, None, None, None
    for cls, status_, code_, param_, prefix_ in STATUSES:
        if isinstance(exc, cls):
            status, code, param, prefix = status_, code_, param_, prefix_
            break
    message = str(exc) or type(exc).__name__
    for lead in (prefix, context):
        if lead:
            message = f"{lead}: {message}"
    return APIError(status, message, param=param, code=code)

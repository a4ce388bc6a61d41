"""Rate-limited logging for the server: one line per cause per interval, with a count of what was suppressed.

Why: an attack or a fault repeats the same error thousands of times a second (asyncio logs a traceback for every
failed ``accept()`` when descriptors run out; uvicorn logs every malformed request), which fills the disk and
hides everything else. A cause is the logger, the message's first line (its template, before arguments) and the
exception type. Records below WARNING pass untouched.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitFilter", "install"]

_MAX_CAUSES = 512  # beyond this many distinct causes in one interval, they share one budget


class RateLimitFilter(logging.Filter):
    """Passes the first record of each cause per ``interval_s`` (tracebacks included); counts the others and
    appends "[N more like this suppressed in the last Ts]" to the next record of that cause that passes."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._causes: dict[tuple, list] = {}  # cause -> [interval start, suppressed count, first line logged]
        self.suppressed = 0

    def _cause(self, record: logging.LogRecord) -> tuple:
        first = str(record.msg).split("\n", 1)[0][:120]
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        return record.name, first, exc

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "rate_limit_summary", False):
            return True
        cause = self._cause(record)
        now = time.monotonic()
        with self._lock:
            seen = self._causes.get(cause)
            if seen is None and len(self._causes) >= _MAX_CAUSES:
                self._causes = {key: value for key, value in self._causes.items()
                                if now - value[0] < self.interval_s}
                if len(self._causes) >= _MAX_CAUSES:
                    cause = ("*", "many distinct errors", None)
                    seen = self._causes.get(cause)
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                self.suppressed += 1
                return False
            suppressed = seen[1] if seen is not None else 0
            self._causes[cause] = [now, 0, None]
        try:
            text = record.getMessage().split("\n", 1)[0][:200]
        except Exception:  # a record whose arguments do not fit its format: logging reports that itself
            text = cause[1]
        with self._lock:
            if cause in self._causes:
                self._causes[cause][2] = text
        if suppressed:  # the suffix has no '%': safe whether or not the record has arguments
            record.msg = f"{record.msg} [{suppressed} more like this suppressed in the last {self.interval_s:g}s]"
        return True


    def flush(self) -> None:
        """Log one summary line per cause whose interval ended with records suppressed (so a storm that stops
        is still counted), and forget it."""
        now = time.monotonic()
        with self._lock:
            due = [(cause, seen[1], seen[2]) for cause, seen in self._causes.items()
                   if seen[1] and now - seen[0] >= self.interval_s]
            for cause, _, _ in due:
                del self._causes[cause]
        for (name, first, exc), count, text in due:
            logging.getLogger(name if name != "*" else "spec_cache.apps.server").warning(
                "%d more like this suppressed in the last %gs: %s%s", count, self.interval_s, text or first,
                f" ({exc})" if exc else "", extra={"rate_limit_summary": True})


def install(interval_s: float = 10.0) -> RateLimitFilter:
    """Put one ``RateLimitFilter`` on every handler of the root logger (the server's loggers, uvicorn's and
    asyncio's propagate there) and start a daemon thread that logs its summaries; returns it."""
    limiter = RateLimitFilter(interval_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limiter)

    def summaries() -> None:
        while True:
            time.sleep(interval_s / 2)
            limiter.flush()

    threading.Thread(target=summaries, name="spec-cache-log-summaries", daemon=True).start()
    return limiter

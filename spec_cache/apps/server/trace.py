"""``SPEC_CACHE_SCHED_TRACE``: an opt-in JSON-lines trace of the scheduler thread, for finding where a serving
burst spends its time (issue 27's 8-client turn-2 burst); off unless the variable names a path prefix.

One line per scheduler iteration that did something: ``t`` (seconds since the scheduler started), ``adm`` (jobs
admitted), ``adm_ms`` / ``step_ms`` / ``ck_ms`` (time admitting, in the engine step, queueing checkpoints), the
session before the step (``waiting``: rows queued or prefilling to join; ``active``: rows decoding), ``pend`` (jobs
not yet admitted), ``wq`` (write-behind bytes queued), ``ck_parts`` (where ``ck_ms`` went: ``SpecCache.save_seconds``);
and one ``first`` line per job's first token
(``queue_ms``, ``ttft_ms``, ``cached``, ``prompt``; ``http_ms``: from the HTTP request's start to its submit, where
a route set ``Job.received``; ``ttft_ms`` counts from the submit). The file is ``<prefix>.<pid>.jsonl``, buffered
and flushed every ``FLUSH_EVERY`` lines and at shutdown. /metrics keeps the aggregate stage histograms; this keeps
the order. The first line, ``began_unix`` (the wall clock at ``t`` 0), places the trace beside other clocks: the
files MLX's CUDA backend writes to its kernel cache as it compiles (``tools/diag/trace_summary.py --compiles``).
"""

from __future__ import annotations

import json
import os
import time

FLUSH_EVERY = 256


class SchedulerTrace:
    def __init__(self, prefix: str):
        self.path = f"{prefix}.{os.getpid()}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._lines: list[str] = []
        self.began = time.perf_counter()
        self._lines.append(json.dumps({"began_unix": round(time.time(), 6), "t": 0.0}, separators=(",", ":")))

    def record(self, **fields) -> None:
        fields["t"] = round(time.perf_counter() - self.began, 6)
        self._lines.append(json.dumps(fields, separators=(",", ":")))
        if len(self._lines) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines = []

    def close(self) -> None:
        self.flush()
        self._file.close()


def scheduler_trace() -> SchedulerTrace | None:
    """The trace ``SPEC_CACHE_SCHED_TRACE`` asks for, or None (the default)."""
    prefix = os.environ.get("SPEC_CACHE_SCHED_TRACE", "")
    return SchedulerTrace(prefix) if prefix else None

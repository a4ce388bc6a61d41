"""Per-layer times of multi-token forwards (a diagnostic, off by default): ``SPEC_CACHE_LAYER_TIMES=PATH``.

Why: on the H100 and the H200 one step of issue 35's agent workload (the sixth turn: both rows' prompt pieces
prefilled together once both held ~12k tokens) took 1.7-2.6 s where an 8B forward of its tokens takes ~0.2 s, with
the scheduler thread waiting in ``mx.eval``, in every run. Which of a JIT compile or graph build (the first layer
slow), an attention fallback or allocation churn (every layer slow) or queued work from before the step (the wait
before the first layer) it is shows only with the device synchronised layer by layer.

With the variable set, ``DecoderPort.run_layers`` evaluates the residual stream before the first layer (what was
queued before: ``queued_ms``) and after each layer, and appends one JSON line per forward of more than one token to
``PATH.<pid>.jsonl``: ``rows``, ``new`` tokens, ``keys`` (the first cache's offset after the forward), ``mask``
(``none``, ``causal`` or ``array``), ``queued_ms``, ``ms`` (per layer). The values computed are unchanged (an
evaluation only waits); the pipelining is lost, so figures taken with it on are not speed figures.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Sequence

import mlx.core as mx

__all__ = ["LayerClock", "clock"]

_LOCK = threading.Lock()


def _path() -> str | None:
    prefix = os.environ.get("SPEC_CACHE_LAYER_TIMES", "")
    return f"{prefix}.{os.getpid()}.jsonl" if prefix else None


def _offset(cache: Any) -> int | None:
    for name in ("_idx", "offset"):
        value = getattr(cache, name, None)
        if isinstance(value, int):
            return value
    return None


def _mask_kind(mask: Any) -> str:
    if mask is None:
        return "none"
    return mask if isinstance(mask, str) else "array"


class LayerClock:
    """Times one forward's layers (``lap`` after each); ``done`` writes the line."""

    def __init__(self, path: str, h: mx.array, caches: Sequence[Any], mask: Any) -> None:
        self.path, self.caches, self.mask = path, caches, mask
        self.rows, self.new = int(h.shape[0]), int(h.shape[1])
        t0 = time.perf_counter()
        mx.eval(h)
        self.last = time.perf_counter()
        self.queued_ms = (self.last - t0) * 1e3
        self.laps: list[float] = []

    def lap(self, h: mx.array) -> None:
        mx.eval(h)
        now = time.perf_counter()
        self.laps.append(round((now - self.last) * 1e3, 3))
        self.last = now

    def done(self) -> None:
        line = {"t": round(time.time(), 3), "rows": self.rows, "new": self.new,
                "keys": _offset(self.caches[0]) if self.caches else None, "mask": _mask_kind(self.mask),
                "queued_ms": round(self.queued_ms, 3), "ms": self.laps}
        try:
            with _LOCK, open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:  # a diagnostic never fails a forward
            pass


def clock(h: mx.array, caches: Sequence[Any], mask: Any) -> LayerClock | None:
    """A clock for this forward when the diagnostic is on and it runs more than one token a row; else None."""
    if h.ndim < 2 or h.shape[1] < 2:  # a decode round: no environment lookup on the hottest path
        return None
    path = _path()
    return None if path is None else LayerClock(path, h, caches, mask)

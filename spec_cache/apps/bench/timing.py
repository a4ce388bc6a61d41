"""The one timing helper every benchmark section uses."""

from __future__ import annotations

import statistics
import time


def median_time(fn, reps: int) -> float:
    """Median wall seconds of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

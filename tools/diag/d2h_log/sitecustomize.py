"""What a checkpoint's device-to-host copies cover, measured on the CPU (issue 35's GPU agent run: was the writer
behind because it copied whole rows, or because of how many rows it held?).

On the CPU the checkpoint copier is off (numpy views of unified memory), so the ranged-copy logic never runs. Put
this folder first on ``PYTHONPATH`` with ``SC_FAKE_D2H_LOG=<path>`` set, and every Python process that imports
spec-cache (a ``spec-cache serve`` started by ``tools/bench_serve.py``) gets a stand-in copier with the CUDA
copier's interface that copies with ``ctypes.memmove`` and appends one JSON line per copy to ``<path>.<pid>``:
``{"k": "full" | "range", "shape": [...], "start": N, "bytes": N}``. Example (serve alone, the agent workload)::

    SC_FAKE_D2H_LOG=/tmp/d2hlog PYTHONPATH=tools/diag/d2h_log .venv/bin/python tools/bench_serve.py \\
        --workload agent --sessions 2 --clients 2 --servers serve

Seen at 05b311c: 200 ranged copies, none from token 0 (tails only, as designed).
"""

import os

if os.environ.get("SC_FAKE_D2H_LOG"):
    import ctypes
    import json
    import sys
    import threading
    import time

    import numpy as np

    class _LoggingCopier:
        def __init__(self, path: str) -> None:
            self._file = open(path, "a", buffering=1)
            self._lock = threading.Lock()

        def _log(self, kind: str, shape, start: int, nbytes: int) -> None:
            with self._lock:
                self._file.write(json.dumps({"k": kind, "shape": list(shape), "start": start, "bytes": nbytes}) + "\n")

        def __call__(self, x):
            import mlx.core as mx

            from spec_cache.state.device_copy import host_view
            mx.eval(x)
            out = np.array(host_view(x), copy=True)
            self._log("full", out.shape, 0, out.nbytes)
            return out

        def copy_from(self, x, axis: int, start: int, stop: int | None = None):
            import mlx.core as mx

            from spec_cache.state.device_copy import _pointer, copy_token_range, host_view
            mx.eval(x)
            view = host_view(x)
            shape = list(view.shape)
            shape[axis] = shape[axis] if stop is None else stop
            out = np.empty(shape, view.dtype)
            n = copy_token_range(_pointer(out), _pointer(view), shape, view.itemsize, axis, start,
                                 lambda dst, src, k: ctypes.memmove(dst, src, k), src_length=view.shape[axis])
            self._log("range" if stop is None else "lent", tuple(shape), start, n)
            return out

    _copier: list = []

    def _device_to_host():
        if not _copier:
            _copier.append(_LoggingCopier(f"{os.environ['SC_FAKE_D2H_LOG']}.{os.getpid()}"))
        return _copier[0]

    def _patch() -> None:  # once spec_cache's cache_state is imported (after the model loads, before a checkpoint)
        for _ in range(6000):
            module = sys.modules.get("spec_cache.state.cache_state")
            if module is not None and hasattr(module, "_device_to_host"):
                module._device_to_host = _device_to_host
                return
            time.sleep(0.02)

    threading.Thread(target=_patch, name="d2h-log-patch", daemon=True).start()

"""On the lent GPU, before a serving run: the device-to-host copier's ranged copy (``DeviceToHost.copy_from``, what a
checkpoint uses to copy only the tokens the store lacks) gives the bytes of a whole copy from its start on (the
positions before it are left unwritten: the store never reads there). Exits 1 otherwise, so no figure is measured
on a store of wrong bytes; prints ``skipped`` where MLX has no CUDA copier (the CPU: numpy views, no ranged copy)."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from spec_cache.state import device_copy


def main() -> int:
    d2h = device_copy.device_to_host() if device_copy.is_gpu() else None
    if d2h is None:
        print("ranged device-to-host copy: skipped (no CUDA copier)")
        return 0
    for shape, start in (((1, 8, 1000, 128), 512), ((1, 8, 300, 64), 0), ((1, 2, 256, 16), 256)):
        x = (mx.random.normal(shape) * 100).astype(mx.bfloat16).view(mx.uint16)
        mx.eval(x)
        whole = d2h(x)
        part = d2h.copy_from(x, 2, start)
        if not np.array_equal(part[:, :, start:], whole[:, :, start:]):  # before start: unwritten (never read)
            print(f"ranged device-to-host copy: WRONG for {shape} from {start}")
            return 1
    print("ranged device-to-host copy: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks (same as ``spec-cache bench``): python tools/bench.py [--quick] [--json] [--plot ttft.png]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spec_cache.apps.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

"""``spec-cache serve`` vs ``mlx_lm.server`` (and our ``mlx-lm-server`` launcher) on a multi-turn chat workload.

    .venv/bin/python tools/bench_serve.py [--servers mlx-lm,serve,spec-cache] [--conversations 8] [--turns 4]
        [--clients 4] [--system-words 1500] [--user-words 150] [--max-tokens 24] [--paired] [--json OUT]

``tools/bench_mlx_lm_server.py`` with other defaults (the servers above, 4 turns); see that file for what is
measured: TTFT p50/p95 per turn, aggregate output tokens/s, the same after restarting each server, and whether
the greedy replies are identical between servers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mlx_lm_server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--turns", "4", *sys.argv[1:]], servers="mlx-lm,serve,spec-cache"))

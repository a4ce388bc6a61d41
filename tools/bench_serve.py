"""``spec-cache serve`` vs ``mlx_lm.server`` (and our ``mlx-lm-server`` launcher) on a multi-turn chat workload, or
on a coding-agent workload.

    .venv/bin/python tools/bench_serve.py [--workload chat] [--servers mlx-lm,serve,spec-cache] [--conversations 8]
        [--turns 4] [--clients 4] [--system-words 1500] [--user-words 150] [--max-tokens 24] [--paired] [--json OUT]
    .venv/bin/python tools/bench_serve.py --workload agent [--sessions 4] [--clients 4] [--turns 8]
        [--system-words 8000] [--tools 20] [--max-tokens 64] [--tool-result-words 300-1500] [--json OUT] ...

``--workload chat`` (the default) is ``tools/bench_mlx_lm_server.py`` with other defaults (the servers above, 4
turns); see that file for what is measured: TTFT p50/p95 per turn, aggregate output tokens/s, the same after
restarting each server, and whether the greedy replies are identical between servers. ``--workload agent`` is
``tools/bench_agent.py``: concurrent coding-agent sessions sharing one long system prompt of tool definitions,
serve driven through Anthropic's ``/v1/messages``, the others through ``/v1/chat/completions``, a restart after the
turns; its figures are named ``agent_*``. ``--workload agent --help`` lists its options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SERVERS = "mlx-lm,serve,spec-cache"


def workload(argv: list[str]) -> tuple[str, list[str]]:
    """``--workload`` and the rest of the command line (``--help`` goes on to the chosen workload's parser)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--workload", choices=("chat", "agent"), default="chat")
    known, rest = p.parse_known_args(argv)
    return known.workload, rest


def main(argv: list[str] | None = None) -> int:
    kind, rest = workload(sys.argv[1:] if argv is None else argv)
    if kind == "agent":
        import bench_agent

        return bench_agent.main(rest, servers=SERVERS)
    import bench_mlx_lm_server

    return bench_mlx_lm_server.main(["--turns", "4", *rest], servers=SERVERS)


if __name__ == "__main__":
    sys.exit(main())

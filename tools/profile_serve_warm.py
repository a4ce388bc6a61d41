"""Where a warm turn of ``spec-cache serve`` spends its time to the first token, stage by stage.

Why a separate tool: ``tools/bench_mlx_lm_server.py`` times requests from outside (TTFT) and reads the server's
coarse ``spec_cache_stage_seconds``; this one runs the same server in-process (uvicorn on 127.0.0.1 in a thread,
the model and options ``bench_mlx_lm_server.py`` gives ``serve``) with timers wrapped around the functions of the
request path, and prints, per warm turn (turn >= 2, one client), the milliseconds from the request's arrival:

    tokenize (template + ids), boundaries (the seam's prefix renders), lookup + take (memory tier), admit (row
    build), prefill (new tokens), checkpoint (boundary extract + save), first round, first SSE chunk at the client.

    .venv/bin/python tools/profile_serve_warm.py [--model DIR] [--conversations 4] [--turns 3]
        [--system-words 1500] [--user-words 150] [--max-tokens 24] [--pause 0] [--json OUT]

Medians over the warm turns; each column is the summed time inside that function during the request up to its
first token (nested calls are counted in both). Without ``--model`` the bench's tiny float32 llama is used.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

import bench_mlx_lm_server as bench  # noqa: E402

_now: dict = {"on": False, "acc": {}}


_MISSING: list[str] = []  # instrumented names the code no longer has (printed: the tool then needs updating)


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None:  # renamed by a refactor: time what is left rather than fail
        _MISSING.append(f"{owner.__name__}.{name}")
        return

    @functools.wraps(fn)
    def wrapper(*a, **k):
        if not _now["on"]:
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc = _now["acc"]
            acc[label] = acc.get(label, 0.0) + (time.perf_counter() - t)
            acc[label + " calls"] = acc.get(label + " calls", 0) + 1e-3  # printed x 1e3: the call count
    setattr(owner, name, wrapper)


def instrument() -> None:
    from spec_cache.apps.server import openai_routes, scheduler
    from spec_cache.decode import cached_session, engine, generator
    from spec_cache.rows import target
    from spec_cache.tiers import cache as cache_mod
    from spec_cache.tiers import memory_tier

    _timed(openai_routes._Prompts, "chat", "tokenize")
    _timed(openai_routes._Prompts, "boundaries", "boundaries")
    _timed(scheduler.Scheduler, "_submit", "submit")
    _timed(generator.Generator, "prepare", "prepare")
    _timed(memory_tier.MemoryTier, "lookup", "tier_lookup")
    _timed(memory_tier.MemoryTier, "take", "tier_take")
    _timed(engine.DecodeSession, "_admit", "admit")
    _timed(target.TargetRows, "from_row_caches", "row_build")
    _timed(target.TargetRows, "prefill", "prefill")
    _timed(target.TargetRows, "prepare_append", "append")
    _timed(target.TargetRows, "extract", "extract")
    _timed(cache_mod.SpecCache, "save", "save")
    _timed(scheduler.Scheduler, "_write_checkpoints", "write_ckpt")
    _timed(engine.DecodeSession, "_plain_round", "round")
    _timed(engine.DecodeSession, "_round", "round")
    _timed(cached_session.CachedSession, "_on_checkpoint", "on_checkpoint")

    original = scheduler.Scheduler._on_tokens

    def on_tokens(self, handle, tokens, *args, **kwargs):
        job = self._rows.get(getattr(handle, "row", handle))  # the scheduler's rows are keyed by the handle's row
        if _now["on"] and job is not None and job.phase_end is None and job.last_token_at is None:
            _now["first"] = dict(_now["acc"], first_token_at=time.perf_counter() - _now["t0"])
        return original(self, handle, tokens, *args, **kwargs)
    scheduler.Scheduler._on_tokens = on_tokens


def serve(model: str, store: str):
    import uvicorn

    from spec_cache.apps.server import cli
    from spec_cache.apps.server.app import create_app

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", model, "--model-id", bench.MODEL_NAME, "--cache", store,
                              "--log-level", "warning", "--cached-tokens-granularity", "1"])
    state = cli.build_state(args)
    port = bench.free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                          lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, port


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--user-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--pause", type=float, default=0.0, help="seconds between turns (the bench: 0)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="profile-serve-warm-"))
    model = args.model
    if model is None:
        from spec_cache.testing.tiny import write_tiny_target

        model = str(write_tiny_target(tmp / "tiny"))
    instrument()
    server, thread, port = serve(model, str(tmp / "store"))
    system = bench.words(args.system_words, 999)
    rows = []
    try:
        for conv in range(args.conversations):
            history = [{"role": "system", "content": system}]
            for turn in range(args.turns):
                history.append({"role": "user", "content": bench.words(args.user_words, conv * 10 + turn)})
                _now["acc"], _now["first"] = {}, {}
                _now["t0"] = time.perf_counter()
                _now["on"] = True
                got = bench.chat(port, history, args.max_tokens)
                _now["on"] = False
                history.append({"role": "assistant", "content": got.text})
                if turn >= 1:
                    rows.append({"ttft": got.ttft, "cached": got.cached, **_now.get("first", {})})
                time.sleep(args.pause)  # > 0: the write-behind of this turn's checkpoints is done before the next
    finally:
        server.should_exit = True
        thread.join(30)
    keys = sorted({k for r in rows for k in r if k != "cached"})
    medians = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in keys}
    cached = statistics.median(r["cached"] or 0 for r in rows)
    print(f"warm turns: {len(rows)}; medians in ms (cached tokens p50 {cached})")
    if _MISSING:
        print(f"  not timed (no longer in the code: update instrument()): {', '.join(_MISSING)}")
    for k in keys:
        print(f"  {k:22s} {medians[k]:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians_ms": medians, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

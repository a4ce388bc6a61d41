"""Write amplification of an agentic conversation: bytes the server writes to disk per byte of unique KV state.

A disk prompt cache that rewrites a conversation's whole prefix on every turn wears SSDs (40 GB per agentic session
was reported against one such cache). This section starts a real ``spec-cache serve`` process on a tiny float32
llama with ``--checkpoint-every`` on, plays one conversation of ``turns`` turns (each request resends the whole
history plus a new user message, as agents do), waits after each turn until every checkpoint is durable, and
counts what the server process wrote. Unique KV bytes = the final conversation's tokens x the KV bytes of one token
(layers x 2 x kv_heads x head_dim x 4); ``store_bytes`` is what the store holds at the end (its records' bytes: what
was written and not superseded; nothing is evicted here). Figure ``write_amplification`` = bytes written / unique
KV bytes (goal <= 1.2), with the bytes written per turn; ``overhead_bytes`` = bytes written - ``store_bytes``
(LMDB's copy-on-write b-tree, free-list and meta pages, continuation records, the server's log).

Bytes written = the process's ``wchar`` (``/proc/<pid>/io``: bytes its write/pwrite calls handed to the kernel; LMDB
writes every page with ``pwrite``, replies go out through ``send``, which is not counted). ``write_bytes`` (the
block-layer accounting, ``write_amplification_write_bytes``) is reported too but is not the figure: on kernels
with large page-cache folios (Linux 6.x ext4; the 6.18 VM this was measured on) a 4 KiB ``pwrite`` into a 2 MiB
folio is accounted as 2 MiB (200 random 4 KiB writes + fdatasync: ``wchar`` 0.8 MB, ``write_bytes`` 419 MB, the
device's own sector counter 0.86 MB), so it counts how many folios a commit touches, not bytes the disk takes.

``chunk_tokens`` creates the store with that chunk size first (None: the store's default, 256). ``whole_tails``
writes the pre-1.3 layout (every entry's whole tail, every chunk whole: ``store/spans.py``'s ``WRITE_SPANS`` off in
the server process), the "before" figure. Figures: ``write_amplification``, ``write_amplification_bytes_per_turn``
(mean bytes written per turn; the list is ``bytes_written_per_turn``), ``write_amplification_records`` (store
records / unique: what the format writes; the rest is LMDB's per-commit page cost, ~40-60 KiB a commit, which
matters only at tiny KV sizes). Linux only (``/proc``); the store lives in a temporary directory on the same disk as
``tempfile.gettempdir()``.

What the disk itself takes (``block_device``, ``--block-device NAME``): the sectors the block device ``NAME`` wrote
over the turns (``/sys/block/NAME/stat``), as ``write_amplification_device``; meaningful only on a device nothing
else writes to, e.g. a loop device with its own ext4 (``TMPDIR`` on it puts the store there). Measured so (20
turns, tiny model): the device wrote 1.12x the ``wchar`` bytes (ext4's journal for each commit's two
``fdatasync``s), and far less than ``write_bytes`` (5.3x ``wchar`` there; the same 200-random-4-KiB-writes test on
a file read through ``mmap`` first, as LMDB reads its map: ``write_bytes`` 198 MB, device 2.4 MB; without the
``mmap`` read, ``write_bytes`` 0.83 MB): ``write_bytes`` counts folios dirtied, not bytes the device wrote.

``python -m spec_cache.apps.bench.write_amp [--checkpoint-every N] [--kv-heads H --head-dim D] [--chunk-tokens C]
[--whole-tails] [--block-device NAME] [--json]`` prints the bytes written per turn and the figures (``--json``: the
whole result).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

OPERATOR_KEY = "bench-operator"
USER_WORDS = ["read", "the", "file", "and", "fix", "bug", "in", "parser", "then", "run", "tests", "again"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _written(pid: int) -> tuple[int, int]:
    """``(wchar, write_bytes)`` of process ``pid`` (see the module docstring for why both)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines() if ":" in line)
    try:
        return int(fields["wchar"]), int(fields["write_bytes"])
    except KeyError:
        raise RuntimeError(f"/proc/{pid}/io has no wchar/write_bytes") from None


def _device_written(name: str) -> int:
    """Bytes block device ``name`` wrote so far (sectors written x 512; ``/sys/block/<name>/stat``)."""
    os.sync()  # the journal's commits of what the server fdatasync'd, not left to the next turn
    try:
        return int(Path(f"/sys/block/{name}/stat").read_text().split()[6]) * 512
    except (OSError, IndexError, ValueError):
        raise RuntimeError(f"/sys/block/{name}/stat: not a block device this machine has") from None


def _call(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {OPERATOR_KEY}",
                                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_durable(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = _call(base + "/health")
        if (health.get("checkpoints_not_durable") == 0 and health.get("write_queue_pending") == 0
                and health.get("active_rows") == 0):
            return
        time.sleep(0.05)
    raise RuntimeError("checkpoints did not become durable in time")


_WHOLE_TAILS = ("import runpy, sys; import spec_cache.store.spans as s; s.WRITE_SPANS = False; "
                "sys.argv[0] = 'spec_cache.apps.server'; "
                "runpy.run_module('spec_cache.apps.server', run_name='__main__', alter_sys=True)")


def _start(model: Path, store: Path, port: int, checkpoint_every: int, log, whole_tails: bool = False
           ) -> subprocess.Popen:
    entry = ["-c", _WHOLE_TAILS] if whole_tails else ["-m", "spec_cache.apps.server"]
    args = [sys.executable, *entry, "--model", str(model), "--model-id", "tiny",
            "--cache", str(store), "--port", str(port),
            "--checkpoint-every", str(checkpoint_every), "--cached-tokens-granularity", "1", "--log-level", "warning"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("SPEC_CACHE_API_KEYS", "SPEC_CACHE_OPERATOR_KEYS"):
        env.pop(name, None)
    # keys come from the environment or files, never the command line (every local user reads it)
    env.update(SPEC_CACHE_API_KEY=OPERATOR_KEY, SPEC_CACHE_OPERATOR_KEY=OPERATOR_KEY)
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if _call(base + "/health", timeout=2).get("status") == "ok":
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def run(turns: int = 20, user_words: int = 120, reply_tokens: int = 32, checkpoint_every: int = 64,
        layers: int = 4, kv_heads: int = 2, head_dim: int = 64, chunk_tokens: int | None = None,
        whole_tails: bool = False, block_device: str | None = None, progress=None) -> dict:
    """Play one ``turns``-turn conversation against a real server; see the module docstring."""
    from spec_cache.testing.tiny import write_tiny_target

    work = Path(tempfile.mkdtemp(prefix="bench-write-amp-"))
    proc = None
    try:
        model = write_tiny_target(work / "model", seed=3, num_layers=layers, num_kv_heads=kv_heads,
                                  num_heads=kv_heads * 2, head_dim=head_dim, hidden_size=kv_heads * 2 * head_dim)
        config = json.loads((model / "config.json").read_text())
        token_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        from spec_cache.store import Store, maintenance

        if chunk_tokens is not None:
            Store.open(str(work / "store"), chunk_tokens=chunk_tokens).close()
        with open(work / "server.log", "wb") as log:
            proc = _start(model, work / "store", port, checkpoint_every, log, whole_tails)
            _wait_durable(base)
            start = _written(proc.pid)
            device_start = None if block_device is None else _device_written(block_device)
            messages = [{"role": "system", "content": " ".join(USER_WORDS[i % 12] for i in range(300))}]
            per_turn, accounted, prompt_tokens, cached = [], [], 0, []
            for turn in range(turns):
                words = " ".join(USER_WORDS[(turn * 7 + i) % 12] for i in range(user_words))
                messages.append({"role": "user", "content": f"turn {turn}: {words}"})
                before = _written(proc.pid)
                reply = _call(base + "/v1/chat/completions", {"model": "tiny", "messages": messages,
                                                               "max_tokens": reply_tokens, "temperature": 0})
                _wait_durable(base)
                after = _written(proc.pid)
                per_turn.append(after[0] - before[0])
                accounted.append(after[1] - before[1])
                usage = reply["usage"]
                prompt_tokens = usage["prompt_tokens"] + usage["completion_tokens"]
                cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
                if progress is not None:
                    progress(f"write_amp turn {turn + 1}/{turns}: {per_turn[-1] / 1024:.0f} KiB written")
            end = _written(proc.pid)
            device = None if block_device is None else _device_written(block_device) - device_start
            total, total_accounted = end[0] - start[0], end[1] - start[1]
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            proc = None
        with Store.open(str(work / "store")) as store:
            stored = maintenance.stats(store)
        unique = prompt_tokens * token_bytes
        return {"store_bytes": stored["bytes"], "store_entries": stored.get("entries"), "turns": turns,
                "chunk_tokens": stored["chunk_tokens"], "overhead_bytes": total - stored["bytes"],
                "final_tokens": prompt_tokens, "kv_bytes_per_token": token_bytes,
                "unique_kv_bytes": unique, "bytes_written": total, "bytes_written_per_turn": per_turn,
                "cached_tokens_per_turn": cached, "checkpoint_every": checkpoint_every,
                "write_bytes": total_accounted, "write_bytes_per_turn": accounted,
                "write_amplification_write_bytes": total_accounted / unique,
                "write_amplification_bytes_per_turn": total / turns,
                "write_amplification_records": stored["bytes"] / unique, "whole_tails": whole_tails,
                "write_amplification": total / unique,
                **({} if device is None else {"device_bytes": device, "block_device": block_device,
                                              "write_amplification_device": device / unique})}
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spec_cache.apps.bench.write_amp",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--whole-tails", action="store_true", help="the pre-1.3 layout (the 'before' figure)")
    parser.add_argument("--block-device", default=None, metavar="NAME",
                        help="also count what block device NAME wrote (one nothing else writes to: see the docstring)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    a = parser.parse_args(argv)
    r = run(turns=a.turns, checkpoint_every=a.checkpoint_every, kv_heads=a.kv_heads, head_dim=a.head_dim,
            chunk_tokens=a.chunk_tokens, whole_tails=a.whole_tails, block_device=a.block_device,
            progress=lambda line: print(line, file=sys.stderr))
    figures = {k: v for k, v in r.items() if k.startswith("write_amplification")}
    if a.json:
        print(json.dumps({"figures": figures, "details": r}, indent=2))
        return
    for turn, nbytes in enumerate(r["bytes_written_per_turn"], 1):
        print(f"turn {turn:2d}: {nbytes / 1024:8.0f} KiB written")
    print(f"{r['final_tokens']} tokens x {r['kv_bytes_per_token']} KV bytes = {r['unique_kv_bytes'] / 1e6:.1f} MB "
          f"unique; {r['bytes_written'] / 1e6:.1f} MB written ({r['store_bytes'] / 1e6:.1f} MB in records)")
    for k, v in figures.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()

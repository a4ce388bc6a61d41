"""What the server's ``--checkpoint-every N`` costs during generation, and what it saves a retry after a SIGKILL.

Runs the server's own ``Scheduler`` in process on a tiny float32 model (random weights, CPU or GPU), one greedy
request of ``--max-tokens`` at a time, each on a fresh store (an identical request on the same store would replay
the earlier one's record). For each N: the decode rate (generated tokens after the first / time from the first
token to the last, as a client streaming them sees it) and the checkpoints written; N values run interleaved
(repeat 1 of every N, then repeat 2, ...) so load drifting on a shared machine hits all of them alike; medians and
the spread (min..max) of ``--repeats`` runs. "0" is no mid-generation checkpoint at all (prompt and finish only).

What a retry saves follows from N: a request killed after k generated tokens has its last record at
``N * floor(k / N)`` (if the write-behind committed it: the test in ``tests/apps/test_checkpoint_every.py`` waits for
it), so the retry regenerates ``k mod N`` tokens (N/2 on average, N at most) instead of all k; printed in seconds at
the measured rate. Wall-clock rates on a loaded machine spread widely; the CPU time this process spent per
generated token (``time.process_time``, the write-behind thread's encoding and commits included) is the steadier
measure of what checkpoints add.

    python tools/bench_checkpoint_every.py --repeats 5 --max-tokens 1024 [--layers 30 --kv-heads 3] [--json]
    python tools/bench_checkpoint_every.py --repeats 5 --max-tokens 1 --prompt-tokens 4096 --drafter ngram
    python tools/bench_checkpoint_every.py --repeats 3 --max-tokens 1024 --every 4096,256 --kill-at 300,700
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_run(target: Path, store: Path, every: int, max_tokens: int, prompt: list[int], drafter=None) -> dict:
    from spec_cache.apps.server.scheduler import Job, Scheduler
    from spec_cache.decode.generator import Generator
    from spec_cache.rows.sampling import RowSampling
    from spec_cache.tiers.cache import SpecCache

    cache = SpecCache.open(store)
    generator = Generator.load(target, drafter, cache=cache)
    saves = []
    save = generator.save_checkpoint

    def counted(tokens, *args, **kwargs):
        saves.append(len(tokens))
        return save(tokens, *args, **kwargs)
    generator.save_checkpoint = counted
    sched = Scheduler(generator, max_rows=4, checkpoint_every=every or None, eos_token_ids=())
    sched.start()
    times: list[float] = []
    done = threading.Event()
    job = Job(prompt=prompt, max_tokens=max_tokens, sampling=RowSampling(), deliver=lambda e: deliver(e),
              stop_at_eos=False)

    def deliver(event):
        if event[0] == "tokens":
            times.extend([time.perf_counter()] * len(event[1]))
        if event[0] in ("done", "error"):
            done.set()
    cpu0 = time.process_time()
    try:
        job.arrived = time.perf_counter()
        sched.submit(job)
        if not done.wait(600):
            raise RuntimeError("the request did not finish")
    finally:
        sched.stop(30)
        cache.drain(60)
        cpu = time.process_time() - cpu0  # this process's CPU, writes included: other processes' load hardly moves it
        cache.close()
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return {"tokens": len(times), "decode_tok_s": rate, "checkpoints": len(saves), "ttft_s": times[0] - job.arrived,
            "cpu_ms_per_token": 1e3 * cpu / len(times)}


def _serve(target: Path, store: Path, every: int, log: Path):
    """``python -m spec_cache.apps.server`` on a free port (no API keys), ready; returns (process, url)."""
    import os
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEC_CACHE_API_KEY", "SPEC_CACHE_OPERATOR_KEY"))}
    proc = subprocess.Popen([sys.executable, "-m", "spec_cache.apps.server", "--model", str(target), "--model-id",
                             "tiny", "--cache", str(store), "--port", str(port), "--checkpoint-every", str(every),
                             "--cached-tokens-granularity", "1", "--log-level", "warning"],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not come up: {log.read_text()[-2000:]}")


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def kill_and_retry(target: Path, work: Path, every: int, max_tokens: int, kill_at: int, prompt: list[int]) -> dict:
    """A real ``spec-cache serve`` streams a greedy answer, is SIGKILLed right after ``kill_at`` streamed tokens (no
    wait for the write-behind), restarted on its store; the same request again: tokens replayed, and its time."""
    import signal

    import httpx

    store = work / f"kill-{every}-{kill_at}-{prompt[0]}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    proc, url = _serve(target, store, every, work / "kill.log")
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: {")
                if seen >= kill_at:
                    proc.send_signal(signal.SIGKILL)
                    break
    finally:
        proc.kill()
        proc.wait()
    proc, url = _serve(target, store, every, work / "kill.log")
    try:
        before = _metric(url, "spec_cache_replayed_tokens")
        began = time.perf_counter()
        reply = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
        retry_s = time.perf_counter() - began
        replayed = _metric(url, "spec_cache_replayed_tokens") - before
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"every": every, "killed_at": kill_at, "replayed": int(replayed), "retry_s": round(retry_s, 3),
            "tokens": reply["usage"]["completion_tokens"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", default="4096,512,256,128,64,0", help="N values, comma separated (0: none)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2, help="tiny model layers (30 with --kv-heads 3: SmolLM2-135M's KV "
                                                         "bytes per token, in float32)")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=7,
                   help="prompt length; with --max-tokens 1 this measures the prefill (time to first token): the "
                        "option also splits a prompt of more than N tokens (phases with a drafter, chunk "
                        "checkpoints without)")
    p.add_argument("--drafter", choices=["none", "ngram"], default="none")
    p.add_argument("--kill-at", default="",
                   help="instead: SIGKILL a real server after these many streamed tokens (comma separated), restart "
                        "it, retry the request; prints the tokens the retry replayed and its time, per N")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    import os

    from spec_cache.testing.tiny import write_tiny_target

    values = [int(v) for v in a.every.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-every-"))
    os.environ.setdefault("SPEC_CACHE_IDENTITY_DIR", str(work / "memo"))
    heads = max(2, a.kv_heads)
    target = write_tiny_target(work / "model", seed=7, num_layers=a.layers, num_kv_heads=a.kv_heads,
                               num_heads=heads, hidden_size=64 * heads, vocab_size=256)
    if a.kill_at:
        rows = []
        for r in range(a.repeats):
            for k in (int(x) for x in a.kill_at.split(",")):
                for v in values:
                    rows.append(kill_and_retry(target, work, v, a.max_tokens, k, [5 + r, 6, 7, 8, 9, 10, 11]))
        table = []
        for v in values:
            for k in sorted({x["killed_at"] for x in rows}):
                mine = [x for x in rows if x["every"] == v and x["killed_at"] == k]
                table.append({"every": v, "killed_at": k,
                              "median_replayed": statistics.median(x["replayed"] for x in mine),
                              "median_retry_s": round(statistics.median(x["retry_s"] for x in mine), 3)})
        print(json.dumps({"max_tokens": a.max_tokens, "repeats": a.repeats, "layers": a.layers, "runs": rows,
                          "results": table}, indent=1) if a.json else "\n".join(
            f"N={t['every']:>5} killed after {t['killed_at']:>4}: replayed {t['median_replayed']:>6}, retry "
            f"{t['median_retry_s']} s" for t in table))
        return 0
    runs: dict[int, list[dict]] = {v: [] for v in values}
    one_run(target, work / "warm", 0, 64, [3, 4, 5], None if a.drafter == "none" else a.drafter)  # warm up
    for r in range(a.repeats):
        for v in values:
            prompt = [5 + r] + [(7 * i) % 250 + 3 for i in range(a.prompt_tokens - 1)]
            runs[v].append(one_run(target, work / f"store-{v}-{r}", v, a.max_tokens, prompt,
                                   None if a.drafter == "none" else a.drafter))
    ref = 0 if 0 in values else max(values)  # no mid-generation checkpoint, else the rarest
    base = statistics.median(x["decode_tok_s"] for x in runs[ref])
    base_cpu = statistics.median(x["cpu_ms_per_token"] for x in runs[ref])
    table = []
    for v in values:
        rates = [x["decode_tok_s"] for x in runs[v]]
        med = statistics.median(rates)
        cpu = [x["cpu_ms_per_token"] for x in runs[v]]
        ttft = statistics.median(x["ttft_s"] for x in runs[v])
        table.append({"every": v, "median_ttft_s": round(ttft, 3), "median_tok_s": round(med, 1),
                      "min_tok_s": round(min(rates), 1),
                      "max_tok_s": round(max(rates), 1), "vs_none": round(med / base, 3),
                      "checkpoints": runs[v][0]["checkpoints"],
                      "median_cpu_ms_per_token": round(statistics.median(cpu), 3),
                      "cpu_vs_none": round(statistics.median(cpu) / base_cpu, 3),
                      "retry_regenerates_at_most_s": round((v or a.max_tokens) / med, 3)})
    kv_bytes = a.layers * a.kv_heads * 64 * 4 * 2
    out = {"max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens, "drafter": a.drafter, "repeats": a.repeats,
           "layers": a.layers, "kv_heads": a.kv_heads,
           "kv_bytes_per_token": kv_bytes, "results": table}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"tiny model: {a.layers} layers x {a.kv_heads} KV heads x 64, float32 ({kv_bytes} KV bytes/token); "
              f"{a.prompt_tokens}-token prompt, {a.max_tokens} tokens greedy, drafter {a.drafter}, {a.repeats} repeats")
        print(f"{'N':>6} {'median tok/s':>13} {'min..max':>17} {'vs N=' + str(ref):>13} {'ckpts':>6} "
              f"{'retry redo <= s':>16} {'CPU ms/token':>13} {'CPU vs N=' + str(ref):>12} {'TTFT s':>8}")
        for row in table:
            print(f"{row['every']:>6} {row['median_tok_s']:>13} {row['min_tok_s']:>8}..{row['max_tok_s']:<8} "
                  f"{row['vs_none']:>13} {row['checkpoints']:>6} {row['retry_regenerates_at_most_s']:>16} "
                  f"{row['median_cpu_ms_per_token']:>13} {row['cpu_vs_none']:>12} {row['median_ttft_s']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

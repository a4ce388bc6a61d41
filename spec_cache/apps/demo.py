"""``spec-cache demo``: the README's main job, on tiny local models (random weights, no downloads).

It builds a tiny llama target and a drafter, then runs a batch of multi-turn conversations three times:
cold without a cache (the baseline), once through the cache (turn 2 already resumes from turn 1's finish
checkpoint), and again with the store reopened (every prompt resumes). It prints, per request, the prompt
length, the tokens restored, TTFT cold vs warm, drafted/accepted counts, and whether the tokens are identical
to the cold run, a legend of those columns, TTFT per batch and tokens/s per run, the store's summary and how to
inspect it. A progress line per step goes to stderr. The work directory (tiny models, and the store unless
``--cache`` names one) is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np

TURNS = 2
CONVERSATIONS = 4


def _conversations(vocab: int, seed: int = 7) -> list[list[list[int]]]:
    """Per conversation, the user messages of each turn (token ids); a shared system prompt comes first."""
    rng = np.random.default_rng(seed)
    system = rng.integers(4, vocab, 600).tolist()
    return [[system + rng.integers(4, vocab, 40 + 25 * c).tolist()] +
            [rng.integers(4, vocab, 24).tolist() for _ in range(TURNS - 1)] for c in range(CONVERSATIONS)]


def _progress(message: str) -> None:
    """One progress line on stderr (the table and summary go to stdout)."""
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def _run(generator, conversations, max_tokens, label: str):
    """All conversations as one batch per turn; a turn's prompt is the whole history plus the new message.
    Returns the rows, each turn's batch TTFT (until every row of it had its first token) and the wall time."""
    histories = [[] for _ in conversations]
    out, batch_ttft, started = [], [], time.perf_counter()
    for turn in range(TURNS):
        _progress(f"{label}: turn {turn + 1}/{TURNS}, {len(conversations)} conversations in one batch ...")
        step = time.perf_counter()
        prompts = [h + conv[turn] for h, conv in zip(histories, conversations)]
        results = generator.generate(prompts, max_tokens=max_tokens)
        batch_ttft.append(max(r.ttft_s for r in results))
        for c, (p, r) in enumerate(zip(prompts, results)):
            out.append((f"conv {c} turn {turn + 1}", p, r))
            histories[c] = p + r.tokens
        _progress(f"{label}: turn {turn + 1}/{TURNS} done in {time.perf_counter() - step:.1f} s, "
                  f"{sum(r.cached_tokens for r in results)} prompt tokens from the cache")
    return out, batch_ttft, time.perf_counter() - started


LEGEND = """\
REQUEST      conversation and turn (turn 2's prompt is turn 1's prompt + its reply + a new message)
PROMPT       prompt tokens
CACHED 1ST   tokens restored on the first visit (turn 2 resumes from turn 1's finish checkpoint)
CACHED 2ND   tokens restored after the store was reopened (what a restarted engine sees)
TTFT ... MS  time to this request's first token, lookups and restores included; the rows of one turn run as
             one batch and share its prefill, so per-row figures overlap (the summary adds batches, not rows)
DRAFTED/ACC  draft tokens proposed / accepted on the warm run
SAME TOKENS  the three runs emitted identical tokens (greedy, float32)"""


def main(args) -> int:
    method = getattr(args, "method", None) or "assistant"
    max_tokens = getattr(args, "max_tokens", None) or 24
    keep = bool(getattr(args, "keep", False))
    cache_given = bool(getattr(args, "cache_given", False))
    work = tempfile.mkdtemp(prefix="spec-cache-demo-")
    cache_dir = args.cache if cache_given else os.path.join(work, "store")
    # the identity memo of the demo's temporary models lives and dies with them (not in ~/.cache), unless the user
    # named a memo directory
    memo_given = "SPEC_CACHE_IDENTITY_DIR" in os.environ
    if not memo_given:
        os.environ["SPEC_CACHE_IDENTITY_DIR"] = os.path.join(work, "identity")
    try:
        return _main(args, method, max_tokens, work, cache_dir)
    finally:
        if not memo_given:
            os.environ.pop("SPEC_CACHE_IDENTITY_DIR", None)
        if keep:
            print(f"kept the work directory {work} (tiny models{'' if cache_given else ' and the store'})")
        else:
            shutil.rmtree(work, ignore_errors=True)
        if keep or cache_given:
            print(f"inspect the store: spec-cache --cache {cache_dir} ls   (then: show NS, stats, verify)")
        else:
            print("the store was in a temporary directory, now removed: run with --cache DIR (or --keep) and then "
                  "'spec-cache --cache DIR ls' to inspect it")


def _main(args, method: str, max_tokens: int, work: str, cache_dir: str) -> int:
    from spec_cache.apps.tables import human_bytes, table
    from spec_cache.decode.generator import Generator
    from spec_cache.store import maintenance
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
    from spec_cache.tiers.cache import SpecCache

    t0 = time.perf_counter()
    _progress("building a tiny target and drafter (random weights) ...")
    target_dir = write_tiny_target(os.path.join(work, "target"), hidden_size=256, num_layers=4, num_heads=4,
                                   num_kv_heads=2, intermediate_size=512, vocab_size=512, seed=0)
    drafter_dir = write_tiny_drafter(os.path.join(work, method), method, target_dir, seed=1)
    conversations = _conversations(vocab=512)
    print(f"tiny llama target (hidden 256, 4 layers, float32) and drafter '{method}'")
    print(f"store: {cache_dir}\n")

    cold = _run(Generator.load(target_dir, drafter_dir, method=method), conversations, max_tokens,
                "1/3 cold, no cache")
    memory = {} if getattr(args, "memory_bytes", None) is None else {"memory_bytes": args.memory_bytes}
    with SpecCache.open(cache_dir, **memory) as cache:
        first = _run(Generator.load(target_dir, drafter_dir, method=method, cache=cache), conversations, max_tokens,
                     "2/3 first visit, through the cache")
    with SpecCache.open(cache_dir, **memory) as cache:  # reopened: what a restarted engine sees
        generator = Generator.load(target_dir, drafter_dir, method=method, cache=cache)
        warm = _run(generator, conversations, max_tokens, "3/3 warm, store reopened")
        _progress("verifying the store ...")
        cache.store.flush()  # the hit/miss counters are batched: written now, so the summary counts this run's
        stats = maintenance.stats(cache.store)
        verify = maintenance.verify(cache.store).as_dict()
        print(f"target identity   {generator.target_identity}")
        print(f"prefix namespace  {generator.prefix_namespace}\n")

    rows, identical = [], True
    for (name, prompt, c), (_, _, f), (_, _, w) in zip(cold[0], first[0], warm[0]):
        same = c.tokens == f.tokens == w.tokens
        identical &= same
        rows.append([name, len(prompt), f.cached_tokens, w.cached_tokens, f"{c.ttft_s * 1e3:.0f}",
                     f"{f.ttft_s * 1e3:.0f}", f"{w.ttft_s * 1e3:.0f}", f"{w.drafted}/{w.accepted}",
                     "yes" if same else "NO"])
    print(table(rows, ["REQUEST", "PROMPT", "CACHED 1ST", "CACHED 2ND", "TTFT COLD MS", "TTFT 1ST MS",
                       "TTFT 2ND MS", "DRAFTED/ACC", "SAME TOKENS"]))
    print("\n" + LEGEND + "\n")
    cold_ttft, warm_ttft = sum(cold[1]), sum(warm[1])
    print(f"TTFT per batch, summed over the {TURNS} turns (one batch of {CONVERSATIONS} requests each): "
          f"cold {cold_ttft * 1e3:.0f} ms, warm {warm_ttft * 1e3:.0f} ms ({cold_ttft / max(warm_ttft, 1e-9):.1f}x)")
    for label, (runs, _, seconds) in (("cold", cold), ("first visit", first), ("warm", warm)):
        generated = sum(len(r.tokens) for _, _, r in runs)
        print(f"  {label:<12} {generated} tokens in {seconds:.2f} s: {generated / max(seconds, 1e-9):.1f} tok/s "
              "(prefill included)")
    print(f"tokens identical to the cold run: {'yes' if identical else 'NO'}")
    print(f"store: {stats['entries']} entries, {stats['chunks']} shared chunks of {stats['chunk_tokens']} tokens, "
          f"{stats['drafter_parts']} drafter parts, {human_bytes(stats['bytes'])}; hits {stats['hits']}, misses "
          f"{stats['misses']}; verify: {verify['ok']}/{verify['records']} records ok")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if identical else 1

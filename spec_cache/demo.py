"""``spec-cache demo``: the README's main job, on tiny local models (random weights, no downloads).

It builds a tiny llama target and a drafter, then runs a batch of multi-turn conversations three times:
cold without a cache (the baseline), once through the cache (turn 2 already resumes from turn 1's finish
checkpoint), and again with the store reopened (every prompt resumes). It prints, per request, the prompt
length, the tokens restored, TTFT cold vs warm, drafted/accepted counts, and whether the tokens are identical
to the cold run, followed by the store's summary.
"""

from __future__ import annotations

import os
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


def _run(generator, conversations, max_tokens):
    """All conversations as one batch per turn; a turn's prompt is the whole history plus the new message."""
    histories = [[] for _ in conversations]
    out = []
    for turn in range(TURNS):
        prompts = [h + conv[turn] for h, conv in zip(histories, conversations)]
        results = generator.generate(prompts, max_tokens=max_tokens)
        for c, (p, r) in enumerate(zip(prompts, results)):
            out.append((f"conv {c} turn {turn + 1}", p, r))
            histories[c] = p + r.tokens
    return out


def main(args) -> int:
    from spec_cache.cache import SpecCache
    from spec_cache.cli import human_bytes, table
    from spec_cache.generator import Generator
    from spec_cache.store import maintenance
    from spec_cache.tiny import write_tiny_drafter, write_tiny_target

    method = getattr(args, "method", None) or "assistant"
    max_tokens = getattr(args, "max_tokens", None) or 24
    work = tempfile.mkdtemp(prefix="spec-cache-demo-")
    cache_dir = args.cache if getattr(args, "cache_given", False) else os.path.join(work, "store")
    t0 = time.perf_counter()
    target_dir = write_tiny_target(os.path.join(work, "target"), hidden_size=256, num_layers=4, num_heads=4,
                                   num_kv_heads=2, intermediate_size=512, vocab_size=512, seed=0)
    drafter_dir = write_tiny_drafter(os.path.join(work, method), method, target_dir, seed=1)
    conversations = _conversations(vocab=512)
    print(f"tiny llama target (hidden 256, 4 layers, float32) and drafter '{method}' in {work}")
    print(f"store: {cache_dir}\n")

    cold = _run(Generator.load(target_dir, drafter_dir, method=method), conversations, max_tokens)
    memory = {} if getattr(args, "memory_bytes", None) is None else {"memory_bytes": args.memory_bytes}
    with SpecCache.open(cache_dir, **memory) as cache:
        first = _run(Generator.load(target_dir, drafter_dir, method=method, cache=cache), conversations, max_tokens)
    with SpecCache.open(cache_dir, **memory) as cache:  # reopened: what a restarted engine sees
        generator = Generator.load(target_dir, drafter_dir, method=method, cache=cache)
        warm = _run(generator, conversations, max_tokens)
        stats = maintenance.stats(cache.store)
        verify = maintenance.verify(cache.store).as_dict()
        print(f"target identity   {generator.target_identity}")
        print(f"prefix namespace  {generator.prefix_namespace}\n")

    rows, identical = [], True
    for (name, prompt, c), (_, _, f), (_, _, w) in zip(cold, first, warm):
        same = c.tokens == f.tokens == w.tokens
        identical &= same
        rows.append([name, len(prompt), f.cached_tokens, w.cached_tokens, f"{c.ttft_s * 1e3:.0f}",
                     f"{f.ttft_s * 1e3:.0f}", f"{w.ttft_s * 1e3:.0f}", f"{w.drafted}/{w.accepted}",
                     "yes" if same else "NO"])
    print(table(rows, ["REQUEST", "PROMPT", "CACHED 1ST", "CACHED 2ND", "TTFT COLD MS", "TTFT 1ST MS",
                       "TTFT 2ND MS", "DRAFTED/ACC", "SAME TOKENS"]))
    cold_ttft = sum(c.ttft_s for _, _, c in cold)
    warm_ttft = sum(w.ttft_s for _, _, w in warm)
    print(f"\nTTFT summed over requests: cold {cold_ttft * 1e3:.0f} ms, warm {warm_ttft * 1e3:.0f} ms "
          f"({cold_ttft / max(warm_ttft, 1e-9):.1f}x); tokens identical to the cold run: {'yes' if identical else 'NO'}")
    print(f"store: {stats['entries']} entries, {stats['chunks']} shared chunks of {stats['chunk_tokens']} tokens, "
          f"{stats['drafter_parts']} drafter parts, {human_bytes(stats['bytes'])}; hits {stats['hits']}, misses "
          f"{stats['misses']}; verify: {verify['ok']}/{verify['records']} records ok")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if identical else 1

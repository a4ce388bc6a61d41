"""Batched speculative decoding: a batch of 4 rows vs the same 4 requests one after another, and decode speed of
restored rows vs cold rows (after the first token: restoring must not slow decoding down)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np


def run(*, hidden: int = 512, layers: int = 4, vocab: int = 4096, prompt_tokens: int = 128, new_tokens: int = 48,
        reps: int = 3) -> dict:
    from spec_cache.decode.generator import Generator
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
    from spec_cache.tiers.cache import SpecCache

    work = tempfile.mkdtemp(prefix="bench-batch-")
    target = write_tiny_target(os.path.join(work, "target"), hidden_size=hidden, num_layers=layers,
                               num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
                               intermediate_size=hidden * 2, vocab_size=vocab, tokenizer=False)
    drafter = write_tiny_drafter(os.path.join(work, "assistant"), "assistant", target, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, prompt_tokens + 8 * i).tolist() for i in range(4)]
    gen = Generator.load(target, drafter)
    gen.generate([prompts[0][:8]], max_tokens=2)

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    batch_s, seq_s = [], []
    for _ in range(reps):
        t, batch = timed(lambda: gen.generate(prompts, max_tokens=new_tokens))
        batch_s.append(t)
        t, seq = timed(lambda: [gen.generate([p], max_tokens=new_tokens)[0] for p in prompts])
        seq_s.append(t)
        if [r.tokens for r in batch] != [r.tokens for r in seq]:
            raise AssertionError("batched and one-by-one decoding disagree")
    tokens = sum(len(r.tokens) for r in batch)
    out = {"rows": 4, "new_tokens": new_tokens, "batch_tok_s": tokens / statistics.median(batch_s),
           "sequential_tok_s": tokens / statistics.median(seq_s)}
    out["spec_batch_speedup"] = out["batch_tok_s"] / out["sequential_tok_s"]

    # decode speed after the first token, cold rows vs restored rows (one row at a time)
    store_dir = os.path.join(work, "store")
    cold_rates, warm_rates = [], []
    with SpecCache.open(store_dir) as cache:
        cached = Generator.load(target, drafter, cache=cache)
        cached.generate(prompts, max_tokens=2)
        for p in prompts:
            for _ in range(reps):
                t, (c,) = timed(lambda: gen.generate([p], max_tokens=new_tokens))
                cold_rates.append((len(c.tokens) - 1) / (t - c.ttft_s))
                t, (w,) = timed(lambda: cached.generate([p], max_tokens=new_tokens))
                if w.cached_tokens == 0 or w.tokens != c.tokens:
                    raise AssertionError("restored row did not restore or changed the tokens")
                warm_rates.append((len(w.tokens) - 1) / (t - w.ttft_s))
    out["cold_decode_tok_s"] = statistics.median(cold_rates)
    out["restored_decode_tok_s"] = statistics.median(warm_rates)
    out["restored_vs_cold_decode"] = out["restored_decode_tok_s"] / out["cold_decode_tok_s"]
    return out

"""Compile the GPU kernels an engine will need before it takes requests.

MLX's CUDA backend compiles kernels with NVRTC the first time a new kernel configuration runs (a new token-count
class of a quantized matmul, a new attention shape). Measured on the lent H200 (MLX 0.32.4, SmolLM2-135M 4-bit,
``tools/device/shape_compile.py``): after forwards of 1-16 and 64 tokens had run, the first forward of 23 tokens
took 36.5 s, the next 8.6 ms; other new lengths cost 5-76 ms once. MLX keeps compiled kernels on disk
(``$TMPDIR/mlx/<version>/ptx``, or ``MLX_PTX_CACHE_DIR``), so a machine pays each once, but without a warm-up that
once falls on a request: a 36 s first token in a server, or an adaptive-depth probe that makes a drafted run 30x
slower than plain decoding in a benchmark.

:func:`warm_up` runs the engine itself (so its batched masks, verify windows and drafter forwards are the ones
compiled) on throwaway requests: prompts whose lengths cover the token-count classes up to the prefill step, each
draft depth from 1 to the engine's, batches of 1 to 8 rows, rows leaving a batch one at a time over prompts
longer than a prefill chunk, and rows joining a batch that decodes over such a prompt; on a GPU also the
target's attention alone at key lengths up to 32k (:func:`warm_attention`), which short prompts never reach. It
writes nothing to any cache (no checkpoint hook) and uses its own engine objects (the adaptive controller's
measurements stay clean). Tokens are a fixed repeating pattern, so a prompt-lookup drafter drafts. ``spec-cache
serve --warmup auto`` (the default) runs it before the server reports ready when MLX's default device is a GPU; on
the CPU backend there is nothing to compile and it is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: token counts whose forwards are compiled: every small count (decode, verify windows) and the edges of the
#: classes a matmul may switch kernels at, up to the prefill step
BASE_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 23, 24, 32, 33, 48, 64, 65, 96, 128, 129, 192, 256, 257, 384,
                512, 513, 1024, 2048)
#: row counts of the batched decode runs: every count, since a row leaving a batch of 4 makes one of 3 (issue 35's
#: H100 trace: the first steps after a row left took 162-726 ms, later ones 31-77, a steady one 19.6; (1, 2, 4, 8)
#: warmed before)
BATCHES = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass
class WarmupReport:
    """What :func:`warm_up` ran: ``runs`` engine runs in ``seconds``; ``slowest`` the (label, seconds) of the run
    that compiled the most."""

    runs: int = 0
    seconds: float = 0.0
    slowest: tuple[str, float] = ("", 0.0)
    timings: list[tuple[str, float]] = field(default_factory=list)


#: key lengths at which :func:`warm_attention` runs the target's attention once per route (capped by the model's
#: context): the agent workload's prompts reach ~17k tokens, and its first step with two rows over ~12k keys took
#: 1.7 s of prefill on the H200 at every run (issue 35), where a plan or kernel met for the first time is suspected
LONG_KEYS = (4096, 8192, 12288, 16384, 24576, 32768)
#: the array-masked (two padded rows) cases stop here: MLX's CUDA backend widens the mask to a [2, heads, chunk,
#: keys] bias, ~1.3 GB at 601 x 16384 for 32 heads
ARRAY_MAX_KEYS = 16384


def warm_attention(target, step: int, *, max_keys: int | None = None, keys: Sequence[int] = LONG_KEYS,
                   progress: Callable[[str], None] | None = None) -> list[tuple[str, float]]:
    """Run the target's attention alone, as its prefill chunks call it, at long key lengths: one row with the
    ``"causal"`` mode (an unpadded batch, ``DecoderPort._masks``) and two left-padded rows with the batch cache's
    array mask, for a short chunk, an odd one and a full ``step``; keys sliced from a 256-step buffer as a batch
    cache hands them over. A short engine warm-up never reaches these key lengths, so whatever MLX's CUDA backend
    builds or compiles for them the first time (a cuDNN plan, a kernel) fell on a request. Returns (label, seconds)
    per call; nothing is kept."""
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    layer = next((i for i in range(target.num_layers) if target.layer_kind(i) == "attention"
                  and target.layer_window(i) is None), None)
    if layer is None:
        return []
    kv_heads, dim = target.kv_geometry(layer)
    attention = target._layers[layer].self_attn
    heads = int(getattr(attention, "n_heads", None) or getattr(attention, "num_attention_heads", 0) or kv_heads)
    dtype = target.dtype
    limit = max_keys or int(target.config.get("max_position_embeddings") or max(keys))
    out = []
    for total in [k for k in keys if k <= limit]:
        for chunk in sorted({65, 601, step}):
            if chunk >= total:
                continue
            for rows in (1, 2):
                if rows == 2 and (total > ARRAY_MAX_KEYS or chunk > 1024):
                    continue
                pad = 600 if rows == 2 else 0
                width = -(-(total + pad) // 256) * 256
                q = mx.zeros((rows, heads, chunk, dim), dtype=dtype)
                k = mx.zeros((rows, kv_heads, width, dim), dtype=dtype)[..., : total + pad, :]
                mask = "causal" if rows == 1 else create_causal_mask(
                    chunk, offset=total + pad - chunk, left_padding=mx.array([pad, 0]))
                started = time.perf_counter()
                mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=dim ** -0.5, mask=mask))
                took = time.perf_counter() - started
                label = f"attention {rows}x{chunk} over {total} keys"
                out.append((label, took))
                if progress is not None:
                    progress(f"warm-up {label}: {took * 1000:.0f} ms")
    return out


def wanted(engine) -> bool:
    """Whether a warm-up pays on this machine: MLX's default device is a GPU (kernels are compiled there)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def _joining(engine, long: int, vocab: int, rows: int) -> None:
    """One row decodes over ``long`` + 1 tokens; a longer row joins it chunk by chunk, then short rows join whole
    (the batch's caches merged, each new batch size's rounds over a long context, rows leaving one by one): issue
    35's H100 chat run met kernels here first, in rounds of 226-978 ms right after rows joined or left, where a
    round takes ~20 ms. Nothing is written (no checkpoint hook)."""
    from spec_cache.decode.engine import RowRequest

    session = engine.session()
    try:
        session.submit(RowRequest(_pattern(long + 1, vocab), max_tokens=8, stop_at_eos=False))
        session.step()
        session.submit(RowRequest(_pattern(long + 40, vocab), max_tokens=3, stop_at_eos=False))
        session.step()
        for r in range(rows - 2):
            session.submit(RowRequest(_pattern(24 + r, vocab), max_tokens=2, stop_at_eos=False))
        for _ in range(64):  # bounded: a few prefill chunks and at most 8 rounds
            if not session.step():
                break
    finally:
        session.close()


def _pattern(length: int, vocab: int) -> list[int]:
    """``length`` tokens repeating a 7-token cycle of ids well inside the vocabulary (ngram drafts on repeats)."""
    span = max(2, min(vocab - 1, 1000))
    return [1 + (i % 7) * 13 % span for i in range(length)]


def warm_up(engine, *, lengths: Sequence[int] | None = None, batches: Sequence[int] = BATCHES,
            progress: Callable[[str], None] | None = None) -> WarmupReport:
    """Run ``engine`` (a ``SpeculativeEngine``; ``Generator.engine``) on throwaway requests; see the module doc.

    ``lengths`` (default ``BASE_LENGTHS`` up to the prefill step, plus the step): prompt lengths; ``batches``:
    row counts of the batched decode runs (capped by the engine's ``max_rows``). Tokens and caches are discarded.
    """
    from spec_cache.decode.engine import RowRequest, SpeculativeEngine

    target = engine.target
    vocab = int(getattr(target, "vocab_size", 0) or 1000)
    step = engine.prefill_step_size
    if lengths is None:
        lengths = sorted({n for n in BASE_LENGTHS if n <= step} | {step})
    report = WarmupReport()

    def record(label: str, took: float) -> None:
        report.runs += 1
        report.seconds += took
        report.timings.append((label, took))
        if took > report.slowest[1]:
            report.slowest = (label, took)

    def measured(label: str, work: Callable[[], object]) -> None:
        started = time.perf_counter()
        work()
        took = time.perf_counter() - started
        record(label, took)
        if progress is not None:
            progress(f"warm-up {label}: {took * 1000:.0f} ms")

    def timed(label: str, runner: SpeculativeEngine, requests: list) -> None:
        measured(label, lambda: runner.run(requests))

    def fresh(depth: int) -> SpeculativeEngine:
        made = SpeculativeEngine(target, engine.provider if depth else None, depth, engine.kv,
                                 max_rows=engine.max_rows, prefill_step_size=step, adaptive=False,
                                 pipeline=engine.pipeline)
        made.join_budget = engine.join_budget  # the server's (``--join-budget``), as rows join its batches
        return made

    plain = fresh(0)
    for length in lengths:  # prefill classes (the row forwards length - 1 prompt tokens, then decodes)
        timed(f"prompt {length + 1}", plain, [RowRequest(_pattern(length + 1, vocab), max_tokens=2,
                                                         stop_at_eos=False)])
    cap = engine.max_rows or max(batches)
    counts = sorted({min(b, cap) for b in batches})
    for rows in counts:  # batched decode
        timed(f"{rows} rows", plain, [RowRequest(_pattern(24 + r, vocab), max_tokens=3, stop_at_eos=False)
                                      for r in range(rows)])
    # rows leaving one at a time over a long context: each count's decode after a departure (the batch's KV
    # gathered, every row's prompt past a prefill chunk), as a server's batch shrinks between turns
    widest, long = max(counts), step + 1
    timed(f"{widest} rows leaving, {long + 1} tokens", plain,
          [RowRequest(_pattern(long + 1 + r, vocab), max_tokens=2 + r, stop_at_eos=False) for r in range(widest)])
    if cap > 1:  # rows joining a batch that decodes over a long context, as a server's next turns do
        measured(f"rows joining {long + 1} tokens", lambda: _joining(plain, long, vocab, min(3, cap)))
    if wanted(engine):  # a GPU's long contexts: the attention alone (it reports its own progress)
        for label, took in warm_attention(target, step, progress=progress):
            record(label, took)
    if engine.provider is not None:
        for depth in range(1, engine.draft_depth + 1):  # verify windows and drafter forwards of each depth
            drafting = fresh(depth)
            for rows in sorted({1, min(2, cap)}):
                timed(f"depth {depth}, {rows} rows", drafting,
                      [RowRequest(_pattern(40 + r, vocab), max_tokens=2 * depth + 2, stop_at_eos=False)
                       for r in range(rows)])
    return report

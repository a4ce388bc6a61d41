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
draft depth from 1 to the engine's, batches of 1 to 8 rows, and rows leaving a batch one at a time over prompts
longer than a prefill chunk. It writes nothing to any cache (no checkpoint
hook) and uses its own engine objects (the adaptive controller's measurements stay clean). Tokens are a fixed
repeating pattern, so a prompt-lookup drafter drafts. ``spec-cache serve --warmup auto`` (the default) runs it
before the server reports ready when MLX's default device is a GPU; on the CPU backend there is nothing to compile
and it is skipped.
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


def wanted(engine) -> bool:
    """Whether a warm-up pays on this machine: MLX's default device is a GPU (kernels are compiled there)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu


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

    def timed(label: str, runner: SpeculativeEngine, requests: list) -> None:
        started = time.perf_counter()
        runner.run(requests)
        took = time.perf_counter() - started
        report.runs += 1
        report.seconds += took
        report.timings.append((label, took))
        if took > report.slowest[1]:
            report.slowest = (label, took)
        if progress is not None:
            progress(f"warm-up {label}: {took * 1000:.0f} ms")

    def fresh(depth: int) -> SpeculativeEngine:
        return SpeculativeEngine(target, engine.provider if depth else None, depth, engine.kv,
                                 max_rows=engine.max_rows, prefill_step_size=step, adaptive=False,
                                 pipeline=engine.pipeline)

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
    if engine.provider is not None:
        for depth in range(1, engine.draft_depth + 1):  # verify windows and drafter forwards of each depth
            drafting = fresh(depth)
            for rows in sorted({1, min(2, cap)}):
                timed(f"depth {depth}, {rows} rows", drafting,
                      [RowRequest(_pattern(40 + r, vocab), max_tokens=2 * depth + 2, stop_at_eos=False)
                       for r in range(rows)])
    return report

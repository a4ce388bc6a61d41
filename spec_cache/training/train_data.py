"""The self-distillation corpus of a drafter: the target's own greedy continuations of prompts, cut into windows
of ``(h_j, t_{j+1}) -> t_{j+2}`` pairs.

Why the target's argmax as the label: the engine accepts a draft exactly when it is the target's greedy token, so
that is what the head should predict; inside the generated part the argmax is the next generated token. Why the
loss counts generated positions only (``prompt_lengths``): the head drafts only there, and a bundled chat set
repeats its template and system prompt in every prompt, which the head memorises (82% teacher-forced accuracy on
SmolLM2's held-out prompt part against 23% on the generated part) at the cost of what matters. Prompt pairs
still feed the head's attention context, as they do at run time.
The hidden ``h_j`` is the target's pre-final-norm residual after its last layer, the tap the ``qwen-mtp`` rows
read at run time (``TargetModel.forward(tap_layers=(depth - 1,))``).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from spec_cache.errors import InvalidRequest
from spec_cache.rows.target import TargetModel

__all__ = ["Corpus", "greedy_sequences", "build_corpus", "save_corpus", "load_corpus"]

Progress = Callable[[int, int], None]


@dataclass
class Corpus:
    """Windows of ``L`` pairs: ``hiddens`` ``[N, L, H]`` float32, ``tokens``/``labels`` ``[N, L]`` int32 and
    ``valid`` ``[N, L]``: the pairs the loss counts (False: padding after a sequence's last pair, and prompt
    pairs when the corpus was built with prompt lengths)."""

    hiddens: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    valid: np.ndarray

    @property
    def windows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def pairs(self) -> int:
        return int(self.valid.sum())


def greedy_sequences(generator, prompts: Sequence[Sequence[int]], max_tokens: int, batch: int = 16,
                     progress: Progress | None = None, samples: int = 1, temperature: float = 0.8,
                     seed: int = 0) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (``generator``: a ``Generator`` without drafter;
    decoding stops at EOS or ``max_tokens``), in batches of ``batch`` prompts; ``samples`` > 1 adds
    ``samples - 1`` continuations sampled at ``temperature`` (seeds ``seed + k``) per prompt.

    Why sampled continuations: more varied contexts from the same prompts (a small prompt set overfits a head);
    their labels stay the target's argmax at each position (``build_corpus``), so the head still learns what
    greedy decoding accepts."""
    jobs = [(p, k) for k in range(samples) for p in range(len(prompts))]
    sequences = []
    for start in range(0, len(jobs), batch):
        chunk = jobs[start:start + batch]
        for k in sorted({k for _, k in chunk}):
            rows = [list(prompts[p]) for p, kk in chunk if kk == k]
            options = {} if k == 0 else {"temperature": temperature, "seed": seed + k}
            for prompt, result in zip(rows, generator.generate(rows, max_tokens=max_tokens, **options)):
                sequences.append(prompt + list(result.tokens))
        if progress is not None:
            progress(min(start + batch, len(jobs)), len(jobs))
    return sequences


def _pairs(target: TargetModel, sequence: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(h_j, t_{j+1}, argmax_{j+1})`` for ``j < n - 1`` of one sequence: one target forward."""
    layer = target.depth - 1
    out = target.forward(mx.array([list(sequence)]), target.make_caches(), tap_layers=(layer,))
    hiddens = out.taps[layer][0, :-1].astype(mx.float32)
    labels = mx.argmax(out.logits[0, 1:], axis=-1).astype(mx.int32)
    mx.eval(hiddens, labels)
    return np.array(hiddens), np.array(sequence[1:], dtype=np.int32), np.array(labels)


def build_corpus(target: TargetModel, sequences: Sequence[Sequence[int]], seq_len: int,
                 progress: Progress | None = None, prompt_lengths: Sequence[int] | None = None) -> Corpus:
    """The pairs of every sequence (two tokens at least), cut into non-overlapping windows of ``seq_len``;
    ``prompt_lengths[i]``: sequence ``i``'s prompt, whose pairs the loss then skips (pair ``j`` counts when its
    label ``t_{j+2}`` is generated: ``j >= prompt_length - 1``)."""
    hidden_size = target.hidden_size
    hiddens, tokens, labels, valid = [], [], [], []
    lengths = [0] * len(sequences) if prompt_lengths is None else list(prompt_lengths)
    usable = [(s, n) for s, n in zip(sequences, lengths) if len(s) >= 2]
    for done, (sequence, prompt_length) in enumerate(usable, start=1):
        h, t, y = _pairs(target, sequence)
        for start in range(0, len(t), seq_len):
            n = min(seq_len, len(t) - start)
            pad = seq_len - n
            hiddens.append(np.concatenate([h[start:start + n], np.zeros((pad, hidden_size), np.float32)]))
            tokens.append(np.concatenate([t[start:start + n], np.zeros(pad, np.int32)]))
            labels.append(np.concatenate([y[start:start + n], np.zeros(pad, np.int32)]))
            j = start + np.arange(seq_len)
            valid.append((np.arange(seq_len) < n) & (j >= prompt_length - 1))
        if progress is not None:
            progress(done, len(usable))
    if not tokens or not any(v.any() for v in valid):
        raise InvalidRequest("no training pairs: no sequence has a generated token to predict")
    return Corpus(np.stack(hiddens), np.stack(tokens), np.stack(labels), np.stack(valid))


def fsync_replace(tmp: Path, path: Path) -> None:
    """``tmp`` (written whole) fsynced, then renamed over ``path``: a run killed at any point leaves the old file
    or the new one, never a torn one (every file of a training run is written so)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_corpus(corpus: Corpus, path: Path) -> None:
    """Write ``corpus`` to ``path`` (``.npz``) atomically (``fsync_replace``)."""
    buffer = io.BytesIO()
    np.savez(buffer, hiddens=corpus.hiddens, tokens=corpus.tokens, labels=corpus.labels, valid=corpus.valid)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    fsync_replace(tmp, path)


def load_corpus(path: Path) -> Corpus:
    with np.load(path) as data:
        return Corpus(data["hiddens"], data["tokens"], data["labels"], data["valid"])

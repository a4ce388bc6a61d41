"""Token log-probabilities: what a row that asks for them (``RowRequest.logprobs`` / ``prompt_logprobs``) gets.

The logprob of a token is the log-softmax of the target's logits at its position: the model's own distribution,
before temperature, ``top_p``, ``min_p`` and ``top_k`` (which only decide which token is drawn), computed in the
logits' dtype as mlx-lm's ``generate_step`` computes the ``logprobs`` it yields (``logits - logsumexp(logits)``)
and mlx_lm.server reports. ``top`` holds the ``n`` most likely tokens at that position, most likely first (ties
by token id).

Generated tokens are scored in the verify round that chose them (a window position per accepted token);
prompt tokens in the prefill (``BatchRows.prefill(scores=...)``), from the logits at the position before each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from spec_cache.errors import InvalidRequest

__all__ = ["TokenLogprob", "RowLogprobs", "score", "check_top", "MAX_TOP"]

#: the most alternatives a row may ask for per position (OpenAI's chat ``top_logprobs`` limit)
MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One scored token: its id, its logprob, and the ``n`` most likely tokens there as ``(id, logprob)``."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RowLogprobs:
    """What a row that asks for logprobs gets with its tokens (``on_tokens(row_id, tokens, RowLogprobs)``):
    ``tokens[i]`` scores the i-th token of that call; ``prompt`` (on the row's first call only, when it asked for
    prompt logprobs) holds one ``TokenLogprob`` or None per prompt position (None where nothing scored it: the
    first token, a restored prefix)."""

    tokens: list
    prompt: list | None = None


def check_top(value, what: str) -> None:
    """ValueError unless ``value`` is None or an int in ``0..MAX_TOP``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
        raise InvalidRequest(f"{what} must be None or an int in [0, {MAX_TOP}], got {value!r}")


def score(logits: mx.array, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``logits [L, V]`` (position ``i`` chose ``tokens[i]``; ``L >= len(tokens)``, the rest is ignored): each
    token's logprob and the ``top`` most likely tokens at its position. One host read."""
    count = len(tokens)
    if count == 0:
        return []
    logits = logits[:count]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.array(list(tokens), dtype=mx.uint32)[:, None]
    chosen = mx.take_along_axis(logprobs, ids, axis=-1)[:, 0].astype(mx.float32)
    top = min(top, logprobs.shape[-1])
    if top > 0:
        order = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(logprobs, order, axis=-1).astype(mx.float32)
        mx.eval(chosen, order, values)
        alternatives = [tuple(sorted(zip(o, v), key=lambda p: (-p[1], p[0])))
                        for o, v in zip(order.tolist(), values.tolist())]
    else:
        alternatives = [()] * count
    return [TokenLogprob(int(t), float(lp), alt) for t, lp, alt in zip(tokens, chosen.tolist(), alternatives)]

"""Streaming detokenization and stop strings.

``StreamingDetokenizer`` turns generated token ids into text pieces as they arrive, never emitting a piece that
ends inside a multi-byte character (the tokenizer decodes an incomplete UTF-8 sequence as U+FFFD; such text is
held until the next token completes it). It decodes a short window (the unread tokens after those of the last
emitted piece, which give the decoder its left context for spacing rules), so the whole stream costs
O(tokens), as vLLM's incremental detokenizer does.

``StopMatcher`` holds back the tail of the text that could still become one of the stop strings and cuts the
text at the first stop string found (the stop string itself is not returned, as in OpenAI's API).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["StreamingDetokenizer", "StopMatcher"]

REPLACEMENT = "\ufffd"
class StreamingDetokenizer:
    """``add(tokens) -> str`` (new text, possibly empty); ``flush() -> str`` (what is held at the end);
    ``text``: everything emitted so far. ``tokenizer.decode(ids)`` is all it uses.

    Special tokens keep their text, as mlx_lm.server's detokenizer writes them (``"w5 <s> w6"``), except the ids in
    ``hidden`` (default: the tokenizer's end-of-sequence ids, the tokens a row stops at, which mlx_lm.server never
    decodes either). Why: the client sends the reply back in the next turn; text without a special token the model
    generated re-tokenizes to another prompt than the tokens the cache holds (and than mlx_lm.server's reply), so the
    next turn restored fewer tokens (issue 35, chat at 1 client)."""

    def __init__(self, tokenizer: Any, hidden: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.hidden = frozenset(int(t) for t in (
            getattr(tokenizer, "eos_token_ids", None) or () if hidden is None else hidden))
        self.tokens: list[int] = []
        self._prefix = 0  # decoded as context only
        self._read = 0  # tokens whose text is emitted
        self._held_back = 0  # characters of the current window already emitted before its tail completed
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def add(self, tokens: Sequence[int]) -> str:
        self.tokens.extend(int(t) for t in tokens if int(t) not in self.hidden)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read >= len(self.tokens):
            return ""
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        complete = final or not after.endswith(REPLACEMENT)
        visible = after if complete else after.rstrip(REPLACEMENT)  # an incomplete character waits
        if not visible.startswith(before):  # a decoder rewrote its context: emit what differs from here on
            before = _common_prefix(before, visible)
        start = len(before) + self._held_back
        new = visible[start:] if len(visible) > start else ""
        if complete and len(after) > len(before):
            self._prefix, self._read, self._held_back = self._read, len(self.tokens), 0
        else:
            self._held_back += len(new)  # emitted while the window stays (its tail is still incomplete)
        self.text += new
        return new


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


class StopMatcher:
    """``feed(text) -> (emit, stopped)``: the text safe to emit now, and whether a stop string was reached
    (then ``emit`` ends just before it and everything after is dropped). ``flush()``: the held tail at the end."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that was reached

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self.held + text
        cut, self.matched = min(((i, s) for s, i in ((s, buffer.find(s)) for s in self.stops) if i >= 0),
                                default=(-1, None))
        if cut >= 0:
            self.held, self.stopped = "", True
            return buffer[:cut], True
        keep = 0  # the longest tail of the buffer that begins a stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held

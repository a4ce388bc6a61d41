"""OpenAI's ``logprobs`` / ``top_logprobs`` / ``echo``: reading them from a body, and the answer's shapes.

What a logprob is: the log-softmax of the target's logits at the token's position (the model's distribution
after ``logit_bias`` and the penalties, before temperature, ``top_p``, ``min_p`` and ``top_k``), as mlx_lm.server
reports it (``spec_cache.rows.logprobs``). Chat: ``logprobs: true`` with ``top_logprobs`` 0..20 gives each choice's
``logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``. Completions (the legacy
shape): ``logprobs: N`` (0..5) gives ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``,
the chosen token always among the alternatives (so up to N + 1 of them, as OpenAI's); ``echo: true`` puts the
prompt first (its first token's logprob and alternatives null), and ``max_tokens: 0`` with ``echo`` answers the
prompt alone (lm-eval's loglikelihood). A token's text is ``tokenizer.decode([id])``; ``text_offset`` counts
characters of the answer's text (prompt included when echoed).

Why the options are taken out of the body here (``take``) rather than in ``protocol``: they change what a job
computes (for echo's prompt logprobs a restore only as far as ``PromptScores`` knows the prompt's scores; no
replay of a stored answer, which has none) and how the answer is built, all of which lives in ``jobs`` and the
scheduler; ``protocol`` sees a body without them.

Echo from the cache: position ``p``'s score depends on ``prompt[:p + 1]`` only, and a restored prefix has no
logits. So the scheduler keeps the prompt scores echo requests computed (``PromptScores``: per tenant and
``logprobs`` count, in memory, bounded) and restores a new echo request's prompt from the KV cache at most as far as
those scores reach, minus one token (the restored prefix's last token is scored by the table, the rest by the
engine: ``RowRequest.prompt_logprobs`` scores the tokens after the restored prefix). The answer is the cold one bit
for bit (``tests/apps/test_server_echo_cache.py``); ``cached_tokens`` reports what was restored.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from spec_cache.apps.server.protocol import APIError

__all__ = ["Scoring", "take", "chat_logprobs", "completion_logprobs", "MAX_CHAT_TOP", "MAX_COMPLETION_TOP",
           "PromptScores", "common_prefix"]

MAX_CHAT_TOP = 20  # OpenAI's top_logprobs limit
MAX_COMPLETION_TOP = 5  # OpenAI's legacy logprobs limit


@dataclass(frozen=True)
class Scoring:
    """A request's logprob options: ``logprobs`` alternatives per token (None: no logprobs), ``echo`` the prompt
    (completions), ``zero``: ``max_tokens`` 0 (the prompt alone; the row generates one token, not answered)."""

    logprobs: int | None = None
    echo: bool = False
    zero: bool = False

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token (None: the prompt is not scored)."""
        return self.logprobs if self.echo else None

    @property
    def active(self) -> bool:
        return self.logprobs is not None or self.echo


def _malformed(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _bad_value(message: str, param: str) -> APIError:
    return APIError(422, message, param=param, code="invalid_value")


def _int(value: Any, name: str, high: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _malformed(f"'{name}' must be an integer in [0, {high}] (null: off)", name)
    if not 0 <= value <= high:
        raise _bad_value(f"'{name}' must be in [0, {high}], got {value}", name)
    return value


def take(body: Any, chat: bool) -> tuple[Any, Scoring]:
    """``body`` without its logprob options, and those options checked (400 for a wrong type, 422 for a value out
    of range). Chat: ``logprobs`` (boolean), ``top_logprobs`` (0..20, only with ``logprobs: true``). Completions:
    ``logprobs`` (0..5; null or false: off), ``echo`` (boolean), and ``max_tokens: 0``, taken only with ``echo``
    (the body then asks one token, which the answer leaves out)."""
    if not isinstance(body, dict):
        return body, Scoring()
    body = dict(body)
    if chat:
        flag, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
        if flag is not None and not isinstance(flag, bool):
            raise _malformed("'logprobs' must be a boolean", "logprobs")
        top = _int(top, "top_logprobs", MAX_CHAT_TOP)
        if top and not flag:
            raise _malformed("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return body, Scoring(logprobs=(top or 0) if flag else None)
    logprobs = body.pop("logprobs", None)
    logprobs = None if logprobs is False else _int(logprobs, "logprobs", MAX_COMPLETION_TOP)  # false: off, as before
    echo = body.pop("echo", None)
    if echo is not None and not isinstance(echo, bool):
        raise _malformed("'echo' must be a boolean", "echo")
    zero = False
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens == 0:
        if not echo:
            raise _bad_value("'max_tokens' 0 answers nothing without 'echo': true", "max_tokens")
        body["max_tokens"], zero = 1, True
    return body, Scoring(logprobs=logprobs, echo=bool(echo), zero=zero)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's (or chunk's) ``logprobs`` for ``entries`` (``jobs``' scored tokens)."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, _, lp in e["top"]]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict]) -> dict:
    """A completion choice's (or chunk's) legacy ``logprobs`` for ``entries``: a prompt's first token has null
    logprob and alternatives; the chosen token is always among the alternatives."""
    tops = []
    for e in entries:
        if e["logprob"] is None:
            tops.append(None)
            continue
        top = {t: lp for t, _, lp in e["top"]}
        top.setdefault(e["token"], e["logprob"])
        tops.append(top)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": [e["offset"] for e in entries]}


class PromptScores:
    """The prompt logprobs echo requests computed, so that a later echo request restores its prompt from the cache
    as far as they cover it (a restored prefix has no logits: the engine scores only the tokens after it,
    ``RowRequest.prompt_logprobs``). In memory, least recently used first out, bounded by ``max_bytes`` (an
    estimate of what the entries hold) and ``max_entries``.

    Keyed by tenant (``Job.tenant``: API key and cache salt; a tenant never reads another's) and the alternatives
    per token (``logprobs``), then by prompt: an entry holds one ``TokenLogprob`` (None at position 0) per
    position of its prompt. Position ``p``'s score depends on ``prompt[:p + 1]`` only, so an entry serves the
    positions of any prompt up to where the two agree (``longest``). Lookups go through an index of each entry's
    prefixes at every ``BLOCK`` tokens (bisected: a few hashes of the prompt, then the few entries that share its
    longest indexed prefix, compared exactly), never a scan of the table. Only the scheduler thread uses it.

    Fair across API keys (issue 37, fourth attacker pass): past a bound the least recently used entry *of the API
    key holding the most bytes* (entries, for ``max_entries``) goes, so one key's flood of long echo prompts evicts
    its own scores, never another key's while that key holds less. Before: one table LRU; ~20 echo requests of
    4000 tokens from A pushed B's scores out and B's next echo request restored nothing."""

    #: bytes counted per position and per alternative (Python objects: a ``TokenLogprob``, its tuple, floats)
    POSITION_BYTES = 160
    ALTERNATIVE_BYTES = 120
    BLOCK = 8  # prefix lengths indexed: multiples of this
    CANDIDATES = 32  # entries compared exactly per lookup at most (the most recently added under the prefix)

    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 4096) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("max_bytes and max_entries must be >= 0")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.bytes = 0
        #: (tenant, top, prompt) -> (scores, bytes); order: least recently used first
        self._entries: collections.OrderedDict = collections.OrderedDict()
        #: API key (``owner``) -> [its entry keys, least recently used first; its bytes]
        self._owners: dict = {}
        #: (tenant, top, hash of prompt[:k]) for k = 0, BLOCK, 2 BLOCK, ... -> {entry key: None} (an ordered set)
        self._index: dict = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _size(self, scores: Sequence) -> int:
        return sum(self.POSITION_BYTES + (0 if s is None else self.ALTERNATIVE_BYTES * len(s.top)) for s in scores)

    def _blocks(self, tenant, top, prompt: tuple, upto: int | None = None):
        """The index keys of ``prompt``'s prefixes (lengths 0, BLOCK, ...; at most ``upto`` blocks)."""
        count = len(prompt) // self.BLOCK if upto is None else upto
        return [(tenant, top, hash(prompt[: j * self.BLOCK])) for j in range(count + 1)]

    def longest(self, tenant: str | None, top: int, prompt: Sequence[int]) -> tuple[int, list]:
        """``(n, scores)``: the scores of ``prompt[:n]``'s positions, ``n`` the longest an entry of this tenant and
        ``top`` covers (0 and [] for none)."""
        prompt = tuple(int(t) for t in prompt)
        low, high = -1, len(prompt) // self.BLOCK  # bisect the longest indexed prefix (prefix-closed)
        while low < high:
            middle = (low + high + 1) // 2
            if (tenant, top, hash(prompt[: middle * self.BLOCK])) in self._index:
                low = middle
            else:
                high = middle - 1
        if low < 0:
            return 0, []
        members = self._index[(tenant, top, hash(prompt[: low * self.BLOCK]))]
        candidates = list(itertools.islice(reversed(members), self.CANDIDATES))
        best, found = 0, None
        for key in candidates:
            n = common_prefix(key[2], prompt)
            if n > best:
                best, found = n, key
        if found is None:
            return 0, []
        self._entries.move_to_end(found)
        self._owners[owner(found[0])][0].move_to_end(found)
        return best, list(self._entries[found][0][:best])

    def put(self, tenant: str | None, top: int, prompt: Sequence[int], scores: Sequence) -> None:
        """Keep ``scores`` (one per position of ``prompt``, each set but the first) for ``tenant`` and ``top``;
        nothing is added when an entry covers it already."""
        prompt = tuple(int(t) for t in prompt)
        if len(scores) != len(prompt) or len(prompt) < 2 or any(s is None for s in scores[1:]):
            return
        if self.longest(tenant, top, prompt)[0] == len(prompt):
            return
        size = self._size(scores) + 8 * len(prompt) + 100 * (len(prompt) // self.BLOCK + 1)
        if size > self.max_bytes or self.max_entries < 1:
            return
        key = (tenant, top, prompt)
        self._entries[key] = (list(scores), size)
        for block in self._blocks(tenant, top, prompt):
            self._index.setdefault(block, {})[key] = None
        self.bytes += size
        held = self._owners.setdefault(owner(tenant), [collections.OrderedDict(), 0])
        held[0][key] = None
        held[1] += size
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            by_bytes = self.bytes > self.max_bytes
            largest = max(self._owners.values(), key=lambda h: h[1] if by_bytes else len(h[0]))
            self._drop(next(iter(largest[0])))

    def _drop(self, key) -> None:
        _, size = self._entries.pop(key)
        self.bytes -= size
        held = self._owners[owner(key[0])]
        del held[0][key]
        held[1] -= size
        if not held[0]:
            del self._owners[owner(key[0])]
        for block in self._blocks(key[0], key[1], key[2]):
            members = self._index.get(block)
            if members is not None:
                members.pop(key, None)
                if not members:
                    del self._index[block]


def owner(tenant: str | None) -> str:
    """The API key's part of a ``Job.tenant`` (``scheduler.fair_key``: a ``cache_salt`` is no other owner)."""
    return "open" if tenant is None else tenant.split("|", 1)[0]


def common_prefix(a: tuple, b: tuple) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slices compared in C, by bisection)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low + 1 < high:  # a[:low] == b[:low], a[:high] != b[:high]
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low

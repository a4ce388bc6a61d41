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
computes (a cold prefill of the whole prompt for echo's prompt logprobs, no replay of a stored answer, which has
none) and how the answer is built, all of which lives in ``jobs``; ``protocol`` sees a body without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec_cache.apps.server.protocol import APIError

__all__ = ["Scoring", "take", "chat_logprobs", "completion_logprobs", "MAX_CHAT_TOP", "MAX_COMPLETION_TOP"]

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

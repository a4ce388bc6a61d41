"""The template seam: where the messages of a rendered chat prompt end, as token offsets to checkpoint.

Why: an agent's next turn is the whole conversation re-rendered by the chat template. The assistant turn comes back
as its text (re-tokenized, maybe re-spaced; a tool call re-rendered from its JSON), so it rarely equals the tokens
that were generated, and the previous turn's finish checkpoint only serves the common part (the target's KV by
trimming, in memory; never a drafter's exact-length row, never past a chunk boundary from LMDB). What the next turn
shares for sure is the previous prompt and every message boundary before it. The scheduler checkpoints these
offsets while prefilling (``Job.checkpoint_at``); ``len(prompt)``, the end of this prompt, is where the next turn
continues.

``message_boundaries`` renders ``messages[:i]`` for the last few ``i`` through the caller's own template call and
keeps an offset only where the rendered ids are a true prefix of the prompt's ids (a template that renders a
message differently when it is last, or a tokenizer that merges across the seam, yields no offset there: never a
wrong one). Before an assistant message it also renders with the generation prompt: that is exactly the prompt
the previous turn was sent with. Cost: up to ``2 * limit`` renders + tokenizations of a prefix of the prompt, on
the tokenizer thread (about as much as tokenizing the prompt ``2 * limit`` times).
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable, Sequence

log = logging.getLogger("spec_cache.apps.server")

__all__ = ["message_boundaries", "RENDERED_PREFIXES", "TextLocator"]

#: how many message prefixes (counted back from the last message) are rendered a request
RENDERED_PREFIXES = 6

Render = Callable[[list, bool], Sequence[int]]


def message_boundaries(render: Render, messages: Sequence[dict], prompt: Sequence[int], *,
                       limit: int = RENDERED_PREFIXES, floor: int = 0,
                       locate: "TextLocator | None" = None) -> list[int]:
    """Sorted offsets into ``prompt`` where one of the last ``limit`` message prefixes ends, plus ``len(prompt)``.

    ``render(messages, add_generation_prompt)`` returns the token ids of those messages through the chat template
    (the same call, tools and options that produced ``prompt``). A prefix the template refuses (one that must end
    with a user turn, say) or whose ids are not a prefix of ``prompt`` gives no offset.

    ``floor``: offsets at or below it give no checkpoint (what the cache holds already, ``Scheduler.seam_floor``).
    Heads are rendered longest first, so once one without the generation prompt ends at or below it, the shorter
    ones are not rendered at all: a warm turn renders one head (its history up to the new message) instead of up
    to ``2 * limit``, each a tokenization of most of the prompt (~25 ms at 10k tokens: issue 35's agent workload
    spent ~300 ms a request here before the first token, on the H100).

    ``locate`` (a :class:`TextLocator` over the same prompt): heads are found in the prompt's text instead of
    tokenized, one tokenization of the whole prompt for all of them (each head otherwise costs one); where it cannot
    answer, the head is rendered to ids as above."""
    prompt = [int(t) for t in prompt]
    offsets = {len(prompt)} if prompt else set()
    first = max(1, len(messages) - limit)
    for i in range(len(messages) - 1, first - 1, -1):
        variants = [False]
        if messages[i].get("role") == "assistant":
            variants.append(True)  # the previous turn's own prompt: messages[:i] + the generation prompt
        below = False
        for generation_prompt in variants:
            head = list(messages[:i])
            end = locate(head, generation_prompt) if locate is not None else UNKNOWN
            if end is UNKNOWN:
                end = _prefix_end(render, head, generation_prompt, prompt)
            if end is not None and end > floor:
                offsets.add(end)
            elif end is not None and floor and not generation_prompt:
                below = True
        if below:  # every shorter head ends lower still
            break
    return sorted(offsets)


def _prefix_end(render: Render, head: list, generation_prompt: bool, prompt: list[int]) -> int | None:
    try:
        ids = [int(t) for t in render(head, generation_prompt)]
    except Exception as exc:  # a template that refuses this prefix: no boundary there
        log.debug("spec-cache: the chat template refused a prefix of %d messages: %s", len(head), exc)
        return None
    if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids:
        return len(ids)
    return None


#: ``TextLocator``'s answer where it cannot tell (the caller renders the head to ids instead)
UNKNOWN = object()


class TextLocator:
    """Where a head of the conversation ends in the prompt, read off the prompt's own tokenization.

    Why: on a warm agent turn ``message_boundaries`` tokenized up to three heads of a 15k-token prompt (the prompt
    is one more): ~20 ms each on the 2-core VM (SmolLM2's tokenizer), most of a request's time between its HTTP
    start and its submit, which comes before its first token. A head's text is cheap to render (~0.5 ms); its end
    is a token boundary of the prompt where the prompt's text starts with the head's text and no token of the prompt
    runs across its end (character offsets of one tokenization with offsets). Never a wrong offset: the prompt's
    tokenization with offsets must give ``prompt`` itself (else every head is rendered to ids, as before), and a
    head that does not end on a token boundary gives no offset. (``prompt`` may go on past the text: an assistant
    prefill's tokens.) A checkpoint there holds exactly the prompt's first
    ``k`` tokens, whatever a head alone would tokenize to; a later request restores it only by sharing those tokens.

    ``render_text(messages, generation_prompt)``: the template's text for ``messages`` (the render that made
    ``prompt``, ``tokenize=False``); ``tokenizer``: the served tokenizer (mlx-lm's wrapper or a Hugging Face fast
    tokenizer: offsets need the fast one). The prompt is tokenized on the first question, not before.
    """

    def __init__(self, tokenizer, render_text: Callable[[list, bool], str], messages: Sequence[dict],
                 prompt: Sequence[int], *, full_text: Callable[[], str] | None = None) -> None:
        """``full_text``: the prompt's text, when the caller renders it otherwise than ``render_text(messages,
        True)`` (a counting wrapper, say)."""
        self._tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self._render_text = render_text
        self._full_text = full_text
        self._messages = list(messages)
        self._prompt = prompt
        self._text: str | None = None
        self._ends: list[int] | None = None
        self._starts: list[int] | None = None
        self.usable: bool | None = None  # None: not tried yet

    def _prepare(self) -> bool:
        if self.usable is None:
            self.usable = False
            try:
                text = self._full_text() if self._full_text is not None else self._render_text(self._messages, True)
                encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
                ids = [int(t) for t in encoded["input_ids"]]
                spans = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
            except Exception as exc:  # a slow tokenizer (no offsets), a template that renders only ids
                log.debug("spec-cache: no text offsets for the template seam: %s", exc)
                return False
            ends = [b for _, b in spans]
            if list(self._prompt[: len(ids)]) != ids or any(b < a for a, b in zip(ends, ends[1:])):
                return False  # not the prompt's own tokenization, or offsets out of order: heads get rendered
            self._text, self._ends, self._starts = text, ends, [a for a, _ in spans]
            self.usable = True
        return self.usable

    def __call__(self, head: list, generation_prompt: bool):
        """The prompt offset where ``head`` ends (None: not on a token boundary of the prompt, or the template
        refuses the head), or ``UNKNOWN`` when this locator cannot tell."""
        if not self._prepare():
            return UNKNOWN
        try:
            part = self._render_text(head, generation_prompt)
        except Exception as exc:  # a template that refuses this prefix: no boundary there
            log.debug("spec-cache: the chat template refused a prefix of %d messages: %s", len(head), exc)
            return None
        size = len(part)
        if not (0 < size < len(self._text)) or not self._text.startswith(part):  # (offsets are in characters)
            return None
        # the tokens that end by the head's end; none may start before it and end after (a token across the seam):
        # characters no token covers (a word-level tokenizer's spaces) may lie between
        k = bisect.bisect_right(self._ends, size)
        if k == 0 or (k < len(self._ends) and self._starts[k] < size):
            return None
        return k if 0 < k < len(self._prompt) else None

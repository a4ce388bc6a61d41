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

import logging
from typing import Callable, Sequence

log = logging.getLogger("spec_cache.apps.server")

__all__ = ["message_boundaries", "RENDERED_PREFIXES"]

#: how many message prefixes (counted back from the last message) are rendered a request
RENDERED_PREFIXES = 6

Render = Callable[[list, bool], Sequence[int]]


def message_boundaries(render: Render, messages: Sequence[dict], prompt: Sequence[int], *,
                       limit: int = RENDERED_PREFIXES, floor: int = 0) -> list[int]:
    """Sorted offsets into ``prompt`` where one of the last ``limit`` message prefixes ends, plus ``len(prompt)``.

    ``render(messages, add_generation_prompt)`` returns the token ids of those messages through the chat template
    (the same call, tools and options that produced ``prompt``). A prefix the template refuses (one that must end
    with a user turn, say) or whose ids are not a prefix of ``prompt`` gives no offset.

    ``floor``: offsets at or below it give no checkpoint (what the cache holds already, ``Scheduler.seam_floor``).
    Heads are rendered longest first, so once one without the generation prompt ends at or below it, the shorter
    ones are not rendered at all: a warm turn renders one head (its history up to the new message) instead of up
    to ``2 * limit``, each a tokenization of most of the prompt (~25 ms at 10k tokens: issue 35's agent workload
    spent ~300 ms a request here before the first token, on the H100)."""
    prompt = [int(t) for t in prompt]
    offsets = {len(prompt)} if prompt else set()
    first = max(1, len(messages) - limit)
    for i in range(len(messages) - 1, first - 1, -1):
        variants = [False]
        if messages[i].get("role") == "assistant":
            variants.append(True)  # the previous turn's own prompt: messages[:i] + the generation prompt
        below = False
        for generation_prompt in variants:
            end = _prefix_end(render, list(messages[:i]), generation_prompt, prompt)
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

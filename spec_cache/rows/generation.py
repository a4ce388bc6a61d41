"""What a generate call takes and returns: ``check_prompts`` (the prompts' shape and ids, checked before any
work) and ``Result`` (one row's outcome).

Its own module, below ``spec_cache.decode.generator`` (which re-exports both) and
``spec_cache.tiers.continuations`` (whose ``ResumedResult`` extends ``Result``): the two used to import each
other (``Generator.generate`` hands resumable calls to ``continuations.generate``), an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from spec_cache.errors import InvalidRequest

__all__ = ["Result", "check_prompts"]


@dataclass
class Result:
    """One row's outcome. ``cached_tokens``: prompt tokens restored instead of prefilled.

    ``tokens`` are the generated ids as the engine emitted them: a row that ended at an end-of-sequence id keeps
    that id as its last token (as mlx-lm's ``generate_step`` yields it; ``len(tokens)`` is what was generated).
    ``Generator.decode(result.tokens)`` gives the text without it."""

    tokens: list[int]
    cached_tokens: int
    drafted: int
    accepted: int
    ttft_s: float
    prompt_tokens: int = 0
    restored_drafter: bool = False


def check_prompts(prompts: Any, vocab_size: int) -> list[list[int]]:
    """``prompts`` as lists of ints, or ``ValueError`` naming the prompt index and position of the first problem:
    a string where token ids belong, a flat list (one prompt not wrapped in a list), floats, booleans, negative
    or out-of-vocabulary ids, an empty prompt. Numpy integer ids are accepted; nothing is coerced silently."""
    import numbers

    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not _is_array(prompts):
        raise InvalidRequest(f"prompts must be a list of prompts (each a list of token ids), got "
                             f"{type(prompts).__name__}")
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, numbers.Integral) and not isinstance(prompt, bool):
            raise InvalidRequest(f"prompt {i} is the token id {prompt!r}, not a list: prompts is a list of prompts; "
                                 "wrap one prompt as [[1, 2, 3]]")
        if isinstance(prompt, (str, bytes)):
            raise InvalidRequest(f"prompt {i} is a {type(prompt).__name__} ({_shown(prompt)}): give token ids "
                                 "(encode text with the model's tokenizer first)")
        if not isinstance(prompt, Sequence) and not _is_array(prompt):
            raise InvalidRequest(f"prompt {i} is a {type(prompt).__name__}, not a list of token ids")
        row = []
        for j, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise InvalidRequest(f"prompt {i}, position {j}: {_shown(token)} ({type(token).__name__}) is not a "
                                     "token id (an int)")
            token = int(token)
            if not 0 <= token < vocab_size:
                raise InvalidRequest(f"prompt {i}, position {j}: token id {token} is outside the vocabulary "
                                     f"[0, {vocab_size})")
            row.append(token)
        if not row:
            raise InvalidRequest(f"prompt {i} is empty")
        rows.append(row)
    return rows


def _is_array(x) -> bool:
    return hasattr(x, "__array__") and getattr(x, "ndim", None) is not None and hasattr(x, "__len__")


def _shown(x) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:39] + "…"

"""Grammar-constrained decoding (``RowSampling.grammar``): structured output that parses.

A ``Grammar`` is one more logits processor (``spec_cache.rows.sampling`` module doc): at each verify-window
position ``j`` every token the grammar does not allow after the row's *generated* tokens (``tokens[start:position +
j]``: the prompt is no part of the grammar) goes to -inf, and an EOS id is allowed only where the grammar is
complete. Position ``j`` sees the window's drafts before it, exactly the history the row has if those drafts are
accepted, so a constrained row's tokens equal a sequential decode that applies the same mask token by token,
whatever was drafted, restored or batched beside it.

The grammar engine is llguidance (``LLMatcher``: JSON schema -> grammar, token masks, ``rollback``). A grammar
keeps a few matcher states, each with the tokens it consumed; a window's masks come from the state whose tokens
share the longest prefix with the row's generated tokens, rolled back to that prefix and advanced over the rest
(accepted tokens, then the window's drafts), so a round costs the tokens it adds, not the row's length. A draft
the grammar refuses ends the window's masks there: the target never samples it, so the positions after it are
discarded whatever they hold.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Sequence

import numpy as np

from spec_cache.errors import InvalidRequest

__all__ = ["Grammar", "GrammarError", "llg_tokenizer", "JSON_OBJECT_SCHEMA"]

#: ``response_format: {"type": "json_object"}``: any JSON object
JSON_OBJECT_SCHEMA: dict = {"type": "object"}
#: matcher states kept per grammar (rows sharing one grammar object each find theirs by prefix)
MAX_STATES = 8
#: llguidance's JSON compiler options: whitespace between tokens limited (an unbounded run of blanks is how a
#: small model loops inside a schema until ``max_tokens``)
JSON_OPTIONS: dict = {"whitespace_flexible": False, "whitespace_pattern": r"[ \n]{0,8}"}


class GrammarError(InvalidRequest):
    """A grammar (JSON schema) llguidance refuses."""


_TOKENIZERS: dict = {}
_TOKENIZERS_LOCK = threading.Lock()


def llg_tokenizer(tokenizer: Any, eos_token_ids: Sequence[int] = ()):
    """The ``llguidance.LLTokenizer`` of ``tokenizer`` (an ``LLTokenizer`` as is; an mlx-lm ``TokenizerWrapper``
    or a fast HF tokenizer through ``llguidance.hf.from_tokenizer``) with ``eos_token_ids`` (and the tokenizer's
    own EOS) as its EOS ids; built once per tokenizer (it takes about a second)."""
    import llguidance

    if isinstance(tokenizer, llguidance.LLTokenizer):
        return tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
    eos = sorted({int(t) for t in eos_token_ids} | set(getattr(tokenizer, "eos_token_ids", None) or ())
                 | ({int(hf.eos_token_id)} if getattr(hf, "eos_token_id", None) is not None else set()))
    key = (id(hf), tuple(eos))
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(key)
        if found is not None and found[0] is hf:
            return found[1]
    import llguidance.hf

    built = llguidance.hf.from_tokenizer(hf, eos_token=eos or None)
    with _TOKENIZERS_LOCK:
        _TOKENIZERS[key] = (hf, built)
    return built


class _State:
    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []


class Grammar:
    """A grammar over one tokenizer's ids (module doc). ``Grammar.json_schema(tokenizer, schema)`` /
    ``Grammar.json_object(tokenizer)`` build one; ``tokenizer`` as ``llg_tokenizer`` takes it. Raises
    ``GrammarError`` (an ``InvalidRequest``) for a schema llguidance refuses."""

    def __init__(self, tokenizer: Any, grammar: str, *, eos_token_ids: Sequence[int] = ()) -> None:
        import llguidance

        self.tokenizer = llg_tokenizer(tokenizer, eos_token_ids)
        self.grammar = grammar
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError(f"the grammar is refused: {' '.join(messages)[:500]}")
        self.eos = sorted(set(self.tokenizer.eos_tokens))  # ``llg_tokenizer`` took ``eos_token_ids`` in
        if not self.allowed(self.matcher()).any():
            raise GrammarError("this tokenizer cannot spell any output the grammar allows")
        #: the continuation key's part (``RowSampling.processor_params``)
        self.key = hashlib.sha256(grammar.encode()).hexdigest()
        self._states: list[_State] = []
        self._lock = threading.Lock()

    @classmethod
    def json_schema(cls, tokenizer: Any, schema: Any, *, eos_token_ids: Sequence[int] = ()) -> "Grammar":
        """Output that is one JSON value valid under ``schema`` (a dict or its JSON text)."""
        import llguidance

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise GrammarError("the JSON schema is not valid JSON") from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is refused: {str(exc)[:500]}") from None
        return cls(tokenizer, grammar, eos_token_ids=eos_token_ids)

    @classmethod
    def json_object(cls, tokenizer: Any, *, eos_token_ids: Sequence[int] = ()) -> "Grammar":
        """Output that is one JSON object (``response_format: {"type": "json_object"}``)."""
        return cls.json_schema(tokenizer, JSON_OBJECT_SCHEMA, eos_token_ids=eos_token_ids)

    def matcher(self):
        """A fresh ``llguidance.LLMatcher`` of this grammar (at the start of the output)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar is refused: {matcher.get_error()[:500]}")
        return matcher

    def allowed(self, matcher) -> np.ndarray:
        """The tokens ``matcher`` allows next, as a bool array over the tokenizer's ids: EOS only where the grammar
        is complete (all of this grammar's EOS ids then)."""
        if matcher.is_stopped():
            mask = np.zeros(self.tokenizer.vocab_size, dtype=bool)
        else:
            mask = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8) > 0
            mask[[t for t in self.eos if t < mask.shape[0]]] = False
        if matcher.is_accepting() or matcher.is_stopped():
            mask[[t for t in self.eos if t < mask.shape[0]]] = True
        return mask

    def _state_for(self, generated: Sequence[int]) -> _State:
        """The kept state sharing the longest prefix with ``generated`` (a new one when none shares any and room
        is left), rolled back to that prefix (module doc)."""
        best, shared = None, -1
        for state in self._states:
            n = 0
            for a, b in zip(state.consumed, generated):
                if a != b:
                    break
                n += 1
            if n > shared:
                best, shared = state, n
        if best is None or (shared == 0 and len(self._states) < MAX_STATES):
            best, shared = _State(self.matcher()), 0
            self._states.append(best)
        self._states.remove(best)
        self._states.insert(0, best)  # most recently used first
        if len(self._states) > MAX_STATES:
            self._states.pop()
        back = len(best.consumed) - shared
        if back:
            if not best.matcher.rollback(back) or best.matcher.is_error():
                best.matcher, best.consumed = self.matcher(), []
                shared = 0
            else:
                del best.consumed[shared:]
        return best

    def _advance(self, state: _State, token: int) -> bool:
        if state.matcher.is_stopped() or not state.matcher.consume_token(int(token)):
            return False
        state.consumed.append(int(token))
        return True

    def window_masks(self, tokens: Sequence[int], start: int, position: int, width: int, vocab: int) -> np.ndarray:
        """``[width, vocab]`` bool: row ``j`` the tokens allowed at ``position + j`` after ``tokens[start:position +
        j]`` (the row's generated tokens, then the window's drafts). Ids past the tokenizer's vocabulary are never
        allowed. Raises ``RuntimeError`` if the row's own accepted tokens break the grammar (never with tokens this
        mask chose)."""
        masks = np.zeros((width, vocab), dtype=bool)
        with self._lock:
            generated = list(tokens[start:position])
            state = self._state_for(generated)
            for token in generated[len(state.consumed):]:
                if not self._advance(state, token):
                    state.matcher, state.consumed = self.matcher(), []
                    raise RuntimeError("a constrained row's tokens do not follow its grammar")
            for j in range(width):
                allowed = self.allowed(state.matcher)
                if j == 0 and not allowed[:vocab].any():
                    raise RuntimeError("a constrained row reached a point where its grammar allows no token")
                n = min(vocab, allowed.shape[0])
                masks[j, :n] = allowed[:n]
                if j + 1 == width or position + j >= len(tokens):
                    masks[j + 1:] = masks[j]  # past the row's drafts: never read
                    break
                draft = int(tokens[position + j])
                if not (0 <= draft < n and allowed[draft]) or not self._advance(state, draft):
                    masks[j + 1:] = masks[j]  # a refused draft: the positions after it are discarded
                    break
        return masks

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

Bounded for a server's tenants (issue 37, third attacker pass): llguidance's compiler has no bound of its own on
some schemas (an ``allOf`` of 22 ``.*ab.*`` patterns, 700 bytes, ran for minutes and grew past 14 GiB), so a
grammar text is first checked in a child process under ``CHECK_SECONDS`` and ``CHECK_BYTES`` of address space
(killed past them: one ``GrammarError``); a checked grammar is compiled once per tokenizer (``COMPILED`` kept) and
every matcher after that is a copy. A row's masks take at most ``ROW_SECONDS`` + ``TOKEN_SECONDS`` per generated
token of its own time (a 180 KB ``enum`` string costs ~125 ms a mask): past that, or when llguidance fails (a
limit of its own, a panic), the row's grammar *fails*: its masks allow only EOS from there, so the row ends in its
own step, and ``failure`` tells the scheduler to answer that row's error (never a step that raises and takes the
batch's other rows down with it).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from spec_cache.errors import InvalidRequest

__all__ = ["Grammar", "GrammarError", "llg_tokenizer", "JSON_OBJECT_SCHEMA", "check_grammar"]

#: ``response_format: {"type": "json_object"}``: any JSON object
JSON_OBJECT_SCHEMA: dict = {"type": "object"}
#: matcher states kept per grammar (rows sharing one grammar object each find theirs by prefix)
MAX_STATES = 8
#: llguidance's JSON compiler options: whitespace between tokens limited (an unbounded run of blanks is how a
#: small model loops inside a schema until ``max_tokens``)
JSON_OPTIONS: dict = {"whitespace_flexible": False, "whitespace_pattern": r"[ \n]{0,8}"}
#: a grammar text's check in a child process: wall seconds and address space (module doc)
CHECK_SECONDS = 5.0
CHECK_BYTES = 2 << 30
#: compiled grammars kept (root matchers, per tokenizer), and the checks' verdicts kept
COMPILED = 32
#: a row's own mask time: this much, plus this much per token it generated (module doc)
ROW_SECONDS = 1.0
TOKEN_SECONDS = 0.005


class GrammarError(InvalidRequest):
    """A grammar (JSON schema) llguidance refuses."""


_TOKENIZERS: dict = {}
_TOKENIZERS_LOCK = threading.Lock()
#: sha256 of a grammar text -> None (passed) or the refusal; (tokenizer, eos, sha) -> a compiled root matcher
_CHECKED: "OrderedDict[str, str | None]" = OrderedDict()
_ROOTS: "OrderedDict[tuple, Any]" = OrderedDict()
#: every root a live ``Grammar`` holds, by the same key: a grammar in use (a row's, or one a server compiled
#: ahead of its job) is never compiled again because ``COMPILED`` newer ones pushed its root out
_LIVE: "weakref.WeakValueDictionary[tuple, _Root]" = weakref.WeakValueDictionary()


class _Root:
    """A compiled root matcher, held by every ``Grammar`` of it (and by ``_ROOTS`` while kept there)."""

    __slots__ = ("matcher", "tokenizer", "__weakref__")

    def __init__(self, matcher, tokenizer) -> None:
        self.matcher, self.tokenizer = matcher, tokenizer  # the tokenizer kept alive: its ``id`` is in the key
_COMPILE_LOCK = threading.Lock()

_CHILD = """
import resource, sys, json
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
import llguidance
failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(sys.stdin.read(), None)
sys.stdout.write(json.dumps([bool(failed), [str(m)[:500] for m in messages]]))
"""


def _panic(exc: BaseException) -> bool:
    """A Rust panic inside llguidance (pyo3's ``PanicException``, a ``BaseException``)."""
    return type(exc).__name__ == "PanicException"


def _remember(kept: OrderedDict, key, value) -> None:
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > COMPILED:
        kept.popitem(last=False)


def check_grammar(grammar: str) -> None:
    """Raises ``GrammarError`` unless llguidance's own check of ``grammar`` (no tokenizer) passes in a child
    process within ``CHECK_SECONDS`` and ``CHECK_BYTES``; the verdict of a grammar text is kept (``COMPILED``)."""
    digest = hashlib.sha256(grammar.encode()).hexdigest()
    with _COMPILE_LOCK:
        if digest in _CHECKED:
            _CHECKED.move_to_end(digest)
            refusal = _CHECKED[digest]
            if refusal is not None:
                raise GrammarError(refusal)
            return
    refusal = None
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD, str(CHECK_BYTES)], input=grammar.encode(),
                              capture_output=True, timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        refusal = f"the grammar is refused: too complex (its check ran past {CHECK_SECONDS:g} s)"
    else:
        try:
            failed, messages = json.loads(done.stdout) if done.returncode == 0 else (None, None)
        except ValueError:
            failed, messages = None, None
        if failed is None:  # killed, out of memory, a panic: the compiler could not finish
            refusal = f"the grammar is refused: too complex (its check failed, exit {done.returncode})"
        elif failed:
            refusal = f"the grammar is refused: {' '.join(messages)[:500]}"
    with _COMPILE_LOCK:
        _remember(_CHECKED, digest, refusal)
    if refusal is not None:
        raise GrammarError(refusal)


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
        self.tokenizer = llg_tokenizer(tokenizer, eos_token_ids)
        self.grammar = grammar
        self.eos = sorted(set(self.tokenizer.eos_tokens))  # ``llg_tokenizer`` took ``eos_token_ids`` in
        #: the continuation key's part (``RowSampling.processor_params``)
        self.key = hashlib.sha256(grammar.encode()).hexdigest()
        self._holder = self._compiled()
        self._root = self._holder.matcher
        self._states: list[_State] = []
        self._lock = threading.Lock()
        self._spent = 0.0  # seconds of mask time (``ROW_SECONDS``)
        #: ``(generated tokens, message)`` once this grammar failed (module doc): ``failure`` reads it
        self._failure: tuple[tuple[int, ...], str] | None = None

    def _compiled(self):
        """The root matcher of this grammar over this tokenizer: checked (``check_grammar``), compiled once and
        kept; rows get copies."""
        import llguidance

        key = (id(self.tokenizer), tuple(self.eos), self.key)
        with _COMPILE_LOCK:
            found = _ROOTS.get(key)
            if found is not None and found[0] is self.tokenizer:
                _ROOTS.move_to_end(key)
                if isinstance(found[1], str):
                    raise GrammarError(found[1])
                return found[1]
            live = _LIVE.get(key)
            if live is not None and live.tokenizer is self.tokenizer:
                _remember(_ROOTS, key, (self.tokenizer, live))
                return live
        check_grammar(self.grammar)
        try:
            root = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
            if root.is_error():
                refusal = f"the grammar is refused: {root.get_error()[:500]}"
            else:  # its first mask (on a copy): a grammar whose start fails or allows nothing is refused here
                first = self.allowed(root.deep_copy())
                refusal = None if first is not None and first.any() else \
                    "this tokenizer cannot spell any output the grammar allows (or its first mask failed)"
        except BaseException as exc:
            if not _panic(exc):
                raise
            refusal = "the grammar is refused: its compiler failed"
        holder = None if refusal is not None else _Root(root, self.tokenizer)
        with _COMPILE_LOCK:
            _remember(_ROOTS, key, (self.tokenizer, refusal or holder))
            if holder is not None:
                _LIVE[key] = holder
        if refusal is not None:
            raise GrammarError(refusal)
        return holder

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
        """A fresh ``llguidance.LLMatcher`` of this grammar (at the start of the output): a copy of the compiled
        one."""
        return self._root.deep_copy()

    def failure(self, generated: Sequence[int]) -> str | None:
        """Why this grammar failed a row whose generated tokens are ``generated`` (its final EOS, if any, aside),
        or None: the row's output is cut there and is to be answered as an error (module doc)."""
        failed = self._failure
        if failed is None:
            return None
        prefix, message = failed
        return message if tuple(generated[: len(prefix)]) == prefix else None

    @property
    def failed(self) -> bool:
        """Whether this grammar failed at some point (a row of it is then never replayed from a record)."""
        return self._failure is not None

    def allowed(self, matcher) -> np.ndarray:
        """The tokens ``matcher`` allows next, as a bool array over the tokenizer's ids: EOS only where the grammar
        is complete (all of this grammar's EOS ids then); None when the matcher failed (a limit of llguidance's)."""
        if matcher.is_error():
            return None
        if matcher.is_stopped():
            mask = np.zeros(self.tokenizer.vocab_size, dtype=bool)
        else:
            mask = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8) > 0
            if matcher.is_error():
                return None
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
        allowed. Where the grammar fails (llguidance's error or panic, no token allowed, the row's accepted tokens
        refused, its mask time spent: module doc) only EOS is allowed from there on and ``failure`` names it."""
        masks = np.zeros((width, vocab), dtype=bool)
        began = time.perf_counter()
        with self._lock:
            generated = list(tokens[start:position])
            try:
                self._masks(masks, tokens, generated, position, width, vocab)
            except _Failed as failed:
                self._fail(masks, generated + failed.drafts, failed.j, str(failed))
            except BaseException as exc:
                if not _panic(exc):
                    raise
                self._states.clear()  # a matcher that panicked is not used again
                self._fail(masks, generated, 0, "the grammar's matcher failed")
            self._spent += time.perf_counter() - began
            if self._spent > ROW_SECONDS + TOKEN_SECONDS * len(generated) and self._failure is None:
                self._fail(masks, generated, 0, f"following the grammar took {self._spent:.1f} s of mask time for "
                           f"{len(generated)} tokens (at most {ROW_SECONDS:g} s + {TOKEN_SECONDS:g} s a token)")
        return masks

    def _fail(self, masks: np.ndarray, prefix: list[int], j: int, message: str) -> None:
        """Masks from window position ``j`` allow only EOS; ``failure`` answers ``message`` for a row whose generated
        tokens start with ``prefix`` (at ``j`` > 0, drafts the target may still refuse: then no failure)."""
        masks[j:] = False
        masks[j:, [t for t in self.eos if t < masks.shape[1]]] = True
        if self._failure is None or j == 0:
            self._failure = (tuple(int(t) for t in prefix), "'response_format': " + message)

    def _masks(self, masks: np.ndarray, tokens, generated: list[int], position: int, width: int,
               vocab: int) -> None:
        state = self._state_for(generated)
        for token in generated[len(state.consumed):]:
            if not self._advance(state, token):
                error = state.matcher.get_error() if state.matcher.is_error() else ""
                state.matcher, state.consumed = self.matcher(), []
                raise _Failed(f"the grammar failed: {error.splitlines()[0][:200]}" if error else
                              "the row's tokens do not follow its grammar", 0, [])
        for j in range(width):
            allowed = self.allowed(state.matcher)
            drafts = [int(t) for t in tokens[position:position + j]]
            if allowed is None:
                error = state.matcher.get_error().splitlines()[0][:200] if state.matcher.get_error() else "failed"
                self._states.remove(state)  # never used again
                raise _Failed(f"the grammar failed: {error}", j, drafts)
            if not allowed[:vocab].any():
                raise _Failed("the grammar allows no token here", j, drafts)
            n = min(vocab, allowed.shape[0])
            masks[j, :n] = allowed[:n]
            if j + 1 == width or position + j >= len(tokens):
                masks[j + 1:] = masks[j]  # past the row's drafts: never read
                break
            draft = int(tokens[position + j])
            if not (0 <= draft < n and allowed[draft]) or not self._advance(state, draft):
                masks[j + 1:] = masks[j]  # a refused draft: the positions after it are discarded
                break


class _Failed(Exception):
    """The grammar fails at window position ``j`` (after ``drafts``, the window's drafts before it)."""

    def __init__(self, message: str, j: int, drafts: list[int]) -> None:
        super().__init__(message)
        self.j, self.drafts = j, drafts

"""Token sampling shared by target verification and drafting.

mlx-lm's parity rule for speculative decoding: the drafter proposes, and a draft is accepted while it equals the
token the target sampled at that position. Every emitted token is therefore drawn from the target's own
distribution (greedy: exactly the target's argmax sequence).

Temperature 0 is greedy (argmax of the log-probabilities, as mlx-lm's ``greedy_sampler``). Temperature > 0 draws
from ``softmax(logprobs / T)`` (restricted to the ``top_p`` nucleus when ``top_p < 1``).

Below a safe floor a sampling parameter means greedy (``means_greedy``): a temperature under ``MIN_TEMPERATURE``
(``1 / T`` overflows float32 near 1e-38, and the logits turn to NaN: every token came out as id 0), or a ``top_p``
under ``MIN_TOP_P`` (a nucleus that small holds the most likely token alone, whose probability is at least
``1 / vocab``; in float32 a ``top_p`` under ~1e-45 is 0 and kept nothing, id 0 again). Greedy is what either
asks for in the limit, and its tokens are exactly the target's argmax.

Two samplers:

* ``TokenSampler`` (drafters): one PRNG stream per batch, split per call. Drafts only decide how many tokens a
  round emits, never which, so their stream may depend on the batch.
* ``RowSampler`` (the target's verification): each row samples the token at absolute position ``p`` of its
  sequence with the key ``position_key(seed, p)``, so a row's tokens depend only on its own prompt, parameters
  and seed, never on what else is in the batch, on how many drafts were accepted, or on a restore.

Logits processors (``RowSampling.logit_bias``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``): exactly mlx-lm's (``mlx_lm.sample_utils.make_logits_processors``: the same operations in
the same order, bias, repetition, presence, frequency), applied to the raw logits before everything else, greedy
rows included (they move the argmax). mlx-lm's ``generate_step`` hands a processor every token before the one it
chooses, prompt included, and each penalty looks at the last ``*_context_size`` of them (0: all of them, as
mlx-lm's ``tokens[-0:]``). A verify window's position ``j`` chooses the token at ``p + j``, so it sees the row's
tokens and the window's drafts before it: the history the row has if those drafts are accepted, and when one is
rejected, every later position is discarded. So the tokens equal ``generate_step``'s with
``make_logits_processors(...)`` whatever was drafted, restored or batched beside the row.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mlx.core as mx

from spec_cache.errors import InvalidRequest

__all__ = ["Sampling", "TokenSampler", "RowSampling", "RowSampler", "position_key", "means_greedy", "process_logits",
           "MIN_TEMPERATURE", "MIN_TOP_P"]

#: a temperature below this samples greedily (module doc)
MIN_TEMPERATURE = 1e-5
#: a ``top_p`` below this keeps the most likely token alone: greedy (module doc; vocabularies up to 1M tokens)
MIN_TOP_P = 1e-6


def means_greedy(temperature: float, top_p: float = 1.0) -> bool:
    """Whether ``temperature`` / ``top_p`` (checked numbers) sample exactly as greedy does: 0, or below the floors
    (``MIN_TEMPERATURE``, ``MIN_TOP_P``; module doc). Callers that key on greediness (a retry's replay, the seed a
    server picks) ask this, not ``temperature == 0``."""
    return temperature < MIN_TEMPERATURE or top_p < MIN_TOP_P


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked: ``temperature`` 0 is greedy; ``seed`` makes sampled runs reproducible."""

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(self.temperature).__name__}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if means_greedy(self.temperature):  # below the floor: greedy (module doc)
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenSampler:
    """Picks token ids from logits ``[..., V]``; ``stream`` separates the PRNG streams of target and drafter."""

    def __init__(self, sampling: Sampling, stream: int = 0) -> None:
        self.sampling = sampling
        self._key = None if sampling.greedy else mx.random.key((sampling.seed * 1_000_003 + stream) % (2**63))

    def __call__(self, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self._key is None:
            return mx.argmax(logprobs, axis=-1)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.sampling.temperature), key=key)


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling: ``temperature`` (0: greedy), ``top_p`` in (0, 1] (1: the whole distribution),
    ``seed`` (any int), ``top_k`` (keep the k most likely tokens; 0: off) and ``min_p`` in [0, 1] (keep the tokens
    at least ``min_p`` times as likely as the most likely one; 0: off). Raises TypeError / ValueError for values
    outside those ranges. The filters apply to the tempered distribution in that order (top_p, min_p, top_k); a
    greedy row's token passes every one of them, so they change nothing there. A temperature or ``top_p`` below
    its floor (``means_greedy``) is greedy: ``temperature`` reads 0 then."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    #: logits processors (module doc), mlx-lm's ``make_logits_processors`` arguments: ``logit_bias`` a mapping (or
    #: pairs) token id -> finite value added to its logit, kept as sorted ``(id, value)`` pairs; ``repetition_penalty``
    #: > 0 (1: off) divides a positive logit of a token seen in the last ``repetition_context_size`` tokens and
    #: multiplies a negative one; ``presence_penalty`` (0: off) is subtracted once from each token seen in its
    #: context, ``frequency_penalty`` (0: off) once per occurrence. A context size 0 means the whole sequence.
    logit_bias: Any = ()
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    #: a ``spec_cache.rows.grammar.Grammar`` (None: off): every token it does not allow after the row's generated
    #: tokens is masked, after the processors above (``spec_cache.rows.grammar`` module doc)
    grammar: Any = None

    def __post_init__(self) -> None:
        self._check_processors()
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)):
            raise TypeError(f"min_p must be a number, got {type(self.min_p).__name__}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if self.temperature and means_greedy(self.temperature, self.top_p):  # below a floor: greedy (module doc)
            object.__setattr__(self, "temperature", 0.0)

    def _check_processors(self) -> None:
        bias = self.logit_bias
        if bias is None:
            bias = ()
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        if not isinstance(pairs, (list, tuple)) and not isinstance(bias, Mapping):
            raise TypeError(f"logit_bias must be a mapping of token id to number, got {type(bias).__name__}")
        checked: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError("logit_bias must be a mapping of token id to number")
            token, value = pair
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"logit_bias keys must be int token ids, got {type(token).__name__}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"logit_bias values must be numbers, got {type(value).__name__}")
            if token < 0:
                raise InvalidRequest(f"logit_bias: token id {token} is negative")
            if not math.isfinite(value):
                raise InvalidRequest(f"logit_bias: the value for token {token} must be finite, got {value}")
            if token in checked:
                raise InvalidRequest(f"logit_bias: token id {token} is given twice")
            checked[token] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(checked.items())))
        if self.grammar is not None and not callable(getattr(self.grammar, "window_masks", None)):
            raise TypeError(f"grammar must be a spec_cache.rows.grammar.Grammar, got {type(self.grammar).__name__}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise InvalidRequest(f"{name} must be finite, got {value}")
        if not self.repetition_penalty > 0:
            raise InvalidRequest(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise InvalidRequest(f"{name} must be >= 0 (0: the whole sequence), got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether a logits processor is on (module doc): the sampler then needs the row's tokens."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(
            self.frequency_penalty) or self.grammar is not None

    def processor_params(self) -> dict:
        """The logits processors that are on, as a JSON-able mapping (a continuation key's part: empty when none,
        so every older key stays what it was)."""
        params: dict = {}
        if self.logit_bias:
            params["logit_bias"] = [[token, value] for token, value in self.logit_bias]
        for name, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            value = getattr(self, name)
            if value != off:
                context = name.replace("_penalty", "_context_size")
                params[name] = [float(value), getattr(self, context)]
        if self.grammar is not None:
            params["grammar"] = self.grammar.key
        return params

    def max_logit_bias_id(self) -> int:
        """The largest token id ``logit_bias`` names (-1: none); the engine checks it against the vocabulary."""
        return self.logit_bias[-1][0] if self.logit_bias else -1


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key that samples the token at ``position`` (its index in the row's whole sequence) for ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little") >> 1)


def _nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """``logprobs [W, V]`` with every token outside the smallest set whose probability reaches ``top_p`` at -inf
    (the most likely token always stays)."""
    order = mx.argsort(-logprobs, axis=-1)
    ranked = mx.take_along_axis(logprobs, order, axis=-1)
    before = mx.cumsum(mx.exp(ranked), axis=-1) - mx.exp(ranked)  # mass of the tokens ranked above each one
    keep_ranked = (before < top_p) | (mx.arange(logprobs.shape[-1]) == 0)  # the top token even if top_p rounds to 0
    keep = mx.put_along_axis(mx.zeros(logprobs.shape, dtype=mx.bool_), order, keep_ranked, axis=-1)
    return mx.where(keep, logprobs, -mx.inf)


def _min_p(logprobs: mx.array, min_p: float) -> mx.array:
    """``logprobs [W, V]`` (normalized) with every token less than ``min_p`` times as likely as the most likely one
    at -inf."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logprobs >= floor, logprobs, -mx.inf)


def _top_k(logprobs: mx.array, k: int) -> mx.array:
    """``logprobs [W, V]`` with every token outside the ``k`` most likely at -inf (ties at the k-th kept)."""
    if k >= logprobs.shape[-1]:
        return logprobs
    kth = mx.sort(logprobs, axis=-1)[..., -k:][..., :1]
    return mx.where(logprobs >= kth, logprobs, -mx.inf)


def _context_pairs(tokens: Sequence[int], position: int, width: int, size: int) -> tuple[list[int], list[int]]:
    """The ``(window position, token)`` pairs of every window position's penalty context: position ``j`` sees the
    last ``size`` (0: all) of ``tokens[:position + j]`` (module doc), one pair per occurrence."""
    rows: list[int] = []
    ids: list[int] = []
    for j in range(width):
        end = min(position + j, len(tokens))  # past the row's drafts (padding): never read, any context will do
        context = tokens[max(0, end - size) if size else 0:end]
        rows.extend([j] * len(context))
        ids.extend(context)
    return rows, ids


def process_logits(logits: mx.array, sampling: RowSampling, tokens: Sequence[int], position: int,
                   start: int | None = None) -> mx.array:
    """One row's window logits ``[W, V]`` through its logits processors (module doc): window position ``j`` chooses
    the token at ``position + j`` and its penalties see ``tokens[:position + j]``. The operations are mlx-lm's
    (``make_logits_processors``), row by row. Then the grammar's mask (``RowSampling.grammar``) over the generated
    tokens ``tokens[start:position + j]``: ``start`` (where the prompt ends) is required with a grammar."""
    width = logits.shape[0]
    if sampling.logit_bias:
        ids = mx.array([token for token, _ in sampling.logit_bias])
        values = mx.array([value for _, value in sampling.logit_bias])
        logits = logits.at[:, ids].add(values)
    penalties = ((sampling.repetition_penalty, sampling.repetition_context_size, "repetition"),
                 (sampling.presence_penalty, sampling.presence_context_size, "presence"),
                 (sampling.frequency_penalty, sampling.frequency_context_size, "frequency"))
    for penalty, size, kind in penalties:
        if (kind == "repetition" and penalty == 1.0) or not penalty:
            continue  # 1 (repetition) and 0 (the others) change no logit: mlx-lm's defaults
        rows, ids = _context_pairs(tokens, position, width, size)
        if not ids:
            continue
        js, ts = mx.array(rows), mx.array(ids)
        if kind == "repetition":
            selected = logits[js, ts]
            logits[js, ts] = mx.where(selected < 0, selected * penalty, selected / penalty)
        elif kind == "presence":
            logits[js, ts] = logits[js, ts] - penalty
        else:
            logits = logits.at[js, ts].subtract(penalty)
    if sampling.grammar is not None:
        if start is None:
            raise ValueError("a sampling with a grammar needs where the row's prompt ends (start)")
        masks = sampling.grammar.window_masks(tokens, start, position, width, logits.shape[-1])
        logits = mx.where(mx.array(masks), logits, -mx.inf)
    return logits


class RowSampler:
    """Samples a verify window ``logits [B, W, V]`` row by row (see module doc)."""

    def __call__(self, logits: mx.array, rows: Sequence[tuple]) -> list[list[int]]:
        """``rows[b] = (sampling, position[, tokens])``: row ``b``'s sampling (None: greedy), the absolute
        position of the token its window's first logits choose and, when its sampling has logits processors,
        its tokens followed by the window's drafts (``tokens[:position + j]`` is what window position ``j``
        follows), and with a grammar, where its prompt ends in them. Returns ``[B][W]`` token ids."""
        return self.sample(logits, rows).tolist()

    def sample(self, logits: mx.array, rows: Sequence[tuple]) -> mx.array:
        """``__call__`` left on the device: the ``[B, W]`` token ids as a lazy array (same operations, same
        tokens), so a pipelined round can feed them to the next forward before the host reads them."""
        processed = {}
        for b, (sampling, position, *rest) in enumerate(rows):
            if sampling is not None and sampling.processes:
                if not rest or rest[0] is None:
                    raise ValueError(f"row {b}: a sampling with logits processors needs the row's tokens")
                processed[b] = process_logits(logits[b], sampling, rest[0], position, *rest[1:2])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.argmax(logprobs, axis=-1)
        special = [b for b, (sampling, *_) in enumerate(rows)
                   if b in processed or (sampling is not None and not sampling.greedy)]
        if not special:
            return chosen
        width, vocab = logprobs.shape[1], logprobs.shape[2]
        per_row = [chosen[b] for b in range(len(rows))]
        for b in special:
            sampling, position, *_ = rows[b]
            row = logprobs[b]
            if b in processed:
                row = processed[b] - mx.logsumexp(processed[b], axis=-1, keepdims=True)
            if sampling.greedy:
                per_row[b] = mx.argmax(row, axis=-1)
                continue
            scaled = row * (1.0 / sampling.temperature)
            if sampling.top_p < 1.0:
                scaled = _nucleus(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), sampling.top_p)
            if sampling.min_p > 0.0:
                scaled = _min_p(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), sampling.min_p)
            if sampling.top_k > 0:
                scaled = _top_k(scaled, sampling.top_k)
            noise = mx.stack([mx.random.gumbel((vocab,), key=position_key(sampling.seed, position + j))
                              for j in range(width)])
            per_row[b] = mx.argmax(scaled + noise, axis=-1)
        return mx.stack(per_row)

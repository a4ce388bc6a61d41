"""Token sampling shared by target verification and drafting.

mlx-lm's parity rule for speculative decoding: the drafter proposes with the same sampler the target verifies
with, and a draft is accepted while it equals the token the target sampled at that position. Every emitted token
is therefore drawn from the target's own distribution (greedy: exactly the target's argmax sequence).

Temperature 0 is greedy (argmax of the log-probabilities, as mlx-lm's ``greedy_sampler``). Temperature > 0 draws
from ``softmax(logprobs / T)`` with an explicit PRNG key split per call, so a run is reproducible from its seed
and never touches MLX's global random state.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

__all__ = ["Sampling", "TokenSampler"]


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked: ``temperature`` 0 is greedy; ``seed`` makes sampled runs reproducible."""

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(self.temperature).__name__}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")

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

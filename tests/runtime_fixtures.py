"""Shared fixtures for the MLX runtime tests: tiny model directories and a plain-greedy reference.

Import the fixtures into a test module (``from tests.runtime_fixtures import tiny, ...``). Model directories
are written once per session (a few milliseconds each); the identity memo goes to a session temp directory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from spec_cache.drafters import load_provider
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

#: Drafter variants every engine test runs: name -> (method, write_tiny_drafter options)
DRAFTERS = {
    "draft-model": ("draft-model", {}),  # first target layer only: partial acceptance
    "draft-model-full": ("draft-model", {"layers": 2}),  # the target itself: every draft accepted
    "assistant": ("assistant", {}),
    "ngram": ("ngram", {}),
    "deepspec": ("deepspec", {}),  # projected context, token-by-token drafting
    "dflash": ("dflash", {"gamma": 4}),  # projected context, one block forward (untrained: drafts rarely agree)
    "qwen-mtp": ("qwen-mtp", {}),  # one-layer MTP head over the target's last hidden
    "dflash2": ("dflash2", {"gamma": 4}),  # DFlash with projections quantized at load (b4)
}

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43],
]


@dataclass
class Tiny:
    """One tiny target and its drafter directories."""

    root: Path
    target: TargetModel

    def drafter_dir(self, name: str) -> Path:
        return self.root / name

    def provider(self, name: str | None):
        return None if name is None else load_provider(self.drafter_dir(name))


def build_tiny(root: Path, arch: str = "llama", seed: int = 0, drafters: dict | None = None, **target_options) -> Tiny:
    """A tiny target (``write_tiny_target`` options) and its drafter directories (default: ``DRAFTERS``)."""
    target_dir = write_tiny_target(root / "target", arch, seed=seed, tokenizer=False, **target_options)
    for name, (method, options) in (DRAFTERS if drafters is None else drafters).items():
        write_tiny_drafter(root / name, method, target_dir, seed=seed, **options)
    return Tiny(root, TargetModel.load(target_dir))


@pytest.fixture(scope="session", autouse=True)
def _identity_memo(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path_factory.mktemp("identity-memo")))
        yield


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    """The llama tiny target with every drafter."""
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"))


#: per target (weakly: a target's ``id`` is reused once it is collected, and an ``id`` key once served one
#: model's tokens for another's, failing a test in a long run only) -> {(prompt, max_tokens, options): tokens}
_PLAIN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def plain_greedy(target: TargetModel, prompt: list[int], max_tokens: int, **options) -> list[int]:
    """The target's own greedy tokens from mlx-lm's ``generate_step`` (memoized per target, prompt and options,
    e.g. ``kv_bits``/``kv_group_size``/``quantized_kv_start``/``prefill_step_size``)."""
    key = (tuple(prompt), max_tokens, tuple(sorted(options.items())))
    memo = _PLAIN.setdefault(target, {})
    if key not in memo:
        steps = generate_step(mx.array(prompt), target.model, max_tokens=max_tokens, **options)
        memo[key] = [token for token, _ in steps]
    return list(memo[key])


class CheckpointRecorder:
    """An ``on_checkpoint`` callback that keeps every call and checks each cache covers exactly its tokens."""

    def __init__(self):
        self.calls = []

    def __call__(self, row, tokens, caches, draft):
        assert all(cache.offset == len(tokens) for cache in caches)
        self.calls.append((row, list(tokens), caches, draft))

    def boundary(self, row):
        """The row's first checkpoint (its prompt boundary)."""
        return next(call for call in self.calls if call[0] == row)

    def finish(self, row):
        """The row's last checkpoint."""
        return [call for call in self.calls if call[0] == row][-1]


class _Stays(KVCache):
    """A layer ``maybe_quantize_kv_cache`` leaves in full precision (its ``to_quantized`` is a no-op)."""

    def to_quantized(self, **_):
        return self


def _converting(bits: int, group_size: int) -> type:
    class Converts(KVCache):
        def to_quantized(self, **_):  # the layer's own setting, whatever generate_step asks for
            return KVCache.to_quantized(self, group_size=group_size, bits=bits)

    return Converts


def per_layer_greedy(target: TargetModel, prompt: list[int], max_tokens: int, layers: dict, start: int,
                     prefill_step_size: int = 2048) -> list[int]:
    """mlx-lm's ``generate_step`` with a per-layer KV quantization (``layers``: index -> (bits, group_size)).

    mlx-lm has no ``kv_config``; its conversion hook calls ``cache.to_quantized`` on every layer once the offset
    reaches ``quantized_kv_start``, so layers whose ``to_quantized`` applies their own setting (or keeps the
    layer) make ``generate_step`` itself the reference.
    """
    caches = [(_converting(*layers[i]) if i in layers else _Stays)() for i in range(target.num_layers)]
    steps = generate_step(mx.array(prompt), target.model, max_tokens=max_tokens, prompt_cache=caches, kv_bits=8,
                          quantized_kv_start=start, prefill_step_size=prefill_step_size)
    return [token for token, _ in steps]

"""DeepSpec: a projected-context drafter that drafts token by token.

Each step feeds one token per row (the pending token first, then its own last draft) at the row's next
position; every drafter layer attends over the row's projected context and the K/V of the tokens drafted so far
this round (kept only for the round: the row state is the context alone). The output runs through the target's
final head. Shared machinery, config keys and the row checkpoint: ``projected.py``. ``config.json`` carries
``"method": "deepspec"``; the namespace is ``deepspec-context-v1:<identity of config.json + weights>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.schemas import DEEPSPEC_CONTEXT_V1

from ..rows import check_per_row
from .base import directory_namespace
from .projected import ContextKV, ProjectedConfig, load_network
from .projected_rows import ProjectedProvider, ProjectedRows

__all__ = ["DeepSpecProvider", "DeepSpecRows", "METHOD"]

METHOD = "deepspec"


class DeepSpecRows(ProjectedRows):
    """DeepSpec draft rows: ``depth`` chained single-token steps against the projected context."""

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0 or not pending:
            return [[] for _ in pending]
        model = self.target.model
        dtype = self.provider.dtype
        contexts = self._contexts()
        positions = mx.array(self._processed, dtype=mx.int32)
        ids = mx.array(list(pending), dtype=mx.uint32)[:, None]
        ones = mx.ones((len(pending), 1), dtype=mx.bool_)
        steps = []
        for step in range(depth):
            hidden, block = self.network(model.embed(ids).astype(dtype), positions + step, contexts, causal=True)
            ids = self._sampler(model.logits(hidden.astype(model.dtype))[:, -1, :]).astype(mx.uint32)[:, None]
            steps.append(ids)
            contexts = [_extended(context, keys, values, ones) for context, (keys, values) in zip(contexts, block)]
        return mx.concatenate(steps, axis=1).tolist()


def _extended(context: ContextKV, keys: mx.array, values: mx.array, valid: mx.array) -> ContextKV:
    if context.keys is None:
        return ContextKV(keys, values, mx.broadcast_to(valid, (keys.shape[0], keys.shape[2])))
    return ContextKV(mx.concatenate([context.keys, keys], axis=2), mx.concatenate([context.values, values], axis=2),
                     mx.concatenate([context.valid, valid], axis=1))


class DeepSpecProvider(ProjectedProvider):
    """A loaded DeepSpec drafter (``config.json`` with ``"method": "deepspec"`` + ``*.safetensors``)."""

    schema = DEEPSPEC_CONTEXT_V1
    family = "DeepSpec"
    rows_class = DeepSpecRows

    @classmethod
    def load(cls, model_dir: str | Path) -> "DeepSpecProvider":
        path = Path(model_dir)
        config = ProjectedConfig.from_dict(json.loads((path / "config.json").read_text()), METHOD)
        return cls(load_network(path, config), directory_namespace(cls.schema, path, "config.json"), path)

"""DeepSpec: a projected-context drafter that drafts a block (the seed's ``gamma = block_size``) and slices it.

With ``block_size`` in the config (the seed's DeepSpec): one non-causal forward over the pending token followed
by ``block_size - 1`` mask tokens (``mask_token_id``) at the row's next positions, attending over the row's
projected context and the whole block; the output at block position ``k`` (``0..block_size-1``, through the
target's head) is draft ``k``, and the round takes the first ``depth`` of them. One drafter forward per round,
whatever the depth.

Without ``block_size`` (this project's earlier DeepSpec directories, kept drafting as they did): ``depth``
chained single-token steps, each feeding one token per row (the pending token first, then its own last draft)
and attending over the context and this round's earlier steps.

Shared machinery, config keys and the row checkpoint: ``projected.py``. ``config.json`` carries
``"method": "deepspec"``; the namespace is ``deepspec-context-v1:<identity of config.json + weights>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.drafters.base import directory_namespace
from spec_cache.drafters.dflash import block_logits
from spec_cache.drafters.projected import ContextKV, ProjectedConfig, load_network
from spec_cache.drafters.projected_rows import ProjectedProvider, ProjectedRows
from spec_cache.rows.protocol import check_per_row
from spec_cache.schemas import DEEPSPEC_CONTEXT_V1

__all__ = ["DeepSpecProvider", "DeepSpecRows", "METHOD"]

METHOD = "deepspec"


class DeepSpecRows(ProjectedRows):
    """DeepSpec draft rows: one block forward sliced to ``depth`` (``block_size`` configs), else ``depth`` chained
    single-token steps, against the projected context."""

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0 or not pending:
            return [[] for _ in pending]
        config = self.provider.config
        if config.block_size:
            logits = block_logits(self, pending, config.block_size, config.mask_token_id)
            return self._sampler(logits)[:, :depth].tolist()
        return self._draft_steps(pending, depth)

    def _draft_steps(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        """The token-by-token drafting of configs without ``block_size``."""
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

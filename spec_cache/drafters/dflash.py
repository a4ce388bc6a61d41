"""DFlash / DSpark: a projected-context drafter that drafts a whole block in one forward.

The block is the pending token followed by ``gamma - 1`` mask tokens (``gamma``: the block width the drafter
was trained for), at the row's next positions. Every drafter layer attends over the row's projected context and
the whole block (no causal mask inside it); the outputs at block positions ``1..gamma-1``, through the target's
head, are the drafts. Shared machinery, the other config keys and the row checkpoint: ``projected.py``.

**Early stop** (DSpark's ``sts.thresholds`` / ``minConf``, the seed's confidence-scheduled draft length): draft
``k`` of the block (``k >= 1``; the first draft is always kept) ends the row's proposal when its confidence is
below ``sts.thresholds[k]`` (``minConf`` for positions past the list). The seed's confidence is a learned head;
this network has none, so the confidence is the drafter's own probability of its draft (softmax of its logits).
A shorter proposal changes only how many tokens the target verifies, never which tokens are emitted.

**Config file**: ``dspark.json`` (this project's layout), else a published DFlash ``config.json``
(``dflash_config.py``). The namespace is ``dflash-context-v1:<identity of that file + weights>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from spec_cache.drafters.base import directory_namespace
from spec_cache.drafters.dflash_config import DSPARK_NAME, read_dflash_config
from spec_cache.drafters.projected import ProjectedConfig, load_network
from spec_cache.drafters.projected_rows import ProjectedProvider, ProjectedRows
from spec_cache.rows.protocol import check_per_row
from spec_cache.schemas import DFLASH_CONTEXT_V1

__all__ = ["DFlashProvider", "DFlashRows", "METHOD", "CONFIG_NAME", "block_logits", "kept_lengths"]

METHOD = "dflash"
CONFIG_NAME = DSPARK_NAME


def block_logits(rows: Any, pending: Sequence[int], width: int, mask_token_id: int) -> mx.array:
    """Target-head logits ``[B, width, V]`` of one non-causal drafter forward over each row's block: its pending
    token, then ``width - 1`` mask tokens, at the row's next positions, over its projected context."""
    model = rows.target.model
    block = mx.array([[token] + [mask_token_id] * (width - 1) for token in pending], dtype=mx.uint32)
    positions = mx.array(rows._processed, dtype=mx.int32)
    hidden, _ = rows.network(model.embed(block).astype(rows.provider.dtype), positions, rows._contexts(),
                             causal=False)
    return model.logits(hidden.astype(model.dtype))


def kept_lengths(logits: mx.array, drafts: mx.array, config: ProjectedConfig) -> list[int]:
    """Per row, how many of the ``drafts`` ``[B, W]`` (with their ``logits`` ``[B, W, V]``) the early stop keeps:
    all of them without ``sts.thresholds`` / ``minConf``, else up to the first draft ``k >= 1`` whose probability
    is below its threshold."""
    rows, width = drafts.shape
    limits = [config.sts_thresholds[k] if k < len(config.sts_thresholds) else config.min_conf
              for k in range(width)]
    if all(limit is None for limit in limits[1:]):
        return [width] * rows
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    confidence = mx.take_along_axis(probs, drafts.astype(mx.int32)[..., None], axis=-1)[..., 0].tolist()
    kept = []
    for row in confidence:
        low = [k for k in range(1, width) if limits[k] is not None and row[k] < limits[k]]
        kept.append(low[0] if low else width)
    return kept


class DFlashRows(ProjectedRows):
    """DFlash draft rows: one block forward per round; up to ``min(depth, gamma - 1)`` drafts per row, fewer
    where the early stop ends the block."""

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0 or not pending:
            return [[] for _ in pending]
        config = self.provider.config
        logits = block_logits(self, pending, config.gamma, config.mask_token_id)[:, 1:, :]
        drafts = self._sampler(logits)[:, :depth]
        kept = kept_lengths(logits[:, : drafts.shape[1], :], drafts, config)
        return [row[:count] for row, count in zip(drafts.tolist(), kept)]


class DFlashProvider(ProjectedProvider):
    """A loaded DFlash/DSpark drafter (``dspark.json`` or a published DFlash ``config.json``, + weights)."""

    schema = DFLASH_CONTEXT_V1
    family = "DFlash"
    rows_class = DFlashRows

    @property
    def gamma(self) -> int:
        return self.config.gamma

    @classmethod
    def load(cls, model_dir: str | Path) -> "DFlashProvider":
        path = Path(model_dir)
        raw, config_name = read_dflash_config(path)
        config = ProjectedConfig.from_dict(raw, METHOD, block=True)
        return cls(load_network(path, config), directory_namespace(cls.schema, path, config_name), path)

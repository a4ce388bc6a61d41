"""DFlash / DSpark: a projected-context drafter that drafts a whole block in one forward.

The block is the pending token followed by ``gamma - 1`` mask tokens (``gamma``: the block width the drafter
was trained for, from ``dspark.json``), at the row's next positions. Every drafter layer attends over the row's
projected context and the whole block (no causal mask inside it); the outputs at block positions ``1..gamma-1``,
through the target's head, are the drafts. Shared machinery, the other config keys and the row checkpoint:
``projected.py``. The directory's config is ``dspark.json``; the namespace is
``dflash-context-v1:<identity of dspark.json + weights>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from spec_cache.schemas import DFLASH_CONTEXT_V1

from ..rows import check_per_row
from .base import directory_namespace
from .projected import ProjectedConfig, load_network
from .projected_rows import ProjectedProvider, ProjectedRows

__all__ = ["DFlashProvider", "DFlashRows", "METHOD", "CONFIG_NAME"]

METHOD = "dflash"
CONFIG_NAME = "dspark.json"


class DFlashRows(ProjectedRows):
    """DFlash draft rows: one block forward per round; up to ``min(depth, gamma - 1)`` drafts per row."""

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0 or not pending:
            return [[] for _ in pending]
        config = self.provider.config
        model = self.target.model
        block = mx.array([[token] + [config.mask_token_id] * (config.gamma - 1) for token in pending], dtype=mx.uint32)
        positions = mx.array(self._processed, dtype=mx.int32)
        hidden, _ = self.network(model.embed(block).astype(self.provider.dtype), positions, self._contexts(),
                                 causal=False)
        drafts = self._sampler(model.logits(hidden[:, 1:, :].astype(model.dtype)))
        return drafts[:, :depth].tolist()


class DFlashProvider(ProjectedProvider):
    """A loaded DFlash/DSpark drafter (``dspark.json`` + ``*.safetensors``)."""

    schema = DFLASH_CONTEXT_V1
    family = "DFlash"
    rows_class = DFlashRows

    @property
    def gamma(self) -> int:
        return self.config.gamma

    @classmethod
    def load(cls, model_dir: str | Path) -> "DFlashProvider":
        path = Path(model_dir)
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"DFlash drafter directory {path} has no {CONFIG_NAME}")
        config = ProjectedConfig.from_dict(json.loads((path / CONFIG_NAME).read_text()), METHOD, block=True)
        return cls(load_network(path, config), directory_namespace(cls.schema, path, CONFIG_NAME), path)

"""DFlash 2: the DFlash block drafter from a ``config.json``, its projections quantized when it is loaded.

Drafting and the row checkpoint are DFlash's (``dflash.py``, ``projected.py``), stored under their own schema
``dflash2-context-v1`` so a DFlash 2 context is never restored into a DFlash drafter or back. The drafter's
linear projections are quantized to ``draft_bits`` bits (config key, default 4 as in mlx-bun; 0 keeps the stored
float weights) with group size ``draft_group_size`` (64) at load, and the context it projects depends on that
width, so the namespace carries it: ``dflash2-context-v1:<identity of config.json + weights>:b<bits>``
(mlx-bun's formula). Config keys otherwise as DFlash (``gamma``, ``mask_token_id``, ...), with
``"method": "dflash2"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from spec_cache.drafters.dflash import DFlashProvider, DFlashRows
from spec_cache.drafters.projected import ProjectedConfig, load_network
from spec_cache.errors import InvalidRequest
from spec_cache.schemas import DFLASH2_CONTEXT_V1

__all__ = ["DFlash2Provider", "METHOD", "DEFAULT_BITS"]

METHOD = "dflash2"
#: the projection width mlx-bun's draft registry loads DFlash 2 with
DEFAULT_BITS = 4
_BITS = (0, 2, 3, 4, 5, 6, 8)


def dflash2_bits(config: dict) -> tuple[int, int]:
    """``(draft_bits, draft_group_size)`` of a DFlash 2 config, checked (ValueError)."""
    bits = config.get("draft_bits", DEFAULT_BITS)
    group = config.get("draft_group_size", 64)
    if isinstance(bits, bool) or bits not in _BITS:
        raise InvalidRequest(f"{METHOD} draft_bits must be one of {', '.join(map(str, _BITS))}, got {bits!r}")
    if isinstance(group, bool) or group not in (32, 64, 128):
        raise InvalidRequest(f"{METHOD} draft_group_size must be 32, 64 or 128, got {group!r}")
    return bits, group


class DFlash2Provider(DFlashProvider):
    """A loaded DFlash 2 drafter (``config.json`` with ``"method": "dflash2"`` + ``*.safetensors``)."""

    schema = DFLASH2_CONTEXT_V1
    family = "DFlash 2"
    rows_class = DFlashRows

    @property
    def dtype(self) -> mx.Dtype:
        fc = self.network.fc
        return fc.scales.dtype if isinstance(fc, nn.QuantizedLinear) else fc.weight.dtype

    @classmethod
    def load(cls, model_dir: str | Path) -> "DFlash2Provider":
        from spec_cache.naming.identity import model_identity
        from spec_cache.naming.namespace import dflash2_namespace

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"DFlash 2 drafter directory {path} has no config.json")
        raw = json.loads((path / "config.json").read_text())
        config = ProjectedConfig.from_dict(raw, METHOD, block=True)
        bits, group = dflash2_bits(raw)
        network = load_network(path, config)
        if bits:
            nn.quantize(network, group_size=group, bits=bits,
                        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group == 0)
            mx.eval(network.parameters())
        return cls(network, dflash2_namespace(model_identity(path, config_name="config.json"), bits), path)

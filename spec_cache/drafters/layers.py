"""Network pieces the trained drafters (assistant, DeepSpec, DFlash) share: the SwiGLU MLP and weight loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

__all__ = ["MLP", "load_weights"]

Network = TypeVar("Network", bound=nn.Module)


class MLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` over ``config.hidden_size``/``config.intermediate_size``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def load_weights(network: Network, path: Path, method: str) -> Network:
    """``network`` with every ``*.safetensors`` of ``path`` loaded strictly and evaluated (none: FileNotFoundError)."""
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    if not weights:
        raise FileNotFoundError(f"{method} drafter {path} has no *.safetensors weights")
    network.load_weights(list(weights.items()), strict=True)
    mx.eval(network.parameters())
    return network

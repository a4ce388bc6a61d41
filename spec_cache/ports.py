"""Architecture ports: the few entry points of an mlx-lm decoder the speculative runtime uses.

A port runs the same operations in the same order as the mlx-lm model's ``__call__`` (so logits are
bit-identical), and additionally hands out the residual stream after chosen layers (*taps*, for drafters that
condition on target hiddens). Supporting another architecture means adding one port class here.

* :class:`DecoderPort`: llama-layout decoders (llama, mistral, qwen2): embeddings, a stack of full-attention
  layers sharing one mask, final norm, head (tied or not).
* :class:`Gemma3Port`: ``gemma3_text``: scaled embeddings, interleaved sliding-window and global layers with
  one mask per kind, ``(1 + w)`` norms inside the layers, final norm, head.

Every port answers ``layer_window(i)``: the sliding window of layer ``i`` (None for full attention). The
batched rows keep sliding layers as plain KV plus a window mask (exact rollback, see ``target.py``); a single
row run through mlx-lm's own caches (``make_cache``) uses ``RotatingKVCache`` as mlx-lm does.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

__all__ = ["DecoderPort", "Gemma3Port", "PORTS", "SUPPORTED_ARCHITECTURES", "out_features"]


def out_features(linear: Any) -> int:
    """Output size of an ``nn.Linear``, also when wrapped for LoRA (``LoRALinear.linear``)."""
    inner = getattr(linear, "linear", linear)
    return int(inner.weight.shape[0])


class DecoderPort:
    """llama-layout decoders: embeddings, a plain stack of full-attention layers, final norm, head."""

    def __init__(self, model: Any, config: dict) -> None:
        inner = getattr(model, "model", None)
        for part in ("embed_tokens", "layers", "norm"):
            if inner is None or not hasattr(inner, part):
                raise NotImplementedError(f"model_type {config.get('model_type')!r}: no model.{part} to port")
        if any(kind != "full_attention" for kind in (getattr(inner, "layer_types", None) or [])):
            raise NotImplementedError(
                f"model_type {config.get('model_type')!r} with sliding-window layer_types has no target port; "
                "sliding windows are supported for gemma3_text"
            )
        self.model = model
        self.inner = inner
        self.tied = bool(getattr(model.args, "tie_word_embeddings", False))

    def embed(self, ids: mx.array) -> mx.array:
        return self.inner.embed_tokens(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.inner.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def layers(self) -> list:
        return list(self.inner.layers)

    def layer_window(self, layer: int) -> int | None:
        return None

    def make_caches(self) -> list:
        return [KVCache() for _ in self.inner.layers]

    def run_layers(self, h: mx.array, caches: Sequence[Any], taps: Sequence[int]) -> tuple[mx.array, dict]:
        mask = create_attention_mask(h, caches[0] if caches else None)
        tapped: dict[int, mx.array] = {}
        for index, (layer, cache) in enumerate(zip(self.inner.layers, caches)):
            h = layer(h, mask, cache)
            if index in taps:
                tapped[index] = h
        return self.inner.norm(h), tapped


class Gemma3Port:
    """``gemma3_text``: every ``sliding_window_pattern``-th layer is global, the others attend over a window."""

    def __init__(self, model: Any, config: dict) -> None:
        inner = getattr(model, "model", None)
        for part in ("embed_tokens", "layers", "norm", "window_size", "sliding_window_pattern"):
            if inner is None or not hasattr(inner, part):
                raise NotImplementedError(f"model_type {config.get('model_type')!r}: no model.{part} to port")
        self.model = model
        self.inner = inner
        self.pattern = int(inner.sliding_window_pattern)
        self.window = int(inner.window_size)
        self.scale = mx.array(inner.args.hidden_size**0.5, mx.bfloat16)  # exactly as Gemma3Model scales

    def _is_global(self, layer: int) -> bool:
        return layer % self.pattern == self.pattern - 1

    def embed(self, ids: mx.array) -> mx.array:
        h = self.inner.embed_tokens(ids)
        return h * self.scale.astype(h.dtype)

    def logits(self, hidden: mx.array) -> mx.array:
        if getattr(self.model, "tie_word_embeddings", False) or "lm_head" not in self.model:
            return self.inner.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def layers(self) -> list:
        return list(self.inner.layers)

    def layer_window(self, layer: int) -> int | None:
        return None if self._is_global(layer) else self.window

    def make_caches(self) -> list:
        return self.model.make_cache()

    def run_layers(self, h: mx.array, caches: Sequence[Any], taps: Sequence[int]) -> tuple[mx.array, dict]:
        layers = self.inner.layers
        globals_ = [i for i in range(len(layers)) if self._is_global(i)]
        slidings = [i for i in range(len(layers)) if not self._is_global(i)]
        global_mask = create_attention_mask(h, caches[globals_[0]]) if globals_ else None
        sliding_mask = None
        if slidings and self.pattern > 1:
            sliding_mask = create_attention_mask(h, caches[slidings[0]], window_size=self.window)
        tapped: dict[int, mx.array] = {}
        for index, (layer, cache) in enumerate(zip(layers, caches)):
            h = layer(h, global_mask if self._is_global(index) else sliding_mask, cache)
            if index in taps:
                tapped[index] = h
        return self.inner.norm(h), tapped


PORTS = {"llama": DecoderPort, "mistral": DecoderPort, "qwen2": DecoderPort, "gemma3_text": Gemma3Port}
#: model_type values with a target port
SUPPORTED_ARCHITECTURES = tuple(PORTS)

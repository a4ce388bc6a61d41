"""Architecture ports: the few entry points of an mlx-lm decoder the speculative runtime uses.

A port runs the same operations in the same order as the mlx-lm model's ``__call__`` (so logits are
bit-identical), and additionally hands out the residual stream after chosen layers (*taps*, for drafters that
condition on target hiddens). Supporting another architecture means adding one port class here.

* :class:`DecoderPort`: llama-layout decoders (llama, mistral, qwen2): embeddings, a stack of full-attention
  layers sharing one mask, final norm, head (tied or not).
* :class:`Gemma3Port`: ``gemma3_text``: a ``DecoderPort`` with scaled embeddings and interleaved sliding-window
  and global layers (one mask per kind; the ``(1 + w)`` norms live inside mlx-lm's layers).
* :class:`Gemma4Port`: ``gemma4_text``: scaled embeddings plus per-layer inputs (a second embedding of the ids
  and a projection of the first, one slice per layer), sliding/global layers, and *KV-shared* layers at the end
  that hold no cache and attend over the K/V of the last earlier layer of their kind; soft-capped logits.
* :class:`Qwen3NextPort`: ``qwen3_next``: a ``DecoderPort`` whose layers are a hybrid of gated-delta (recurrent,
  ``ArraysCache``: conv state + recurrent state) and full-attention layers.

Caches are per *cache layer*: ``make_caches()`` is mlx-lm's ``make_cache()`` (Gemma 4's KV-shared layers have
none, so a port's ``layers()`` are the layers that hold a cache, and ``depth`` counts every decoder layer; taps
index decoder layers). ``layer_kind(i)`` says what cache layer ``i`` holds: ``"attention"`` (K/V, sliding or
not) or ``"recurrent"`` (``ArraysCache``, never trimmable).

Every port answers ``layer_window(i)``: the sliding window of layer ``i`` (None for full attention). The
batched rows keep sliding layers as plain KV plus a window mask (exact rollback, see ``target.py``); a single
row run through mlx-lm's own caches (``make_cache``) uses ``RotatingKVCache`` as mlx-lm does.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from spec_cache.rows import layer_times

__all__ = ["DecoderPort", "Gemma3Port", "Gemma4Port", "Qwen3NextPort", "PORTS", "SUPPORTED_ARCHITECTURES",
           "out_features"]


def out_features(linear: Any) -> int:
    """Output size of an ``nn.Linear``, also when wrapped for LoRA (``LoRALinear.linear``)."""
    inner = getattr(linear, "linear", linear)
    return int(inner.weight.shape[0])


def inner_model(model: Any, config: dict, parts: Sequence[str] = ("embed_tokens", "layers", "norm")) -> Any:
    """``model.model``, the decoder stack a port drives, when it has every one of ``parts`` (else
    NotImplementedError naming the first one missing)."""
    inner = getattr(model, "model", None)
    for part in parts:
        if inner is None or not hasattr(inner, part):
            raise NotImplementedError(f"model_type {config.get('model_type')!r}: no model.{part} to port")
    return inner


class DecoderPort:
    """llama-layout decoders: embeddings, a plain stack of full-attention layers, final norm, head.

    The other ports derive from it and replace only what differs: ``__init__`` (what they check), ``embed``,
    ``layer_window``, ``layer_kind``, ``make_caches`` and the per-layer attention masks (``_masks``).
    """

    def __init__(self, model: Any, config: dict) -> None:
        inner = inner_model(model, config)
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

    @property
    def depth(self) -> int:
        return len(self.inner.layers)

    def layer_window(self, layer: int) -> int | None:
        return None

    def layer_kind(self, layer: int) -> str:
        return "attention"

    def make_caches(self) -> list:
        return [KVCache() for _ in self.inner.layers]

    def _masks(self, h: mx.array, caches: Sequence[Any], unpadded: bool) -> list:
        """The attention mask of each layer: here one causal mask for all of them.

        Rows without left padding need no array: one query per row sees every key (no mask, as mlx-lm's own
        decode step; on the GPU a mask costs a slower attention kernel, ~40% of a small model's step), and a
        longer chunk is bottom-right causal, the ``"causal"`` mode mlx-lm's single-row ``KVCache`` passes. The
        batch cache's own mask is an array even for one row (``BatchKVCache.make_mask``); on MLX's CUDA backend
        an array mask is widened per layer to an additive ``[B, heads, chunk, keys]`` bias that cuDNN then
        reads: ~1.4 GB a layer for a 1.5k-token chunk over 14k keys of an 8B-shaped model. Same scores on the
        CPU either way (both mask with ``finfo.min``), so the same tokens."""
        if unpadded:
            mask = None if h.shape[1] == 1 else "causal"
        else:
            mask = create_attention_mask(h, caches[0] if caches else None)
        return [mask] * len(caches)

    def run_layers(self, h: mx.array, caches: Sequence[Any], taps: Sequence[int], *, unpadded: bool = False,
                   **_: Any) -> tuple[mx.array, dict]:
        tapped: dict[int, mx.array] = {}
        masks = self._masks(h, caches, unpadded)
        timer = layer_times.clock(h, caches, masks[0] if masks else None)  # None unless SPEC_CACHE_LAYER_TIMES
        for index, (layer, cache, mask) in enumerate(zip(self.inner.layers, caches, masks)):
            h = layer(h, mask, cache)
            if timer is not None:
                timer.lap(h)
            if index in taps:
                tapped[index] = h
        if timer is not None:
            timer.done()
        return self.inner.norm(h), tapped


class Gemma3Port(DecoderPort):
    """``gemma3_text``: every ``sliding_window_pattern``-th layer is global, the others attend over a window;
    embeddings scaled by ``sqrt(hidden_size)``."""

    def __init__(self, model: Any, config: dict) -> None:  # not DecoderPort's: sliding layers are the point here
        self.model = model
        self.inner = inner_model(model, config, ("embed_tokens", "layers", "norm", "window_size",
                                                 "sliding_window_pattern"))
        self.pattern = int(self.inner.sliding_window_pattern)
        self.window = int(self.inner.window_size)
        self.scale = mx.array(self.inner.args.hidden_size**0.5, mx.bfloat16)  # exactly as Gemma3Model scales
        self.tied = bool(getattr(model, "tie_word_embeddings", False) or "lm_head" not in model)

    # logits, layers, depth, layer_kind and run_layers are DecoderPort's

    def embed(self, ids: mx.array) -> mx.array:
        h = self.inner.embed_tokens(ids)
        return h * self.scale.astype(h.dtype)

    def layer_window(self, layer: int) -> int | None:
        return None if layer % self.pattern == self.pattern - 1 else self.window

    def make_caches(self) -> list:
        return self.model.make_cache()

    def _masks(self, h: mx.array, caches: Sequence[Any], unpadded: bool) -> list:
        """One mask per kind of layer (global, sliding), each built over the first cache of its kind; always
        masked (a sliding layer's window needs its mask at every step)."""
        by_window: dict = {}
        for layer, cache in enumerate(caches):
            window = self.layer_window(layer)
            if window not in by_window:
                by_window[window] = create_attention_mask(h, cache, window_size=window)
        return [by_window[self.layer_window(layer)] for layer in range(len(caches))]


class Gemma4Port:
    """``gemma4_text``: Gemma3-like layers plus per-layer inputs and KV-shared trailing layers.

    The first ``num_hidden_layers - num_kv_shared_layers`` layers hold caches (mlx-lm's ``make_cache``); each
    later layer reuses the K/V (and RoPE offset) the last cache-holding layer of its kind produced in the same
    forward, exactly as ``Gemma4TextModel.__call__`` wires them (``previous_kvs``).
    """

    def __init__(self, model: Any, config: dict) -> None:
        inner = inner_model(model, config, ("embed_tokens", "layers", "norm", "window_size", "previous_kvs",
                                            "_make_masks"))
        self.model = model
        self.inner = inner
        self.window = int(inner.window_size)
        self.cached = len(model.make_cache())  # layers 0..cached-1 hold caches; the rest share their K/V
        if any(inner.previous_kvs[i] != i for i in range(self.cached)):
            raise NotImplementedError("gemma4_text: a cache-holding layer that borrows another layer's K/V")
        from mlx_lm.models.gemma4_text import logit_softcap

        self._softcap = logit_softcap

    def embed(self, ids: mx.array) -> mx.array:
        return self.inner.embed_tokens(ids) * self.inner.embed_scale

    def logits(self, hidden: mx.array) -> mx.array:
        if self.model.tie_word_embeddings:
            out = self.inner.embed_tokens.as_linear(hidden)
        else:
            out = self.model.lm_head(hidden)
        cap = self.model.final_logit_softcapping
        return out if cap is None else self._softcap(cap, out)

    def layers(self) -> list:
        return list(self.inner.layers[: self.cached])

    @property
    def depth(self) -> int:
        return len(self.inner.layers)

    def layer_window(self, layer: int) -> int | None:
        return self.window if self.inner.layers[layer].layer_type == "sliding_attention" else None

    def layer_kind(self, layer: int) -> str:
        return "attention"

    def make_caches(self) -> list:
        return self.model.make_cache()

    def run_layers(self, h: mx.array, caches: Sequence[Any], taps: Sequence[int], *, ids: mx.array | None = None,
                   **_: Any) -> tuple[mx.array, dict]:
        inner = self.inner
        layers = inner.layers
        per_layer: list = [None] * len(layers)
        if inner.hidden_size_per_layer_input:
            if ids is None:
                raise ValueError("gemma4_text per-layer inputs need the token ids")
            projected = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids))
            per_layer = [projected[:, :, i, :] for i in range(len(layers))]
        full = list(caches) + [None] * (len(layers) - len(caches))
        masks = inner._make_masks(h, full)
        intermediates: list = [(None, None)] * len(layers)
        tapped: dict[int, mx.array] = {}
        for index, (layer, cache, mask, source) in enumerate(zip(layers, full, masks, inner.previous_kvs)):
            shared, offset = intermediates[source]
            h, shared, offset = layer(h, mask, cache, per_layer_input=per_layer[index], shared_kv=shared,
                                      offset=offset)
            intermediates[index] = (shared, offset)
            if index in taps:
                tapped[index] = h
        return inner.norm(h), tapped


class Qwen3NextPort(DecoderPort):
    """``qwen3_next``: gated-delta recurrent layers (``ArraysCache(2)``: conv state, recurrent state) every
    ``full_attention_interval - 1`` of ``full_attention_interval`` layers, full attention in the others.

    ``run_layers(..., record=dict)`` also hands out each recurrent layer's normalized input (what its mixer
    read): the rows replay a prefix of a verify window through the mixer alone to roll the state back.
    """

    def __init__(self, model: Any, config: dict) -> None:  # not DecoderPort's: no llama-only checks
        inner = inner_model(model, config)
        self.model = model
        self.inner = inner
        self.linear = [bool(layer.is_linear) for layer in inner.layers]
        if all(self.linear):
            raise NotImplementedError("qwen3_next without a full-attention layer has no way to tell a row's length "
                                      "from its caches; full_attention_interval must be <= num_hidden_layers")
        self.tied = bool(model.args.tie_word_embeddings)

    # embed, logits, layers, depth and layer_window (no sliding layers) are DecoderPort's

    def layer_kind(self, layer: int) -> str:
        return "recurrent" if self.linear[layer] else "attention"

    def make_caches(self) -> list:
        return [ArraysCache(size=2) if linear else KVCache() for linear in self.linear]

    def mixer(self, layer: int) -> Any:
        """Recurrent layer ``layer``'s token mixer: ``mixer(normed_inputs, mask, cache)``."""
        return self.inner.layers[layer].linear_attn

    def run_layers(self, h: mx.array, caches: Sequence[Any], taps: Sequence[int], *, record: dict | None = None,
                   **_: Any) -> tuple[mx.array, dict]:
        attention = self.linear.index(False)
        fa_mask = create_attention_mask(h, caches[attention])
        ssm_mask = create_ssm_mask(h, caches[self.linear.index(True)]) if any(self.linear) else None
        tapped: dict[int, mx.array] = {}
        for index, (layer, cache) in enumerate(zip(self.inner.layers, caches)):
            if layer.is_linear:  # Qwen3NextDecoderLayer.__call__, with the mixer's input kept
                normed = layer.input_layernorm(h)
                if record is not None:
                    record[index] = normed
                r = layer.linear_attn(normed, ssm_mask, cache)
            else:
                r = layer.self_attn(layer.input_layernorm(h), fa_mask, cache)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if index in taps:
                tapped[index] = h
        return self.inner.norm(h), tapped


PORTS = {"llama": DecoderPort, "mistral": DecoderPort, "qwen2": DecoderPort, "gemma3_text": Gemma3Port,
         "gemma4_text": Gemma4Port, "qwen3_next": Qwen3NextPort}
#: model_type values with a target port
SUPPORTED_ARCHITECTURES = tuple(PORTS)

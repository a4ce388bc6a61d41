"""Projected-context drafters (DeepSpec, DFlash/DSpark): what they share.

The target's residual stream at the drafter's *tap layers* (``target_layer_ids``), for every token the target
processes (prefill and each verify forward), is concatenated and projected into the drafter's own context:
``ctx = RMSNorm(fc(concat(taps)))``. Each drafter layer turns the context into its own K/V rows
(``k = rope(k_norm(k_proj(ctx)))``, ``v = v_proj(ctx)``: post-norm, post-RoPE, at the token's position) and keeps
them; a row's context grows by ``accepted + 1`` rows per round (the pending token and the kept drafts). Drafting
attends over that context plus the tokens being drafted, embedded with the target's embeddings and read out
through the target's head. How the drafting forward runs is the family's own (``deepspec.py``: one block sliced to
the depth with ``block_size``, else token by token; ``dflash.py``: one block of mask tokens in one forward, with
DSpark's confidence early stop).

The row checkpoint is the context itself: per drafter layer K and V ``[1, kvHeads, processedTokens, headDim]``,
through the ``spec-cache-kv-v1`` cache codec (schemas ``deepspec-context-v1`` / ``dflash-context-v1``). Unlike
mlx-bun, a restored checkpoint's alignment is validated: the schema's rules, then one header per drafter layer,
this drafter's K/V geometry and dtype.

This module holds the configuration and the network; ``projected_rows.py`` the provider and the grouped rows.

Config keys (``config.json`` / ``dspark.json``; a published DFlash ``config.json`` is mapped onto these by
``dflash_config.py``): ``hidden_size`` (= the target's), ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` (= the target's),
``target_layer_ids`` (tap layers: the output of decoder layer ``i``, KV-shared Gemma 4 layers included;
``num_target_layers`` itself is the post-final-norm hidden, the seed's Gemma tap sentinel), ``num_target_layers``
(the target depth it was trained for), ``target_hidden_size`` (default ``hidden_size``), ``rms_norm_eps`` (1e-6),
``rope_theta`` (10000), ``qk_norm`` (true: RMSNorm on queries and keys per head); DFlash ``gamma`` and
``mask_token_id``, ``sts: {"thresholds": [...]}`` and ``minConf``; DeepSpec ``block_size`` (+ ``mask_token_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from math import inf
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from spec_cache.drafters.layers import MLP, load_weights
from spec_cache.errors import ModelLoadError

__all__ = ["ProjectedConfig", "ProjectedNetwork", "ContextKV", "load_network"]


@dataclass(frozen=True)
class ProjectedConfig:
    """The configuration of a projected-context drafter (see module doc for the keys)."""

    method: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    gamma: int = 0  # DFlash: the trained block width (pending token + gamma - 1 mask tokens)
    mask_token_id: int = 0  # DFlash, block DeepSpec: the token fed at the positions being drafted
    #: DeepSpec: the seed's ``block_size`` (one forward over the pending token + ``block_size - 1`` mask tokens
    #: drafts ``block_size`` tokens, sliced to the round's depth); 0: this project's earlier token-by-token drafting
    block_size: int = 0
    #: DFlash/DSpark early stop (``sts.thresholds``): draft ``k`` (k >= 1) ends the block when its confidence is
    #: below ``sts_thresholds[k]`` (or ``min_conf`` past the list); empty and None: the whole block is drafted
    sts_thresholds: tuple[float, ...] = ()
    min_conf: float | None = None
    #: per drafter layer ``"full_attention"`` or ``"sliding_attention"`` (empty: all full), the window of the
    #: sliding ones, and ``is_causal`` (None: sliding layers are causal inside the drafted block, full layers take
    #: the family's rule), as published DFlash configs give them
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None

    @classmethod
    def from_dict(cls, config: dict, method: str, *, block: bool = False) -> "ProjectedConfig":
        if config.get("method", method) != method:
            raise ModelLoadError(f"not a {method} drafter config (method={config.get('method')!r})")
        required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size", "target_layer_ids", "num_target_layers"]
        required += ["gamma", "mask_token_id"] if block else []
        missing = [key for key in required if key not in config]
        if missing:
            raise ModelLoadError(f"{method} drafter config is missing {', '.join(missing)}")
        taps = config["target_layer_ids"]
        layers = config["num_target_layers"]
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ModelLoadError(f"{method} num_target_layers must be an int >= 1, got {layers!r}")
        if (not isinstance(taps, list) or not taps
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= layers for t in taps)):
            raise ModelLoadError(f"{method} target_layer_ids must be a non-empty list of layer indices in "
                                 f"[0, {layers}] ({layers}: the post-final-norm hidden), got {taps!r}")
        if block and (not isinstance(config["gamma"], int) or config["gamma"] < 2):
            raise ModelLoadError(f"{method} gamma (the trained block width) must be an int >= 2, "
                                 f"got {config['gamma']!r}")
        known = {f.name for f in fields(cls)} - {"method", "target_layer_ids"} - _EXPLICIT
        values = {key: config[key] for key in known if key in config}
        values.setdefault("target_hidden_size", config["hidden_size"])
        values.update(_block_size(config, method, block))
        values.update(_early_stop(config, method, block))
        values.update(_layer_types(config, method))
        return cls(method=method, target_layer_ids=tuple(taps), **values)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["target_layer_ids"] = list(self.target_layer_ids)
        for name in _EXPLICIT:
            out.pop(name)
        if not self.gamma and not self.block_size:
            out.pop("gamma"), out.pop("mask_token_id")
        elif not self.gamma:
            out.pop("gamma")
        if self.block_size:
            out["block_size"] = self.block_size
        if self.sts_thresholds:
            out["sts"] = {"thresholds": list(self.sts_thresholds)}
        if self.min_conf is not None:
            out["minConf"] = self.min_conf
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        for name in ("sliding_window", "is_causal"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def layer_window(self, layer: int) -> int | None:
        """Drafter layer ``layer``'s sliding window (None: full attention)."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def layer_causal(self, layer: int, causal: bool) -> bool:
        """Whether layer ``layer`` masks later block positions, for a family whose default is ``causal``."""
        if self.is_causal is not None:
            return self.is_causal
        return causal or self.layer_window(layer) is not None


#: fields read by their own rules (the seed's key names), not copied from the config as they are
_EXPLICIT = frozenset({"block_size", "sts_thresholds", "min_conf", "layer_types", "sliding_window", "is_causal"})
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(config: dict, method: str) -> dict:
    """``layer_types`` / ``sliding_window`` / ``is_causal``, checked."""
    out: dict = {}
    kinds = config.get("layer_types")
    if kinds:
        layers = config["num_hidden_layers"]
        if not isinstance(kinds, list) or len(kinds) != layers or any(kind not in _LAYER_TYPES for kind in kinds):
            raise ModelLoadError(f"{method} layer_types must list one of {', '.join(_LAYER_TYPES)} per drafter layer "
                                 f"({layers}), got {kinds!r}")
        if "sliding_attention" in kinds:  # all full attention is the default: the same drafter
            out["layer_types"] = tuple(kinds)
    window = config.get("sliding_window")
    if "sliding_attention" in out.get("layer_types", ()):
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ModelLoadError(f"{method} sliding_attention layers need sliding_window (an int >= 1), got {window!r}")
        out["sliding_window"] = window
    causal = config.get("is_causal")
    if causal is not None:
        if not isinstance(causal, bool):
            raise ModelLoadError(f"{method} is_causal must be true, false or null, got {causal!r}")
        out["is_causal"] = causal
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != inf


def _block_size(config: dict, method: str, block: bool) -> dict:
    """DeepSpec's ``block_size`` (the seed's gamma; needs ``mask_token_id`` when >= 2)."""
    if "block_size" not in config or block:
        return {}
    size = config["block_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ModelLoadError(f"{method} block_size (the drafted block width) must be an int >= 1, got {size!r}")
    if size >= 2 and "mask_token_id" not in config:
        raise ModelLoadError(f"{method} block_size {size} needs mask_token_id (the token fed at the drafted positions)")
    return {"block_size": size}


def _early_stop(config: dict, method: str, block: bool) -> dict:
    """DSpark's ``sts.thresholds`` and ``minConf`` (block drafters only), checked."""
    sts, min_conf = config.get("sts"), config.get("minConf", config.get("min_conf"))
    if sts is None and min_conf is None:
        return {}
    if not block:
        raise ModelLoadError(f"{method}: sts / minConf (confidence early stop) apply to DFlash/DSpark block drafters")
    out: dict = {}
    if sts is not None:
        thresholds = sts.get("thresholds") if isinstance(sts, dict) else None
        if not isinstance(thresholds, list) or not all(_number(t) for t in thresholds):
            raise ModelLoadError(f"{method} sts.thresholds must be a list of numbers, got {sts!r}")
        out["sts_thresholds"] = tuple(float(t) for t in thresholds)
    if min_conf is not None:
        if not _number(min_conf):
            raise ModelLoadError(f"{method} minConf must be a number, got {min_conf!r}")
        out["min_conf"] = float(min_conf)
    return out


@dataclass
class ContextKV:
    """One drafter layer's keys and values for a forward: ``[B, kvHeads, T, D]`` and the ``[B, T]`` mask of
    the positions each row may attend to (all None: no row has any context yet)."""

    keys: mx.array | None
    values: mx.array | None
    valid: mx.array | None


class _Attention(nn.Module):
    """Queries from the drafted block; keys and values from the row's context and the block itself."""

    def __init__(self, config: ProjectedConfig) -> None:
        super().__init__()
        self.config = config
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scale = head_dim**-0.5
        #: Qwen3-Next style: q_proj also yields a per-head output gate (``o_proj(out * sigmoid(gate))``)
        self.gated = bool(getattr(config, "attn_output_gate", False))
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim * (2 if self.gated else 1), bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: mx.array, count: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, count, -1).transpose(0, 2, 1, 3)

    def kv(self, x: mx.array, rope: Any, positions: mx.array) -> tuple[mx.array, mx.array]:
        """Post-norm, post-RoPE keys and values of ``x`` ``[B, L, H]`` at positions ``positions + i``."""
        keys = self._heads(self.k_proj(x), self.config.num_key_value_heads)
        if self.config.qk_norm:
            keys = self.k_norm(keys)
        return rope(keys, offset=positions), self._heads(self.v_proj(x), self.config.num_key_value_heads)

    def __call__(self, h: mx.array, rope: Any, positions: mx.array, context: ContextKV, causal: bool,
                 window: int | None = None) -> tuple:
        B, L, _ = h.shape
        gate = None
        if self.gated:
            queries, gate = mx.split(self.q_proj(h).reshape(B, L, self.config.num_attention_heads, -1), 2, axis=-1)
            queries, gate = queries.transpose(0, 2, 1, 3), gate.reshape(B, L, -1)
        else:
            queries = self._heads(self.q_proj(h), self.config.num_attention_heads)
        if self.config.qk_norm:
            queries = self.q_norm(queries)
        queries = rope(queries, offset=positions)
        keys, values = self.kv(h, rope, positions)
        query = mx.arange(L)[:, None]
        block = query >= mx.arange(L)[None, :] if causal else mx.ones((L, L), dtype=mx.bool_)
        if window is not None:
            block = block & (query - mx.arange(L)[None, :] < window)
        mask = mx.broadcast_to(block[None, None], (B, 1, L, L))
        if context.keys is not None:
            prior = mx.broadcast_to(context.valid[:, None, None, :], (B, 1, L, context.valid.shape[1]))
            if window is not None:
                # context index j of a row holds position p - T + j (its last entry is just before the block at
                # p): block query i (position p + i) sees it within the window when T + i - j < window
                T = context.valid.shape[1]
                prior = prior & (T + query - mx.arange(T)[None, :] < window)[None, None]
            mask = mx.concatenate([prior, mask], axis=-1)
            all_keys = mx.concatenate([context.keys, keys], axis=2)
            all_values = mx.concatenate([context.values, values], axis=2)
        else:
            all_keys, all_values = keys, values
        out = mx.fast.scaled_dot_product_attention(queries, all_keys, all_values, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out if gate is None else out * mx.sigmoid(gate)), keys, values


class _Layer(nn.Module):
    def __init__(self, config: ProjectedConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array, rope: Any, positions: mx.array, context: ContextKV, causal: bool,
                 window: int | None = None) -> tuple:
        """The block ``x`` ``[B, L, H]`` at ``positions + i`` attending over ``context`` and itself (all of the
        block, or causally). Returns the layer output and the block's own keys and values."""
        r, keys, values = self.self_attn(self.input_layernorm(x), rope, positions, context, causal, window)
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h)), keys, values


class ProjectedNetwork(nn.Module):
    """``fc`` + ``hidden_norm`` (taps -> context), the drafter layers, the final norm; RoPE over ``head_dim``."""

    def __init__(self, config: ProjectedConfig) -> None:
        super().__init__()
        self.config = config
        width = len(config.target_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [_Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._rope = nn.RoPE(config.head_dim, traditional=False, base=config.rope_theta)

    def context_kv(self, taps: mx.array, positions: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Per drafter layer the K/V context rows of target taps ``[B, L, len(taps) * H]`` at ``positions + i``."""
        context = self.hidden_norm(self.fc(taps))
        return [layer.self_attn.kv(context, self._rope, positions) for layer in self.layers]

    def __call__(self, x: mx.array, positions: mx.array, contexts: Sequence[ContextKV], causal: bool) -> tuple:
        """Run the drafted block ``x`` (embeddings ``[B, L, H]``); returns the final hidden and per layer the
        block's K/V (DeepSpec carries them to its next step)."""
        block_kv = []
        for index, (layer, context) in enumerate(zip(self.layers, contexts)):
            x, keys, values = layer(x, self._rope, positions, context, self.config.layer_causal(index, causal),
                                    self.config.layer_window(index))
            block_kv.append((keys, values))
        return self.norm(x), block_kv


def load_network(path: Path, config: ProjectedConfig) -> ProjectedNetwork:
    return load_weights(ProjectedNetwork(config), path, config.method)

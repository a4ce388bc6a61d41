"""The training-time view of a ``qwen-mtp`` head: its config for a target, and the chained teacher-forced loss.

Why a qwen-mtp head (not the assistant block): the head reads exactly what a self-distillation corpus gives, the
target's pre-final-norm hidden ``h_i`` and the next token ``t_{i+1}``, and its own K/V over those pairs makes the
teacher-forced forward over a whole window one causal pass, as the engine's prefill runs it. The assistant reads
the target's K/V of donor layers per draft step, which a training batch would have to rebuild position by
position. A trained head is saved as a plain ``qwen-mtp`` directory, so it runs through the engine unchanged.

Chained loss (``depth`` > 1): drafting feeds draft ``k + 1`` the head's own output hidden of draft ``k``. Pass
``d`` of the loss reproduces that with teacher forcing: pair ``j`` reads ``(out_{d-1}[j - 1], t_{j+1})`` at
position ``j`` and attends to the true pairs at positions ``<= j - d + 1`` and, for each earlier pass ``e >= 2``,
to that pass's pair at position ``j - d + e`` (the K/V the engine's draft loop holds at that step). Pass 1 is
the plain causal forward, identical to :class:`QwenMTPNetwork`'s.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from spec_cache.drafters.qwen_mtp import QwenMTPConfig, QwenMTPNetwork
from spec_cache.errors import UnsupportedCombination
from spec_cache.rows.target import TargetModel

__all__ = ["head_config", "new_head", "chained_outputs", "chained_losses", "chain_masks", "subset_projection"]


def head_config(target: TargetModel, intermediate_size: int | None = None) -> QwenMTPConfig:
    """A one-layer head shaped like the target's attention (heads, KV heads, head_dim, RoPE base, MLP width).

    Raises UnsupportedCombination when the target's config lacks what the head needs (the message says what)."""
    config = target.config
    model_type = config.get("model_type")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        width = int(intermediate_size or config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedCombination(f"cannot build a qwen-mtp head for model_type {model_type!r}: its config has "
                                     f"no usable {exc}") from None
    if heads % kv_heads:
        raise UnsupportedCombination(f"cannot build a qwen-mtp head: {heads} attention heads are not a multiple "
                                     f"of {kv_heads} KV heads")
    return QwenMTPConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, intermediate_size=width, vocab_size=vocab,
                         rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         rope_theta=float(config.get("rope_theta", 10000.0)), qk_norm=True)


def new_head(config: QwenMTPConfig, seed: int) -> QwenMTPNetwork:
    """A float32 head drawn from ``seed`` (MLX's default initialisers; norms one)."""
    mx.random.seed(seed)
    network = QwenMTPNetwork(config)
    network.set_dtype(mx.float32)
    mx.eval(network.parameters())
    return network


def chain_masks(length: int, depth: int) -> list[mx.array]:
    """Per pass ``d`` (1-based) the boolean mask ``[L, d * L]`` of what query ``j`` attends to (module doc)."""
    j = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    masks = []
    for d in range(1, depth + 1):
        parts = [k <= j - d + 1] + [k == j - d + e for e in range(2, d + 1)]
        masks.append(mx.array(np.concatenate(parts, axis=1)))
    return masks


def _qkv(network: QwenMTPNetwork, x: mx.array) -> tuple:
    """Queries (and the output gate), keys and values of the head's layer for inputs ``x`` at positions 0..L-1,
    as ``_Attention`` computes them."""
    layer = network.layers[0]
    attn = layer.self_attn
    config = network.config
    h = layer.input_layernorm(x)
    B, L, _ = h.shape
    gate = None
    if attn.gated:
        queries, gate = mx.split(attn.q_proj(h).reshape(B, L, config.num_attention_heads, -1), 2, axis=-1)
        queries, gate = queries.transpose(0, 2, 1, 3), gate.reshape(B, L, -1)
    else:
        queries = attn._heads(attn.q_proj(h), config.num_attention_heads)
    if config.qk_norm:
        queries = attn.q_norm(queries)
    queries = network._rope(queries, offset=0)
    keys, values = attn.kv(h, network._rope, 0)
    return queries, gate, keys, values


def _finish(network: QwenMTPNetwork, x: mx.array, queries, gate, keys, values, mask: mx.array) -> mx.array:
    """The layer's output (pre-final-norm) for inputs ``x`` attending over ``keys``/``values`` under ``mask``."""
    layer = network.layers[0]
    attn = layer.self_attn
    B, L, _ = x.shape
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    h = x + attn.o_proj(out if gate is None else out * mx.sigmoid(gate))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def subset_projection(target: TargetModel, ids: np.ndarray, chunk: int = 64):
    """``x -> logits over ids`` (``[..., len(ids)]``) through the target's LM head, or None when the head is not
    linear (a logit soft-cap): the head's matrix is read by projecting unit vectors, whatever its storage.

    Why: on a CPU the LM head over a 50k vocabulary costs several times the head itself; a loss over the tokens
    the corpus holds (labels and inputs) is a sampled softmax whose negatives are the tokens that matter."""
    hidden = target.hidden_size
    index = mx.array(ids.astype(np.int32))
    columns = []
    for start in range(0, hidden, chunk):
        eye = mx.eye(hidden, dtype=mx.float32)[start:start + chunk].astype(target.dtype)
        columns.append(target.logits(eye[None])[0][:, index].astype(mx.float32))
        mx.eval(columns[-1])
    matrix = mx.concatenate(columns, axis=0)  # [H, V']
    probe = mx.random.normal((1, 2, hidden), key=mx.random.key(0)).astype(target.dtype)
    full = target.logits(probe).astype(mx.float32)[..., index]
    if not mx.allclose(full, probe.astype(mx.float32) @ matrix, rtol=1e-2, atol=1e-2 * float(mx.abs(full).max())):
        return None
    return lambda x: x @ matrix


def chained_outputs(network: QwenMTPNetwork, target: TargetModel, hiddens: mx.array, tokens: mx.array,
                    masks: list[mx.array]) -> list[mx.array]:
    """The head's pre-norm output ``[B, L, H]`` of each pass (``len(masks)`` passes; module doc) over windows of
    ``hiddens`` ``[B, L, H]`` (the target's pre-final-norm ``h_j``) and ``tokens`` ``[B, L]`` (``t_{j+1}``)."""
    embedded = network.pre_fc_norm_embedding(target.embed(tokens).astype(mx.float32))
    all_keys, all_values, outs = [], [], []
    previous = hiddens
    for d, mask in enumerate(masks, start=1):
        if d > 1:  # pair j reads the previous pass's output at j - 1
            previous = mx.concatenate([mx.zeros_like(previous[:, :1]), previous[:, :-1]], axis=1)
        x = network.fc(mx.concatenate([embedded, network.pre_fc_norm_hidden(previous)], axis=-1))
        queries, gate, keys, values = _qkv(network, x)
        all_keys.append(keys)
        all_values.append(values)
        out = _finish(network, x, queries, gate, mx.concatenate(all_keys, axis=2),
                      mx.concatenate(all_values, axis=2), mask)
        outs.append(out)
        previous = out
    return outs


def chained_losses(network: QwenMTPNetwork, target: TargetModel, hiddens: mx.array, tokens: mx.array,
                   labels: mx.array, valid: mx.array, masks: list[mx.array], project=None) -> list[mx.array]:
    """Mean cross-entropy of each pass over a batch of windows (``chained_outputs``): ``labels`` ``[B, L]`` (the
    target's greedy ``t_{j+2}``), ``valid`` ``[B, L]`` (real pairs, not padding); pass ``d`` counts positions
    ``j >= d - 1`` (earlier ones have no previous output). ``project``: normed head output -> logits (default
    the target's LM head; ``subset_projection``: labels are then indices into its subset)."""
    project = target.logits if project is None else project
    L = hiddens.shape[1]
    losses = []
    for d, out in enumerate(chained_outputs(network, target, hiddens, tokens, masks), start=1):
        logits = project(network.norm(out)).astype(mx.float32)
        weight = valid.astype(mx.float32) * (mx.arange(L) >= d - 1)[None, :]
        ce = nn.losses.cross_entropy(logits, labels) * weight
        losses.append(ce.sum() / mx.maximum(weight.sum(), 1.0))
    return losses

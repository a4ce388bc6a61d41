"""The KV-borrowing assistant drafter (the Gemma "-assistant" design).

A small network that owns no KV. Each draft step reads:

* the embedding of the token being extended (the target's own embedding table, through ``target.embed``);
* the drafter hidden: at step 0 the *last true target hidden* of the row, later its own previous output;
* the target's K/V of chosen donor layers for that row (read-only views; attention stays in target storage).

and predicts the next token through the target's LM head. Its row state is therefore one hidden ``[1, 1, H]`` per
row plus the token count it covers: schema ``gemma-assistant-v1``. Architecture and config keys: docs/DRAFTERS.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from spec_cache.drafters.base import PAIRING, BoundDraftRows, NetworkProvider, check_sizes, directory_namespace
from spec_cache.drafters.layers import MLP, load_weights
from spec_cache.errors import ModelLoadError, UnsupportedCombination
from spec_cache.rows.protocol import (
    PrefillContext,
    PreparedStateChange,
    RoundContext,
    check_checkpoints,
    check_per_row,
    check_row,
    to_mx,
)
from spec_cache.rows.target import DonorView, TargetModel
from spec_cache.schemas import (
    GEMMA_ASSISTANT_V1,
    CheckpointAttachment,
    DraftRowCheckpoint,
    SchemaError,
    validate_checkpoint,
)

__all__ = ["AssistantConfig", "AssistantNetwork", "AssistantProvider", "AssistantRows", "METHOD"]

METHOD = "assistant"
#: ``llama``: pre-norm blocks, SwiGLU, queries scaled by ``head_dim ** -0.5``. ``gemma4``: Gemma 4's block (queries
#: RMS-normed per head and unscaled, like the target's keys; sandwich norms around attention and MLP; GeGLU).
BLOCK_STYLES = ("llama", "gemma4")


@dataclass(frozen=True)
class AssistantConfig:
    """The ``config.json`` of an assistant drafter directory (``"method": "assistant"``)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    donor_layers: tuple[int, ...]
    vocab_size: int
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    block_style: str = "llama"
    intermediate_sizes: tuple[int, ...] | None = None

    def block_intermediate_size(self, block: int) -> int:
        """The MLP width of drafter block ``block`` (Gemma 4's KV-shared layers have double-wide MLPs)."""
        return self.intermediate_size if self.intermediate_sizes is None else self.intermediate_sizes[block]

    @classmethod
    def from_dict(cls, config: dict) -> "AssistantConfig":
        if config.get("method") != METHOD:
            raise ModelLoadError(f"not an assistant drafter config (method={config.get('method')!r})")
        required = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "donor_layers", "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise ModelLoadError(f"assistant config is missing {', '.join(missing)}")
        donors = config["donor_layers"]
        if not isinstance(donors, list) or not donors or not all(isinstance(d, int) for d in donors):
            raise ModelLoadError(f"assistant config donor_layers must be a non-empty list of ints, got {donors!r}")
        style = config.get("block_style", "llama")
        if style not in BLOCK_STYLES:
            raise ModelLoadError(f"assistant config block_style must be one of {', '.join(BLOCK_STYLES)}, got {style!r}")
        sizes = config.get("intermediate_sizes")
        if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(donors)
                                  or not all(isinstance(n, int) and n > 0 for n in sizes)):
            raise ModelLoadError(f"assistant config intermediate_sizes must list one positive int per donor layer "
                                 f"({len(donors)}), got {sizes!r}")
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            head_dim=int(config["head_dim"]),
            intermediate_size=int(config["intermediate_size"]),
            donor_layers=tuple(donors),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            attention_bias=bool(config.get("attention_bias", False)),
            block_style=style,
            intermediate_sizes=None if sizes is None else tuple(sizes),
        )

    def to_dict(self) -> dict:
        return {
            "method": METHOD,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "donor_layers": list(self.donor_layers),
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            # the defaults stay unwritten: a llama-style drafter's config.json (and so its identity) is unchanged
            **({} if self.block_style == "llama" else {"block_style": self.block_style}),
            **({} if self.intermediate_sizes is None else {"intermediate_sizes": list(self.intermediate_sizes)}),
        }


class _DonorAttention(nn.Module):
    """Queries from the drafter stream; keys and values borrowed from one target layer."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        gemma = config.block_style == "gemma4"
        self.scale = 1.0 if gemma else config.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=config.attention_bias)
        if gemma:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def __call__(self, x: mx.array, donor: DonorView, rope: Any, positions: mx.array) -> mx.array:
        B, L, _ = x.shape
        if donor.keys is None:  # no row holds any token yet: nothing to attend to
            return mx.zeros_like(x)
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        if "q_norm" in self:
            queries = self.q_norm(queries)
        queries = queries.transpose(0, 2, 1, 3)
        queries = rope(queries, offset=positions)
        out = mx.fast.scaled_dot_product_attention(
            queries, donor.keys, donor.values, scale=self.scale, mask=donor.valid
        )
        # A row with no real position (an empty prompt prefix) attends to nothing: zero, not NaN.
        out = mx.where(donor.valid.any(axis=-1, keepdims=True), out, 0.0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _GeGLU(MLP):
    """Gemma's MLP: ``down_proj(gelu_approx(gate_proj(x)) * up_proj(x))``."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class _AssistantLayer(nn.Module):
    def __init__(self, config: AssistantConfig, block: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.gemma = config.block_style == "gemma4"
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = _DonorAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        width = _Width(config.hidden_size, config.block_intermediate_size(block))
        self.mlp = _GeGLU(width) if self.gemma else MLP(width)
        if self.gemma:
            self.pre_feedforward_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)

    def __call__(self, x: mx.array, donor: DonorView, rope: Any, positions: mx.array) -> mx.array:
        attended = self.self_attn(self.input_layernorm(x), donor, rope, positions)
        if not self.gemma:
            h = x + attended
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


@dataclass(frozen=True)
class _Width:
    """What :class:`MLP` reads from a config: one block's sizes."""

    hidden_size: int
    intermediate_size: int


class AssistantNetwork(nn.Module):
    """``x = embed + input_proj(norm(hidden))``; one donor-attention block per donor layer; final norm."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.layers = [_AssistantLayer(config, block) for block in range(len(config.donor_layers))]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(
        self,
        embedding: mx.array,
        hidden: mx.array,
        donors: Sequence[DonorView],
        ropes: Sequence[Any],
        positions: mx.array,
    ) -> mx.array:
        x = embedding + self.input_proj(self.hidden_norm(hidden))
        for layer, donor, rope in zip(self.layers, donors, ropes):
            x = layer(x, donor, rope, positions)
        return self.norm(x)


class AssistantRows(BoundDraftRows):
    """Assistant draft rows: the last true target hidden per row (``[B, 1, H]``) and its token coverage."""

    prefill_needs_target_hidden = True
    provider: "AssistantProvider"

    def _init_state(self) -> None:
        self._hidden: mx.array | None = None

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | None]) -> PreparedStateChange:
        check_checkpoints(checkpoints, self.provider.validate_checkpoint)
        dtype = self.target.model.dtype
        for index, checkpoint in enumerate(checkpoints):
            if checkpoint is not None and (got := to_mx(checkpoint.attachment.tensors[0]).dtype) != dtype:
                raise SchemaError(self.schema, "tensors[0].dtype", f"hidden dtype {got} differs from the target's {dtype}")
        if not checkpoints:
            return PreparedStateChange(lambda: None, lambda: None)
        size = self.provider.config.hidden_size
        parts = [] if self._hidden is None else [self._hidden]
        for checkpoint in checkpoints:
            if checkpoint is None:
                parts.append(mx.zeros((1, 1, size), dtype=dtype))
            else:
                parts.append(to_mx(checkpoint.attachment.tensors[0]))
        hidden = mx.concatenate(parts, axis=0)
        processed = self._processed + [0 if cp is None else cp.processed_tokens for cp in checkpoints]

        def put(state: tuple) -> None:
            self._hidden, self._processed = state

        return PreparedStateChange.swap(lambda: (self._hidden, self._processed), put, (hidden, processed))

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context: PrefillContext | None) -> None:
        """Rows given tokens take the target hidden of their last forwarded token (the engine forwards it)."""
        counts = [len(tokens) for tokens in tokens_per_row]
        check_per_row(counts, self.row_count, "token list")
        if not any(counts):
            return
        for row, count in enumerate(counts):
            if count and (context is None or context.lengths[row] == 0):
                raise ValueError(
                    f"assistant row {row} needs the target hidden of its last prompt token, but the target "
                    "forwarded nothing for it"
                )
        takes = mx.array([count > 0 for count in counts])[:, None, None]
        self._hidden = mx.where(takes, context.last_hidden.astype(self._hidden.dtype), self._hidden)
        self._processed = [p + c for p, c in zip(self._processed, counts)]

    def lazy_state(self) -> list:
        return [] if self._hidden is None else [self._hidden]

    def materialize(self) -> None:
        mx.eval(self.lazy_state())

    def _keep_rows(self, keep: list[int]) -> None:
        self._hidden = self._hidden[mx.array(keep, dtype=mx.int32)]
        self._processed = [self._processed[row] for row in keep]

    def capture(self, row: int) -> DraftRowCheckpoint:
        check_row(row, self.row_count)
        hidden = self._hidden[row : row + 1]
        mx.eval(hidden)
        processed = self._processed[row]
        return DraftRowCheckpoint(processed, CheckpointAttachment(self.schema, {"processedTokens": processed}, (hidden,)))

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        """``depth`` chained steps against the borrowed target K/V (rows at their own positions)."""
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0 or not pending:
            return [[] for _ in pending]
        model = self.target.model
        layers = self.provider.config.donor_layers
        donors = [self.target.donors(layer) for layer in layers]
        ropes = [model.rope(layer) for layer in layers]
        positions = donors[0].positions
        ids = mx.array(list(pending), dtype=mx.uint32)[:, None]
        hidden = self._hidden
        steps = []
        for step in range(depth):
            hidden = self.provider.network(model.embed(ids), hidden, donors, ropes, positions + step)
            ids = self._sampler(model.logits(hidden)[:, -1, :]).astype(mx.uint32)[:, None]
            steps.append(ids)
        return mx.concatenate(steps, axis=1).tolist()

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        """The new last true hidden is the target hidden at the last kept window position."""
        check_per_row(accepted, self.row_count, "accepted count")
        index = mx.array(list(accepted), dtype=mx.int32)[:, None, None]
        self._hidden = mx.take_along_axis(context.hidden, index, axis=1).astype(self._hidden.dtype)
        self._processed = [p + a + 1 for p, a in zip(self._processed, accepted)]

    def dispose(self) -> None:
        self._hidden = None
        self._processed = []


class AssistantProvider(NetworkProvider):
    """A loaded assistant drafter; opens :class:`AssistantRows` groups over target rows."""

    schema = GEMMA_ASSISTANT_V1
    rows_class = AssistantRows
    supports_target_adapters = False
    network: AssistantNetwork
    config: AssistantConfig

    @classmethod
    def load(cls, model_dir: str | Path) -> "AssistantProvider":
        """Read ``config.json`` + ``*.safetensors``; the namespace is ``gemma-assistant-v1:<model identity>``."""
        path = Path(model_dir)
        config = AssistantConfig.from_dict(json.loads((path / "config.json").read_text()))
        network = load_weights(AssistantNetwork(config), path, METHOD)
        return cls(network, directory_namespace(cls.schema, path), path)

    def bind(self, target: TargetModel) -> None:
        """Check that this drafter fits ``target`` (hidden size, vocabulary, donor K/V geometry)."""
        config = self.config
        check_sizes(METHOD, (("hidden size", config.hidden_size, target.hidden_size),
                             ("vocabulary", config.vocab_size, target.vocab_size)))
        for layer in config.donor_layers:
            if not -target.num_layers <= layer < target.num_layers:
                raise UnsupportedCombination(f"assistant donor layer {layer} does not exist in a {target.num_layers}-layer target")
            heads, head_dim = target.kv_geometry(layer)
            if (heads, head_dim) != (config.num_key_value_heads, config.head_dim):
                raise UnsupportedCombination(
                    f"assistant drafter reads {config.num_key_value_heads} KV heads of size {config.head_dim}; "
                    f"target layer {layer} has {heads} of size {head_dim} - {PAIRING}"
                )

    def validate_checkpoint(self, checkpoint: DraftRowCheckpoint) -> None:
        """Schema rules plus this drafter's hidden size; raises SchemaError."""
        validate_checkpoint(checkpoint, expect_schema=self.schema)
        size = checkpoint.attachment.tensors[0].shape[2]
        if size != self.config.hidden_size:
            raise SchemaError(
                self.schema, "tensors[0].shape", f"hidden size {size} does not match this drafter's {self.config.hidden_size}"
            )

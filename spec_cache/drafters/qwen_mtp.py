"""Qwen multi-token prediction (MTP): a one-layer head that reads the target's own hidden state.

Why one file: one drafter method, as every drafter under ``drafters/``: its config, network, rows and provider are
bound by the coverage rule and row checkpoint below, and change together.

For the pair (target hidden ``h_i``, token ``t_{i+1}``) the head computes ``x = fc(concat(
pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))`` and runs one decoder layer over it at
position ``i``, attending over its own K/V of the earlier pairs; ``norm`` of the result through the target's
head predicts ``t_{i+2}``. ``h_i`` is the target's *pre-final-norm* hidden (the residual stream after its last
layer: the tap of layer ``num_layers - 1``). Drafting chains the head: draft ``k + 1`` reads the head's own
output hidden of draft ``k``. Embeddings and head are the target's (shared, as in Qwen3-Next).

Coverage (why the schema says ``draftOffset == processedTokens - 1``): after a row has processed ``P`` tokens,
the head's K/V holds the ``P - 1`` pairs ``(h_i, t_{i+1})``, ``i < P - 1``, and ``h_{P-1}`` waits for the next
token. A commit of ``accepted + 1`` tokens (the pending token and the kept drafts) adds that many pairs, so a
zero-depth round still appends the pending token's pair and the K/V stays aligned. A row with no token yet
(``P == 0``) has no state to capture: :meth:`QwenMTPRows.capture` returns None for it (a cold row).

Prefill: tail-split, as every row of this engine (the target forwards ``prompt[:-1]``, the last prompt token is
the first pending token). The seed's MTP rows declare a ``"full"`` mode (the target forwards the whole prompt and
the first token comes from that forward); it is not implemented here and no row declares it (issue 38, row 27):
the head's pairs depend only on which tokens the target covered, so tail-split gives the same pairs and the same
tokens, and "full" would only bring the first token one forward earlier at admission (out of the prefill forward
itself, not the first verify round), at the cost of a second admission path through the engine's boundary
checkpoints, interleaved prefill, logprobs and KV-quantization conversion points (each written and tested for
tail-split). Tokens appended to a row that already has state (a
restored row's new turn, a continuation's replayed tokens, the tail after a target-only hit) come in through
:meth:`QwenMTPRows.consume` (``consumes_appended_tokens``), as externally supplied tokens; the pairs they add are
the ones a prefill of the same tokens adds.

Target-only hit (the target restored without this head's part): the row opens cold beside it (``base.ColdRow``),
its hidden unknown; its K/V then holds the pairs of the tokens the target forwards from then on, at their true
positions (the first such token has no known hidden before it: no pair). The engine forwards the last restored
token again when nothing else would be forwarded (``prefill_needs_target_hidden``: the head needs the hidden that
precedes the pending token, as the assistant does). Such a row drafts from fewer pairs (acceptance may start
lower, tokens never change); its checkpoints carry its pairs in ``qwen-mtp-v1``'s layout with the missing early
pairs as zero rows (``base.padded``; the target part alone while it holds no pair), and a restore opens them as the
same partial row (``base.opened``; issue 38).

The row checkpoint is ``qwen-mtp-v1``: ``[k, v, hidden]`` (``[hidden]`` while ``draftOffset == 0``), metadata
``{draftOffset}``. The namespace is ``qwen-mtp-v1:<identity of config.json + weights>``.

Config keys (``config.json``, ``"method": "qwen-mtp"``): ``hidden_size`` (= the target's), ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` (= the target's), ``rms_norm_eps``
(1e-6), ``rope_theta`` (10000), ``qk_norm`` (true), ``attn_output_gate`` (false; Qwen3-Next's gated attention:
``q_proj`` yields queries and a per-head gate, ``o_proj(out * sigmoid(gate))``), ``partial_rotary_factor`` (1.0;
RoPE over that share of each head), ``num_hidden_layers`` (must be 1: the schema stores one K/V pair).
Weights: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc`` ``[H, 2H]``, ``layers.0.*`` (one decoder
layer: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj`` (+ ``q_norm``/``k_norm``), ``post_attention_layernorm``,
``mlp.{gate,up,down}_proj``), ``norm``; an ``mtp.`` prefix (as in Qwen3-Next checkpoints) is stripped; weights
are taken as mlx-lm stores them (Hugging Face Qwen3-Next norms are ``1 + w``: convert them as mlx-lm's
``qwen3_next.sanitize`` does). A dense MLP only (the 80B model's MTP MoE is not modelled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from spec_cache.drafters.base import (
    BoundDraftRows,
    ColdRow,
    NetworkProvider,
    PartialRowCheckpoint,
    check_opening,
    directory_namespace,
    opened_all,
)
from spec_cache.drafters.deepspec import _extended
from spec_cache.drafters.projected import ContextKV, _Layer
from spec_cache.errors import ModelLoadError, UnsupportedCombination
from spec_cache.rows.protocol import PreparedStateChange, RoundContext, check_accepted, check_per_row, check_row, to_mx
from spec_cache.rows.target import TargetModel, clone_batch_cache
from spec_cache.schemas import QWEN_MTP_V1, CheckpointAttachment, DraftRowCheckpoint, SchemaError, validate_checkpoint

__all__ = ["QwenMTPConfig", "QwenMTPNetwork", "QwenMTPProvider", "QwenMTPRows", "METHOD"]

METHOD = "qwen-mtp"


@dataclass(frozen=True)
class QwenMTPConfig:
    """The configuration of a Qwen MTP head (see module doc for the keys)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    num_hidden_layers: int = 1
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also yields a per-head output gate
    partial_rotary_factor: float = 1.0  # RoPE over the first head_dim * factor dims of each head

    @classmethod
    def from_dict(cls, config: dict) -> "QwenMTPConfig":
        if config.get("method", METHOD) != METHOD:
            raise ModelLoadError(f"not a {METHOD} drafter config (method={config.get('method')!r})")
        required = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "vocab_size"]
        missing = [key for key in required if key not in config]
        if missing:
            raise ModelLoadError(f"{METHOD} drafter config is missing {', '.join(missing)}")
        for key in required:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"{METHOD} {key} must be an int >= 1, got {value!r}")
        factor = config.get("partial_rotary_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ModelLoadError(f"{METHOD} partial_rotary_factor must be in (0, 1], got {factor!r}")
        if config.get("num_hidden_layers", 1) != 1:
            raise ModelLoadError(f"{METHOD} heads have exactly one layer (qwen-mtp-v1 stores one K/V pair), got "
                                 f"num_hidden_layers={config['num_hidden_layers']!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{key: config[key] for key in known if key in config})

    def to_dict(self) -> dict:
        return dict({f.name: getattr(self, f.name) for f in fields(self)}, method=METHOD)


class QwenMTPNetwork(nn.Module):
    """``fc`` over the normed (embedding, hidden) pair, one decoder layer, the final ``norm``."""

    def __init__(self, config: QwenMTPConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [_Layer(config)]
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        rotary = int(config.head_dim * config.partial_rotary_factor)
        self._rope = nn.RoPE(rotary, traditional=False, base=config.rope_theta)

    def __call__(self, embeddings: mx.array, hiddens: mx.array, positions: mx.array, context: ContextKV) -> tuple:
        """The pairs ``(hiddens[:, j], embeddings[:, j])`` ``[B, L, H]`` at ``positions + j``, causal among
        themselves, over ``context``. Returns the head's pre-norm output ``[B, L, H]`` and the pairs' K/V."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hiddens)],
                                   axis=-1))
        out, keys, values = self.layers[0](x, self._rope, positions, context, True)
        return out, keys, values


def load_network(path: Path, config: QwenMTPConfig) -> QwenMTPNetwork:
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    if not weights:
        raise FileNotFoundError(f"{METHOD} drafter {path} has no *.safetensors weights")
    weights = {key.removeprefix("mtp."): value for key, value in weights.items()}
    network = QwenMTPNetwork(config)
    network.load_weights(list(weights.items()), strict=True)
    mx.eval(network.parameters())
    return network


class QwenMTPRows(BoundDraftRows):
    """MTP rows: one ``BatchKVCache`` of the head's K/V, each row's pending pre-norm hidden ``[B, 1, H]`` and
    its coverage."""

    prefill_needs_target_taps = True
    #: a row opened beside a restored target needs the hidden before its pending token (module doc)
    prefill_needs_target_hidden = True
    #: tokens appended to a row that has state reach it through ``consume`` (the engine's admission; module doc)
    consumes_appended_tokens = True
    supports_external_tokens = True
    opens_beside_target = True
    provider: "QwenMTPProvider"

    # -- membership -------------------------------------------------------------------------------------
    def _init_state(self) -> None:
        self.network = self.provider.network
        self.tap_layers = (self.target.model.depth - 1,)
        self._cache: BatchKVCache | None = None
        self._hidden: mx.array | None = None
        self._start: list[int] = []  # per row: the first token its state covers (0 but for target-only hits)

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | ColdRow | None]) -> PreparedStateChange:
        checkpoints = opened_all(checkpoints)  # a stored partial row (zero head) opens as the partial row it was
        check_opening(checkpoints, self.provider.validate_checkpoint)
        if not checkpoints:
            return PreparedStateChange(lambda: None, lambda: None)
        model = self.target.model
        singles, hiddens = [], []
        for checkpoint in checkpoints:
            cache = KVCache()
            hidden = mx.zeros((1, 1, model.hidden_size), dtype=model.dtype)
            if checkpoint is not None and not isinstance(checkpoint, ColdRow):
                tensors = checkpoint.attachment.tensors
                hidden = to_mx(tensors[-1])
                if len(tensors) == 3:
                    cache.keys, cache.values = to_mx(tensors[0]), to_mx(tensors[1])
                    cache.offset = int(cache.keys.shape[2])
            singles.append(cache)
            hiddens.append(hidden)
        joining = BatchKVCache.merge(singles)
        if self._cache is None or not self._processed:
            cache, hidden = joining, mx.concatenate(hiddens, axis=0)
        else:
            cache = clone_batch_cache(self._cache)
            cache.extend(joining)
            hidden = mx.concatenate([self._hidden, *hiddens], axis=0)
        processed = self._processed + [0 if cp is None else cp.processed_tokens for cp in checkpoints]
        start = self._start + [_start_of(cp) for cp in checkpoints]

        def put(state: tuple) -> None:
            self._cache, self._hidden, self._processed, self._start = state

        return PreparedStateChange.swap(lambda: (self._cache, self._hidden, self._processed, self._start), put,
                                        (cache, hidden, processed, start))

    def _keep_rows(self, keep: list[int]) -> None:
        indices = mx.array(keep, dtype=mx.int32)
        self._cache.filter(indices)
        self._hidden = self._hidden[indices]
        self._processed = [self._processed[row] for row in keep]
        self._start = [self._start[row] for row in keep]

    def lazy_state(self) -> list:
        cache = self._cache
        arrays = [] if cache is None else [cache.offset, cache.left_padding]
        if cache is not None and cache.keys is not None:
            arrays += [cache.keys, cache.values]
        return arrays + ([] if self._hidden is None else [self._hidden])

    def materialize(self) -> None:
        mx.eval(self.lazy_state())

    def dispose(self) -> None:
        self._cache = None
        self._hidden = None
        self._processed = []
        self._start = []

    # -- growth -----------------------------------------------------------------------------------------
    def _pairs_so_far(self) -> list[int]:
        return [max(p - 1, 0) for p in self._processed]

    def _advance(self, tokens_per_row: Sequence[Sequence[int]], taps: mx.array, counts: Sequence[int]) -> None:
        """Add each row's first ``counts[row]`` tokens, whose target pre-norm hiddens are ``taps[row, :count]``:
        one pair per token (a row's very first token has no hidden before it, so no pair), then the hidden of
        its last token waits."""
        previous = mx.concatenate([self._hidden, taps.astype(self._hidden.dtype)], axis=1)  # [B, 1 + L, H]
        # a row's first token ever (or first after a target-only hit: its hidden is unknown) has no pair
        starts = [0 if p > first else 1 for p, first in zip(self._processed, self._start)]
        pairs = [max(count - start, 0) for count, start in zip(counts, starts)]
        width = max(pairs)
        if width:
            # pair j of a row: hidden previous[start + j] (the token before it) with token tokens[start + j]
            index = [[min(start + j, count) for j in range(width)] for start, count in zip(starts, counts)]
            ids = [[tokens[start + j] if j < n else 0 for j in range(width)]
                   for tokens, start, n in zip(tokens_per_row, starts, pairs)]
            hiddens = mx.take_along_axis(previous, mx.array(index, dtype=mx.int32)[:, :, None], axis=1)
            dtype = self.provider.dtype
            embeddings = self.target.model.embed(mx.array(ids, dtype=mx.uint32)).astype(dtype)
            # pair (h_i, t_{i+1}) sits at position i: the row's processed count - 1 (+ 1 when it has no pair yet)
            positions = mx.array([p - 1 + s for p, s in zip(self._processed, starts)], dtype=mx.int32)
            _, keys, values = self.network(embeddings, hiddens.astype(dtype), positions, self._context())
            self._cache.prepare(right_padding=[width - n for n in pairs])
            self._cache.update_and_fetch(keys, values)
            self._cache.finalize()
        last = mx.array(list(counts), dtype=mx.int32)[:, None, None]
        self._hidden = mx.take_along_axis(previous, last, axis=1)
        self._processed = [p + c for p, c in zip(self._processed, counts)]

    def _checked_taps(self, context, counts: Sequence[int], what: str) -> mx.array:
        layer = self.tap_layers[0]
        taps = None if context is None else (context.taps or {}).get(layer)
        if taps is None:
            raise ValueError(f"qwen MTP rows need the target's pre-norm hidden (tap of layer {layer}) at every "
                                 f"{what} token")
        return taps

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context) -> None:
        """Add each row's forwarded tokens (the target's taps at them in ``context``)."""
        counts = [len(tokens) for tokens in tokens_per_row]
        check_per_row(counts, self.row_count, "token list")
        if not any(counts):
            return
        # a row with no tokens here takes none (the engine feeds a row that has state through ``consume``)
        lengths = None if context is None else list(context.lengths)
        if lengths is None or len(lengths) != len(counts) or any(c and c != n for c, n in zip(counts, lengths)):
            raise ValueError(f"qwen MTP rows need the target's taps at every token they cover; got {lengths} for "
                                 f"{counts}")
        self._advance(tokens_per_row, self._checked_taps(context, counts, "prefilled"), counts)

    def consume(self, tokens_per_row: Sequence[Sequence[int]], context, lengths: Sequence[int]) -> None:
        """Add externally supplied tokens (not drafted, e.g. forced or replayed): ``lengths[row]`` of
        ``tokens_per_row[row]``, with the target's taps at them in ``context`` (a ``PrefillContext`` or
        ``RoundContext`` of the forward that appended them)."""
        check_per_row(lengths, self.row_count, "length")
        for row, (tokens, count) in enumerate(zip(tokens_per_row, lengths)):
            if not 0 <= count <= len(tokens):
                raise ValueError(f"row {row}: consume length {count} for {len(tokens)} tokens")
        if any(lengths):
            self._advance(tokens_per_row, self._checked_taps(context, lengths, "consumed"), lengths)

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None:
        """Add the pending token and the kept drafts of each row (``accepted + 1`` pairs)."""
        check_accepted(accepted, self.row_count, context)
        counts = [kept + 1 for kept in accepted]
        self._advance(context.window, self._checked_taps(context, counts, "verified"), counts)

    # -- drafting and checkpoints -----------------------------------------------------------------------
    def _context(self) -> ContextKV:
        cache = self._cache
        if cache is None or cache.keys is None or cache._idx == 0:
            return ContextKV(None, None, None)
        keys, values = cache.keys_and_values()
        return ContextKV(keys, values, mx.arange(cache._idx)[None, :] >= cache.left_padding[:, None])

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        """Chain the head ``depth`` times from each row's pending hidden and pending token."""
        check_per_row(pending, self.row_count, "pending token")
        if depth <= 0 or not pending:
            return [[] for _ in pending]
        model, dtype = self.target.model, self.provider.dtype
        context = self._context()
        positions = mx.array(self._pairs_so_far(), dtype=mx.int32)
        ids = mx.array(list(pending), dtype=mx.uint32)[:, None]
        hidden = self._hidden.astype(dtype)
        ones = mx.ones((len(pending), 1), dtype=mx.bool_)
        steps = []
        for step in range(depth):
            out, keys, values = self.network(model.embed(ids).astype(dtype), hidden, positions + step, context)
            logits = model.logits(self.network.norm(out).astype(model.dtype))[:, -1, :]
            ids = self._sampler(logits).astype(mx.uint32)[:, None]
            steps.append(ids)
            hidden = out
            context = _extended(context, keys, values, ones)
        return mx.concatenate(steps, axis=1).tolist()

    def capture(self, row: int) -> DraftRowCheckpoint | None:
        """The row's ``qwen-mtp-v1`` checkpoint (owned arrays); None before its first token (no state)."""
        check_row(row, self.row_count)
        processed, start = self._processed[row], self._start[row]
        if processed == 0:
            return None
        # pairs held: one per token after the first whose hidden was known (a partial row lacks its head's)
        offset = processed - 1 if not start else max(processed - 1 - start, 0)
        hidden = mx.array(self._hidden[row : row + 1])
        tensors = [hidden]
        if offset:
            single = self._cache.extract(row)
            if single.offset != offset:
                raise RuntimeError(f"row {row}: MTP cache holds {single.offset} pairs, expected {offset}")
            tensors = [single.keys, single.values, hidden]
        mx.eval(tensors)
        attachment = CheckpointAttachment(QWEN_MTP_V1, {"draftOffset": offset}, tensors)
        if start:
            return PartialRowCheckpoint(processed, attachment, start=start, base_tokens=offset + 1)
        return DraftRowCheckpoint(processed, attachment)


class QwenMTPProvider(NetworkProvider):
    """A loaded Qwen MTP head (``config.json`` with ``"method": "qwen-mtp"`` + ``*.safetensors``)."""

    schema = QWEN_MTP_V1
    rows_class = QwenMTPRows
    supports_target_adapters = False
    prefill_needs_target_taps = True
    network: QwenMTPNetwork

    def __init__(self, network: QwenMTPNetwork, namespace: str, model_dir: Path | None = None) -> None:
        super().__init__(network, namespace, model_dir)
        self._target_dtype: mx.Dtype | None = None

    @property
    def dtype(self) -> mx.Dtype:
        return self.network.fc.weight.dtype

    @classmethod
    def load(cls, model_dir: str | Path) -> "QwenMTPProvider":
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"qwen MTP drafter directory {path} has no config.json")
        config = QwenMTPConfig.from_dict(json.loads((path / "config.json").read_text()))
        return cls(load_network(path, config), directory_namespace(cls.schema, path, "config.json"), path)

    def bind(self, target: TargetModel) -> None:
        """The head reads the target's hidden and shares its embeddings and head: sizes must agree."""
        if self.config.hidden_size != target.hidden_size:
            raise UnsupportedCombination(f"qwen MTP drafter hidden {self.config.hidden_size} != target "
                                         f"{target.hidden_size}")
        if self.config.vocab_size != target.vocab_size:
            raise UnsupportedCombination(f"qwen MTP drafter vocabulary {self.config.vocab_size} != target "
                                         f"{target.vocab_size}")
        self._target_dtype = target.dtype

    def validate_checkpoint(self, checkpoint: DraftRowCheckpoint) -> None:
        """Schema rules (``draftOffset == processed_tokens - 1``), then this head's K/V geometry and dtype and
        the hidden's size (and dtype, once bound to a target); raises SchemaError."""
        validate_checkpoint(checkpoint, expect_schema=self.schema)
        tensors = checkpoint.attachment.tensors
        hidden = tensors[-1]
        if tuple(hidden.shape)[2] != self.config.hidden_size:
            raise SchemaError(self.schema, f"tensors[{len(tensors) - 1}].shape",
                              f"hidden of size {hidden.shape[2]} for a head of hidden {self.config.hidden_size}")
        if self._target_dtype is not None and _dtype_name(hidden.dtype) != _dtype_name(self._target_dtype):
            raise SchemaError(self.schema, f"tensors[{len(tensors) - 1}].dtype",
                              f"hidden dtype {_dtype_name(hidden.dtype)} differs from the target's "
                              f"{_dtype_name(self._target_dtype)}")
        if len(tensors) == 3:
            shape = tuple(tensors[0].shape)
            geometry = (self.config.num_key_value_heads, self.config.head_dim)
            if (shape[1], shape[3]) != geometry:
                raise SchemaError(self.schema, "tensors[0].shape",
                                  f"K/V of {shape[1]} heads x {shape[3]} do not fit this head "
                                  f"({geometry[0]} x {geometry[1]})")
            if _dtype_name(tensors[0].dtype) != _dtype_name(self.dtype):
                raise SchemaError(self.schema, "tensors[0].dtype",
                                  f"K/V dtype {_dtype_name(tensors[0].dtype)} differs from this head's "
                                  f"{_dtype_name(self.dtype)}")


def _start_of(opening) -> int:
    """The first token a joining row's state covers."""
    if isinstance(opening, ColdRow):
        return opening.processed_tokens
    return opening.start if isinstance(opening, PartialRowCheckpoint) else 0


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]

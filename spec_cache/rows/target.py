"""The target model behind narrow ports, and the batched KV rows of a speculative group.

Why one file of ~550 lines: ``TargetRows`` reaches into ``TargetModel``'s ports on every forward and the two
change together (``quantized_rows.py`` holds the other ``rows.TargetRowGroup``).

:class:`TargetModel` wraps an mlx-lm decoder. Drafters and the engine use only its ports (``embed``,
``logits``, ``forward`` with hidden taps, ``make_caches``, ``kv_geometry``, ``rope``, ``layer_window``); nothing
else reaches into the mlx-lm module. The per-architecture code lives in ``spec_cache/rows/ports.py``.

:class:`TargetRows` holds the KV of a group of rows: one mlx-lm ``BatchKVCache`` per layer. Rows are
right-justified (left padding), so one forward appends the same number of tokens to every row; a row that keeps
fewer of them (rejected drafts, shorter prompt chunk) is rolled back with ``prepare(right_padding=...)`` +
``finalize()``, which turns its discarded tail into left padding. This is exact: the padding is masked out of
attention and the kept tokens keep their RoPE positions. The draft-model drafter uses the same class for the
draft model's own KV.

**Sliding-window layers** (gemma3_text) are held as plain KV too, attended through a window mask
(``BatchKVCache.make_mask(window_size=W)``): a token at position ``p`` sees positions ``p-W+1..p``, exactly the
keys mlx-lm's ``RotatingKVCache`` would hold, and a rejected draft rolls back like any other. A row restored
from a ring snapshot holds only its last ``W`` keys there (its older positions are left padding; the window
never reaches them), so a layer's ``BatchKVCache.offset`` is the row's *position*, which may exceed the keys it
holds. At a checkpoint a sliding layer is written back as mlx-lm's ``RotatingKVCache`` (the last ``W`` keys in
temporal order), an exact-boundary snapshot the store never trims. Each layer's rows move between single-row
caches and its batch cache through the layer's kind in the table of cache kinds (``spec_cache.state.cache_kinds``:
``BatchRows.merge_rows`` / ``split_row``).

**KV quantization** is batched by phase in ``spec_cache.rows.quantized_rows`` over
``spec_cache.state.batch_caches.BatchQuantizedKVCache`` (mlx-lm has no batched quantized cache).

**Recurrent layers** (hybrid targets such as ``qwen3_next``) hold an ``ArraysCache`` per layer instead of K/V;
``TargetRows.from_row_caches`` hands such a model ``HybridTargetRows`` (end of this file; the state operations
are the ``arrays`` kind's), which rolls a rejected draft back by replaying the kept tokens through the recurrent
mixers (recurrent state is never trimmable). **Cache layers**: ``num_layers`` counts the layers that hold a cache
(mlx-lm's ``make_cache``; Gemma 4's KV-shared layers hold none), ``depth`` every decoder layer; taps index decoder
layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from spec_cache.errors import RestoreRefused
from spec_cache.rows.attention_route import install as install_attention_route
from spec_cache.rows.batch_rows import BatchRows, DonorView, clone_batch_cache
from spec_cache.rows.ports import PORTS, SUPPORTED_ARCHITECTURES, out_features
from spec_cache.rows.protocol import PreparedStateChange, check_per_row, check_window
from spec_cache.state.cache_kinds import UnknownCacheType, batch_kind_of, kind_of, kinds
from spec_cache.state.cache_state import mark_queued
from spec_cache.state.row_caches import prefix_caches, rotating_snapshot, row_position

__all__ = [
    "TargetModel",
    "ForwardOutput",
    "DonorView",
    "TargetRows",
    "HybridTargetRows",
    "SUPPORTED_ARCHITECTURES",
    "clone_batch_cache",
    "check_kv_options",
    "prefix_caches",
    "row_position",
    "rotating_snapshot",
]


def check_kv_options(kv: Any) -> None:
    """Refuse KV options no runtime path can honour (``turbo_quant``: no codec yet); None passes."""
    from spec_cache.rows.kv_quant import TURBO_QUANT_REFUSED

    if kv is not None and getattr(kv, "turbo_quant", None) is not None:
        raise NotImplementedError(TURBO_QUANT_REFUSED)


@dataclass
class ForwardOutput:
    """``logits`` ``[B, L, V]`` (None when not asked for), final post-norm ``hidden`` ``[B, L, H]``, and the
    residual stream after each tapped layer (``taps[layer]``, ``[B, L, H]``)."""

    logits: mx.array | None
    hidden: mx.array
    taps: dict[int, mx.array] = field(default_factory=dict)


class TargetModel:
    """An mlx-lm decoder behind the ports the speculative runtime uses.

    Build with :meth:`load` (a model directory: ``config.json`` + ``*.safetensors``, optionally LoRA adapters)
    or :meth:`from_model`. ``hidden`` always means the final post-norm hidden, the input of the LM head.
    """

    def __init__(self, model: Any, config: dict, model_dir: Path | None = None) -> None:
        model_type = config.get("model_type")
        port = PORTS.get(model_type)
        if port is None:
            raise NotImplementedError(
                f"spec-cache has no target port for model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.model = model
        self.config = dict(config)
        self.model_dir = model_dir
        self._port = port(model, config)
        self._layers = self._port.layers()
        #: mlx-lm modules whose few-query attention runs MLX's ops rather than a cuDNN plan per shape (MLX's CUDA
        #: backend; ``spec_cache.rows.attention_route``)
        self.attention_routed = install_attention_route(self._layers)

    @classmethod
    def load(cls, model_dir: str | Path, *, adapters: Sequence[str | Path] = (), lazy: bool = False) -> "TargetModel":
        """Load a local mlx-lm model directory, then apply LoRA ``adapters`` (mlx-lm adapter directories, in
        order; see ``spec_cache.rows.adapters``). Raises FileNotFoundError when it has no config or weights."""
        from mlx_lm.utils import load_model

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        model, config = load_model(path, lazy=lazy)
        if adapters:
            from spec_cache.rows.adapters import apply_adapters

            apply_adapters(model, adapters)
        return cls(model, config, path)

    @classmethod
    def from_model(cls, model: Any, config: dict | None = None) -> "TargetModel":
        config = dict(config or {})
        config.setdefault("model_type", getattr(model, "model_type", None))
        return cls(model, config)

    # -- geometry ---------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Layers that hold a cache (one single-row cache each in a checkpoint)."""
        return len(self._layers)

    @property
    def depth(self) -> int:
        """Decoder layers, cache-holding or not (tap layers index these)."""
        return int(self._port.depth)

    def layer_kind(self, layer: int) -> str:
        """What cache layer ``layer`` holds: ``"attention"`` (K/V) or ``"recurrent"`` (an ``ArraysCache``)."""
        return self._port.layer_kind(layer % self.num_layers)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Cache layers holding recurrent state (never trimmable; empty for attention-only targets)."""
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i) == "recurrent")

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def dtype(self) -> mx.Dtype:
        embed = self._port.inner.embed_tokens
        scales = getattr(embed, "scales", None)  # a quantized embedding's weight is packed uint32
        return embed.weight.dtype if scales is None else scales.dtype

    def kv_geometry(self, layer: int) -> tuple[int, int]:
        """``(kv_heads, head_dim)`` of ``layer``'s cache (negative indices count from the end); ``(0, 0)`` for a
        recurrent layer, which holds no K/V."""
        if self.layer_kind(layer) == "recurrent":
            return 0, 0
        attention = self._layers[layer].self_attn
        heads = int(getattr(attention, "n_kv_heads", None) or attention.num_key_value_heads)
        head_dim = getattr(attention, "head_dim", None)
        return heads, int(head_dim) if head_dim else out_features(attention.k_proj) // heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (a token attends to itself and the ``W - 1`` before it), or None."""
        return self._port.layer_window(layer % self.num_layers)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def rope(self, layer: int) -> Any:
        """``layer``'s rotary embedding, ``rope(x, offset)`` (offset an int or a ``[B]`` array): a drafter that
        attends over that layer's keys must rotate its queries the same way."""
        if self.layer_kind(layer) == "recurrent":
            raise ValueError(f"layer {layer} is recurrent: it has no keys and no rotary embedding")
        return self._layers[layer].self_attn.rope

    # -- ports ------------------------------------------------------------------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        """The first layer's input ``[B, L, H]`` for ids ``[B, L]`` (token embeddings, scaled where the
        architecture scales them)."""
        return self._port.embed(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        """LM head over final (post-norm) hiddens."""
        return self._port.logits(hidden)

    def forward(
        self,
        ids: mx.array,
        caches: Sequence[Any],
        *,
        tap_layers: Sequence[int] = (),
        with_logits: bool = True,
        recurrent_inputs: dict | None = None,
        unpadded: bool = False,
    ) -> ForwardOutput:
        """One forward over ``ids`` ``[B, L]``, appending to ``caches`` (one per cache layer).

        Same operations in the same order as the mlx-lm model's ``__call__``, so the logits are bit-identical.
        ``recurrent_inputs``: a dict that receives each recurrent layer's mixer input ``[B, L, H]`` (hybrid
        targets; the rows replay it to roll the state back). ``unpadded``: no row of ``caches`` has left padding
        (a one-token step then needs no attention mask, a longer one mlx-lm's ``"causal"`` mode instead of an
        array; ports that cannot use it ignore it).
        """
        if len(caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} caches (one per cache layer), got {len(caches)}")
        # tap ``depth`` (one past the last layer) is the post-final-norm hidden, the seed's gemmaTaps sentinel
        taps = tuple(layer % self.depth for layer in tap_layers if layer != self.depth)
        hidden, tapped = self._port.run_layers(self.embed(ids), caches, taps, ids=ids, record=recurrent_inputs,
                                               unpadded=unpadded)
        tapped = {layer: hidden if layer == self.depth else tapped[layer % self.depth] for layer in tap_layers}
        return ForwardOutput(self.logits(hidden) if with_logits else None, hidden, tapped)

    def recurrent_mixer(self, layer: int) -> Any:
        """Recurrent layer ``layer``'s token mixer, ``mixer(normed_inputs, mask, cache)`` (what its decoder layer
        runs on its normalized input); ValueError for an attention layer."""
        if self.layer_kind(layer) != "recurrent":
            raise ValueError(f"layer {layer} is not recurrent")
        return self._port.mixer(layer % self.num_layers)

    def make_caches(self, batch: int | None = None) -> list:
        """Fresh caches: the model's own single-row caches (``batch=None``: ``KVCache``, ``RotatingKVCache`` for
        sliding layers, ``ArraysCache`` for recurrent ones, as mlx-lm's ``make_prompt_cache``), else each
        layer's empty batch cache as its kind makes it (``cache_kinds``: a ``BatchKVCache`` per attention layer,
        an empty batched ``ArraysCache`` per recurrent layer)."""
        if batch is None:
            return self._port.make_caches()
        return [batch_kind_of(c).empty_batch(c, batch) for c in self._port.make_caches()]

    @functools.cached_property
    def cache_templates(self) -> tuple:
        """One single-row cache per cache layer, as ``make_caches()`` makes them: only read (for each layer's
        kind and scalars: a recurrent state's slot count), never run."""
        return tuple(self._port.make_caches())

    def check_restored(self, where: str, caches: Sequence[Any], restored: int, *, quantized: bool = False) -> None:
        """Refuse restored single-row caches this target cannot continue from (ValueError naming ``where`` and
        the layer): one per cache layer; ``KVCache`` for attention (``RotatingKVCache`` too for a sliding
        layer, ``QuantizedKVCache`` for a full one when ``quantized``); ``ArraysCache`` for a recurrent layer;
        every K/V layer holding ``restored`` tokens."""
        if len(caches) != self.num_layers:
            raise RestoreRefused(f"{where}: expected {self.num_layers} restored layer caches, got {len(caches)}")
        for layer, cache in enumerate(caches):
            window, layer_batch = self.layer_window(layer), batch_kind_of(self.cache_templates[layer])
            try:
                kind = kind_of(cache)
            except UnknownCacheType:
                kind = None
            if kind is None or not kind.serves(layer_batch, window, True):
                expected = [k.cache_class for k in kinds() if k.serves(layer_batch, window, True)]
                raise RestoreRefused(f"{where}: restored layer {layer} is a {type(cache).__name__}; expected "
                                     f"{' or '.join(expected)}")
            if not kind.serves(layer_batch, window, quantized):
                raise RestoreRefused(f"{where}: restored layer {layer} is quantized, but this engine runs without "
                                     "KV quantization")
            held = kind.tokens(cache)
            if held is None:  # a state with no token count (recurrent): it must hold every array
                if restored and not kind.complete(cache):
                    raise RestoreRefused(f"{where}: restored recurrent layer {layer} is empty, "
                                         f"restored_tokens={restored}")
            elif held != restored:
                raise RestoreRefused(f"{where}: restored layer {layer} holds {cache.offset} tokens, "
                                     f"restored_tokens={restored}")


class TargetRows(BatchRows):
    """The KV of a group of rows of one model (one ``BatchKVCache`` per layer), with per-row lengths.

    ``offsets[row]`` is how many tokens of that row the KV holds. Membership changes are two-phase
    (:meth:`prepare_append`); :meth:`filter_rows` and the round operations act in place between rounds
    (prefill, rollback, append, filter and donors are ``batch_rows.BatchRows``').
    """

    _holds_recurrent_state = False  # HybridTargetRows: True

    def __init__(self, model: TargetModel) -> None:
        if model.recurrent_layers and not self._holds_recurrent_state:
            raise NotImplementedError("a target with recurrent layers needs HybridTargetRows "
                                      "(TargetRows.from_row_caches picks it)")
        super().__init__(model)

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_row_caches(cls, model: TargetModel, rows: Sequence[Sequence[Any] | None]) -> "TargetRows":
        """Rows built from single-row caches (per layer a ``KVCache``, or a ``RotatingKVCache`` for a
        sliding-window layer, an ``ArraysCache`` for a recurrent one; None for an empty row: each layer's batch
        kind merges them, ``BatchRows.merge_rows``). The caller's caches are only read (copied into a batch). A
        model with recurrent layers gets ``HybridTargetRows``."""
        if model.recurrent_layers and not cls._holds_recurrent_state:
            return HybridTargetRows.from_row_caches(model, rows)
        built = cls(model)
        built.merge_rows(rows)
        return built

    # -- state ------------------------------------------------------------------------------------------
    def window_limits(self) -> list[int | None]:
        """The longest verify window each row may take this round (None: no limit). Full-precision rows have
        none; quantized rows stop at their conversion point (``QuantizedTargetRows``)."""
        return [None] * self.row_count

    # -- rounds -----------------------------------------------------------------------------------------
    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append an equal-length window to every row and return logits/hidden for all its positions."""
        check_window(window, self.row_count)
        return self.append_ids(mx.array([list(w) for w in window], dtype=mx.uint32), tap_layers=tap_layers)

    def append_ids(self, ids: mx.array, *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """``verify`` for a window already on the device (``ids [B, L]``, e.g. the lazily sampled tokens of the
        round before): no host read, so the engine can queue a round before reading the last one."""
        if self._holds_recurrent_state:
            raise NotImplementedError("recurrent rows verify through HybridTargetRows.verify (they record a replay)")
        if ids.ndim != 2 or ids.shape[0] != self.row_count or ids.shape[1] == 0:
            raise ValueError(f"ids must be [{self.row_count}, L>0], got shape {tuple(ids.shape)}")
        caches = self._ensure_caches()
        ids = ids if ids.dtype == mx.uint32 else ids.astype(mx.uint32)
        out = self.model.forward(ids, caches, tap_layers=tap_layers, unpadded=self._unpadded())
        self._lengths = [n + ids.shape[1] for n in self._lengths]
        return out

    def discard_last(self, count: int) -> None:
        """Undo the last ``count`` tokens appended to *every* row (a queued round the engine will not use). Unlike
        ``rollback`` it adds no left padding: the layout is exactly what it was before they were appended."""
        if not 0 <= count <= min(self._lengths, default=0):
            raise ValueError(f"cannot discard {count} tokens of rows holding {self._lengths}")
        if self._caches and not all(kind.trimmable for kind in self._kinds):
            raise NotImplementedError("recurrent state cannot discard tokens")
        for cache in self._caches or ():
            cache.trim(count)
        self._lengths = [n - count for n in self._lengths]

    # -- rows in and out --------------------------------------------------------------------------------
    def extract(self, row: int, *, rotating: bool = True) -> list:
        """Owned single-row caches holding exactly the row's tokens (``offset`` == its length): a ``KVCache``
        per full-attention layer; per sliding layer mlx-lm's ``RotatingKVCache`` snapshot (``rotating=False``:
        a ``KVCache`` of the whole history, which the row must hold); per recurrent layer an ``ArraysCache``."""
        out = self.split_row(row, ring=rotating)
        # queued, not waited for: the copies run on the device behind the current round, and the caller (a
        # checkpoint on the scheduler thread) goes on at once; whoever reads them later (the memory tier's restore,
        # the write-behind thread's host copy) waits for exactly these arrays. A blocking eval here made every
        # checkpoint wait for the whole queued round on a GPU.
        mx.async_eval([a for cache in out for a in kind_of(cache).arrays(cache)])
        mark_queued(out)  # a deferred capture of them needs no MLX op of its own (``capture_caches``)
        return out



@dataclass
class _Replay:
    """What the last verify forward left for a rollback: each recurrent layer's state before it and its mixer
    inputs ``[B, width, H]``."""

    before: dict
    inputs: dict
    width: int


class HybridTargetRows(TargetRows):
    """``TargetRows`` for a target with recurrent layers: verify keeps what a rollback needs to replay.

    Rollback reaches only into the last verify window (the states before it are all that is kept); a rollback
    of more tokens than that, or without a verify since the last prefill or membership change, is refused.
    """

    _holds_recurrent_state = True

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._recurrent = model.recurrent_layers
        self._replay: _Replay | None = None

    def prefill(self, tokens_per_row, step: int = 512, *, tap_layers: Sequence[int] = (), need_hidden: bool = True,
                scores=None):
        self._replay = None
        return super().prefill(tokens_per_row, step, tap_layers=tap_layers, need_hidden=need_hidden, scores=scores)

    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        width = check_window(window, self.row_count)
        caches = self._ensure_caches()
        before = {layer: list(caches[layer].cache) for layer in self._recurrent}
        inputs: dict = {}
        out = self.model.forward(mx.array([list(w) for w in window], dtype=mx.uint32), caches, tap_layers=tap_layers,
                                 recurrent_inputs=inputs)
        self._lengths = [n + width for n in self._lengths]
        self._replay = _Replay(before, inputs, width)
        return out

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[row]`` tokens of each row: K/V as ``TargetRows`` does, recurrent state by
        replaying the kept part of the last verify window from the state before it."""
        rejected = [int(r) for r in rejected]
        check_per_row(rejected, self.row_count, "rollback count")
        replay = self._replay
        if not any(rejected):
            self._replay = None
            return
        if replay is None or any(r > replay.width for r in rejected):
            width = 0 if replay is None else replay.width
            raise ValueError(f"recurrent state is never trimmable: a rollback reaches only into the last verify "
                             f"window ({width} tokens), asked for {rejected}")
        super().rollback(rejected)
        self._replay = None
        kept = [replay.width - r for r in rejected]
        span = max(kept)
        changed = mx.array([r > 0 for r in rejected])
        for layer in self._recurrent:
            cache = self._caches[layer]
            verified = list(cache.cache)
            cache.cache = [mx.zeros_like(v) if b is None else b for b, v in zip(replay.before[layer], verified)]
            if span:
                cache.lengths = mx.array(kept)
                try:
                    self.model.recurrent_mixer(layer)(replay.inputs[layer][:, :span], cache.make_mask(span), cache)
                finally:
                    cache.lengths = None
            cache.cache = [mx.where(changed.reshape(-1, *([1] * (v.ndim - 1))), r, v)
                           for r, v in zip(cache.cache, verified)]
        self.materialize()

    def prepare_append(self, other: "TargetRows") -> PreparedStateChange:
        self._replay = None
        return super().prepare_append(other)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._replay = None
        super().filter_rows(keep)

    def donors(self, layer: int) -> DonorView:
        if self.model.layer_kind(layer) == "recurrent":
            raise ValueError(f"layer {layer} is recurrent: it holds no K/V to donate")
        return super().donors(layer)

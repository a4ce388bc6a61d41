"""The plumbing every draft provider and row group shares, so each drafter module holds only its own state.

* :class:`DraftRows`: a row group's identity (provider, namespace, schema, ``supports_target_adapters``), its
  per-row coverage (``row_count``/``processed`` over ``_processed``), ``append`` through the two-phase
  :func:`~spec_cache.rows.protocol.apply_state_changes`, and ``filter_rows`` (``[]`` releases everything).
* :class:`BoundDraftRows`: rows that read a target group (bound to it by ``provider.bind``) and sample drafts.
* :class:`OpensRows`: a provider's ``open``/``open_prefill`` over its ``rows_class``; :class:`NetworkProvider`
  adds the fields of a provider around a trained network (assistant, DeepSpec, DFlash).
* ``consume(tokens, context, lengths)``: externally supplied tokens (``supports_external_tokens``), as in the seed's
  ``DraftRowGroup``; ``prefill_mode`` is always ``"tail-split"`` (the seed's ``"full"`` is not implemented:
  ``drafters.qwen_mtp``'s module doc says why).
* :func:`directory_namespace`: the ``<schema>:<model identity>`` namespace of a drafter directory;
  :func:`check_sizes`: the "expects X; target has Y" checks of ``bind``.
* :class:`ColdRow` and :class:`PartialRowCheckpoint`: a drafter row opened cold beside a restored target (a
  target-only hit) by rows that declare ``opens_beside_target``: its state covers only the tokens the target
  forwards from then on (the tail), at their true positions; drafting may start weaker, tokens never change.
* :func:`storable` / :func:`opened` (issue 38): such a row's checkpoint is stored in its schema's own layout, the
  head it never had written as zero rows (:func:`padded`), and read back as the partial row it was
  (:func:`opened`), so the next turn of a conversation that began with a target-only hit restores both parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import mlx.core as mx

from spec_cache.errors import UnsupportedCombination
from spec_cache.rows.protocol import PreparedStateChange, apply_state_changes, check_keep
from spec_cache.rows.sampling import Sampling, TokenSampler
from spec_cache.rows.target import TargetRows
from spec_cache.schemas import DraftRowCheckpoint, SchemaError

__all__ = [
    "PAIRING",
    "BoundDraftRows",
    "ColdRow",
    "DraftRows",
    "PartialRowCheckpoint",
    "NetworkProvider",
    "OpensRows",
    "check_sizes",
    "check_opening",
    "directory_namespace",
    "opened",
    "opened_all",
    "padded",
    "storable",
]

#: the tail of every "this drafter does not fit this target" error
PAIRING = "wrong (target, drafter) pairing"


@dataclass(frozen=True)
class ColdRow:
    """Open a cold drafter row beside a target row that already holds ``processed_tokens`` tokens (restored
    without this drafter's part). Only rows declaring ``opens_beside_target`` take one: their state then covers
    the tokens forwarded from ``processed_tokens`` on, at their true positions."""

    processed_tokens: int

    def __post_init__(self) -> None:
        count = self.processed_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"ColdRow needs processed_tokens >= 1, got {count!r}")


@dataclass(frozen=True)
class PartialRowCheckpoint(DraftRowCheckpoint):
    """A live row's state that starts at token ``start`` (it was opened as a :class:`ColdRow`): it covers
    ``processed_tokens`` tokens as the target does, but holds state only from ``start`` on. ``attachment`` is the
    schema's checkpoint of that part alone (covering ``base_tokens``), so it validates as one. It moves rows
    between groups of one engine (prefill group to decode group) as it is; a store gets it through
    :func:`storable` (:func:`padded`: the missing head as zero rows) and a restore reads that back as one
    (:func:`opened`)."""

    start: int = 0
    #: ``processed_tokens`` of the attachment's own checkpoint (the part held)
    base_tokens: int = 0

    def held(self) -> DraftRowCheckpoint:
        """The attachment as the plain checkpoint it is (what the schema validates)."""
        return DraftRowCheckpoint(self.base_tokens, self.attachment)


def storable(checkpoint: DraftRowCheckpoint | None) -> DraftRowCheckpoint | None:
    """``checkpoint`` as a store may keep it as this drafter's part: a partial row :func:`padded` (None when it
    holds nothing yet: the target part is stored alone)."""
    return padded(checkpoint) if isinstance(checkpoint, PartialRowCheckpoint) else checkpoint


# A partial row in its schema's layout (issue 38). The projected contexts (deepspec/dflash/dflash2-context-v1)
# and the Qwen MTP head (qwen-mtp-v1) hold per token one K/V row (the MTP head: one per token after the first);
# a partial row lacks the rows of the head it never saw, ``start`` of them. Stored, those rows are zeros: a real
# row is never all zeros (a projection of a real hidden, normed, rotated), so the zero head says "missing" in the
# layout the schema already has, and :func:`opened` reads it back as the same partial row, exactly. The other
# schemas never have partial rows. A spec-cache older than this reads the zero rows as context: its drafts from
# such a row differ (tokens never do: drafts only change how many tokens come per forward).

def _kv_rows(checkpoint: DraftRowCheckpoint) -> tuple[str, list] | None:
    """``(layout, [(k index, v index), ...])`` of a checkpoint with per-token K/V rows; None for other layouts."""
    metadata = checkpoint.attachment.metadata
    if "cacheHeaders" in metadata and "processedTokens" in metadata:
        headers = json.loads(metadata["cacheHeaders"])
        if not headers or any(h is None or h.get("kind") != "kv" for h in headers):
            return None
        return "projected", [tuple(h["tensors"]) for h in headers]
    if "draftOffset" in metadata and len(checkpoint.attachment.tensors) == 3:
        return "mtp", [(0, 1)]
    return None


def _with_rows(checkpoint: DraftRowCheckpoint, layout: str, pairs: list, change: Callable[[Any], Any],
               rows: int) -> Any:
    """The attachment with every K/V of ``pairs`` replaced by ``change(tensor)`` (``rows`` rows each)."""
    from spec_cache.schemas import CheckpointAttachment

    attachment = checkpoint.attachment
    tensors = list(attachment.tensors)
    for k, v in pairs:
        tensors[k], tensors[v] = change(tensors[k]), change(tensors[v])
    metadata = dict(attachment.metadata)
    if layout == "projected":
        headers = json.loads(metadata["cacheHeaders"])
        for header in headers:
            header["offset"] = rows
        metadata["cacheHeaders"] = json.dumps(headers, separators=(",", ":"))
        metadata["processedTokens"] = rows
    else:
        metadata["draftOffset"] = rows
    return CheckpointAttachment(attachment.schema, metadata, tuple(tensors))


def padded(checkpoint: PartialRowCheckpoint) -> DraftRowCheckpoint | None:
    """A partial row as a checkpoint of its schema covering all ``processed_tokens``: its ``start`` missing head
    rows written as zeros. None when it holds no row yet (nothing but the target part to store)."""
    layout = _kv_rows(checkpoint)
    if layout is None or checkpoint.start < 1:
        return None
    kind, pairs = layout
    held = int(checkpoint.attachment.tensors[pairs[0][0]].shape[2])
    if held < 1:
        return None
    start = checkpoint.start

    def pad(tensor):
        tensor = mx.array(tensor) if not isinstance(tensor, mx.array) else tensor
        head = mx.zeros((*tensor.shape[:2], start, tensor.shape[3]), dtype=tensor.dtype)
        return mx.concatenate([head, tensor], axis=2)
    attachment = _with_rows(checkpoint, kind, pairs, pad, held + start)
    mx.eval(list(attachment.tensors))
    return DraftRowCheckpoint(checkpoint.processed_tokens, attachment)


def opened(checkpoint: Any) -> Any:
    """A restored checkpoint as the row it was: a :func:`padded` one (leading all-zero K and V rows) becomes its
    :class:`PartialRowCheckpoint` again; anything else (None, a :class:`ColdRow`, a full checkpoint) is returned
    as it is. Cost for a full checkpoint: one comparison of its first row."""
    if checkpoint is None or isinstance(checkpoint, (ColdRow, PartialRowCheckpoint)) or \
            not isinstance(checkpoint, DraftRowCheckpoint):
        return checkpoint
    layout = _kv_rows(checkpoint)
    if layout is None:
        return checkpoint
    kind, pairs = layout
    tensors = checkpoint.attachment.tensors
    k, v = (mx.array(tensors[i]) if not isinstance(tensors[i], mx.array) else tensors[i] for i in pairs[0])
    if k.ndim != 4 or k.shape[2] == 0 or not bool(mx.all(k[:, :, 0, :] == 0) & mx.all(v[:, :, 0, :] == 0)):
        return checkpoint
    missing = (mx.all(k == 0, axis=(0, 1, 3)) & mx.all(v == 0, axis=(0, 1, 3))).tolist()
    start = next((i for i, gone in enumerate(missing) if not gone), len(missing))
    held = len(missing) - start
    if held < 1:
        return checkpoint  # nothing held: not a padded row (the schema check decides what it is)
    attachment = _with_rows(checkpoint, kind, pairs, lambda t: mx.array(t)[:, :, start:, :], held)
    base = held if kind == "projected" else held + 1
    return PartialRowCheckpoint(checkpoint.processed_tokens, attachment, start=start, base_tokens=base)


def opened_all(checkpoints: Any) -> Any:
    """:func:`opened` over a ``prepare_append`` argument (anything but a sequence is left for its check)."""
    if isinstance(checkpoints, (str, bytes)) or not isinstance(checkpoints, Sequence):
        return checkpoints
    return [opened(cp) for cp in checkpoints]


def check_opening(openings: Sequence[Any], validate: Callable[[DraftRowCheckpoint], None]) -> None:
    """What ``prepare_append`` of rows with ``opens_beside_target`` accepts per row: None (cold), a
    ``ColdRow``, a ``PartialRowCheckpoint`` (its held part validated) or a checkpoint (validated)."""
    if isinstance(openings, (str, bytes)) or not isinstance(openings, Sequence):
        raise TypeError(f"checkpoints must be a sequence (None for a cold row), got {type(openings).__name__}")
    for opening in openings:
        if opening is None or isinstance(opening, ColdRow):
            continue
        if isinstance(opening, PartialRowCheckpoint):
            if not 0 < opening.start <= opening.processed_tokens:
                raise SchemaError(opening.attachment.schema, "start",
                                  f"partial row starts at {opening.start} of {opening.processed_tokens} tokens")
            validate(opening.held())
            continue
        validate(opening)


def directory_namespace(schema: str, model_dir: Path, config_name: str | None = None) -> str:
    """``<schema>:<model identity of model_dir>`` (``config_name``: see ``model_identity``)."""
    from spec_cache.naming.identity import model_identity
    from spec_cache.naming.namespace import drafter_namespace

    return drafter_namespace(schema, model_identity(model_dir, config_name=config_name))


def check_sizes(drafter: str, sizes: Iterable[tuple[str, Any, Any]]) -> None:
    """Each ``(what, the drafter's, the target's)`` must agree, else ValueError naming the wrong pairing."""
    for what, mine, theirs in sizes:
        if mine != theirs:
            raise UnsupportedCombination(f"{drafter} drafter expects {what} {mine}; target has {theirs} - {PAIRING}")


class DraftRows:
    """A draft row group's shared members. A subclass implements ``_init_state`` (its empty state, set before
    the opening checkpoints are appended), ``prepare_append``, ``_keep_rows`` and ``dispose``."""

    prefill_needs_target_hidden = False
    prefill_needs_target_taps = False
    tap_layers: tuple = ()
    #: how rows are admitted: ``"tail-split"`` (the target forwards ``prompt[:-1]``, the last prompt token is the
    #: first pending token), the one mode this engine has. The seed's ``"full"`` (MTP heads: the whole prompt) is
    #: not implemented and no row declares it (issue 38; ``drafters.qwen_mtp``'s module doc says why)
    prefill_mode = "tail-split"
    #: whether the engine feeds tokens appended to a row that already has state (a restored row's new turn, a
    #: continuation's replay, the tail after a target-only hit) through :meth:`consume` rather than ``prefill``
    consumes_appended_tokens = False
    #: whether :meth:`consume` takes externally supplied tokens (the seed's ``supportsExternalTokens``)
    supports_external_tokens = False
    #: whether ``prepare_append`` takes a :class:`ColdRow` (and the :class:`PartialRowCheckpoint` its capture
    #: gives): a cold row beside a restored target that covers only what the target forwards from then on
    opens_beside_target = False

    def __init__(self, provider: Any, checkpoints: Sequence[DraftRowCheckpoint | None]) -> None:
        self.provider = provider
        self.namespace = provider.namespace
        self.schema = provider.schema
        self.supports_target_adapters = provider.supports_target_adapters
        self._init_state()
        self.append(checkpoints)

    def _init_state(self) -> None:
        raise NotImplementedError  # pragma: no cover - abstract

    @property
    def row_count(self) -> int:
        return len(self._processed)

    @property
    def processed(self) -> tuple[int, ...]:
        return tuple(self._processed)

    def append(self, checkpoints: Sequence[DraftRowCheckpoint | None]) -> None:
        apply_state_changes([lambda: self.prepare_append(checkpoints)])

    def prepare_append(self, checkpoints: Sequence[DraftRowCheckpoint | None]) -> PreparedStateChange:
        raise NotImplementedError  # pragma: no cover - abstract

    def consume(self, tokens_per_row: Sequence[Sequence[int]], context: Any, lengths: Sequence[int]) -> None:
        """Add externally supplied tokens (forced or replayed, not drafted): ``lengths[row]`` leading tokens of
        each row's list, with the target forward that appended them as ``context`` (its ``taps``/``hidden``).
        Rows that cannot (``supports_external_tokens`` false) raise NotImplementedError."""
        raise NotImplementedError(f"{self.schema} draft rows cannot consume externally supplied tokens")

    def lazy_state(self) -> list:
        """The arrays a ``commit`` may leave unevaluated: the engine queues them (``mx.async_eval``) beside the
        next round instead of waiting for them (``materialize``). Rows whose state lives on the host: none."""
        return []

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` in that order; ``[]`` releases everything."""
        keep = check_keep(keep, self.row_count)
        if not keep:
            self.dispose()
            return
        self._keep_rows(keep)

    def _keep_rows(self, keep: list[int]) -> None:
        """Reduce the state to the (valid, distinct, non-empty) rows ``keep``."""
        raise NotImplementedError  # pragma: no cover - abstract

    def dispose(self) -> None:
        raise NotImplementedError  # pragma: no cover - abstract


class BoundDraftRows(DraftRows):
    """Rows over a target group: the provider is checked against the target model first, and drafts are
    sampled (stream 1) with the group's sampling."""

    def __init__(
        self,
        provider: Any,
        target: TargetRows,
        checkpoints: Sequence[DraftRowCheckpoint | None],
        sampling: Sampling,
    ) -> None:
        provider.bind(target.model)
        self.target = target
        self._sampler = TokenSampler(sampling, stream=1)
        self._processed: list[int] = []
        super().__init__(provider, checkpoints)


class OpensRows:
    """A provider whose row groups are ``rows_class(provider, target, checkpoints, sampling)``."""

    rows_class: type

    def open_prefill(self, target: TargetRows, checkpoints: Sequence[DraftRowCheckpoint | None]) -> Any:
        return self.rows_class(self, target, checkpoints, Sampling())

    def open(
        self, target: TargetRows, checkpoints: Sequence[DraftRowCheckpoint | None], sampling: Sampling | None = None
    ) -> Any:
        return self.rows_class(self, target, checkpoints, sampling or Sampling())


class NetworkProvider(OpensRows):
    """A provider around a trained network (``network.config`` is its configuration)."""

    def __init__(self, network: Any, namespace: str, model_dir: Path | None = None) -> None:
        self.network = network
        self.config = network.config
        self.namespace = namespace
        self.model_dir = model_dir

"""The plumbing every draft provider and row group shares, so each drafter module holds only its own state.

* :class:`DraftRows`: a row group's identity (provider, namespace, schema, ``supports_target_adapters``), its
  per-row coverage (``row_count``/``processed`` over ``_processed``), ``append`` through the two-phase
  :func:`~spec_cache.rows.protocol.apply_state_changes`, and ``filter_rows`` (``[]`` releases everything).
* :class:`BoundDraftRows`: rows that read a target group (bound to it by ``provider.bind``) and sample drafts.
* :class:`OpensRows`: a provider's ``open``/``open_prefill`` over its ``rows_class``; :class:`NetworkProvider`
  adds the fields of a provider around a trained network (assistant, DeepSpec, DFlash).
* ``consume(tokens, context, lengths)``: externally supplied tokens (``supports_external_tokens``), and
  ``prefill_mode`` (``"tail-split"`` or the MTP heads' ``"full"``), as in the seed's ``DraftRowGroup``.
* :func:`directory_namespace`: the ``<schema>:<model identity>`` namespace of a drafter directory;
  :func:`check_sizes`: the "expects X; target has Y" checks of ``bind``.
* :class:`ColdRow` and :class:`PartialRowCheckpoint`: a drafter row opened cold beside a restored target (a
  target-only hit) by rows that declare ``opens_beside_target``: its state covers only the tokens the target
  forwards from then on (the tail), at their true positions; drafting may start weaker, tokens never change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

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
    between groups of one engine (prefill group to decode group); it is never stored: the schemas have no field
    for a missing head, so a checkpoint of such a row stores the target part only (:func:`storable`)."""

    start: int = 0
    #: ``processed_tokens`` of the attachment's own checkpoint (the part held)
    base_tokens: int = 0

    def held(self) -> DraftRowCheckpoint:
        """The attachment as the plain checkpoint it is (what the schema validates)."""
        return DraftRowCheckpoint(self.base_tokens, self.attachment)


def storable(checkpoint: DraftRowCheckpoint | None) -> DraftRowCheckpoint | None:
    """``checkpoint`` when a store may keep it as this drafter's part; None for a partial row (target only)."""
    return None if isinstance(checkpoint, PartialRowCheckpoint) else checkpoint


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
    #: how the seed admits this drafter's rows: ``"tail-split"`` (the target forwards ``prompt[:-1]``, the last
    #: prompt token is the first pending token) or ``"full"`` (the whole prompt; MTP heads). This engine admits
    #: every row tail-split; rows declaring ``"full"`` follow the target's coverage and are exact either way.
    prefill_mode = "tail-split"
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

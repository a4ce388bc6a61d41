"""The grouped-row protocol shared by the target rows and every draft provider.

A speculative group is a set of rows (sequences) that advance together: one target forward serves every row,
one drafter call proposes for every row. Rows join and leave only *between* committed rounds, and every
membership change goes through two phases so the target rows and the draft rows can never disagree:

1. each side *prepares* its complete replacement state (:class:`PreparedStateChange`) without touching the
   live state;
2. only when every side has prepared does :func:`apply_state_changes` commit them all.

If any preparation fails, everything prepared so far is disposed and the live state is exactly what it was.

Tensor ownership (from mlx-bun): ``open``/``append``/``prepare_append`` *borrow* checkpoints and keep what they
need as their own arrays; ``capture(row)`` returns an *owned* snapshot the caller may keep after the group moves
on. MLX arrays are immutable values, so "owned" here means: distinct array objects that no later group
operation changes.

Token coverage (the tail-split contract every group follows): a row whose sequence is ``tokens`` has the first
``len(tokens) - 1`` tokens in the target KV; the last one is *pending* (fed at the start of the next round).
A draft row's ``processed_tokens`` always equals the target row's KV length between rounds (a row opened beside
a restored target holds state only from its start on, but counts the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

from spec_cache.state.cache_state import to_mx  # re-exported: the one tensor -> mx.array conversion

if TYPE_CHECKING:  # pragma: no cover - typing only
    import mlx.core as mx

    from spec_cache.rows.sampling import Sampling
    from spec_cache.schemas import DraftRowCheckpoint

__all__ = [
    "TargetRowGroup",
    "PreparedStateChange",
    "apply_state_changes",
    "PrefillContext",
    "RoundContext",
    "DraftGroup",
    "DraftProvider",
    "check_checkpoints",
    "check_row",
    "check_keep",
    "check_per_row",
    "check_window",
    "check_accepted",
    "to_mx",
]


@dataclass
class PreparedStateChange:
    """A built-but-unpublished replacement state.

    ``commit()`` swaps the replacement in (a pure swap: it must not fail) and keeps the superseded state;
    ``dispose()`` then releases whichever of the two is no longer live (the replacement when never committed,
    the superseded state after a commit). Both are idempotent.
    """

    commit: Callable[[], None]
    dispose: Callable[[], None]

    @staticmethod
    def swap(get: Callable[[], Any], put: Callable[[Any], None], replacement: Any) -> "PreparedStateChange":
        """The common case: replace one slot with ``replacement`` on commit."""
        held = {"value": replacement, "committed": False}

        def commit() -> None:
            if not held["committed"]:
                old = get()
                put(held["value"])
                held["value"], held["committed"] = old, True

        def dispose() -> None:
            held["value"] = None

        return PreparedStateChange(commit, dispose)


def apply_state_changes(builders: Iterable[Callable[[], PreparedStateChange]]) -> None:
    """Build every change, then commit all of them; all-or-nothing.

    Each builder returns a :class:`PreparedStateChange` and must not touch live state. If a builder raises, the
    changes built so far are disposed and the error is re-raised (an ``ExceptionGroup`` "execution and cleanup
    failed" if a disposal fails too). After the commits, every change is disposed, which releases the
    superseded states.
    """
    prepared: list[PreparedStateChange] = []
    try:
        for build in builders:
            prepared.append(build())
    except BaseException as error:
        failures = _dispose_all(prepared)
        if failures:
            raise ExceptionGroup("execution and cleanup failed", [error, *failures]) from None
        raise
    for change in prepared:
        change.commit()
    failures = _dispose_all(prepared)
    if failures:
        raise ExceptionGroup("resource cleanup failed", failures)


def _dispose_all(changes: Sequence[PreparedStateChange]) -> list[Exception]:
    failures: list[Exception] = []
    for change in changes:
        try:
            change.dispose()
        except Exception as error:  # every change gets its chance to release
            failures.append(error)
    return failures


@dataclass
class PrefillContext:
    """What the target prefill hands the drafters.

    ``last_hidden`` is ``[B, 1, H]``: the target's final (post-norm) hidden at each row's last forwarded token;
    a row that forwarded nothing (``lengths[row] == 0``) holds zeros there. ``taps[layer]`` is
    ``[B, max(lengths), H]``: the residual stream after target layer ``layer`` at every forwarded position
    (row ``r``'s tokens at ``[:lengths[r]]``), for the layers the drafter asked for (``tap_layers``).
    """

    last_hidden: "mx.array | None"
    lengths: list[int]
    taps: dict = field(default_factory=dict)
    #: per row, the ``TokenLogprob`` of each forwarded token's next token (rows that asked; None: none did)
    scores: list | None = None


@dataclass
class RoundContext:
    """One verify round, as the drafters see it at ``commit``.

    ``window[row]`` is what the target forwarded for the row: the pending token, the drafts kept for
    verification, then filler (when rows proposed different counts). ``hidden`` is the target's final hidden for
    those positions, ``[B, L, H]``; ``taps[layer]`` the residual stream after each of the drafter's
    ``tap_layers`` there.
    """

    window: list[list[int]]
    hidden: "mx.array"
    taps: dict = field(default_factory=dict)


@runtime_checkable
class TargetRowGroup(Protocol):
    """The target side of a speculative group: the batched rows of one target model (``TargetRows`` for float
    KV, ``QuantizedTargetRows`` under KV quantization). The engine and every draft provider speak only this.

    Token coverage follows the tail-split contract above: ``offsets[row]`` tokens are in the row's KV.
    """

    @property
    def row_count(self) -> int: ...

    @property
    def offsets(self) -> tuple[int, ...]: ...

    def window_limits(self) -> list: ...

    def materialize(self) -> None: ...

    def dispose(self) -> None: ...

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], step: int = 512, *,
                tap_layers: Sequence[int] = (), need_hidden: bool = True) -> PrefillContext: ...

    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> Any: ...

    def rollback(self, rejected: Sequence[int]) -> None: ...

    def extract(self, row: int) -> list: ...

    def prepare_append(self, other: Any) -> PreparedStateChange: ...

    def filter_rows(self, keep: Sequence[int]) -> None: ...

    def donors(self, layer: int) -> Any: ...


@runtime_checkable
class DraftGroup(Protocol):
    """The draft side of a speculative group (one row per sequence, rows aligned with the target rows)."""

    namespace: str
    schema: str
    #: True when a prefilled row needs the target's hidden at its last prompt token (the assistant): the engine
    #: then makes sure the target forwards at least that token.
    prefill_needs_target_hidden: bool
    #: True when a row needs the target's taps at *every* token it covers (projected-context drafters, MTP
    #: heads). A cold drafter row beside a restored target (a target-only hit) then opens beside it when the
    #: group declares ``opens_beside_target`` (``prepare_append`` takes ``drafters.base.ColdRow``; its state
    #: covers only the tokens forwarded from there on), else the target forwards the whole prefix again.
    #: Optional members the engine reads with ``getattr``: ``opens_beside_target`` (False), ``prefill_mode``
    #: (``"tail-split"``; ``"full"``: tokens appended to a row that has state arrive through
    #: ``consume(tokens, context, lengths)``, which ``supports_external_tokens`` says the group has).
    prefill_needs_target_taps: bool
    #: target layers whose residual stream the drafter reads (``PrefillContext.taps``, ``RoundContext.taps``)
    tap_layers: tuple
    supports_target_adapters: bool

    @property
    def row_count(self) -> int: ...

    @property
    def processed(self) -> tuple[int, ...]: ...

    def append(self, checkpoints: Sequence["DraftRowCheckpoint | None"]) -> None: ...

    def prepare_append(self, checkpoints: Sequence["DraftRowCheckpoint | None"]) -> PreparedStateChange: ...

    def prefill(self, tokens_per_row: Sequence[Sequence[int]], context: PrefillContext | None) -> None: ...

    def materialize(self) -> None: ...

    def filter_rows(self, keep: Sequence[int]) -> None: ...

    def capture(self, row: int) -> "DraftRowCheckpoint": ...

    def draft(self, pending: Sequence[int], depth: int) -> list[list[int]]: ...

    def commit(self, accepted: Sequence[int], context: RoundContext) -> None: ...

    def dispose(self) -> None: ...


@runtime_checkable
class DraftProvider(Protocol):
    """A loaded drafter: opens draft groups over a set of target rows."""

    namespace: str
    schema: str
    supports_target_adapters: bool

    def validate_checkpoint(self, checkpoint: "DraftRowCheckpoint") -> None: ...

    def open_prefill(
        self, target: "TargetRowGroup", checkpoints: Sequence["DraftRowCheckpoint | None"]
    ) -> DraftGroup: ...

    def open(
        self,
        target: "TargetRowGroup",
        checkpoints: Sequence["DraftRowCheckpoint | None"],
        sampling: "Sampling | None" = None,
    ) -> DraftGroup: ...


def check_checkpoints(
    checkpoints: Sequence["DraftRowCheckpoint | None"], validate: Callable[["DraftRowCheckpoint"], None]
) -> None:
    """Run ``validate`` on every non-None checkpoint before anything is built (raises SchemaError)."""
    if isinstance(checkpoints, (str, bytes)) or not isinstance(checkpoints, Sequence):
        raise TypeError(f"checkpoints must be a sequence (None for a cold row), got {type(checkpoints).__name__}")
    for checkpoint in checkpoints:
        if checkpoint is not None:
            validate(checkpoint)


def check_row(row: Any, count: int) -> int:
    """``row`` as a valid index into ``count`` rows, else IndexError."""
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < count:
        raise IndexError(f"row {row!r} out of range for {count} rows")
    return row


def check_keep(keep: Sequence[int], count: int) -> list[int]:
    """``filter_rows`` argument: distinct valid row indices (IndexError / ValueError)."""
    rows = [check_row(row, count) for row in keep]
    if len(set(rows)) != len(rows):
        raise ValueError(f"filter_rows: duplicate rows in {rows}")
    return rows


def check_per_row(values: Sequence[Any], count: int, what: str) -> None:
    """One ``what`` per row, else ValueError."""
    if len(values) != count:
        raise ValueError(f"expected one {what} per row ({count}), got {len(values)}")


def check_window(window: Sequence[Sequence[int]], count: int) -> int:
    """``verify`` argument: one non-empty token list per row, all of one length; returns that width (ValueError)."""
    check_per_row(window, count, "token list")
    lengths = [len(tokens) for tokens in window]
    if len(set(lengths)) != 1 or lengths[0] == 0:
        raise ValueError(f"verify windows must be non-empty and of equal length, got lengths {lengths}")
    return lengths[0]


def check_accepted(accepted: Sequence[int], count: int, context: RoundContext) -> None:
    """``commit`` argument: per row the drafts kept, each within the verified window (``0 <= kept < width``)."""
    check_per_row(accepted, count, "accepted count")
    width = len(context.window[0]) if context.window else 0
    for row, kept in enumerate(accepted):
        if not 0 <= kept < width:
            raise ValueError(f"row {row}: {kept} accepted of a window of {width}")

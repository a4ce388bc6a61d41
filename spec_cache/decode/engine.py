"""Batched speculative decoding over rows that join and leave between rounds.

Why one file of ~900 lines: ``SpeculativeEngine`` (request checks) and ``DecodeSession`` (admit / round /
retire / snapshots) share the row bookkeeping and the two-phase state changes; split, each half would reach into
the other's rows.

One target forward serves every active row. A round: each row's drafter proposes up to ``draft_depth`` tokens
after its pending token; the target verifies ``[pending] + drafts`` for all rows in one forward (shorter
proposals are padded); each row keeps its drafts up to the first disagreement plus the target's own token there,
and the rejected tail of every row is rolled back exactly (see ``TargetRows``). With greedy sampling the emitted
tokens are exactly the target's own greedy tokens; the drafter only changes how many come per forward.

Continuous batching: ``SpeculativeEngine.session()`` returns a ``DecodeSession`` that requests join (``submit``,
cold or restored) and leave (done, ``cancel``, ``finish``) between rounds, with per-row ``on_tokens`` /
``on_finish`` callbacks; ``run`` is a session that is given every request at once. Sampling is per row
(``RowRequest.sampling``: temperature, top_p, seed; ``spec_cache.rows.sampling.RowSampler``): the token at position
``p`` of a row is drawn with a key derived from its seed and ``p`` only, so a row's tokens never depend on the
other rows of its batch, on the drafter, or on where it was restored from.

Row admission (prefill) is tail-split: the target KV gets ``prompt[:-1]`` (minus what was restored) and the last
prompt token is the first pending token. Target rows and draft rows join a running group together through
two-phase state changes, so a failure on either side leaves both as they were. While other rows decode, a
joining cohort's target prefill is spread over steps, one chunk of ``prefill_step_size`` positions between
rounds (``interleave_prefill``; ``spec_cache.rows.joining``): no decoding row stalls behind a long prompt.

A target-only hit (restored target caches, no ``draft_checkpoint``): the assistant makes the target forward the
last prompt token again (it needs that hidden), the draft model and ngram rebuild their row from the prompt
tokens, and the drafters that read the target's taps (``opens_beside_target``: DeepSpec, DFlash, DFlash 2, the
Qwen MTP head) open their row cold beside the restored target (``drafters.base.ColdRow``): it covers the tokens
the target forwards from there on (the MTP head, like the assistant, has the last restored token forwarded again
when nothing else would be); its checkpoints carry that partial row in its schema's layout, the head it never
had as zero rows (``drafters.base.storable``; none while it holds nothing yet), so a restore of them opens the same
partial row again (``drafters.base.opened``: issue 38). A drafter declaring ``consumes_appended_tokens`` (the MTP
head) takes the tokens appended to a row that already has state (restored, or opened beside the target) through
``consume``, as the seed feeds externally supplied tokens. Every row is admitted tail-split: the seed's ``"full"``
prefill mode is not implemented (``drafters.qwen_mtp``'s module doc says why).

Persistence hooks: ``on_checkpoint(row_index, tokens, target_caches, draft_checkpoint)`` is called

* at the prompt boundary, after a row's prefill: ``tokens == prompt[:-1]`` (not for a row that restored exactly
  that boundary, drafter row included: the checkpoint would repeat what it restored);
* when a row finishes (length or EOS): ``tokens == prompt + generated[:-1]`` (the last generated token was never
  forwarded, so no state covers it).

``target_caches`` are single-row mlx-lm caches (one per layer) with ``offset == len(tokens)``: ``KVCache``, a
``RotatingKVCache`` snapshot for a sliding-window layer, a ``QuantizedKVCache`` (recording ``converted_at``) for a
layer converted under KV quantization. ``draft_checkpoint`` is the drafter state at the same boundary (None
without a provider, and for a row opened beside a restored target that holds no row yet; such a row's later
checkpoints hold its missing head as zero rows: ``drafters.base.padded``). Both
are owned snapshots. A request restored from such a checkpoint
(``restored_caches``/``restored_tokens``/``draft_checkpoint``) skips the target prefill of the restored part and
continues token-identically.

KV quantization (``kv``: ``kv_bits``/``kv_group_size``/``quantized_kv_start`` or a per-layer ``kv_config``)
reproduces mlx-lm's ``generate_step``: each row converts at the offset a cold ``generate_step`` run of its prompt
with ``prefill_step_size`` would (``spec_cache.rows.kv_quant``), its rows run through ``QuantizedTargetRows``, and a
restored quantized state is accepted only when it was converted at that same point.

Adaptive draft depth (``adaptive=True``, the default): ``draft_depth`` is the most a row proposes; each round the
engine's ``DepthController`` (``spec_cache.decode.depth``) picks the batch depth in ``0..draft_depth`` with the most
expected tokens per second, from each row's measured acceptance and the measured seconds of the draft call and
of the verify at each window width (timed with ``clock``), probing now and then while plain decoding wins. The
depth changes acceptance only, never the tokens. ``adaptive=False``: always ``draft_depth``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

from spec_cache.decode.depth import DepthController, RowAcceptance
from spec_cache.drafters.base import ColdRow, storable
from spec_cache.errors import InvalidRequest, RestoreRefused
from spec_cache.rows.joining import JoiningCohort
from spec_cache.rows.kv_quant import converted_at, plan_kv, reusable
from spec_cache.rows.logprobs import RowLogprobs, check_top, score
from spec_cache.rows.protocol import RoundContext, TargetRowGroup, apply_state_changes
from spec_cache.rows.quantized_rows import QuantizedTargetRows
from spec_cache.rows.sampling import RowSampler, RowSampling, Sampling
from spec_cache.rows.target import TargetModel, TargetRows, check_kv_options, prefix_caches
from spec_cache.schemas import DraftRowCheckpoint, SchemaError

__all__ = ["RowRequest", "RowResult", "SpeculativeEngine", "DecodeSession", "CheckpointHook"]

#: ``on_checkpoint(row_index, tokens, target_caches, draft_checkpoint)``
CheckpointHook = Callable[[int, list, list, "DraftRowCheckpoint | None"], None]


@dataclass
class RowRequest:
    """One sequence to generate.

    ``restored_caches``: per target layer, single-row mlx-lm caches (``KVCache``; ``RotatingKVCache`` for a
    sliding-window layer; ``QuantizedKVCache`` for a converted layer) covering ``prompt[:restored_tokens]``;
    only read, never changed. ``restored_tokens``: ``0 <= n <= len(prompt) - 1``.
    ``draft_checkpoint``: the drafter state at ``restored_tokens``, or None for a cold drafter row.
    """

    prompt: list[int]
    restored_caches: list | None = None
    restored_tokens: int = 0
    draft_checkpoint: DraftRowCheckpoint | None = None
    max_tokens: int = 32
    #: this row's temperature / top_p / seed (None: the run's); see ``spec_cache.rows.sampling.RowSampler``
    sampling: RowSampling | None = None
    #: False: generate ``max_tokens`` whatever the EOS ids (vLLM's ``ignore_eos``; benchmarks, tests)
    stop_at_eos: bool = True
    #: False: no prompt-boundary checkpoint (``on_checkpoint`` at ``prompt[:-1]``) for this row: its owner
    #: checkpoints ``prompt`` after the first token instead (``DecodeSession.checkpoint``), off the TTFT path (the
    #: boundary checkpoint extracts the row's whole state between its prefill and its first token)
    boundary_checkpoint: bool = True
    #: prompt offsets (token counts) whose target state is checkpointed from the prefill chunks themselves
    #: (``on_checkpoint`` with ``prompt[:k]`` and no drafter state; ``spec_cache.rows.joining``), where the engine
    #: can (``SpeculativeEngine.prefill_checkpoints``); offsets outside ``(restored, len(prompt) - 1)`` are skipped
    checkpoint_at: tuple[int, ...] = ()
    #: the logprob of each generated token and its ``logprobs`` most likely alternatives (0..20; None: off;
    #: ``spec_cache.rows.logprobs``): delivered as ``on_tokens``' third argument (``RowLogprobs``) and in
    #: ``RowResult.logprobs``. Its rounds are not pipelined while it decodes
    logprobs: int | None = None
    #: score the prompt tokens the target forwards too (``prompt[target_start + 1:]``; a cold row: all but the
    #: first) with this many alternatives (0..20; None: off): ``RowResult.prompt_logprobs`` and the row's first
    #: ``on_tokens`` call. Not with KV quantization
    prompt_logprobs: int | None = None


@dataclass
class RowResult:
    """``tokens``: generated tokens (EOS included when hit). ``cached_tokens``: prompt tokens the target did not
    forward. ``drafted``/``accepted``: proposals verified / accepted. ``ttft_s``: seconds from ``run`` (or the
    row's ``submit``) to its first token. ``cancelled``: the row left early through ``cancel``. ``reason``:
    ``"length"``, ``"eos"``, ``"stop"`` (``DecodeSession.finish``) or ``"cancelled"``."""

    tokens: list[int]
    cached_tokens: int
    drafted: int
    accepted: int
    ttft_s: float
    cancelled: bool = False
    reason: str = ""
    #: one ``TokenLogprob`` per generated token (``RowRequest.logprobs``; None: not asked)
    logprobs: list | None = None
    #: per prompt position, its ``TokenLogprob`` or None where nothing scored it (the first token, a restored
    #: prefix); None: not asked (``RowRequest.prompt_logprobs``)
    prompt_logprobs: list | None = None


@dataclass
class _Row:
    index: int
    request: RowRequest
    tokens: list[int]
    target_start: int = 0
    conversion: int | None = None  # where the row's KV converts to quantized (None: never)
    generated: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    ttft_s: float | None = None
    done: bool = False
    reason: str = ""
    sampling: RowSampling | None = None
    on_tokens: Callable[[int, list], None] | None = None
    on_finish: Callable[[int, RowResult], None] | None = None
    submitted: float = 0.0
    acceptance: RowAcceptance = field(default_factory=RowAcceptance)  # what the depth controller knows of it
    beside: bool = False  # its drafter row opened cold beside a restored target (a target-only hit)
    draft_start: int = 0  # the first prompt token its drafter row takes at admission
    scored: list | None = None  # ``TokenLogprob`` per generated token (``RowRequest.logprobs``)
    prompt_scored: list | None = None  # per prompt position (``RowRequest.prompt_logprobs``), once prefilled
    prompt_sent: bool = False  # ``prompt_scored`` went with an ``on_tokens`` call

    def result(self, cancelled: bool = False, reason: str | None = None) -> RowResult:
        return RowResult(list(self.generated), self.target_start, self.drafted, self.accepted,
                         self.ttft_s if self.ttft_s is not None else 0.0, cancelled,
                         self.reason if reason is None else reason,
                         None if self.scored is None else list(self.scored),
                         None if self.prompt_scored is None else list(self.prompt_scored))


def pipelines_by_default() -> bool:
    """Whether plain rounds are pipelined when the caller does not say: yes, on every device. On a GPU the host
    builds round k+1 while the device runs round k. On the CPU MLX evaluates on a thread of its own, so the same
    overlap holds on a machine with a core to spare: on the 2-core VM (tiny float32 llama, OpenBLAS) one
    ``spec-cache serve`` stream over a ~1.8k-token chat decodes 549-577 tok/s pipelined against 456-505
    synchronously (mlx_lm.server, which pipelines, 534-570), a decode step 1.57 vs 2.00 ms in the scheduler
    trace; ``tools/bench_decode.py --no-smollm2 --max-tokens 128`` reads pipelined / synchronous 1.02-1.07x at B=1.
    (An early measurement, 632 vs 1032 tok/s against pipelining on the CPU, no longer holds.)"""
    return True


#: prefill chunk in tokens where the caller does not say, per device (``prefill_step_by_default``)
GPU_PREFILL_STEP = 2048
CPU_PREFILL_STEP = 512
#: new tokens of short rows that join one step on a GPU (``join_budget_by_default``)
GPU_JOIN_BUDGET = 1280


def prefill_step_by_default() -> int:
    """A server's prefill chunk when its operator does not say: 2048 tokens on a GPU (mlx_lm.server's and
    ``generate_step``'s; a 512-token chunk leaves the device underused and made a 540-token warm turn two steps in
    issue 35's H200 trace), 512 on the CPU. There a forward's cost grows with its tokens whatever the chunk, so a
    smaller chunk costs nothing and lets decoding rows and other requests' short turns through between chunks: the
    agent workload at 4 clients (``tools/bench_serve.py --workload agent --sessions 4 --clients 4``, tiny float32
    llama, 2-core VM) read warm-turn TTFT 1.32x mlx_lm.server's at 2048 and 2.36x at 512 (tokens/s 1.06x / 1.13x)."""
    return GPU_PREFILL_STEP if mx.default_device().type == mx.DeviceType.gpu else CPU_PREFILL_STEP


def join_budget_by_default(prefill_step_size: int) -> int:
    """New tokens of the short rows (a warm turn's tail: one prefill chunk at most) that join a decoding batch in
    one step, the first always joining: a step's token budget, as vLLM's scheduler has one. On a GPU,
    ``GPU_JOIN_BUDGET`` (1280, at most a chunk): below a few hundred tokens a forward is bound by reading the
    weights (a bf16 model on an H100/H200 reaches its compute roof at ~300 tokens a forward: ~990 TFLOP/s over
    ~3.4 TB/s, 2 FLOPs a weight a token), so several short prefills in one step cost little more than one; above,
    a forward's time grows with its tokens, and forwarding several warm turns together makes the first wait for
    the others (issue 35, H100, 8B-shaped: three ~570-token turns took 385 ms in one step, one alone 130-167 ms;
    at 2048 four chat turns came out together at ~585 ms each, where one a step gives ~150, 300, 450, 600). But
    every step that joins rows stalls the decoding ones, merges the batch's caches and discards the round queued
    ahead: at 512 the tool's ~545-token chat turns joined one a step and the decoding rows paid for it (4 clients:
    tokens/s 0.97x mlx_lm.server's on an H200 at d49a463, 0.77x on an H100 at df96b45), where 1280 (two such
    turns a step) read 1.29x at a warm TTFT of 1.25x in the same H100 session (2048 on an H100 before:
    1.34x / 1.22x); ``docs/bench-gpu.md``. On
    the CPU, none beyond the first: a forward's cost grows with its tokens whatever the batch (four chat turns
    arriving within ~16 ms of each other at 4 clients on the 2-core VM: ~80 ms to the first token each, against
    ~20, 40, 60, 80 ms one a step)."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return min(prefill_step_size, GPU_JOIN_BUDGET)
    return 0


class SpeculativeEngine:
    """Greedy-exact batched speculative decoding with one target and an optional draft provider.

    ``draft_depth``: the most proposals per row per round (0: plain decoding through the same path).
    ``adaptive``: pick each round's depth in ``0..draft_depth`` from measured acceptance and cost (module doc;
    ``self.depth`` is the ``DepthController``, None when off or without a provider); False: always
    ``draft_depth``. ``clock``: seconds for the controller's cost measurements (tests inject one). ``kv``: KV
    quantization options (``KVOptions``, see module doc; ``turbo_quant`` raises NotImplementedError, it has no
    codec). ``max_rows``: most rows decoded at once (None: all); waiting rows join as others finish.
    ``prefill_step_size``: prompt tokens per prefill forward; with KV quantization it also decides, as in
    ``generate_step``, where a row converts.
    ``pipeline``: overlap plain rounds (float KV, attention-only target) as mlx-lm's ``generate_step`` does: the
    next round is queued on the device before the host reads this one's tokens, with or without a drafter (a
    drafting session's rounds at depth 0; see ``DecodeSession``); False: one synchronous round at a time (same
    tokens, same checkpoints). None (default): ``pipelines_by_default`` (every device).
    ``interleave_prefill``: rows joining a batch that is decoding are prefilled one chunk of
    ``prefill_step_size`` positions per step, between the decoding rows' rounds (``spec_cache.rows.joining``), so no
    decoding row stalls behind a long prompt (float KV, attention-only target, a drafter that needs no taps);
    False: a joining cohort is prefilled whole before the step's round. Tokens are the same either way.
    """

    def __init__(
        self,
        target: TargetModel,
        provider: Any = None,
        draft_depth: int = 4,
        kv: Any = None,
        *,
        max_rows: int | None = None,
        prefill_step_size: int = 512,
        adaptive: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        pipeline: bool | None = None,
        interleave_prefill: bool = True,
    ) -> None:
        check_kv_options(kv)
        head_dims = [target.kv_geometry(layer)[1] for layer in range(target.num_layers)]
        self.plan = plan_kv(kv, target.num_layers, head_dims, target.layer_windows)
        if self.plan is not None and target.recurrent_layers:
            raise NotImplementedError(f"KV quantization of a target with recurrent layers "
                                      f"{list(target.recurrent_layers)} is not supported")
        if isinstance(draft_depth, bool) or not isinstance(draft_depth, int) or draft_depth < 0:
            raise InvalidRequest(f"draft_depth must be an int >= 0, got {draft_depth!r}")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise InvalidRequest(f"max_rows must be None or an int >= 1, got {max_rows!r}")
        if isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int) or prefill_step_size < 1:
            raise InvalidRequest(f"prefill_step_size must be an int >= 1, got {prefill_step_size!r}")
        if not isinstance(adaptive, bool):
            raise InvalidRequest(f"adaptive must be True or False, got {adaptive!r}")
        if not callable(clock):
            raise InvalidRequest(f"clock must be a callable returning seconds, got {clock!r}")
        if pipeline is None:
            pipeline = pipelines_by_default()
        if not isinstance(pipeline, bool):
            raise InvalidRequest(f"pipeline must be True, False or None, got {pipeline!r}")
        if not isinstance(interleave_prefill, bool):
            raise InvalidRequest(f"interleave_prefill must be True or False, got {interleave_prefill!r}")
        if provider is not None and hasattr(provider, "bind"):
            provider.bind(target)
        self.target = target
        self.provider = provider
        self.draft_depth = draft_depth
        self.kv = kv
        self.max_rows = max_rows
        self.prefill_step_size = prefill_step_size
        self.clock = clock
        self.pipeline = pipeline
        #: new tokens of the short rows that join in one step (the first always joins): see ``join_budget_by_default``
        self.join_budget = join_budget_by_default(self.prefill_step_size)
        self.interleave_prefill = interleave_prefill
        #: the adaptive depth controller (costs persist across sessions of this engine); None: fixed depth
        self.depth = DepthController(draft_depth) if adaptive and provider is not None and draft_depth else None

    @property
    def prefill_checkpoints(self) -> bool:
        """Whether ``RowRequest.checkpoint_at`` is honoured: no drafter (a drafter's rows are prefilled after the
        target's, so a state mid-prefill has no drafter part to store beside it), float KV, an attention-only
        target and interleaved prefill (the chunked path). Elsewhere callers split the prompt into phases."""
        return (self.provider is None and self.plan is None and not self.target.recurrent_layers
                and self.interleave_prefill)

    def conversion_point(self, prompt_tokens: int) -> int | None:
        """Where a row with a prompt of ``prompt_tokens`` converts its KV (None: no KV quantization)."""
        return None if self.plan is None else self.plan.conversion_point(prompt_tokens, self.prefill_step_size)

    def _rows(self, restored: list, conversions: list) -> TargetRowGroup:
        """Target rows for the model (restored single-row caches or None per row): float or quantized, both
        speaking ``rows.TargetRowGroup``."""
        if self.plan is None:
            return TargetRows.from_row_caches(self.target, restored)
        return QuantizedTargetRows.from_row_caches(self.target, self.plan, restored, conversions)

    def run(
        self,
        requests: Sequence[RowRequest],
        *,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_ids: Sequence[int] = (),
        on_checkpoint: CheckpointHook | None = None,
        cancel: Callable[[int], bool] | None = None,
    ) -> list[RowResult]:
        """Generate for every request; results in request order.

        Every request is checked before any model work (ValueError naming the request; SchemaError for a draft
        checkpoint of the wrong schema or alignment). ``cancel(row_index)`` is asked between rounds for every
        decoding row; a cancelled row leaves without a finish checkpoint. ``temperature``/``seed`` apply to every
        request without its own ``sampling``; a row's sampled tokens depend on its own prompt and seed only.
        """
        start = time.perf_counter()
        sampling = Sampling(temperature, seed)
        default = None if sampling.greedy else RowSampling(temperature, 1.0, seed)
        for index, request in enumerate(requests):
            self._plan(index, request)  # every request checked before the batch state is built
        if not requests:
            return []
        results: list[RowResult | None] = [None] * len(requests)

        def finished(row_id: int, result: RowResult) -> None:
            results[row_id] = result

        session = self.session(eos_token_ids=eos_token_ids, on_checkpoint=on_checkpoint, draft_sampling=sampling,
                               default_sampling=default, cancel=cancel)
        try:
            for request in requests:
                session.submit(request, on_finish=finished, submitted_at=start)
            while session.step():
                pass
        finally:
            session.close()
        return results  # type: ignore[return-value]

    def session(self, *, eos_token_ids: Sequence[int] = (), on_checkpoint: CheckpointHook | None = None,
                draft_sampling: Sampling | None = None, default_sampling: RowSampling | None = None,
                cancel: Callable[[int], bool] | None = None) -> "DecodeSession":
        """A ``DecodeSession`` on this engine: requests join and leave between rounds (continuous batching).
        ``draft_sampling`` is the drafters' (greedy by default; it changes acceptance, never the tokens);
        ``default_sampling`` applies to requests without their own ``sampling`` (None: greedy)."""
        return DecodeSession(self, eos_token_ids=eos_token_ids, on_checkpoint=on_checkpoint,
                             draft_sampling=draft_sampling, default_sampling=default_sampling, cancel=cancel)

    def _plan(self, index: int, request: RowRequest) -> _Row:
        where = f"request {index}"
        prompt = request.prompt
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequest(f"{where}: prompt must be a non-empty list of token ids")
        vocab = self.target.vocab_size
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequest(f"{where}: token {token!r} is not an id in [0, {vocab})")
        max_tokens = request.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequest(f"{where}: max_tokens must be an int >= 1, got {max_tokens!r}")
        restored = request.restored_tokens
        if isinstance(restored, bool) or not isinstance(restored, int) or not 0 <= restored <= len(prompt) - 1:
            raise RestoreRefused(f"{where}: restored_tokens must be in [0, {len(prompt) - 1}], got {restored!r}")
        caches = request.restored_caches
        if caches is None and restored:
            raise RestoreRefused(f"{where}: restored_tokens={restored} needs restored_caches")
        if request.sampling is not None and not isinstance(request.sampling, RowSampling):
            raise InvalidRequest(f"{where}: sampling must be a RowSampling or None, got {type(request.sampling).__name__}")
        if request.sampling is not None and request.sampling.max_logit_bias_id() >= vocab:
            raise InvalidRequest(f"{where}: logit_bias token {request.sampling.max_logit_bias_id()} is not an id in "
                                 f"[0, {vocab})")
        if any(isinstance(k, bool) or not isinstance(k, int) for k in request.checkpoint_at):
            raise InvalidRequest(f"{where}: checkpoint_at must hold ints (prompt offsets)")
        check_top(request.logprobs, f"{where}: logprobs")
        check_top(request.prompt_logprobs, f"{where}: prompt_logprobs")
        if request.prompt_logprobs is not None and self.plan is not None:
            raise InvalidRequest(f"{where}: prompt_logprobs is not supported with KV quantization")
        conversion = self.conversion_point(len(prompt))
        if caches is not None:
            self._check_restored(where, caches, restored, conversion)
        checkpoint = request.draft_checkpoint
        if checkpoint is not None:
            if self.provider is None:
                raise RestoreRefused(f"{where}: a draft checkpoint needs a draft provider")
            try:
                self.provider.validate_checkpoint(checkpoint)
            except SchemaError:
                raise
            except ValueError as exc:  # unreadable stored metadata (bad JSON, a non-finite number)
                raise RestoreRefused(f"{where}: the draft checkpoint cannot be read: {exc}") from exc
            if checkpoint.processed_tokens != restored:
                raise SchemaError(
                    checkpoint.attachment.schema, "processed_tokens",
                    f"{where}: the draft checkpoint covers {checkpoint.processed_tokens} tokens but the restored "
                    f"target covers {restored}",
                )
        return _Row(index, request, list(prompt), conversion=conversion,
                    scored=None if request.logprobs is None else [])

    def _check_restored(self, where: str, caches, restored: int, conversion: int | None) -> None:
        self.target.check_restored(where, caches, restored, quantized=self.plan is not None)
        if conversion is not None:
            point = converted_at(caches)
            if not reusable(restored, point, conversion):
                held = "full precision" if point is None else f"converted at offset {point}"
                raise RestoreRefused(f"{where}: restored KV ({held}, {restored} tokens) differs from what a cold run "
                                     f"converting at offset {conversion} holds")


class DecodeSession:
    """A running batch that requests join and leave between rounds (continuous batching).

    ``submit`` checks a request (ValueError / SchemaError, before any model work) and queues it; ``step`` admits
    queued rows (up to the engine's ``max_rows`` active; one joining cohort at a time, prefilled one chunk per
    step while others decode), runs one verify round for every active row and retires the rows that are done.
    A row still prefilling counts in ``waiting_count`` and leaves (``cancel``/``finish``) as a waiting row does.
    ``cancel`` ends a row without a finish checkpoint, ``finish`` ends it as done (with one); outside ``step``
    either frees the row at once, inside a callback at the end of the current step.

    Per row: ``on_tokens(row_id, tokens)`` after every round that emitted tokens for it (a row that asks for
    logprobs, ``RowRequest.logprobs`` / ``prompt_logprobs``: ``on_tokens(row_id, tokens, RowLogprobs)``), ``on_finish(row_id,
    RowResult)`` once when it leaves (also when cancelled while waiting). ``on_checkpoint`` as in the module doc
    (``row_index`` is the row id ``submit`` returned).

    Exactness: a row's tokens depend only on its own prompt, ``max_tokens``, sampling and seed (greedy: the
    target's own greedy tokens), never on which rows share its rounds (``spec_cache.rows.sampling.RowSampler``).
    Threading: one owner thread calls every method. If ``step`` raises, the session is unusable: ``close`` it.

    Pipelined plain rounds (``SpeculativeEngine(pipeline=True)``, float KV, no recurrent layer): a round samples
    on the device and queues the next round's forward over those still unread tokens (``mx.async_eval``) before
    the host reads them, one host read per round, as ``generate_step`` does. The queued round is kept only while
    the batch stays as it is: when a row finishes at EOS, leaves, joins or is checkpointed, it is discarded
    (``TargetRows.discard_last``, which restores the exact KV layout) and the next round runs as it would have
    unpipelined (a row's last round under ``max_tokens`` is seen coming: nothing is queued behind it). So every
    forward the rows keep is one the unpipelined session runs too, on the same batch: same tokens, same
    checkpoints.

    With a drafter, every round the depth controller (or the first-token rule) runs at depth 0 is such a plain
    round. Each step chooses its round's depth as the synchronous session does (same inputs, same order of the
    controller's observations); a plain round queues the next one only when the next round will most likely be
    plain too (``DepthController.predicts_plain``: this round's choice was 0, no probe is due, plain rounds are
    measured; with a fixed depth, only when that depth is 0). When the step then chooses to draft after all,
    the queued round is discarded. The drafter sees a consumed round exactly as a depth-0 verify round shows it:
    ``draft(pending, 0)``, then ``commit`` of the pending token with that forward's hidden and taps (lazy arrays,
    queued beside the next round: no host read; drafters that need the target's taps at every token, DeepSpec,
    DFlash, the MTP head, take them this way too). ``pipelined_rounds`` counts the rounds consumed from the
    queue.
    """

    def __init__(self, engine: "SpeculativeEngine", *, eos_token_ids: Sequence[int] = (),
                 on_checkpoint: CheckpointHook | None = None, draft_sampling: Sampling | None = None,
                 default_sampling: RowSampling | None = None,
                 cancel: Callable[[int], bool] | None = None) -> None:
        self.engine = engine
        self.target = engine.target
        self.sampler = RowSampler()
        self.default_sampling = default_sampling
        self.eos = {int(t) for t in eos_token_ids}
        self.on_checkpoint = on_checkpoint
        self.cancel_check = cancel
        self.rows = engine._rows([], [])
        provider = engine.provider
        self.group = None if provider is None else provider.open(self.rows, [], draft_sampling or Sampling())
        self.active: list[_Row] = []
        self.waiting: list[_Row] = []
        self._next_id = 0
        self._stepping = False
        # where the last ``step`` spent its time, seconds by part (prefill: admission and the joining rows' chunks;
        # round; read: a plain round's wait for its tokens, inside round; retire; snapshots):
        # the scheduler's trace records it (issue 35: a step in which a row left took 216 ms on the H100, and the
        # trace could not say in which part)
        self.step_parts: dict[str, float] = {}
        self._leaving: dict[int, bool] = {}  # row id -> write its finish checkpoint (finish) or not (cancel)
        self._snapshots: set[int] = set()  # row ids whose checkpoint is asked for at the end of this step
        self._closed = False
        self._pipelined = engine.pipeline and engine.plan is None and not self.target.recurrent_layers
        #: the queued round: the KV of every active row already holds its pending token
        self._ahead: _Queued | None = None
        #: rows on their way in, prefilled chunk by chunk between rounds (``spec_cache.rows.joining``)
        self._joining: JoiningCohort | None = None
        #: rounds the host consumed from the queue (the next round's forward was in flight as it read them)
        self.pipelined_rounds = 0

    # -- the owner's API ----------------------------------------------------------------------------------
    def submit(self, request: RowRequest, *, on_tokens: Callable[[int, list], None] | None = None,
               on_finish: Callable[[int, "RowResult"], None] | None = None,
               submitted_at: float | None = None) -> int:
        """Check and queue ``request``; returns its row id. It joins at the next ``step``."""
        if self._closed:
            raise RuntimeError("the session is closed")
        row = self.engine._plan(self._next_id, request)
        self._next_id += 1
        row.sampling = request.sampling if request.sampling is not None else self.default_sampling
        row.on_tokens, row.on_finish = on_tokens, on_finish
        row.submitted = time.perf_counter() if submitted_at is None else submitted_at
        self.waiting.append(row)
        return row.index

    def cancel(self, row_id: int) -> bool:
        """End a row without a finish checkpoint (False if it is not here any more)."""
        return self._leave(row_id, checkpoint=False)

    def finish(self, row_id: int) -> bool:
        """End a row as done (e.g. a stop string matched): its finish checkpoint is written."""
        return self._leave(row_id, checkpoint=True)

    def checkpoint(self, row_id: int) -> bool:
        """Call ``on_checkpoint`` for a decoding row as it stands (``tokens == prompt + generated[:-1]``) and let
        it go on: at once between steps, at the end of the step from inside a callback. False if the row is not
        decoding."""
        if not any(row.index == row_id for row in self.active):
            return False
        self._snapshots.add(row_id)
        if not self._stepping:
            self._take_snapshots()
        return True

    @property
    def busy(self) -> bool:
        """Rows are active, joining or waiting."""
        return bool(self.active or self.waiting or self._joining is not None)

    @property
    def active_count(self) -> int:
        return len(self.active)

    @property
    def waiting_count(self) -> int:
        """Rows not decoding yet: queued, or prefilling to join."""
        return len(self.waiting) + (0 if self._joining is None else len(self._joining.members))

    @property
    def first_tokens_due(self) -> int:
        """Rows whose first token comes at the next step: decoding without a token yet, or in a cohort whose last
        prefill chunk is next. A caller about to spend long on the scheduler thread (a restore that reads records)
        can let that step run first (``spec_cache.apps.server.scheduler``)."""
        due = sum(1 for row in self.active if not row.generated)
        joining = self._joining
        if joining is not None and joining.joins_next:
            due += len(joining.members)
        return due

    def step(self) -> bool:
        """Admit what fits, run one round, retire finished rows; True while rows remain."""
        if self._closed:
            raise RuntimeError("the session is closed")
        self._stepping = True
        parts = self.step_parts = {}
        clock = time.perf_counter
        began = clock()
        try:
            short, cohort = self._next_cohorts()
            if cohort:
                self._joining = self._admit(cohort)
            if short:  # one chunk each: they join in this step, beside a long cohort still prefilling
                self._advance(self._admit(short), whole=True)
            if self._joining is not None:
                # one chunk a step even with nothing decoding: a caller admitting rows between steps (the
                # server's scheduler) gets a warm short request in beside a long cold prefill at the next chunk,
                # not after all of it (issue 35's H100 trace: 3.3 s in the queue behind a 5.9k-token prefill)
                self._advance(self._joining, whole=not self.active and not self.engine.interleave_prefill)
            now = clock()
            parts["prefill"], began = now - began, now  # (admission and the joining rows' chunks)
            if self.active:
                if self._pipelined and not self._processing():
                    self._pipelined_round()
                else:  # a row with logits processors needs its tokens on the host: synchronous rounds
                    self._drop_ahead()
                    self._round()
            now = clock()
            parts["round"], began = now - began, now  # (its host read alone also as "read", when plain)
            self._retire()
            now = clock()
            parts["retire"], began = now - began, now
            self._take_snapshots()
            parts["snapshots"] = clock() - began
        finally:
            self._stepping = False
        return self.busy

    def close(self) -> None:
        """Release the batch state (rows still here get no further callbacks). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ahead = None
        try:
            if self._joining is not None:
                self._release(self._joining)
            if self.group is not None:
                self.group.dispose()
        finally:
            self.rows.dispose()

    def _take_snapshots(self) -> None:
        wanted, self._snapshots = self._snapshots, set()
        if self.on_checkpoint is None or not wanted:
            return
        self._drop_ahead()  # a checkpoint holds prompt + generated[:-1]: not the queued round's token
        for i, row in enumerate(self.active):
            if row.index in wanted:
                draft = None if self.group is None else storable(self.group.capture(i))
                self.on_checkpoint(row.index, list(row.tokens[:-1]), self.rows.extract(i), draft)

    def _leave(self, row_id: int, checkpoint: bool) -> bool:
        for i, row in enumerate(self.waiting):
            if row.index == row_id:
                del self.waiting[i]
                if row.on_finish is not None:
                    row.on_finish(row.index, row.result(cancelled=not checkpoint, reason="cancelled"))
                return True
        joining = self._joining
        if joining is not None:
            for i, row in enumerate(joining.members):
                if row.index == row_id:  # prefilling: it leaves before it joins, as a waiting row does
                    joining.drop([i])
                    if not joining.members:
                        self._release(joining)
                    if row.on_finish is not None:
                        row.on_finish(row.index, row.result(cancelled=not checkpoint, reason="cancelled"))
                    return True
        if not any(row.index == row_id for row in self.active):
            return False
        self._leaving.setdefault(row_id, checkpoint)
        if not self._stepping:
            self._retire()
        return True

    # -- admission --------------------------------------------------------------------------------------
    def _free(self) -> int:
        """Places for waiting rows (decoding and prefilling rows hold theirs)."""
        held = len(self.active) + (0 if self._joining is None else len(self._joining.members))
        return len(self.waiting) if self.engine.max_rows is None else self.engine.max_rows - held

    def _short(self, row: _Row) -> bool:
        """``row``'s prefill takes one chunk at most (nothing that makes it forward more than its new tokens)."""
        group = self.group
        return ((group is None or not group.prefill_needs_target_taps)
                and len(row.request.prompt) - row.request.restored_tokens <= self.engine.prefill_step_size)

    def _next_cohorts(self) -> tuple[list[_Row], list[_Row]]:
        """The waiting rows that start their prefill in this step, taken out of ``waiting``: (short rows that join
        whole in this step, a cohort prefilled chunk by chunk from this step on).

        While rows decode or a cohort prefills, short rows (one chunk) never wait behind a long cohort's chunks:
        they join in the step they are admitted, as many as fit one chunk's token budget (``prefill_step_size``
        new tokens, the first always), the rest in the next steps, as vLLM's scheduler budgets a step's tokens:
        several warm turns arriving at once then reach their first tokens one step apart rather than all after
        one step that forwards every one of them; the long rows form the next cohort once none is prefilling.
        With nothing decoding, every row that fits forms one cohort (prefilled chunk by chunk all the same when
        prefill interleaves, so rows admitted meanwhile join beside it)."""
        free = self._free()
        if not self.waiting or free <= 0:
            return [], []
        if not (self.active or self._joining is not None):
            cohort, self.waiting = self.waiting[:free], self.waiting[free:]
            return [], cohort
        short, cohort, left = [], [], []
        budget, spent = self.engine.join_budget, 0
        for row in self.waiting:
            is_short = self._short(row)
            new = len(row.request.prompt) - row.request.restored_tokens
            if free and is_short and (not short or spent + new <= budget):
                short.append(row)
                spent += new
            elif free and not is_short and self._joining is None:
                cohort.append(row)
            else:
                left.append(row)
                continue
            free -= 1
        self.waiting = left
        return short, cohort

    def _admit(self, cohort: list[_Row]) -> JoiningCohort:
        """Plan each joining row (where its target and drafter rows start) and open its target rows; the prefill
        runs in ``_advance`` (spread over steps while others decode: ``spec_cache.rows.joining``)."""
        group = self.group
        needs_hidden = group is not None and group.prefill_needs_target_hidden
        needs_taps = group is not None and group.prefill_needs_target_taps
        beside = group is not None and getattr(group, "opens_beside_target", False)
        windows = self.target.layer_windows
        restored_rows = []
        for row in cohort:
            request = row.request
            start = request.restored_tokens
            caches = request.restored_caches
            boundary = len(request.prompt) - 1
            cold = request.draft_checkpoint is None
            if needs_taps and cold and not beside:
                # A cold drafter row that needs the target's taps at every token it covers, and cannot start
                # beside the restored target: forward them all.
                start = 0
            elif needs_hidden and cold and 0 < start == boundary:
                # A cold drafter row that needs the target hidden of the last prompt token, beside a target
                # restored up to that token: forward that one token again (its K/V is recomputed identically),
                # or everything when the restored state cannot be cut back by one token (recurrent layers); a row
                # that opens beside the target then keeps the restore and starts without that hidden.
                cut = prefix_caches(caches, start - 1, windows) if start > 1 else None
                if cut is not None:
                    start, caches = start - 1, cut
                elif not (beside and start > 1):
                    start = 0
            row.target_start = start
            restored_rows.append(None if start == 0 else caches)
            # a target-only hit: a drafter that can opens its row cold beside the restored target (its state
            # covers what is forwarded from here on); the others prefill from the first token they lack
            row.beside = beside and cold and start > 0
            row.draft_start = start if row.beside else _draft_start(row)
        joining = self.engine._rows(restored_rows, [row.conversion for row in cohort])
        taps = () if group is None else tuple(group.tap_layers)
        split = self.engine.interleave_prefill and self.engine.plan is None and not self.target.recurrent_layers
        stops = None
        if self.engine.prefill_checkpoints and self.on_checkpoint is not None:
            stops = [[k - row.target_start for k in row.request.checkpoint_at
                      if row.target_start < k < len(row.request.prompt) - 1] for row in cohort]
        scores = [None if row.request.prompt_logprobs is None else
                  (row.request.prompt[row.target_start + 1:], row.request.prompt_logprobs) for row in cohort]
        joined = JoiningCohort(cohort, joining, [row.request.prompt[row.target_start : -1] for row in cohort],
                               step=self.engine.prefill_step_size, tap_layers=taps, split=split,
                               need_hidden=group is not None, stops=stops,
                               on_stop=lambda i, forwarded: self._prefill_checkpoint(joined, i, forwarded),
                               scores=scores)
        return joined

    def _prefill_checkpoint(self, cohort: JoiningCohort, i: int, forwarded: int) -> None:
        """``on_checkpoint`` for a joining row whose prefill stands on one of its ``checkpoint_at`` offsets (its
        target rows hold exactly ``prompt[:target_start + forwarded]``; no drafter: ``prefill_checkpoints``)."""
        row = cohort.members[i]
        end = row.target_start + forwarded
        self.on_checkpoint(row.index, list(row.request.prompt[:end]), cohort.rows.extract(i), None)

    def _advance(self, cohort: JoiningCohort, whole: bool) -> None:
        """Forward ``cohort``'s next chunk (``whole``: all of it) and let it join once its prefill is done."""
        try:
            if not cohort.advance(whole=whole):
                return
            self._drop_ahead()  # the batch changes: the queued round is not the one to run
            for row, scored in zip(cohort.members, cohort.scored):
                if scored is not None:  # position p scored by the forward of p - 1 (nothing before target_start)
                    row.prompt_scored = [None] * (row.target_start + 1) + scored
            self._join(cohort.members, cohort.rows, cohort.context())
        except BaseException:
            self._release(cohort)
            raise
        self._release(cohort)

    def _release(self, cohort: JoiningCohort) -> None:
        """``cohort`` is done with (joined, emptied, failed or closed): its target rows go, and it is no longer the
        cohort prefilling."""
        if self._joining is cohort:
            self._joining = None
        cohort.dispose()

    def _join(self, cohort: list[_Row], joining: TargetRowGroup, context) -> None:
        """The drafter rows' prefill over the prefilled target rows, then both join the batch (two-phase)."""
        openings = [ColdRow(row.target_start) if row.beside else row.request.draft_checkpoint for row in cohort]
        prefill_group = None if self.group is None else self.engine.provider.open_prefill(joining, openings)
        try:
            captures: list[DraftRowCheckpoint | None] = [None] * len(cohort)
            if prefill_group is not None:
                tokens = [row.request.prompt[row.draft_start : -1] for row in cohort]
                if _takes_external_tokens(prefill_group):
                    # A drafter that consumes appended tokens (the MTP heads) takes the tokens appended to a row
                    # that already has state (a restored row's new turn or a continuation's replayed tokens; the
                    # tail after a target-only hit) as externally supplied tokens, as the seed feeds them.
                    fed = [0 if opening is None else len(t) for opening, t in zip(openings, tokens)]
                    if any(fed):
                        prefill_group.consume(tokens, context, fed)
                        tokens = [[] if n else t for n, t in zip(fed, tokens)]
                prefill_group.prefill(tokens, context)
                prefill_group.materialize()
                captures = [prefill_group.capture(i) for i in range(len(cohort))]
            changes = [lambda: self.rows.prepare_append(joining)]
            if self.group is not None:
                changes.append(lambda: self.group.prepare_append(captures))
            apply_state_changes(changes)
            self.active.extend(cohort)
            if self.on_checkpoint is not None:
                for i, row in enumerate(cohort):
                    if self._restored_whole(row) or not row.request.boundary_checkpoint:
                        continue  # the boundary state is exactly what the row restored / its owner takes it later
                    self.on_checkpoint(row.index, list(row.request.prompt[:-1]), joining.extract(i),
                                       storable(captures[i]))
        finally:
            if prefill_group is not None:
                prefill_group.dispose()

    def _restored_whole(self, row) -> bool:
        """Whether ``row`` restored its whole prompt boundary, drafter row included (when there is a drafter):
        a boundary checkpoint would repeat it, and extracting one copies the whole state (2 GiB for an
        8B-shaped model at 16k tokens)."""
        request = row.request
        return (row.target_start == request.restored_tokens == len(request.prompt) - 1
                and (self.group is None or request.draft_checkpoint is not None or row.beside))

    # -- one verify round -------------------------------------------------------------------------------
    def _processing(self) -> bool:
        """Whether an active row has logits processors (``RowSampling.processes``): each position's penalties
        read the row's tokens on the host, so its rounds are not pipelined (the queued round's token is unread)."""
        return any(row.sampling is not None and row.sampling.processes for row in self.active)

    def _limits(self, lead: int) -> tuple[list[int], list[int]]:
        """Each row's remaining budget and draft cap ``lead`` rounds of one token from now: a row proposes at
        most its remaining budget minus one, and no further than its window limit (a quantized row stops at its
        conversion point)."""
        budgets = [row.request.max_tokens - len(row.generated) - lead for row in self.active]
        caps = [min(budget - 1, (limit or budget) - 1) for budget, limit in zip(budgets, self.rows.window_limits())]
        return budgets, caps

    def _depth(self, budgets: list[int], caps: list[int], first: bool) -> int:
        """A round's batch depth; ``first``: some row has no token yet."""
        controller = self.engine.depth
        if first:
            return 0  # first token first: a row's first token needs one target step, not a drafting round too
        if controller is not None:
            # with nobody waiting for a place, the run lasts as long as its slowest row (see spec_cache.decode.depth)
            return controller.choose([row.acceptance for row in self.active], caps, None if self.waiting else budgets)
        return min(self.engine.draft_depth, max(caps))

    def _round(self, depth: int | None = None) -> None:
        active = self.active
        pending = [row.tokens[-1] for row in active]
        budgets, caps = self._limits(0)
        controller = self.engine.depth
        if depth is None:
            depth = self._depth(budgets, caps, any(row.ttft_s is None for row in active))
        started = self.engine.clock()
        proposals = [[] for _ in active] if self.group is None else self.group.draft(pending, depth)
        drafts = [list(p[: min(depth, cap)]) for p, cap in zip(proposals, caps)]
        drafted_at = self.engine.clock()
        width = 1 + max(len(d) for d in drafts)
        window = [[p] + d + [0] * (width - 1 - len(d)) for p, d in zip(pending, drafts)]
        taps = () if self.group is None else tuple(self.group.tap_layers)
        out = self.rows.verify(window, tap_layers=taps)
        sampled = self.sampler(out.logits, [_sampled_row(row, draft) for row, draft in zip(active, drafts)])
        clock = time.perf_counter()
        kept, agreed = [], []
        for row, draft, choice, budget in zip(active, drafts, sampled, budgets):
            count, agree = self._emit(row, draft, choice, budget, clock)
            kept.append(count)
            agreed.append(agree)
        for b, (row, count) in enumerate(zip(active, kept)):
            if row.scored is not None:  # the logprob of each emitted token at its window position
                row.scored += _score_window(out.logits[b], row, count + 1)
        self.rows.rollback([width - 1 - k for k in kept])
        if self.group is not None:
            self.group.commit(kept, RoundContext(window, out.hidden, out.taps))
        if controller is not None:
            # the rollback and the drafter's commit are lazy: evaluate them now, so their cost is this round's
            # (it would otherwise land in the next round's measurement, whatever its width)
            self.rows.materialize()
            if self.group is not None:
                self.group.materialize()
            controller.observe_round(len(active), depth, drafted_at - started, width, self.engine.clock() - drafted_at)
            if depth > 0:
                for row, draft, agree, cap in zip(active, drafts, agreed, caps):
                    if min(depth, cap) > 0:  # a row its budget kept from drafting says nothing of its drafter
                        controller.observe_row(row.acceptance, len(draft), agree)
            else:  # a free drafter's would-be drafts, judged (spec_cache.decode.depth)
                controller.observe_shadow(self.group, [row.acceptance for row in active])
        for row, count in zip(active, kept):  # after the round is committed: a callback may end any row
            if row.on_tokens is not None:
                _deliver(row, row.generated[len(row.generated) - count - 1:])

    def _emit(self, row: _Row, draft: list, choice: list, budget: int, clock: float) -> tuple[int, int]:
        """Append what row ``row`` emits this round (its drafts up to the first disagreement with the target's
        ``choice``, then the target's token; cut at its budget and at EOS); returns (kept drafts, agreed)."""
        agree = 0
        while agree < len(draft) and draft[agree] == choice[agree]:
            agree += 1
        emitted = (draft[:agree] + [choice[agree]])[:budget]
        eos = self.eos if row.request.stop_at_eos else ()
        for position, token in enumerate(emitted):
            if token in eos:
                emitted = emitted[: position + 1]
                break
        row.generated += emitted
        row.tokens += emitted
        row.drafted += len(draft)
        row.accepted += min(agree, len(emitted))
        if row.ttft_s is None:
            row.ttft_s = clock - row.submitted
        if emitted[-1] in eos:
            row.done, row.reason = True, "eos"
        elif len(row.generated) >= row.request.max_tokens:
            row.done, row.reason = True, "length"
        return len(emitted) - 1, agree

    # -- pipelined plain rounds (class doc) -------------------------------------------------------------
    def _pipelined_round(self) -> None:
        """This round's depth decides, as in the synchronous session: 0 runs a plain round (the queued one, if
        any), more discards the queued round and runs the synchronous verify round. While a row asks for
        logprobs (``RowRequest.logprobs``), every round is synchronous: its scores are read from each round's
        logits."""
        if any(row.scored is not None for row in self.active):
            self._drop_ahead()
            self._round()
            return
        if self.group is not None:
            budgets, caps = self._limits(0)
            depth = self._depth(budgets, caps, any(row.ttft_s is None for row in self.active))
            if depth > 0:
                self._drop_ahead()
                self._round(depth)
                return
        self._plain_round()

    def _plain_round(self) -> None:
        """One plain round with the next one queued behind it when its depth is 0: at most one host read (this
        round's tokens)."""
        active, group, controller = self.active, self.group, self.engine.depth
        started = self.engine.clock()
        budgets = [row.request.max_tokens - len(row.generated) for row in active]
        current, self._ahead = self._ahead, None
        if current is None:  # nothing queued: this round's window is the pending tokens the host holds
            current = self._queue(mx.array([[row.tokens[-1]] for row in active], dtype=mx.uint32), 0)
            mx.async_eval(current.tokens)
            built = 0.0  # its building is inside this call
        else:
            self.pipelined_rounds += 1
            built = current.built_s  # it was built during the last call: that time is this round's
        lazy: list = []
        drafting = 0.0
        if group is not None:  # the drafter sees this round as a verify round at depth 0 shows it (class doc)
            hooks = self.engine.clock()
            pending = [row.tokens[-1] for row in active]
            group.draft(pending, 0)
            out = current.out
            group.commit([0] * len(active), RoundContext([[token] for token in pending], out.hidden, out.taps))
            if controller is not None:  # a free drafter's would-be drafts, judged (spec_cache.decode.depth)
                controller.observe_shadow(group, [row.acceptance for row in active])
            lazy = list(getattr(group, "lazy_state", list)())
            drafting = self.engine.clock() - hooks
        # plain decoding: a round that gives a row its first token is read and delivered before the next round is
        # queued, so that token does not wait for the next round's graph to be built or (on the CPU) share the
        # cores with its compute (queued first, it cost +1.1 ms at the scheduler and +2.3 ms at the client per warm
        # chat turn on the 2-core VM); the next round is queued right after the delivery (``_queue_after_first``)
        first = group is None and any(row.ttft_s is None for row in active)
        if not first and min(budgets) > 1 and not self._batch_changes() and self._next_depth() == 0:
            # fed this round's unread tokens; discarded if the batch changes or the next step drafts
            self._ahead = self._queue(current.tokens, 1)
            mx.async_eval(self._ahead.tokens, *lazy)
            lazy = []
            built -= self._ahead.built_s  # the next round's
        if lazy:
            mx.async_eval(*lazy)
        read = time.perf_counter()
        chosen = current.tokens.tolist()
        clock = time.perf_counter()
        self.step_parts["read"] = clock - read  # waiting for the device: the round's compute (and what it waited on)
        for row, choice, budget in zip(active, chosen, budgets):
            self._emit(row, [], choice, budget, clock)
        if controller is not None:
            # what a plain round costs the host while the next one is in flight: the drafter's hooks as the depth-0
            # draft cost, the rest (building its forward, the wait for its tokens) as the width-1 verify; a drafting
            # round is timed synchronously, as it runs
            total = self.engine.clock() - started + built
            controller.observe_round(len(active), 0, drafting, 1, max(total - drafting, 0.0))
        for row in active:  # after the round is committed: a callback may end any row
            if row.on_tokens is not None:
                _deliver(row, row.generated[-1:])
        if first:
            self._queue_after_first(current)

    def _queue_after_first(self, current: "_Queued") -> None:
        """After a first-token round (plain decoding, read and delivered): queue the next round over its tokens as
        the round would have before its read, when every row still has a token to go, none ended (EOS, length,
        a callback's finish or cancel) and the batch stays as it is."""
        active = self.active
        if (self._closed or any(row.done for row in active)
                or min(row.request.max_tokens - len(row.generated) for row in active) < 1 or self._batch_changes()):
            return
        self._ahead = self._queue(current.tokens, 0)  # the host already holds these tokens: no lead
        mx.async_eval(self._ahead.tokens)

    def _next_depth(self) -> int:
        """0 when the next round will most likely be plain too (class doc); the next step chooses for itself."""
        if self.group is None:
            return 0
        controller = self.engine.depth
        if controller is None:
            return min(self.engine.draft_depth, max(self._limits(1)[1]))
        return 0 if controller.predicts_plain(len(self.active)) else 1

    def _queue(self, ids: mx.array, lead: int) -> "_Queued":
        """Forward ``ids [B, 1]`` for every active row (with the drafter's taps) and sample its next tokens on the
        device (lazy); ``lead``: rounds between the host's view of the rows and this one (the sampling position
        moves with it)."""
        started = self.engine.clock()
        taps = () if self.group is None else tuple(self.group.tap_layers)
        out = self.rows.append_ids(ids, tap_layers=taps)
        tokens = self.sampler.sample(out.logits, [(row.sampling, len(row.tokens) + lead) for row in self.active])
        return _Queued(tokens, None if self.group is None else out, self.engine.clock() - started)

    def _batch_changes(self) -> bool:
        """Whether the next step will not run the same rows as this one (rows leave, join, or are captured)."""
        free = self._free() > 0
        if self._joining is not None:
            joins = (self._joining.joins_next or not self._joining.split
                     or free and any(self._short(row) for row in self.waiting))
        else:
            joins = bool(self.waiting) and free
        return joins or bool(self._leaving) or bool(self._snapshots)

    def _drop_ahead(self) -> None:
        """Discard the queued round: the KV is exactly as if it had never been computed."""
        if self._ahead is not None:
            self._ahead = None
            self.rows.discard_last(1)

    # -- retirement -------------------------------------------------------------------------------------
    def _retire(self) -> None:
        """Remove every row that is done or asked to leave: done / finished rows write their finish checkpoint."""
        checkpointed: dict[int, bool] = {}
        for i, row in enumerate(self.active):
            if row.index in self._leaving:
                checkpointed[i] = self._leaving[row.index] or row.done
                if not row.done and self._leaving[row.index]:
                    row.reason = "stop"
            elif row.done:
                checkpointed[i] = True
            elif self.cancel_check is not None and self.cancel_check(row.index):
                checkpointed[i] = False
        self._leaving.clear()
        if not checkpointed:
            return
        self._drop_ahead()  # the batch changes: the queued round is not the one to run
        leaving = sorted(checkpointed)
        finished = []
        for i in leaving:
            row = self.active[i]
            held = self.rows.offsets[i]
            if held != len(row.tokens) - 1:
                raise RuntimeError(f"row {row.index}: target KV holds {held} tokens, expected {len(row.tokens) - 1}")
            if self.on_checkpoint is not None and checkpointed[i]:
                draft = None if self.group is None else storable(self.group.capture(i))
                self.on_checkpoint(row.index, list(row.tokens[:-1]), self.rows.extract(i), draft)
            cancelled = not checkpointed[i]
            finished.append((row, row.result(cancelled=cancelled, reason="cancelled" if cancelled else None)))
        keep = [i for i in range(len(self.active)) if i not in checkpointed]
        self.rows.filter_rows(keep)
        if self.group is not None:
            self.group.filter_rows(keep)
        self.active = [self.active[i] for i in keep]
        for row, result in finished:  # the state is consistent again: callbacks may submit or cancel
            if row.on_finish is not None:
                row.on_finish(row.index, result)


@dataclass
class _Queued:
    """A round queued on the device: its lazy sampled tokens ``[B, 1]``, the forward's output (hidden and taps for
    the drafter's commit; None without a drafter) and the engine-clock seconds its building took (part of its
    round's cost for the depth controller)."""

    tokens: mx.array
    out: Any = None
    built_s: float = 0.0


def _sampled_row(row: _Row, draft: list) -> tuple:
    """What the row sampler takes for ``row`` this verify round: its sampling, the position its window's first
    logits choose, and, when it has logits processors, its tokens followed by the round's drafts (each window
    position's history: ``spec_cache.rows.sampling`` module doc)."""
    if row.sampling is not None and row.sampling.processes:
        return row.sampling, len(row.tokens), row.tokens + draft, len(row.tokens) - len(row.generated)
    return row.sampling, len(row.tokens)


def _score_window(logits: mx.array, row: _Row, count: int) -> list:
    """The ``TokenLogprob`` of the last ``count`` tokens ``row`` emitted, from its window's logits ``[W, V]``
    (position ``j`` chose the ``j``-th of them): through the row's logits processors first when it has any, as
    its sampler saw them (mlx-lm's ``generate_step`` yields the processed logprobs, before temperature)."""
    tokens = row.generated[len(row.generated) - count:]
    position = len(row.tokens) - count  # the position the window's first logits chose
    if row.sampling is not None and getattr(row.sampling, "processes", False):
        from spec_cache.rows.sampling import process_logits
        logits = process_logits(logits, row.sampling, row.tokens, position, len(row.tokens) - len(row.generated))
    return score(logits, tokens, row.request.logprobs)


def _deliver(row: _Row, tokens: list) -> None:
    """``row.on_tokens`` for ``tokens`` (its latest): with a ``RowLogprobs`` third argument when it asked for
    logprobs (``RowRequest.logprobs`` / ``prompt_logprobs``), the prompt's on its first call."""
    if row.scored is None and row.prompt_scored is None:
        row.on_tokens(row.index, tokens)
        return
    prompt = None
    if row.prompt_scored is not None and not row.prompt_sent:
        row.prompt_sent, prompt = True, row.prompt_scored
    scored = [] if row.scored is None else row.scored[len(row.scored) - len(tokens):]
    row.on_tokens(row.index, tokens, RowLogprobs(scored, prompt))


def _draft_start(row: _Row) -> int:
    checkpoint = row.request.draft_checkpoint
    return 0 if checkpoint is None else checkpoint.processed_tokens


def _takes_external_tokens(group: Any) -> bool:
    """Whether ``group`` takes the tokens appended to a row with state through ``consume``
    (``consumes_appended_tokens``, with ``supports_external_tokens``)."""
    return bool(getattr(group, "consumes_appended_tokens", False) and getattr(group, "supports_external_tokens",
                                                                                  False))

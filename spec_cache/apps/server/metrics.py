"""``/metrics``: Prometheus text from a registry of this server's own (never the process-global one).

Counters: requests (by endpoint and status), prompt tokens, cached prompt tokens, generated tokens. Gauges
(read when scraped): prompt-cache hit ratio (cached / prompt tokens since start), queue depth, active rows,
memory-tier bytes and entries, checkpoints not yet durable in LMDB, write-behind bytes pending. Histograms: time
to first token (from the request's arrival to its first generated token) and per-token latency (the time
between token deliveries divided by the tokens delivered).

Where a request's time goes (``spec_cache_stage_seconds``, label ``stage``; one observation per request unless
said): ``queue`` (the job's arrival at the scheduler to its admission), ``restore``
(cache lookup and restore at admission: memory tier, LMDB, shared), ``prefill`` (admission to the first token:
prefill of the unrestored tokens and the first sample, in batched rounds shared with other rows), ``round`` (one
engine round of the whole batch, per round: forward, sampling, host sync, callbacks), ``checkpoint`` (the copies
of one round's checkpoints into the memory tier and the write-behind queue, per round that had any), ``stream``
(the scheduler thread handing one event to the HTTP side, per event). ``/metrics`` sums and counts give the mean
of each; ``tools/bench_serve.py --json`` reports them.

Per tenant (label ``tenant``: 8 hex digits of the key's digest, or ``open``): ``spec_cache_tenant_requests``
(by status), ``spec_cache_tenant_prompt_tokens``, ``spec_cache_tenant_cached_prompt_tokens`` (at the granularity
clients see, so the series cannot be used to probe stored prompts token by token) and
``spec_cache_tenant_generated_tokens``. ``render(viewer)``: an operator gets everything; a tenant gets only the
series labelled with its own tenant (not the server-wide ones: totals of cached tokens would tell one tenant about
another's traffic).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 120.0)
STAGES = ("queue", "restore", "prefill", "round", "checkpoint", "stream")


class Metrics:
    """The server's metrics; ``render()`` is the scrape body. Thread-safe (prometheus-client's own locks)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("spec_cache_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("spec_cache_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=registry)
        self.cached_tokens = Counter("spec_cache_cached_prompt_tokens",
                                     "prompt tokens restored from the cache instead of prefilled", registry=registry)
        self.generated_tokens = Counter("spec_cache_generated_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram("spec_cache_time_to_first_token_seconds", "request arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=registry)
        self.token_latency = Histogram("spec_cache_token_latency_seconds", "seconds per generated token after the "
                                       "first", buckets=_TOKEN_BUCKETS, registry=registry)
        self.stage = Histogram("spec_cache_stage_seconds", "seconds spent per request stage (see the module doc)",
                               ["stage"], buckets=_STAGE_BUCKETS, registry=registry)
        # every series exists from the start (a scrape shows zeros, not nothing); the children are kept, as
        # ``stage_of`` hands them out: ``labels()`` takes a lock and builds its key on every call, and the scheduler
        # observes a stage per round and per streamed event (~2% of a tiny model's decode step on the CPU)
        self._stages = {stage: self.stage.labels(stage=stage) for stage in STAGES}
        self._gauges: list[Gauge] = []
        ratio = Gauge("spec_cache_prompt_cache_hit_ratio", "cached prompt tokens / prompt tokens since start",
                      registry=registry)
        ratio.set_function(self._hit_ratio)
        self.tenant_registry = tenants = CollectorRegistry(auto_describe=True)
        self.tenant_requests = Counter("spec_cache_tenant_requests", "requests answered, by tenant and status",
                                       ["tenant", "status"], registry=tenants)
        self.tenant_prompt_tokens = Counter("spec_cache_tenant_prompt_tokens", "prompt tokens of admitted requests",
                                            ["tenant"], registry=tenants)
        self.tenant_cached_tokens = Counter("spec_cache_tenant_cached_prompt_tokens", "cached prompt tokens as "
                                            "reported to the tenant (rounded down to the reporting granularity)",
                                            ["tenant"], registry=tenants)
        self.tenant_generated_tokens = Counter("spec_cache_tenant_generated_tokens", "tokens generated",
                                               ["tenant"], registry=tenants)

    def stage_of(self, stage: str):
        """The ``spec_cache_stage_seconds`` series of ``stage`` (one of ``STAGES``), to ``observe`` on."""
        child = self._stages.get(stage)
        return self.stage.labels(stage=stage) if child is None else child

    def _hit_ratio(self) -> float:
        total = self.prompt_tokens._value.get()
        return 0.0 if total == 0 else self.cached_tokens._value.get() / total

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is ``read()`` at scrape time."""
        gauge = Gauge(name, documentation, registry=self.registry)
        gauge.set_function(read)
        self._gauges.append(gauge)

    def account(self, tenant: str, prompt_tokens: int, cached_tokens: int, generated_tokens: int) -> None:
        """A finished request's tokens, under its tenant's label."""
        self.tenant_prompt_tokens.labels(tenant=tenant).inc(prompt_tokens)
        self.tenant_cached_tokens.labels(tenant=tenant).inc(cached_tokens)
        self.tenant_generated_tokens.labels(tenant=tenant).inc(generated_tokens)

    def render(self, viewer=None) -> bytes:
        """The scrape body for ``viewer`` (an ``auth.Viewer``; None: an operator)."""
        if viewer is None or viewer.operator:
            return generate_latest(self.registry) + generate_latest(self.tenant_registry)
        if viewer.tenant is None:
            return b""
        return generate_latest(_OnlyTenant(self.tenant_registry, viewer.tenant))


class _OnlyTenant:
    """A collector showing only the samples of one tenant label (what ``generate_latest`` needs: ``collect``)."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry, self.tenant = registry, tenant

    def collect(self):
        for family in self.registry.collect():
            only = Metric(family.name, family.documentation, family.type, family.unit)
            only.samples = [sample for sample in family.samples if sample.labels.get("tenant") == self.tenant]
            yield only

"""What a Trainer or Sampler replica records for Prometheus, in its own registry.

Owns `ReplicaMetrics`: the hot-path series (request latency, queue wait, tokens, failures),
updated as work happens, and the state series (queue depth and oldest wait, adapters resident /
offloaded, offload and reload counts, fused-or-sequential choice, process and GPU memory), read
from the replica by a collector only when Prometheus scrapes, so they cost nothing in between.

Labels: every series carries ``model`` (the base model's name, from the server config),
``replica`` (the deployment name, e.g. ``trainer-twinkle-tiny-chat-r1``) and ``role``
(``trainer`` | ``sampler``); some add one label from a fixed set named in this module (``op``,
``kind``, ``category``, ``state``, ``mode``). Nothing a client sends, no tenant, user, org, key,
model id, request id or path ever becomes a label value. Series names and meanings:
infra/observability/README.md.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.errors import (
    AdapterNotFoundError,
    BackendError,
    CheckpointError,
    ConfigError,
    EngineError,
    UserInputError,
)

#: request latency: sub-10 ms skips up to multi-minute saves of big models
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: queue wait: a free replica starts work within ~1 ms; alerts look at 30 s and more
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: the ``category`` label of failed requests: error class → value (first match wins)
CATEGORIES: tuple[tuple[type[BaseException], str], ...] = (
    (AdapterNotFoundError, "adapter_not_found"),
    (CheckpointError, "checkpoint"),
    (UserInputError, "user_input"),
    (ConfigError, "config"),
    (BackendError, "backend"),
    (EngineError, "engine"),
)
CATEGORY_NAMES = (*(name for _, name in CATEGORIES), "internal")
#: the ``kind`` label of ``twinkle_engine_tokens_total`` per role
TOKEN_KINDS = {"trainer": ("trained", "forward"), "sampler": ("prefilled", "sampled")}
#: role-specific counters and gauges a replica's `State` may carry: name → help
EXTRA_COUNTERS = {
    "twinkle_trainer_jobs": "Compute jobs run (slices, optimizer steps, saves, loads)",
    "twinkle_trainer_fused_batches": "Fused multi-adapter batches run (execution: fused)",
    "twinkle_sampler_batches": "Sampling batches run (requests decoded together)",
    "twinkle_sampler_batch_rows": "Sequences (rows) in all sampling batches",
}
EXTRA_GAUGES = {
    "twinkle_trainer_tenants": "Tenants with at least one adapter on this replica",
    "twinkle_trainer_active_tenants": "Tenants with compute work queued right now",
}


T = TypeVar("T")


def failure_category(exc: BaseException) -> str:
    """The ``category`` label of a failed request: an engine error's kind, else ``internal``."""
    for cls, name in CATEGORIES:
        if isinstance(exc, cls):
            return name
    return "internal"


@dataclass
class State:
    """A replica's state at scrape time, read by `ReplicaMetrics`' collector."""

    queue_depth: int = 0
    #: ``time.monotonic()`` when the oldest queued work arrived (None: nothing queued)
    oldest_enqueued: float | None = None
    #: adapter count by state (``resident`` | ``offloaded`` for a Trainer, ``loaded`` for a Sampler)
    adapters: dict[str, int] = field(default_factory=dict)
    offloads: int = 0
    reloads: int = 0
    #: ``fused`` | ``sequential`` (Trainers), None (Samplers)
    execution_mode: str | None = None
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _gpu_memory() -> dict[str, float]:
    """Bytes allocated / reserved by torch on this process's current CUDA device, when torch
    is loaded and CUDA initialized (never imports torch nor initializes CUDA itself)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available() or not cuda.is_initialized():
        return {}
    return {
        "allocated": float(cuda.memory_allocated()),
        "reserved": float(cuda.memory_reserved()),
    }


class ReplicaMetrics:
    """One replica's registry. ``state()`` is called on the scrape thread: it must only read
    (see `State`)."""

    def __init__(self, role: str, model: str, replica: str, state: Callable[[], State]) -> None:
        self.registry = CollectorRegistry()
        self._ids = (model, replica, role)
        base = ["model", "replica", "role"]
        self._request = Histogram(
            "twinkle_engine_request_seconds",
            "Time a request spent in the replica (arrival to result: ordering, queue, compute)",
            [*base, "op"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._wait = Histogram(
            "twinkle_engine_queue_wait_seconds",
            "Time work waited in the replica's compute queue before it started",
            base,
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        ).labels(*self._ids)
        self._tokens = Counter(
            "twinkle_engine_tokens",
            "Tokens processed: trained (forward_backward), forward (forward only), prefilled "
            "(sampling prompts), sampled (generated)",
            [*base, "kind"],
            registry=self.registry,
        )
        self._failed = Counter(
            "twinkle_engine_failed_requests",
            "Requests that failed in the replica, by category (user_input, adapter_not_found, "
            "checkpoint, config, backend, engine, internal)",
            [*base, "category"],
            registry=self.registry,
        )
        # label children are looked up once per (op | kind | category), not on every call. The
        # role's token kinds and every category start at 0, so rate() sees their first increase
        # (a series born at its first event would hide that event).
        self._ops: dict[str, Histogram] = {}
        self._kinds = {k: self._tokens.labels(*self._ids, k) for k in TOKEN_KINDS[role]}
        self._categories = {c: self._failed.labels(*self._ids, c) for c in CATEGORY_NAMES}
        self.registry.register(_StateCollector(self._ids, state))

    # -- hot path ------------------------------------------------------------------------------
    def request(self, op: str, seconds: float, error: BaseException | None = None) -> None:
        child = self._ops.get(op)
        if child is None:
            child = self._ops[op] = self._request.labels(*self._ids, op)
        child.observe(seconds)
        if error is not None:
            self.failed(error)

    def failed(self, error: BaseException) -> None:
        cat = failure_category(error)
        child = self._categories.get(cat)
        if child is None:
            child = self._categories[cat] = self._failed.labels(*self._ids, cat)
        child.inc()

    def queue_wait(self, seconds: float) -> None:
        self._wait.observe(max(seconds, 0.0))

    def tokens(self, kind: str, n: int) -> None:
        if n <= 0:
            return
        child = self._kinds.get(kind)
        if child is None:
            child = self._kinds[kind] = self._tokens.labels(*self._ids, kind)
        child.inc(n)


async def measured(metrics: ReplicaMetrics | None, op: str, call: Callable[[], Awaitable[T]]) -> T:
    """``await call()``, with its latency and any failure recorded under ``op`` (no metrics:
    just the call)."""
    if metrics is None:
        return await call()
    t0 = time.perf_counter()
    try:
        out = await call()
    except Exception as e:
        metrics.request(op, time.perf_counter() - t0, e)
        raise
    metrics.request(op, time.perf_counter() - t0)
    return out


class _StateCollector(Collector):
    def __init__(self, ids: tuple[str, str, str], state: Callable[[], State]) -> None:
        self._ids = list(ids)
        self._state = state

    def _gauge(self, name: str, doc: str, value: float, **extra: str) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model", "replica", "role", *extra])
        g.add_metric([*self._ids, *extra.values()], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model", "replica", "role"])
        c.add_metric(self._ids, value)
        return c

    def _by_label(
        self, name: str, doc: str, label: str, values: Mapping[str, float]
    ) -> GaugeMetricFamily:
        """One gauge with a value per ``label`` value (in the order given)."""
        g = GaugeMetricFamily(name, doc, labels=["model", "replica", "role", label])
        for key, value in values.items():
            g.add_metric([*self._ids, key], value)
        return g

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._state()
        yield self._gauge(
            "twinkle_engine_queue_depth", "Requests or jobs queued for compute", s.queue_depth
        )
        oldest = 0.0 if s.oldest_enqueued is None else time.monotonic() - s.oldest_enqueued
        yield self._gauge(
            "twinkle_engine_queue_oldest_wait_seconds",
            "How long the oldest queued work has waited so far (0 when nothing is queued)",
            max(oldest, 0.0),
        )
        yield self._by_label(
            "twinkle_engine_adapters",
            "Adapters on this replica by state: resident / offloaded (Trainer), loaded (Sampler)",
            "state",
            dict(sorted(s.adapters.items())),
        )
        yield self._counter(
            "twinkle_engine_adapter_offloads",
            "Adapters moved out of memory: Trainer offloads to disk, Sampler cache evictions",
            s.offloads,
        )
        yield self._counter(
            "twinkle_engine_adapter_reloads",
            "Adapters brought into memory: Trainer reloads of offloaded adapters, Sampler loads "
            "from checkpoint directories",
            s.reloads,
        )
        if s.execution_mode is not None:
            yield self._by_label(
                "twinkle_trainer_execution_mode",
                "1 for the execution mode in use (fused multi-adapter batches or sequential)",
                "mode",
                {m: 1.0 if s.execution_mode == m else 0.0 for m in ("fused", "sequential")},
            )
        for name, value in s.counters.items():
            yield self._counter(name, EXTRA_COUNTERS[name], value)
        for name, value in s.gauges.items():
            yield self._gauge(name, EXTRA_GAUGES[name], value)
        yield from self._process()

    def _process(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The replica process's memory and CPU time, and the GPU memory torch holds in it."""
        yield self._gauge(
            "twinkle_engine_process_resident_bytes",
            "Resident memory of the replica process",
            _rss_bytes(),
        )
        t = os.times()
        yield self._counter(
            "twinkle_engine_process_cpu_seconds",
            "CPU time (user + system) of the replica process",
            t.user + t.system,
        )
        gpu = _gpu_memory()
        if gpu:
            yield self._by_label(
                "twinkle_engine_gpu_memory_bytes",
                "GPU memory held by torch in this replica (allocated, reserved)",
                "kind",
                gpu,
            )

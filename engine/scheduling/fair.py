"""Fair scheduling of compute across tenants: deficit round robin (DRR) by tokens.

Owns: the single compute worker of a Trainer replica, per-tenant FIFO queues, the DRR choice of
whose work runs next, and queue positions for `queue_state`. A tenant that sends 8× larger batches
gets the same token share as a small tenant, not 8× the turns: the Trainer slices big requests into
units of at most `slice_tokens` tokens (= the quantum), so a small request waits about one slice.
Tenants that were idle are served first for one quantum (FQ-CoDel's sparse-flow rule), which keeps
latency low for small, interactive tenants without letting anyone exceed its share per round.

Queued calls are plain callables run on one worker thread (torch work must not interleave on a
replica).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

#: tokens a tenant may spend per round before the next tenant's turn (about one small step)
DEFAULT_QUANTUM = 1024
#: event-loop turns the worker yields after each job, so a request woken by its result (the same
#: model's next slice or optim_step) enqueues before the next pick: it takes about 5 turns, 12
#: through the exactly-once wrapper (engine/scheduling/exactly_once.py: task + shield); 32 turns
#: cost ~50 us
CONTINUATION_YIELDS = 32
#: cost charged to work that is not a token batch (optim_step, save, load)
FIXED_COST = 64


@dataclass
class QueuedCall:
    """One tenant's compute call in the queue: what it costs and where its result goes."""

    tenant: str
    model_id: str
    cost: int
    fn: Callable[[], Any]
    future: asyncio.Future
    label: str = ""
    #: set for work that may run fused with other tenants' work (see `FairScheduler.fuse_fn`)
    fuse_item: Any = None
    enqueued: float = field(default_factory=time.monotonic)


class FairScheduler:
    def __init__(self, quantum: int = DEFAULT_QUANTUM) -> None:
        self.quantum = quantum
        #: credit of a tenant that was idle: two quanta plus an optimizer step, so a small
        #: tenant's whole step (fwd/bwd + optim_step) usually runs before a backlog's next slice
        self.new_flow_credit = 2 * quantum + FIXED_COST
        # Active tenants in round-robin order: recently idle ("new") ones are served first.
        # A tenant whose queue ran empty keeps its place until its next turn, so a tenant that
        # immediately sends its next slice does not count as new.
        self._new: OrderedDict[str, deque[QueuedCall]] = OrderedDict()
        self._old: OrderedDict[str, deque[QueuedCall]] = OrderedDict()
        self._deficit: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._worker: asyncio.Task | None = None
        self.running: QueuedCall | None = None
        self.completed = 0
        #: when set, ready fusable jobs of several tenants run as one call: fuse_fn(items) returns
        #: one result or exception per item. None = always one job at a time.
        self.fuse_fn: Callable[[list[Any]], list[Any]] | None = None
        self.fuse_max_jobs = 8
        self.fused_batches = 0
        #: called on the event loop with each job as it starts (queue-wait metrics), or None
        self.on_start: Callable[[QueuedCall], None] | None = None

    def call_on_compute_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the compute thread now and return its result (for a replica's start-up:
        the backend's construction and the execution probe). One thread then runs every torch
        op of the process: libgomp keeps an OpenMP team per thread that ever ran a parallel op,
        and once its threads outnumber the cores it spins ~3000x shorter (100 spins instead of
        300,000) before sleeping between ops, which made the 25 M model's steps 17% slower."""
        return self._pool.submit(fn).result()

    async def run(
        self,
        tenant: str,
        model_id: str,
        cost: int,
        fn: Callable[[], Any],
        label: str = "",
        fuse_item: Any = None,
    ) -> Any:
        """Queue ``fn`` for ``tenant`` and wait for its result (exceptions propagate)."""
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._loop())
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        job = QueuedCall(tenant, model_id, max(int(cost), 1), fn, fut, label, fuse_item)
        if tenant in self._new:
            self._new[tenant].append(job)
        elif tenant in self._old:
            self._old[tenant].append(job)
        else:
            self._new[tenant] = deque([job])
            self._deficit[tenant] = self.new_flow_credit
        self._wake.set()
        return await fut

    def _pick(self) -> QueuedCall | None:
        while self._new or self._old:
            flows = self._new if self._new else self._old
            tenant, queue = next(iter(flows.items()))
            if not queue:
                del flows[tenant]
                if flows is self._new:
                    self._old[tenant] = queue
                else:
                    self._deficit[tenant] = 0
                continue
            head = queue[0]
            if self._deficit[tenant] >= head.cost:
                self._deficit[tenant] -= head.cost
                return queue.popleft()
            self._deficit[tenant] += self.quantum
            del flows[tenant]
            self._old[tenant] = queue
        return None

    def _companions(self, first: QueuedCall) -> list[QueuedCall]:
        """Other tenants' ready fusable jobs to run with ``first``. They are charged their cost
        now (their credit may go negative), so fusing never buys a tenant more than its share."""
        batch, models = [first], {first.model_id}
        budget = self.quantum * self.fuse_max_jobs
        cost = first.cost
        for flows in (self._new, self._old):
            for tenant, queue in flows.items():
                if len(batch) >= self.fuse_max_jobs:
                    return batch
                if not queue or tenant == first.tenant:
                    continue
                head = queue[0]
                if head.fuse_item is None or head.model_id in models or cost + head.cost > budget:
                    continue
                queue.popleft()
                self._deficit[tenant] -= head.cost
                batch.append(head)
                models.add(head.model_id)
                cost += head.cost
        return batch

    async def _run_fused(self, loop: asyncio.AbstractEventLoop, batch: list[QueuedCall]) -> None:
        fuse_fn = self.fuse_fn
        assert fuse_fn is not None  # the worker fuses only while fuse_fn is set
        try:
            results = await loop.run_in_executor(self._pool, fuse_fn, [j.fuse_item for j in batch])
        except BaseException as exc:  # noqa: BLE001 - the whole call failed: every job gets it
            results = [exc] * len(batch)
        self.fused_batches += 1
        for job, res in zip(batch, results, strict=True):
            if job.future.done():
                continue
            if isinstance(res, BaseException):
                job.future.set_exception(res)
            else:
                job.future.set_result(res)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = self._pick()
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if job.future.cancelled():
                continue
            self.running = job
            if self.fuse_fn is not None and job.fuse_item is not None:
                batch = self._companions(job)
                if self.on_start is not None:
                    for j in batch:
                        self.on_start(j)
                if len(batch) > 1:
                    try:
                        await self._run_fused(loop, batch)
                    finally:
                        self.running = None
                        self.completed += len(batch)
                    for _ in range(CONTINUATION_YIELDS):
                        await asyncio.sleep(0)
                    continue
            elif self.on_start is not None:
                self.on_start(job)
            try:
                result = await loop.run_in_executor(self._pool, job.fn)
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting request
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            finally:
                self.running = None
                self.completed += 1
            # Let requests woken by this result (e.g. the same model's optim_step, waiting for its
            # seq turn) enqueue before the next pick, so they compete in this round.
            for _ in range(CONTINUATION_YIELDS):
                await asyncio.sleep(0)

    def position(self, model_id: str) -> tuple[int, int] | None:
        """(jobs ahead of this model's first queued job in DRR order, total queued), or None."""
        queues = [list(q) for q in (*self._new.values(), *self._old.values())]
        total = sum(len(q) for q in queues)
        ahead = 0
        # Approximation of DRR order: one job per tenant per round, tenants in round order.
        for i in range(max((len(q) for q in queues), default=0)):
            for q in queues:
                if i < len(q):
                    if q[i].model_id == model_id:
                        return ahead, total
                    ahead += 1
        return None

    def describe(self, model_id: str) -> str | None:
        """What this model's compute is doing: running (and which job), queued (behind how many
        jobs), or None when it has nothing here."""
        running = self.running
        if running is not None and running.model_id == model_id:
            return f"running ({running.label})"
        pos = self.position(model_id)
        if pos is None:
            return None
        ahead, total = pos
        return f"queued for compute: {ahead} of {total} queued jobs run first"

    def backlog(self) -> tuple[int, float | None]:
        """(jobs queued, ``enqueued`` time of the oldest queue head or None). Safe to call from
        another thread (the metrics scrape): the views are copied in one C call each."""
        queues = [*list(self._new.values()), *list(self._old.values())]
        depth, oldest = 0, None
        for q in queues:
            try:
                head = q[0]
            except IndexError:
                continue
            depth += len(q)
            oldest = head.enqueued if oldest is None else min(oldest, head.enqueued)
        return depth, oldest

    def queued_tenants(self) -> dict[str, int]:
        return {t: len(q) for t, q in (*self._new.items(), *self._old.items()) if q}

    def queue_snapshot(self) -> list[dict]:
        """Per tenant with queued work, in the order `position` serves them: its queued jobs,
        the jobs ahead of its first one and how long its oldest job has waited (seconds)."""
        now = time.monotonic()
        queues = [(t, list(q)) for t, q in (*self._new.items(), *self._old.items()) if q]
        ahead, first = 0, {}
        for i in range(max((len(q) for _, q in queues), default=0)):
            for tenant, q in queues:
                if i < len(q):
                    first.setdefault(tenant, ahead)
                    ahead += 1
        return [
            {
                "tenant": tenant,
                "jobs": len(q),
                "ahead": first[tenant],
                "oldest_wait_s": round(now - min(j.enqueued for j in q), 3),
            }
            for tenant, q in sorted(queues, key=lambda tq: first[tq[0]])
        ]

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

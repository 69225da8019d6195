"""The Sampler: generates from a base model or from saved adapter checkpoints.

In-process or as a Ray Serve deployment (engine/app.py). One worker thread runs the backend; the
backend caches adapters by checkpoint directory, so an evicted adapter is reloaded, never a 404.

Batching at request granularity: `sample` queues the request and wakes the worker (at the end of
the current event-loop iteration, so requests that arrive together are queued together); the
worker takes every queued request (in arrival order, up to ``max_batch_rows`` rows, i.e. sum of
``num_samples``; a single larger request runs alone) and decodes them together with the backend's
``sample_many`` (one decode loop for all tenants and adapters). Requests arriving while a batch
runs wait for the next batch. Each request gets its own result or error.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.backends.base import SamplingBackend, TokenListener
from engine.backends.registry import build_sampling_backend
from engine.config import ModelConfig
from engine.protocol import SampleDelta, SampleInput, SampleOutput, SamplerApi
from engine.sampler_text import SamplerText
from engine.storage import SharedDirStorage
from engine.telemetry.exporter import ServesMetrics, export_replica_metrics
from engine.telemetry.metrics import ReplicaMetrics, State, measured

DEFAULT_MAX_BATCH_ROWS = 64

#: ``listener(sample_index, token, logprob)``, called on the sampling thread per generated token
Listener = TokenListener
#: a queued request: input, its future, its token listener, ``time.monotonic()`` at arrival
Item = tuple[SampleInput, Future, Listener | None, float]


def _rows(inp: SampleInput) -> int:
    n = inp.num_samples
    # invalid counts are the backend's to reject; here they count as one row
    return n if isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 else 1


class Sampler(SamplerText, ServesMetrics):
    """One base model's sampling replica: batches requests onto one `SamplingBackend` (built by
    name in engine/backends/registry.py unless one is injected) on one worker thread. Its text
    methods (tokenizer, chat templates) are `SamplerText`'s (engine/sampler_text.py)."""

    def __init__(
        self,
        model: ModelConfig | dict,
        data_dir: str,
        *,
        backend: SamplingBackend | None = None,
        max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
        telemetry: dict | None = None,
        storage_id: str | None = None,
    ) -> None:
        """``telemetry``: record Prometheus metrics; ``storage_id``: refuse to start on a node
        that does not reach the checkpoint storage; both as for `engine.trainer.Trainer`."""
        self.model = model if isinstance(model, ModelConfig) else ModelConfig.model_validate(model)
        self.storage = SharedDirStorage(data_dir)
        if storage_id is not None:
            self.storage.check(storage_id)
        self.max_batch_rows = max(1, int(max_batch_rows))
        self._queue: deque[Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._batches = 0
        self._requests = 0
        self._rows = 0
        self._max_rows = 0
        self.metrics: ReplicaMetrics | None = None
        self._exporter = None
        # The worker thread builds the backend itself (when none is given), so every torch op of
        # the service runs on that one thread: on CPU, a second thread that has run torch ops
        # keeps its own OpenMP team, and two teams on the same cores slow each other down badly.
        built: Future = Future()
        if backend is not None:
            built.set_result(backend)
        self._worker = threading.Thread(
            target=self._run, args=(built, data_dir), name="sampler", daemon=True
        )
        self._worker.start()
        self.backend = built.result()  # re-raises a build failure here
        if telemetry is not None:
            self.metrics, self._exporter = export_replica_metrics(
                "sampler", self.model.name, data_dir, telemetry, self._telemetry_state
            )

    def _telemetry_state(self) -> State:
        """Read on the metrics scrape thread."""
        with self._cond:
            depth = len(self._queue)
            oldest = self._queue[0][3] if self._queue else None
            batches, rows = self._batches, self._rows
        stats = self.backend.adapter_cache_stats()
        return State(
            queue_depth=depth,
            oldest_enqueued=oldest,
            adapters={"loaded": stats.get("loaded", 0)},
            offloads=stats.get("evictions", 0),
            reloads=stats.get("loads", 0),
            counters={"twinkle_sampler_batches": batches, "twinkle_sampler_batch_rows": rows},
        )

    async def info(self) -> dict:
        return {"base_model": self.model.name, "vocab_size": self.backend.vocab_size}

    def _submit(self, inp: SampleInput, listener: Listener | None = None) -> Future:
        fut: Future = Future()
        if inp.adapter_dir is not None:  # a node-local copy where the storage is remote
            local = str(self.storage.readable(inp.adapter_dir))
            if local != inp.adapter_dir:
                inp = replace(inp, adapter_dir=local)
        with self._cond:
            if self._closed:
                raise RuntimeError("Sampler is closed")
            self._queue.append((inp, fut, listener, time.monotonic()))
        # Wake the worker at the end of this event-loop iteration, not now: requests that arrive
        # together (tasks ready in the same iteration) are then all queued and form one batch.
        asyncio.get_running_loop().call_soon(self._wake)
        return fut

    async def sample(self, inp: SampleInput) -> SampleOutput:
        return await measured(
            self.metrics, "sample", lambda: asyncio.wrap_future(self._submit(inp))
        )

    async def sample_stream(self, inp: SampleInput) -> AsyncIterator[SampleDelta]:
        """Like `sample`, but yields the tokens as they are generated: `SampleDelta`s with the new
        tokens and logprobs per sample index (whatever arrived since the last yield, so a slow
        consumer gets bigger deltas, never a backlog), then one with ``final`` set to the whole
        `SampleOutput`. A request that fails raises its error instead. Batched with every other
        request exactly like `sample` (Ray Serve streams it with ``handle.options(stream=True)``).
        A backend without token callbacks yields only the final delta."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(s: int, tok: int, lp: float) -> None:  # on the sampling thread
            loop.call_soon_threadsafe(events.put_nowait, (s, tok, lp))

        fut = self._submit(inp, listener)
        done = asyncio.wrap_future(fut)
        t0 = time.perf_counter()
        try:
            async for delta in self._deltas(events, done):
                yield delta
        except Exception as e:
            if self.metrics is not None:
                self.metrics.request("sample_stream", time.perf_counter() - t0, e)
            raise
        else:
            if self.metrics is not None:
                self.metrics.request("sample_stream", time.perf_counter() - t0)
        finally:
            fut.cancel()  # a consumer that went away: no work if the batch has not started

    @staticmethod
    async def _deltas(events: asyncio.Queue, done: asyncio.Future) -> AsyncIterator[SampleDelta]:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            items = []
            if getter.done():
                items.append(getter.result())
            else:
                getter.cancel()
            while not events.empty():
                items.append(events.get_nowait())
            if items:
                delta = SampleDelta()
                for s, tok, lp in items:
                    delta.tokens.setdefault(s, []).append(tok)
                    delta.logprobs.setdefault(s, []).append(lp)
                if not done.done():
                    yield delta
                    continue
            if done.done():
                # the final output holds every token; pending deltas are superseded by it
                yield SampleDelta(final=done.result())
                return

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    async def stats(self) -> dict:
        """Batches run so far, requests and rows they held, and the mean batch size."""
        with self._cond:
            b = self._batches
            return {
                "batches": b,
                "requests": self._requests,
                "rows": self._rows,
                "mean_batch_requests": self._requests / b if b else 0.0,
                "mean_batch_rows": self._rows / b if b else 0.0,
                "max_batch_rows_seen": self._max_rows,
                "queued": len(self._queue),
                "max_batch_rows": self.max_batch_rows,
            }

    def close(self) -> None:
        """Stop the worker after the queued requests are done, and the metrics endpoint
        (idempotent)."""
        self._close_exporter()
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._worker:
            self._worker.join()

    # ------------------------------------------------------------------------------- worker

    def _next_batch(self) -> list[Item] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None  # closed and drained
            batch = [self._queue.popleft()]
            rows = _rows(batch[0][0])
            while self._queue and rows + _rows(self._queue[0][0]) <= self.max_batch_rows:
                item = self._queue.popleft()
                batch.append(item)
                rows += _rows(item[0])
            self._batches += 1
            self._requests += len(batch)
            self._rows += rows
            self._max_rows = max(self._max_rows, rows)
            return batch

    def _run(self, built: Future, data_dir: str) -> None:
        if not built.done():
            try:
                built.set_result(build_sampling_backend(self.model, data_dir))
            except BaseException as e:  # noqa: BLE001 (re-raised by the constructor)
                built.set_exception(e)
                return
        while (batch := self._next_batch()) is not None:
            # a future cancelled before the batch started needs no work
            live = [item for item in batch if item[1].set_running_or_notify_cancel()]
            if not live:
                continue
            if self.metrics is not None:
                now = time.monotonic()
                for item in live:
                    self.metrics.queue_wait(now - item[3])
            results = self._execute([it[0] for it in live], [it[2] for it in live])
            for (inp, fut, _, _), res in zip(live, results, strict=True):
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    self._count_tokens(inp, res)
                    fut.set_result(res)

    def _count_tokens(self, inp: SampleInput, out: SampleOutput) -> None:
        if self.metrics is not None:
            self.metrics.tokens("prefilled", len(inp.prompt_tokens))
            self.metrics.tokens("sampled", sum(len(s.tokens) for s in out.sequences))

    def _execute(
        self, inputs: Sequence[SampleInput], listeners: Sequence[Listener | None]
    ) -> list[SampleOutput | BaseException]:
        try:
            if any(lis is not None for lis in listeners):
                return list(self.backend.sample_many(inputs, listeners))
            return list(self.backend.sample_many(inputs))
        except Exception as e:  # noqa: BLE001 (an unexpected failure of the whole batch)
            if len(inputs) == 1:
                return [e]
            # retry one by one, so only the request that fails gets the error
        results: list[SampleOutput | BaseException] = []
        for inp in inputs:
            try:
                results.append(self.backend.sample(inp))
            except Exception as e:  # noqa: BLE001 (EngineError or not: that request's failure)
                results.append(e)
        return results


if TYPE_CHECKING:

    def _serves_the_gateway(replica: Sampler) -> SamplerApi:
        """Checked by pyright, never run: the Sampler has every method the gateway's typed client
        calls, with compatible parameters and results (engine.protocol.SamplerApi)."""
        return replica

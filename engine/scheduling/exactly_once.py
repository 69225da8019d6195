"""Exactly-once execution of sequenced requests: a repeated (model_id, seq_id) gets the result of
the first execution instead of running again.

Why: a gateway replica can die (or be restarted) while the Trainer runs its request; the replica
that takes over calls the Trainer again with the same (model_id, seq_id). The work itself runs in a
task of its own, shielded from the caller's cancellation, so a vanished caller neither interrupts a
half-applied step nor loses its result. The latest ``per_model`` results (or errors) of each model
are kept; older seq_ids fall back to the sequencer's "already executed" error.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

Key = tuple[str, int]


class OnceCache:
    def __init__(self, per_model: int = 16) -> None:
        self._per_model = per_model
        self._done: dict[str, OrderedDict[int, tuple[bool, Any]]] = {}
        self._running: dict[Key, asyncio.Task] = {}
        self.replays = 0

    async def run(self, key: Key, factory: Callable[[], Awaitable[Any]]) -> Any:
        model_id, seq_id = key
        done = self._done.get(model_id)
        if done is not None and seq_id in done:
            self.replays += 1
            ok, value = done[seq_id]
            if ok:
                return value
            raise value
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(factory())
            self._running[key] = task
            task.add_done_callback(lambda t, k=key: self._finish(k, t))
        else:
            self.replays += 1
        return await asyncio.shield(task)

    def _finish(self, key: Key, task: asyncio.Task) -> None:
        self._running.pop(key, None)
        if task.cancelled():
            return
        exc = task.exception()
        results = self._done.setdefault(key[0], OrderedDict())
        results[key[1]] = (exc is None, task.result() if exc is None else exc)
        while len(results) > self._per_model:
            results.popitem(last=False)

    def forget(self, model_id: str) -> None:
        self._done.pop(model_id, None)

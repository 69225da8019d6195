"""Per-model seq_id ordering.

Tinker clients number a model's requests 1, 2, 3, … (0 is the creation) and may send them out of
order (the chunks of one forward_backward arrive concurrently, chunk 1 last). Requests wait here
until every lower seq_id of the same model has run. A failed request still advances the sequence.
If a seq_id never arrives (the client gave up on a submit), the waiter at the head of the line
skips the gap after `gap_timeout` seconds rather than stalling the model forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from engine.errors import UserInputError

log = logging.getLogger(__name__)


class Sequencer:
    def __init__(self, gap_timeout: float = 120.0) -> None:
        self._next: dict[str, int] = {}
        self._cond = asyncio.Condition()
        self._gap_timeout = gap_timeout
        self._waiting: dict[str, set[int]] = {}

    def start(self, model_id: str, next_seq: int = 1) -> None:
        """Register a model whose next expected request is ``next_seq``."""
        self._next[model_id] = next_seq

    def forget(self, model_id: str) -> None:
        self._next.pop(model_id, None)
        self._waiting.pop(model_id, None)

    def expected(self, model_id: str) -> int | None:
        """The seq_id this model runs next (None if unknown)."""
        return self._next.get(model_id)

    def pending(self, model_id: str) -> int:
        """How many requests of this model are waiting for their turn."""
        return len(self._waiting.get(model_id, ()))

    @asynccontextmanager
    async def turn(self, model_id: str, seq_id: int) -> AsyncIterator[None]:
        """Hold the model's turn for ``seq_id`` while the body runs."""
        async with self._cond:
            if model_id not in self._next:
                # First request we see for a model created elsewhere (e.g. after a restart).
                self._next[model_id] = seq_id
            if seq_id < self._next[model_id]:
                raise UserInputError(
                    f"seq_id: {seq_id} for model {model_id} was already executed "
                    f"(next expected is {self._next[model_id]})"
                )
            waiting = self._waiting.setdefault(model_id, set())
            waiting.add(seq_id)
            started = time.monotonic()
            try:
                while self._next.get(model_id, seq_id) != seq_id:
                    remaining = self._gap_timeout - (time.monotonic() - started)
                    head = min(waiting) == seq_id
                    if head and remaining <= 0:
                        log.warning(
                            "model %s: seq_id %d never arrived; skipping to %d",
                            model_id,
                            self._next[model_id],
                            seq_id,
                        )
                        self._next[model_id] = seq_id
                        break
                    with suppress(TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), timeout=max(remaining, 0.5))
            finally:
                waiting.discard(seq_id)
        try:
            yield
        finally:
            async with self._cond:
                if model_id in self._next:
                    self._next[model_id] = max(self._next[model_id], seq_id + 1)
                self._cond.notify_all()

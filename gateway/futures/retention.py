"""How long finished futures stay answerable in one replica, and what is left after they expire.

Owns: the finishing-order queue of finished futures (expiry pops the old ones instead of scanning
every record), the tombstones that make an expired future answer 410 rather than 404 for a day,
and the set of finished futures whose result no retrieve_future has answered yet (a draining
server waits briefly for exactly these).
"""

from __future__ import annotations

import time
from collections import deque

from gateway.futures.record import FutureRecord

#: a finished future is kept this long for retrieval (the SDK retrieves within seconds)
RESULT_TTL_S = 3600.0
#: after expiry, retrieve_future answers 410 (not 404) for this long
TOMBSTONE_TTL_S = 86400.0


class Retention:
    def __init__(self, result_ttl_s: float) -> None:
        self.result_ttl_s = result_ttl_s
        # finished futures in finishing order: an hour of results is ~20k records for one tenant
        # stepping 3 times a second, and a scan of them cost milliseconds per request
        self._finished: deque[tuple[float, str]] = deque()
        #: request id -> (user id, when it expired); insertion order is expiry order
        self.tombstones: dict[str, tuple[int, float]] = {}
        self._uncollected: set[str] = set()

    def uncollected_count(self) -> int:
        return len(self._uncollected)

    def collected(self, request_id: str) -> None:
        self._uncollected.discard(request_id)

    def finish(self, rec: FutureRecord) -> None:
        """Mark ``rec`` finished now and wake its waiters."""
        rec.finished_at = time.monotonic()
        self._finished.append((rec.finished_at, rec.request_id))
        self._uncollected.add(rec.request_id)
        rec.done.set()

    def expire(self, futures: dict[str, FutureRecord], by_idem: dict[tuple[str, int], str]) -> None:
        """Drop results older than the TTL from ``futures`` and ``by_idem`` (tombstoned), and
        tombstones older than theirs. Both are kept in age order, so this costs only what
        expires."""
        now = time.monotonic()
        while self._finished and now - self._finished[0][0] > self.result_ttl_s:
            rid = self._finished.popleft()[1]
            self._uncollected.discard(rid)
            rec = futures.pop(rid, None)
            if rec is None:
                continue
            self.tombstones[rid] = (rec.user_id, now)
            if rec.idem_key is not None and by_idem.get(rec.idem_key) == rid:
                by_idem.pop(rec.idem_key, None)
        while self.tombstones:
            oldest = next(iter(self.tombstones))
            if now - self.tombstones[oldest][1] <= TOMBSTONE_TTL_S:
                break
            del self.tombstones[oldest]

"""What one user's unfinished sequenced requests may hold in this gateway replica.

Owns `HeldLedger`: per user, how many sequenced requests (forward_backward, optim_step, saves,
...) have not finished here and how many bytes of decoded input they hold, against
``gateway.max_pending_sequenced_per_user`` and ``gateway.max_held_mb_per_user``. A request held
behind a seq_id gap stays up to the Trainer's gap timeout (120 s), with its input in this
process and in Ray's object store, so without a bound a tenant could park gigabytes behind a gap.

A request over either limit is a 429 with retry-after (the SDK resends the same seq_id), unless
it is its model's *next* request: one past the last seq_id that finished here. The requests
already held may be waiting for exactly that one, so refusing it would stall them until the gap
timeout; and a model has one next request at a time, so the exemption holds at most one request
per model. A model first seen in this replica (created elsewhere, or before a restart) starts at
the first request seen, as the Trainer's sequencer does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.errors import RateLimitedError

#: how long a refused request waits before the SDK resends it: held requests finish as the
#: model's steps run (seconds), or when the Trainer skips a gap (120 s)
RETRY_AFTER_S = 2.0
#: models whose last finished seq_id is remembered; the least recently used are forgotten
#: (a forgotten model restarts at its next request seen, like a model new to this replica)
MAX_MODELS = 65536


@dataclass
class Hold:
    """One admitted request's share of its user's budget, given back once by `HeldLedger.finish`."""

    user_id: int
    model_id: str
    seq_id: int
    nbytes: int
    released: bool = False


class HeldLedger:
    def __init__(self, max_bytes_per_user: int, max_requests_per_user: int) -> None:
        self.max_bytes, self.max_requests = max_bytes_per_user, max_requests_per_user
        self._bytes: dict[int, int] = {}
        self._count: dict[int, int] = {}
        self._done: OrderedDict[str, int] = OrderedDict()

    def held(self, user_id: int) -> tuple[int, int]:
        """(unfinished requests, bytes they hold) of ``user_id`` in this replica."""
        return self._count.get(user_id, 0), self._bytes.get(user_id, 0)

    def model_created(self, model_id: str) -> None:
        """``model_id`` was created here: its next request is seq_id 1."""
        self._remember(model_id, 0)

    def admit(self, user_id: int, model_id: str, seq_id: int, nbytes: int) -> Hold:
        """Hold ``nbytes`` for request ``seq_id`` of ``model_id``, or `RateLimitedError` naming the
        limit it would pass (see the module docstring for the one request always admitted)."""
        if model_id not in self._done:
            self._remember(model_id, seq_id - 1)
        self._done.move_to_end(model_id)
        count, held = self.held(user_id)
        if seq_id != self._done[model_id] + 1:
            if count + 1 > self.max_requests:
                raise RateLimitedError(
                    f"seq_id: {count} requests of yours are unfinished on this server, at the "
                    f"limit of {self.max_requests} (gateway.max_pending_sequenced_per_user); "
                    "retry once earlier requests finish",
                    RETRY_AFTER_S,
                )
            if held + nbytes > self.max_bytes:
                raise RateLimitedError(
                    f"seq_id: your unfinished requests hold {_mib(held)} of decoded input; this "
                    f"one ({_mib(nbytes)}) would pass the limit of {_mib(self.max_bytes)} "
                    "(gateway.max_held_mb_per_user); retry once earlier requests finish (one "
                    "waiting for a seq_id that never arrives waits up to 120 s)",
                    RETRY_AFTER_S,
                )
        self._count[user_id] = count + 1
        self._bytes[user_id] = held + nbytes
        return Hold(user_id, model_id, seq_id, nbytes)

    def finish(self, hold: Hold) -> None:
        """``hold``'s request finished (ran, failed or was cancelled): give its share back and
        move its model's next seq_id past it. Later calls do nothing."""
        if hold.released:
            return
        hold.released = True
        count, held = self.held(hold.user_id)
        if count <= 1:
            self._count.pop(hold.user_id, None)
            self._bytes.pop(hold.user_id, None)
        else:
            self._count[hold.user_id] = count - 1
            self._bytes[hold.user_id] = held - hold.nbytes
        self._remember(hold.model_id, max(self._done.get(hold.model_id, 0), hold.seq_id))

    def _remember(self, model_id: str, last_done: int) -> None:
        self._done[model_id] = last_done
        self._done.move_to_end(model_id)
        while len(self._done) > MAX_MODELS:
            self._done.popitem(last=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

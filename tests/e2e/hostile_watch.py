"""What the hostile-tenant e2e watches while it attacks (tests/e2e/test_hostile_tenants.py).

`Honest` is a tenant training and sampling in a loop with the unmodified Tinker SDK, recording the
wall time of each step (forward_backward + optim_step + one short sample) and any error, labelled
with the phase the test was in when the step started. `Watch` polls ``/api/v1/healthz`` and sums
the resident memory of the server's process tree (the `twinkle serve` driver, its Ray head and
every worker; shared pages counted in each process, so only its changes mean anything).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import tinker
from tinker import types

BASE = "twinkle/tiny-chat"
#: one honest step: 12 tokens of a fixed sentence, cross-entropy, Adam, and an 8-token sample
TOKENS = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 130, 21]


@dataclass
class Step:
    phase: str
    seconds: float
    error: str | None = None


@dataclass
class Honest:
    """One honest tenant's loop on its own thread (`start`, `stop`)."""

    url: str
    key: str
    phase: str = "undisturbed"
    steps: list[Step] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        service = tinker.ServiceClient(base_url=self.url, api_key=self.key)
        self._service = service
        self._trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        self._sampler = self._trainer.save_weights_and_get_sampling_client("honest").result()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _step(self) -> None:
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
        )
        fb = self._trainer.forward_backward([datum], "cross_entropy")
        opt = self._trainer.optim_step(types.AdamParams(learning_rate=1e-3))
        assert fb.result().metrics["loss:sum"] > 0
        opt.result()
        params = types.SamplingParams(max_tokens=8, temperature=0.0)
        prompt = types.ModelInput.from_ints(TOKENS[:4])
        out = self._sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
        assert out.sequences and out.sequences[0].tokens

    def _loop(self) -> None:
        while not self._stop.is_set():
            phase, t0 = self.phase, time.monotonic()
            try:
                self._step()
                self.steps.append(Step(phase, time.monotonic() - t0))
            except Exception as exc:  # recorded: the test asserts there are none
                self.steps.append(
                    Step(phase, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
                )

    def steps_in(self, phase: str) -> list[Step]:
        return [s for s in self.steps if s.phase == phase]

    def wait_steps(self, phase: str, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while len(self.steps_in(phase)) < n:
            assert time.monotonic() < deadline, f"{n} {phase} steps not done in {timeout} s"
            assert self._thread is not None and self._thread.is_alive()
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)
        self._service.close("success")


def median_seconds(steps: list[Step]) -> float:
    return statistics.median(s.seconds for s in steps)


class Watch:
    """healthz answers and the server tree's memory, every ``period`` seconds, on a thread."""

    def __init__(self, url: str, pid: int, period: float = 0.5) -> None:
        self.url, self.pid, self.period = url, pid, period
        self.health: list[tuple[float, int]] = []  # (time, status; 0 = no answer)
        self.memory: list[tuple[float, int]] = []  # (time, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def tree_rss(self) -> int:
        root = psutil.Process(self.pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # exited between the listing and the read
                total += proc.memory_info().rss
        return total

    def _loop(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                now = time.monotonic()
                try:
                    status = http.get(f"{self.url}/api/v1/healthz").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((now, status))
                self.memory.append((now, self.tree_rss()))
                self._stop.wait(self.period)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def bad_health(self) -> list[tuple[float, int]]:
        return [(t, s) for t, s in self.health if s != 200]

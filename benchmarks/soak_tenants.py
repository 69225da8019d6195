"""The tenants of the soak (benchmarks/soak.py): what each kind of client does in its loop.

Owns the roles and their bookkeeping. Every role runs until a deadline or a request budget and
records, per operation (route), its latency from submission to result, and per outcome what
happened: ``issued`` futures, ``completed`` ones, ``failed`` ones by category. A future counts as
issued when the client submits it and as completed or failed when its result (or error) arrives,
so ``issued - completed - failed`` is what the client lost.

Roles:

* ``sft``: the unmodified Tinker SDK, forward_backward + optim_step (queued, then both results, as
  tinker-cookbook's sl_loop does), save_state every 10 steps;
* ``rl``: the Tinker SDK, save_weights_and_get_sampling_client every 5 steps, 4 samples of a prompt,
  an importance_sampling forward_backward on them, optim_step;
* ``native``: our twinkle_client (upstream Twinkle's API): forward_backward + clip_grad_and_step,
  save every 10 steps;
* ``openai``: streaming chat completions on /v1/chat/completions (time to first token and total);
* ``retry``: raw HTTP with the Tinker wire: every forward_backward / optim_step is sent twice with
  the same seq_id (the second right after the first, and again after its result), as an SDK retry
  after a lost answer does; both answers must name the same future;
* ``vanish``: a Tinker SDK SFT loop in a process of its own that soak.py SIGKILLs at a random
  moment (then starts another one).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

BASE = "twinkle/tiny-chat"
VOCAB = 2048
ROLES = ("sft", "rl", "native", "openai", "retry", "vanish")


@dataclass
class Book:
    """One tenant's record (JSON-able via `as_json`)."""

    tenant: int
    role: str
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    issued: int = 0
    completed: int = 0
    failed: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)  # futures submitted, by the server's kind
    steps: int = 0  # optimizer steps (training roles) or streams (openai)
    dedup_ok: int = 0  # retry role: a resend answered with the first future
    dedup_bad: int = 0  # ... answered with another future (a duplicate execution)
    sessions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def timed(self, op: str, t0: float) -> None:
        self.latencies[op].append(time.perf_counter() - t0)

    def fail(self, exc: BaseException) -> None:
        status = getattr(exc, "status_code", None) or getattr(
            getattr(exc, "response", None), "status_code", None
        )
        self.failed[f"{type(exc).__name__}{f' {status}' if status else ''}"] += 1
        if len(self.errors) < 5:
            self.errors.append(str(exc)[:300])

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "role": self.role,
            "latencies": dict(self.latencies),
            "issued": self.issued,
            "completed": self.completed,
            "failed": dict(self.failed),
            "kinds": dict(self.kinds),
            "steps": self.steps,
            "dedup_ok": self.dedup_ok,
            "dedup_bad": self.dedup_bad,
            "sessions": self.sessions,
            "errors": self.errors,
        }


def _rows(rng: random.Random, n: int = 4, length: int = 32) -> list[list[int]]:
    return [[rng.randrange(10, VOCAB) for _ in range(length + 1)] for _ in range(n)]


def _datums(rows: list[list[int]]) -> list:
    from tinker import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:]},
        )
        for r in rows
    ]


def _session_of(model_id: str) -> str:
    return model_id.split(":", 1)[0]


class Tenant:
    """One tenant: a role's loop under a deadline and a budget of optimizer steps / streams."""

    def __init__(self, url: str, key: str, tenant: int, role: str, deadline: float, budget: int):
        self.url, self.key, self.deadline, self.budget = url, key, deadline, budget
        self.book = Book(tenant, role)
        self.rng = random.Random(tenant)

    def issue(self, *kinds: str) -> None:
        """Book futures submitted, by kind (the server's names: create_model, forward_backward,
        optim_step, save, sample; the native client's calls have no future: "")."""
        self.book.issued += len(kinds)
        self.book.kinds.update(k for k in kinds if k)

    def more(self) -> bool:
        return time.monotonic() < self.deadline and self.book.steps < self.budget

    def run(self) -> Book:
        try:
            getattr(self, f"_{self.book.role}")()
        except Exception as exc:  # a role's set-up failing is an error of the run, not a crash
            self.book.fail(exc)
        return self.book

    # -- Tinker SDK -----------------------------------------------------------------------------
    def _future(self, op: str, fut, t0: float):
        """The result of a submitted future, booked (issued / completed / failed)."""
        try:
            out = fut.result(timeout=300)
        except Exception as exc:
            self.book.fail(exc)
            return None
        self.book.completed += 1
        self.book.timed(op, t0)
        return out

    def _create(self, sc):
        """A LoRA training client of rank 4 (its create_model future booked)."""
        self.issue("create_model")  # a failure propagates: run() books it
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=self.book.tenant)
        self.book.completed += 1
        self.book.sessions.append(_session_of(tc.model_id))
        return tc

    def _sft(self) -> None:
        import tinker
        from tinker import types

        sc = tinker.ServiceClient(base_url=self.url, api_key=self.key)
        tc = self._create(sc)
        adam = types.AdamParams(learning_rate=1e-3)
        while self.more():
            t0 = time.perf_counter()
            fb = tc.forward_backward(_datums(_rows(self.rng)), "cross_entropy")
            opt = tc.optim_step(adam)
            self.issue("forward_backward", "optim_step")
            self._future("forward_backward", fb, t0)
            if self._future("optim_step", opt, t0) is not None:
                self.book.steps += 1
                if self.book.role == "vanish":  # soak.py kills it only once it is training
                    print(f"step {self.book.steps}", flush=True)
            if self.book.steps % 10 == 0:
                t0 = time.perf_counter()
                self.issue("save")
                self._future("save_state", tc.save_state(f"s{self.book.steps}"), t0)

    def _rl(self) -> None:
        import tinker
        from tinker import types

        sc = tinker.ServiceClient(base_url=self.url, api_key=self.key)
        tc = self._create(sc)
        adam = types.AdamParams(learning_rate=1e-3)
        params = types.SamplingParams(max_tokens=8, temperature=1.0)
        sampler = None
        while self.more():
            if sampler is None or self.book.steps % 5 == 0:
                t0 = time.perf_counter()
                self.issue("save")
                try:
                    sampler = tc.save_weights_and_get_sampling_client(f"rl{self.book.steps}")
                    self.book.completed += 1
                    self.book.timed("save_weights_and_get_sampling_client", t0)
                except Exception as exc:
                    self.book.fail(exc)
                    continue
            prompt = [self.rng.randrange(10, VOCAB) for _ in range(6)]
            t0 = time.perf_counter()
            self.issue("sample")
            res = self._future(
                "sample", sampler.sample(types.ModelInput.from_ints(prompt), 4, params), t0
            )
            if res is None:
                continue
            datums = []
            for i, s in enumerate(res.sequences):
                toks = prompt + list(s.tokens)
                lps = list(s.logprobs or [0.0] * len(s.tokens))
                n_p = len(prompt) - 1
                adv = (i - 1.5) / 1.5  # a spread of advantages, as group-normalised rewards give
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={
                            "target_tokens": toks[1:],
                            "logprobs": [0.0] * n_p + lps,
                            "advantages": [0.0] * n_p + [adv] * len(s.tokens),
                        },
                    )
                )
            t0 = time.perf_counter()
            fb = tc.forward_backward(datums, "importance_sampling")
            opt = tc.optim_step(adam)
            self.issue("forward_backward", "optim_step")
            self._future("forward_backward", fb, t0)
            if self._future("optim_step", opt, t0) is not None:
                self.book.steps += 1

    # -- the native client ----------------------------------------------------------------------
    def _native(self) -> None:
        from twinkle_client import TwinkleClient
        from twinkle_client.model import MultiLoraTransformersModel

        client = TwinkleClient(self.url, self.key)
        try:
            model = MultiLoraTransformersModel(BASE, client=client)
            model.add_adapter_to_model("a", {"r": 4, "lora_alpha": 8, "seed": self.book.tenant})
            model.set_loss("CrossEntropyLoss")
            model.set_optimizer("AdamW", lr=1e-3)
            while self.more():
                rows = [{"input_ids": r[:-1], "labels": r[1:]} for r in _rows(self.rng)]
                t0 = time.perf_counter()
                self.issue("")
                try:
                    model.forward_backward(inputs=rows)
                    self.book.timed("native forward_backward", t0)
                    t0 = time.perf_counter()
                    model.clip_grad_and_step(max_grad_norm=1.0)
                    self.book.timed("native clip_grad_and_step", t0)
                    self.book.completed += 1
                    self.book.steps += 1
                except Exception as exc:
                    self.book.fail(exc)
                    continue
                if self.book.steps % 10 == 0:
                    t0 = time.perf_counter()
                    self.issue("")
                    try:
                        model.save(f"n{self.book.steps}")
                        self.book.completed += 1
                        self.book.timed("native save", t0)
                    except Exception as exc:
                        self.book.fail(exc)
        finally:
            client.close()

    # -- OpenAI streaming -----------------------------------------------------------------------
    def _openai(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=120) as http:
            while self.more():
                body = {
                    "model": BASE,
                    "messages": [{"role": "user", "content": f"Count to {self.book.steps}."}],
                    "max_tokens": 16,
                    "stream": True,
                }
                t0 = time.perf_counter()
                self.issue("")
                first = None
                try:
                    with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        done = False
                        for line in r.iter_lines():
                            if first is None and line.startswith("data: {"):
                                first = time.perf_counter() - t0
                            done = done or line.strip() == "data: [DONE]"
                    if not done:
                        raise RuntimeError("stream ended without [DONE]")
                except Exception as exc:
                    self.book.fail(exc)
                    continue
                self.book.completed += 1
                self.book.steps += 1
                self.book.timed("openai stream (total)", t0)
                if first is not None:
                    self.book.latencies["openai stream (first token)"].append(first)

    # -- raw retries with the same seq_id -------------------------------------------------------
    def _retry(self) -> None:
        import tinker

        from gateway.tinker_api.wire_pb import pb

        sc = tinker.ServiceClient(base_url=self.url, api_key=self.key)
        model_id = self._create(sc).model_id
        auth = {"X-API-Key": self.key}
        with httpx.Client(base_url=self.url, headers=auth, timeout=120) as http:
            seq = 1
            while self.more():
                msg = pb.ForwardBackwardRequest(
                    model_id=model_id, seq_id=seq, loss_fn="cross_entropy"
                )
                for r in _rows(self.rng):
                    d = msg.data.add()
                    d.model_input.add().encoded_text.tokens = _i32(r[:-1])
                    t = d.loss_fn_inputs["target_tokens"]
                    t.dtype, t.dense = pb.DTYPE_INT64, _i64(r[1:])
                    t.shape.extend([len(r) - 1])
                fb_body = msg.SerializeToString()
                opt_body = {"model_id": model_id, "seq_id": seq + 1, "adam_params": {}}
                t0 = time.perf_counter()
                try:
                    fb = self._twice(http, "/api/v1/forward_backward", content=fb_body)
                    opt = self._twice(http, "/api/v1/optim_step", json_body=opt_body)
                    self.issue("forward_backward", "optim_step")
                    for op, rid in (("forward_backward", fb), ("optim_step", opt)):
                        self._wait(http, op, rid, t0)
                    # a late retry, after the result was read, still names the first future
                    self._same(fb, self._post(http, "/api/v1/forward_backward", content=fb_body))
                except Exception as exc:
                    self.book.fail(exc)
                    return  # the model's order is broken after a failed submission
                seq += 2
                self.book.steps += 1

    def _post(self, http: httpx.Client, path: str, content=None, json_body=None) -> str:
        headers = {"Content-Type": "application/x-protobuf"} if content is not None else {}
        for attempt in range(20):
            r = http.post(path, content=content, json=json_body, headers=headers)
            if r.status_code == 429:  # a rate limit: the SDK waits and resends the same seq_id
                time.sleep(float(r.headers.get("retry-after", 1)) * (1 + attempt / 4))
                continue
            r.raise_for_status()
            return r.json()["request_id"]
        raise RuntimeError(f"{path}: still rate limited after 20 tries")

    def _twice(self, http: httpx.Client, path: str, content=None, json_body=None) -> str:
        first = self._post(http, path, content, json_body)
        self._same(first, self._post(http, path, content, json_body))
        return first

    def _same(self, a: str, b: str) -> None:
        if a == b:
            self.book.dedup_ok += 1
        else:
            self.book.dedup_bad += 1

    def _wait(self, http: httpx.Client, op: str, request_id: str, t0: float) -> None:
        while True:
            r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            r.raise_for_status()
            body = r.json() if "json" in r.headers.get("content-type", "") else {}
            if body.get("type") == "try_again":
                continue
            if "error" in body:
                self.book.failed[f"future {body.get('category')}"] += 1
                return
            self.book.completed += 1
            self.book.timed(op, t0)
            return

    # -- the vanishing client (its own process) -------------------------------------------------
    def _vanish(self) -> None:
        self._sft()  # soak.py kills the process; nothing after this runs


def _i32(values: list[int]) -> bytes:
    import struct

    return struct.pack(f"<{len(values)}i", *values)


def _i64(values: list[int]) -> bytes:
    import struct

    return struct.pack(f"<{len(values)}q", *values)


def run_worker(spec: dict) -> list[dict]:
    """Run ``spec["tenants"]`` (each {tenant, role, key}) as threads until the deadline; their
    books as JSON. ``spec["deadline_s"]`` is seconds from now."""
    import threading

    deadline = time.monotonic() + spec["deadline_s"]
    tenants = [
        Tenant(spec["url"], t["key"], t["tenant"], t["role"], deadline, spec["budget"])
        for t in spec["tenants"]
    ]
    threads = [threading.Thread(target=t.run, daemon=True) for t in tenants]
    for th in threads:
        th.start()
        time.sleep(0.2)  # stagger the sessions' creation a little, as real clients arrive
    for th in threads:
        th.join(timeout=spec["deadline_s"] + 600)
    return [t.book.as_json() for t in tenants]


if __name__ == "__main__":  # a worker: python soak_tenants.py SPEC.json OUT.json
    import sys
    from pathlib import Path

    out = run_worker(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(out))

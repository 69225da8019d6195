"""The service path against a bare training loop: what running through Twinkle costs.

Usage (from the repository root):

    .venv/bin/python benchmarks/service_path.py                  # tiny + medium (25 M)
    .venv/bin/python benchmarks/service_path.py --models smollm2 # after `twinkle models pull`
    .venv/bin/python benchmarks/service_path.py --quick          # tiny, 4 steps
    .venv/bin/python benchmarks/service_path.py --models medium --compare-metrics

The same SFT loop (model, batch B x T random tokens, rank-8 LoRA on every target, AdamW, summed
cross-entropy) run both ways on the same cores:

* ``bare``: torch + peft in this process (train mode, one adapter), ``torch.set_num_threads`` =
  the cores this process may use: the floor;
* ``service``: the unmodified Tinker SDK (``forward_backward`` + ``optim_step`` queued, then both
  ``.result()``, as tinker-cookbook's sl_loop does) against a ``twinkle serve`` started here with
  that model, one tenant; one server per variant (Trainer threads, gateway ingress, environment,
  config lines: ``--config-variants``).

Paired rounds: all servers start first; each round is a bare block, then every variant's block
(``--steps`` each), with every server but the measured one SIGSTOPped (a paused server uses no
CPU). This VM drifts by tens of percent within minutes, so only blocks seconds apart compare.

Reported per model: tokens/s and step latency p50/p95 of both, their ratio (service / bare, over
all rounds; per-round min / median / max), and where the rest goes: the gateway's own time per
route from its ``/metrics`` (the sum of request durations: forward_backward / optim_step
submission, and retrieve_future, which includes waiting for the Trainer), the overhead per step
(service step - bare step). Also ``twinkle serve``'s time to ready and a new tenant's time to
first step (create the training client + the first step). Numbers: benchmarks/README.md.

``--compare-metrics``: the service twice, Prometheus metrics on (gateway and engine, every
endpoint scraped every ``--scrape-seconds``, default 1 s: 15x Prometheus' default) and off
(``gateway.metrics_enabled`` and ``engine_metrics.enabled`` false), in the order
``--metrics-first`` says; reports service tokens/s on / off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):  # benchmarks/ (multi_tenant.py) and the repo (engine)
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from multi_tenant import ALPHA, LORA_TARGETS, RANK, build_medium, cache_root  # noqa: E402
from multi_tenant import model_dir as bench_model_dir  # noqa: E402

LR = 1e-4
#: per model: (B sequences, T tokens) per step
SHAPE = {"tiny": (8, 128), "medium": (8, 128), "smollm2": (4, 128), "qwen2.5-0.5b": (4, 512)}
TWINKLE = str(Path(sys.executable).parent / "twinkle")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def model_dir(name: str, data_dir: Path) -> tuple[Path, str]:
    """(HF folder with a tokenizer, the name `twinkle serve` serves it under)."""
    from engine.base_models.tiny import build_tiny

    tiny = build_tiny(cache_root() / "tiny-chat")
    if name == "tiny":
        return tiny, "bench/tiny"
    if name in ("medium", "qwen2.5-0.5b"):
        # medium: the 25 M Qwen2 (vocab 2048 = the tiny model's); qwen2.5-0.5b: the real model's
        # shapes with random weights. Training sends token ids, so the tiny tokenizer serves
        path = (
            build_medium(cache_root() / "medium-qwen2-h512-l8-v2048-seed0")
            if name == "medium"
            else bench_model_dir(name)
        )
        for f in tiny.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
        return path, f"bench/{name}"
    if name == "smollm2":
        from engine.base_models.pull import is_pulled, not_pulled_error, pulled_dir

        home = Path(os.environ.get("TWINKLE_DATA_DIR", ".twinkle"))
        if not is_pulled("smollm2-135m-instruct", home):
            raise SystemExit(str(not_pulled_error("smollm2-135m-instruct")))
        return pulled_dir("smollm2-135m-instruct", home), "bench/smollm2"
    raise SystemExit(f"unknown model {name!r} (tiny, medium, smollm2, qwen2.5-0.5b)")


@dataclass(frozen=True)
class Placement:
    """Where both sides compute: the bare loop's device, and the served model's GPUs."""

    device: str = "cpu"  # or cuda
    dtype: str = "float32"

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def sync(self) -> None:
        if self.device == "cuda":  # CUDA launches are asynchronous: time finished work only
            torch.cuda.synchronize()

    def yaml(self) -> str:
        """The model entry's lines: its dtype, and on CUDA half a GPU each for the Trainer and the
        Sampler (one GPU, both replicas on it)."""
        lines = f"    dtype: {self.dtype}\n"
        if self.device == "cuda":
            lines += "    sampler: {num_gpus: 0.5}\n"
        return lines


def batches(vocab: int, b: int, t: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, (b, t + 1)) for _ in range(n)]


@dataclass
class Side:
    tokens_per_s: float
    step_p50_s: float
    step_p95_s: float


def summarize(times: list[float], tokens: int) -> Side:
    q = np.quantile(times, [0.5, 0.95])
    return Side(tokens / statistics.mean(times), float(q[0]), float(q[1]))


# ----------------------------------------------------------------------------------- bare loop


class Bare:
    """The bare loop's model and optimizer, built once, trained block after block."""

    def __init__(self, path: Path, placement: Placement = Placement()) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(cores())
        self.placement = placement
        base = AutoModelForCausalLM.from_pretrained(str(path), dtype=placement.torch_dtype())
        base.to(placement.device)
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=LORA_TARGETS, lora_dropout=0.0)
        self.model = get_peft_model(base, cfg).train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=LR)

    def steps(self, data: list[np.ndarray], warmup: int) -> list[float]:
        times = []
        for i, seq in enumerate(data):
            t0 = time.perf_counter()
            dev = self.placement.device
            ids, tgt = torch.from_numpy(seq[:, :-1]).to(dev), torch.from_numpy(seq[:, 1:]).to(dev)
            logits = self.model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"
            )
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.placement.sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times


# ----------------------------------------------------------------------------------- service


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    path: Path,
    name: str,
    work: Path,
    threads: int | None,
    metrics: bool = True,
    ingress: str = "direct",
    extra_env: dict | None = None,
    extra_yaml: str = "",
    execution: str = "sequential",
    placement: Placement = Placement(),
) -> tuple[subprocess.Popen, str, dict, float]:
    """A `twinkle serve` of ``path`` as ``name`` (Trainer torch threads: ``threads``, None = the
    server's default; ``metrics``: Prometheus metrics on or off; ``ingress``: the gateway's;
    ``extra_yaml``: top-level config lines added; ``execution``: the model's, sequential as in
    every earlier run here, `auto` being the server's default): (process, url, env, seconds to
    ready)."""
    port = _free_port()
    config = work / "server.yaml"
    opts = ([f"torch_threads: {threads}"] if threads else []) + (
        ["num_gpus: 0.5"] if placement.device == "cuda" else []
    )
    trainer = f"    trainer: {{{', '.join(opts)}}}\n" if opts else ""
    flags = f"ingress: {ingress}" + ("" if metrics else ", metrics_enabled: false")
    gateway = f"gateway: {{{flags}}}\n"
    off = "" if metrics else "engine_metrics: {enabled: false}\n"
    config.write_text(
        f"models:\n  - name: {name}\n    path: {path}\n    max_lora_rank: {RANK}\n"
        f"    execution: {execution}\n"
        + trainer
        + placement.yaml()
        + gateway
        + off
        + extra_yaml.strip()
        + "\n"
    )
    return start_server_config(config, work, port, extra_env)


def start_server_config(
    config: Path, work: Path, port: int | None = None, extra_env: dict | None = None
) -> tuple[subprocess.Popen, str, dict, float]:
    """`twinkle serve --config config` with data in ``work/data`` (emptied first) on ``port`` (a
    free one if None), ``extra_env`` added to its environment: (process, url, env, seconds to
    ready); its log is ``work/serve.log``."""
    import httpx

    port = port or _free_port()
    shutil.rmtree(work / "data", ignore_errors=True)
    env = dict(os.environ, TWINKLE_DATA_DIR=str(work / "data"), **(extra_env or {}))
    log = open(work / "serve.log", "w")  # noqa: SIM115 (open while the server runs)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [TWINKLE, "serve", "--config", str(config), "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit((work / "serve.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, url, env, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


_SERIES = re.compile(
    r'^twinkle_http_request_seconds_(sum|count)\{[^}]*route="([^"]+)"[^}]*\} (\S+)$'
)


class Scraper:
    """Scrapes the gateway's /metrics and every engine replica's endpoint (the data dir's
    file_sd targets) every ``period`` seconds, in a thread, as Prometheus would."""

    def __init__(self, url: str, data_dir: Path, period: float = 1.0) -> None:
        self.url, self.targets, self.period = url, data_dir / "metrics" / "targets", period
        self.scrapes = 0
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        # one client, connections kept alive, as Prometheus does: a new httpx client per
        # scrape costs ~25 ms of this process's CPU, which on 2 cores slowed the run by 20%
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.period):
                if self._paused.is_set():
                    continue
                urls = [f"{self.url}/metrics"] + [
                    f"http://{t}/metrics"
                    for f in self.targets.glob("*.json")
                    for t in json.loads(f.read_text())[0]["targets"]
                ]
                for u in urls:
                    client.get(u).raise_for_status()
                    self.scrapes += 1

    def pause(self, paused: bool) -> None:
        """While the server is paused for a bare block, scrape nothing."""
        (self._paused.set if paused else self._paused.clear)()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.scrapes


def gateway_seconds(url: str) -> dict[str, float]:
    """Seconds the gateway spent per route so far (sum of request durations, /metrics; {} when
    metrics are off)."""
    import httpx

    out: dict[str, float] = {}
    r = httpx.get(f"{url}/metrics", timeout=10)
    if r.status_code == 404:
        return out
    for line in r.text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1) == "sum":
            out[m.group(2)] = out.get(m.group(2), 0.0) + float(m.group(3))
    return out


def pause(proc: subprocess.Popen, stop: bool) -> None:
    """SIGSTOP (``stop``) or SIGCONT every process of the server's session (the CLI, Ray's GCS,
    raylet and workers: each worker has its own process group, but all share the session
    `start_server` opened), so a bare block runs on quiet cores, as a bare loop would."""
    sig = signal.SIGSTOP if stop else signal.SIGCONT
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(pid)) == proc.pid:
                    os.kill(int(pid), sig)


class Service:
    """One tenant of the unmodified Tinker SDK against ``url``, trained block after block."""

    def __init__(self, name: str, url: str, key: str) -> None:
        import tinker
        from tinker import types

        self.types, self.url = types, url
        t0 = time.perf_counter()
        self.sc = tinker.ServiceClient(base_url=url, api_key=key)
        tc = self.sc.create_lora_training_client(base_model=name, rank=RANK)
        self.tc = tc.result() if hasattr(tc, "result") else tc
        self.adam = types.AdamParams(learning_rate=LR)
        self.created_s = time.perf_counter() - t0
        self.first_step_s: float | None = None
        self.routes: dict[str, float] = {}

    def _datums(self, seq: np.ndarray) -> list:
        types = self.types
        return [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={"target_tokens": row[1:].tolist()},
            )
            for row in seq
        ]

    def first_step(self, seq: np.ndarray) -> float:
        """A new tenant's time to its first finished step: the client's creation plus one step,
        taken right after creation, before the server is first paused (a step right after a
        resume would count the paused Ray's catching up: 2.1 s against 0.95 s on the 25 M
        model)."""
        s0 = time.perf_counter()
        fb = self.tc.forward_backward(self._datums(seq), "cross_entropy")
        opt = self.tc.optim_step(self.adam)
        fb.result()
        opt.result()
        self.first_step_s = self.created_s + time.perf_counter() - s0
        return self.first_step_s

    def steps(self, data: list[np.ndarray], warmup: int) -> list[float]:
        """Step times after ``warmup``; adds the gateway's seconds per route over the timed
        steps to ``routes``."""
        times: list[float] = []
        before: dict[str, float] = {}
        for i, seq in enumerate(data):
            if i == warmup:
                before = gateway_seconds(self.url)
            s0 = time.perf_counter()
            fb = self.tc.forward_backward(self._datums(seq), "cross_entropy")
            opt = self.tc.optim_step(self.adam)
            fb.result()
            opt.result()
            if i >= warmup:
                times.append(time.perf_counter() - s0)
        after = gateway_seconds(self.url)
        for k, v in after.items():
            d = v - before.get(k, 0.0)
            if d > 0 and not k.startswith("/metrics"):
                self.routes[k] = self.routes.get(k, 0.0) + d
        return times

    def close(self) -> None:
        self.sc.close("success").result()


# ----------------------------------------------------------------------------------- runner


@dataclass
class Variant:
    threads: int | None
    metrics: bool
    ingress: str
    env: dict[str, str]
    yaml: str = ""
    proc: subprocess.Popen | None = None
    url: str = ""
    ready_s: float = 0.0
    scraper: Scraper | None = None
    loop: Service | None = None
    times: list[float] | None = None
    ratios: list[float] | None = None

    def pause(self, stop: bool) -> None:
        if self.scraper:
            self.scraper.pause(stop)
        if self.proc is not None:
            pause(self.proc, stop)


def run(
    name: str,
    steps: int,
    warmup: int,
    variants: list[tuple[int | None, bool, str, dict[str, str], str]],
    scrape_s: float = 1.0,
    rounds: int = 3,
    beside: bool = False,
    execution: str = "sequential",
    placement: Placement = Placement(),
) -> list[dict]:
    """One server per (Trainer threads, metrics on, gateway ingress, extra environment) in
    ``variants``, all started
    first, then ``rounds`` rounds of: a bare block, then each variant's service block, ``steps``
    timed steps each, with every server but the measured one paused (SIGSTOP: a paused server
    uses no CPU, so the bare loop runs on quiet cores). This machine's speed drifts by tens of
    percent within minutes (a shared VM), so each ratio is taken within a round, from blocks
    seconds apart (default: blocks of 2 steps, so a bare step and a service step are seconds
    apart), and tokens/s are summed over all rounds. ``beside``: each round also runs the bare
    loop beside the first variant's server, resumed and idle (what the server costs a loop that
    never talks to it: the ceiling of the service's ratio on these cores)."""
    work = Path(tempfile.mkdtemp(prefix=f"svc-{name}-"))
    rows = []
    vs = [Variant(t, m, i, e, y, times=[], ratios=[]) for t, m, i, e, y in variants]
    try:
        path, served = model_dir(name, work)
        vocab = int(json.loads((path / "config.json").read_text()).get("vocab_size"))
        b, t = SHAPE[name]
        data = batches(vocab, b, t, steps + warmup)
        bare_loop = Bare(path, placement)
        for k, v in enumerate(vs):
            vdir = work / f"v{k}"
            vdir.mkdir()
            v.proc, v.url, env, v.ready_s = start_server(
                path,
                served,
                vdir,
                v.threads,
                v.metrics,
                v.ingress,
                v.env,
                v.yaml,
                execution,
                placement,
            )
            key = subprocess.run(
                [TWINKLE, "keys", "create", "--user", "bench"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[-1]
            v.scraper = Scraper(v.url, vdir / "data", scrape_s) if v.metrics else None
            v.loop = Service(served, v.url, key)
            v.loop.first_step(data[0])
            v.pause(True)
        bare_t: list[float] = []
        beside_t: list[float] = []
        for r in range(rounds):
            # only the first round warms up (first calls allocate, fill caches); a later block
            # starts right after its server was resumed, which counts against the service
            w = warmup if r == 0 else 0
            block = data if r == 0 else data[warmup:]
            bt = bare_loop.steps(block, w)
            bare_t += bt
            if beside:
                vs[0].pause(False)
                try:
                    beside_t += bare_loop.steps(data[warmup:], 0)
                finally:
                    vs[0].pause(True)
            for v in vs:
                assert v.loop is not None and v.times is not None and v.ratios is not None
                v.pause(False)
                try:
                    st = v.loop.steps(block, w)
                finally:
                    v.pause(True)
                v.times += st
                v.ratios.append(statistics.mean(bt) / statistics.mean(st))
        bare_s = summarize(bare_t, b * t)
        bare_step = statistics.mean(bare_t)
        for v in vs:  # all first: the SDK's clients share one event loop, which a paused
            v.pause(False)  # server's pending heartbeat would hold up while another closes
        for v in vs:
            assert v.loop is not None and v.times is not None and v.ratios is not None
            v.loop.close()
            svc = summarize(v.times, b * t)
            wall = statistics.mean(v.times)
            n = len(v.times)
            rows.append(
                {
                    "model": name,
                    "trainer_threads": v.threads or "default",
                    "metrics": v.metrics,
                    "ingress": v.ingress,
                    "server_env": v.env,
                    "server_yaml": v.yaml,
                    "scrapes": v.scraper.stop() if v.scraper else 0,
                    "batch": [b, t],
                    "steps": steps,
                    "rounds": rounds,
                    "cores": cores(),
                    "bare": asdict(bare_s),
                    # the bare loop beside this run's first server, idle: bare step / that step
                    "beside_idle_ratio": (
                        bare_step / statistics.mean(beside_t) if beside_t else None
                    ),
                    "service": asdict(svc),
                    # tokens/s over all rounds (the measure), and per round
                    "ratio": bare_step / statistics.mean(v.times),
                    "ratio_rounds": v.ratios,
                    "serve_ready_s": v.ready_s,
                    "first_step_s": v.loop.first_step_s,
                    # per timed step: where the service's wall time goes
                    "per_step_s": {
                        "wall": wall,
                        "compute (the bare step)": bare_step,
                        "overhead (wall - bare step)": wall - bare_step,
                        **{f"gateway {k}": x / n for k, x in sorted(v.loop.routes.items())},
                    },
                }
            )
    finally:
        for v in vs:
            if v.proc is not None:
                v.pause(False)
                stop_server(v.proc)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="rounds of a bare block and each variant's service block",
    )
    ap.add_argument("--quick", action="store_true", help="tiny only, 4 steps")
    ap.add_argument(
        "--trainer-threads",
        default="1,default",
        help="Trainer torch-thread settings to compare, comma-separated (1 = one torch thread)",
    )
    ap.add_argument(
        "--ingress",
        default="direct",
        help="gateway ingress settings to compare, comma-separated: direct, serve_proxy",
    )
    ap.add_argument(
        "--env-variants",
        default="",
        help="server environments to compare, '|'-separated, each space-separated KEY=VALUE "
        "pairs ('' = the server's defaults), e.g. 'RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1|'",
    )
    ap.add_argument(
        "--config-variants",
        default="",
        help="server config lines to compare, '|'-separated, each added to the server's YAML "
        "('' = none), e.g. 'ray: {housekeeping_nice: 0}|ray: {housekeeping_nice: 10}'",
    )
    ap.add_argument(
        "--compare-metrics",
        action="store_true",
        help="the service with Prometheus metrics on (scraped every second), then off",
    )
    ap.add_argument(
        "--scrape-seconds", type=float, default=1.0, help="with metrics on: scrape period"
    )
    ap.add_argument(
        "--metrics-first",
        choices=["on", "off"],
        default="on",
        help="--compare-metrics: which run goes first (the machine drifts)",
    )
    ap.add_argument(
        "--beside-idle",
        action="store_true",
        help="each round also times the bare loop beside the first variant's server, idle: "
        "the server's background cost alone (the ceiling of the ratio on these cores)",
    )
    ap.add_argument(
        "--execution",
        choices=["sequential", "auto", "fused"],
        default="sequential",
        help="the served model's execution mode (auto: the server's default, probed at start)",
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the bare loop on the GPU, the served Trainer and Sampler on half of it each",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="base weights, both sides (default: bfloat16 on cuda, float32 on cpu)",
    )
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    placement = Placement(a.device, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    models = ["tiny"] if a.quick else a.models.split(",")
    steps = 4 if a.quick else a.steps
    threads = [None if v == "default" else int(v) for v in a.trainer_threads.split(",")]
    ingresses = a.ingress.split(",")
    envs = [dict(kv.split("=", 1) for kv in e.split()) for e in a.env_variants.split("|")]
    yamls = a.config_variants.split("|")
    variants = [(t, True, i, e, y) for y in yamls for e in envs for i in ingresses for t in threads]
    if a.compare_metrics:
        variants = [(threads[-1], m, ingresses[0], envs[0], yamls[0]) for m in (True, False)]
        if a.metrics_first == "off":
            variants.reverse()
    rows = []
    for m in models:
        print(f"[service_path] {m}: bare loop, then the service ...", file=sys.stderr, flush=True)
        rows += run(
            m,
            steps,
            a.warmup,
            variants,
            a.scrape_seconds,
            1 if a.quick else a.rounds,
            beside=a.beside_idle,
            execution=a.execution,
            placement=placement,
        )
    rounds = 1 if a.quick else a.rounds
    print(
        f"\n{placement.device}, {placement.dtype}; cores: {cores()}; per variant {rounds} "
        f"round(s) of a bare block (server paused) and a service block, {steps} timed steps "
        f"each; rank {RANK}; ratio: tokens/s over all rounds"
    )
    head = f"{'model':8} {'ingress':>11} {'threads':>8} {'metrics':>8} {'B x T':>8}"
    head += f" {'bare tok/s':>11}"
    head += f" {'service tok/s':>14}"
    head += f" {'ratio':>6}"
    head += f" {'bare p50/p95 s':>15} {'service p50/p95 s':>18} {'ready s':>8} {'1st step s':>10}"
    print(head)
    for r in rows:
        bs, ss = r["bare"], r["service"]
        shape = "x".join(map(str, r["batch"]))
        print(
            f"{r['model']:8} {r['ingress']:>11} {r['trainer_threads']!s:>8} "
            f"{'on' if r['metrics'] else 'off':>8} "
            f"{shape:>8} {bs['tokens_per_s']:11.0f} "
            f"{ss['tokens_per_s']:14.0f} {r['ratio']:6.2f} "
            f"{bs['step_p50_s']:7.3f}/{bs['step_p95_s']:.3f} "
            f"{ss['step_p50_s']:10.3f}/{ss['step_p95_s']:.3f} "
            f"{r['serve_ready_s']:8.1f} {r['first_step_s']:10.2f}"
        )
    if a.compare_metrics:
        for m in models:
            on, off = (
                next(r for r in rows if r["model"] == m and r["metrics"] is v)
                for v in (True, False)
            )
            ratio = on["service"]["tokens_per_s"] / off["service"]["tokens_per_s"]
            print(
                f"\n{m}: service tokens/s with metrics on / off = {ratio:.3f} "
                f"({on['scrapes']} scrapes during the run)"
            )
    for r in rows:
        q = r["ratio_rounds"]
        rr = f"{min(q):.2f} / {statistics.median(q):.2f} / {max(q):.2f}"
        env = " ".join(f"{k}={v}" for k, v in r["server_env"].items())
        print(
            f"\n{r['model']}, ingress {r['ingress']}, Trainer threads {r['trainer_threads']}"
            + (f", env {env}" if env else "")
            + (f", config {r['server_yaml']}" if r["server_yaml"] else "")
            + f": ratio {r['ratio']:.3f}; per round min / median / max {rr}"
        )
        if r["beside_idle_ratio"]:
            b = r["beside_idle_ratio"]
            print(
                f"  the bare loop beside the first variant's server, idle: ratio {b:.3f} (the "
                f"server's background alone); this service against that: {r['ratio'] / b:.3f} "
                "(its per-step work)"
            )
        print("  per timed step, seconds:")
        for k, v in r["per_step_s"].items():
            print(f"  {k:40} {v:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Multi-tenant LoRA training throughput: fused vs sequential vs peft vs a bare-torch floor.

Usage (from the repository root):

    .venv/bin/python benchmarks/multi_tenant.py            # tiny + medium, 1/4/8 tenants
    .venv/bin/python benchmarks/multi_tenant.py --quick    # tiny only, 1/4 tenants, 2 steps
    .venv/bin/python benchmarks/multi_tenant.py --models medium --tenants 8 --json out.json

Every tenant owns one rank-8 LoRA adapter on all targets (q/k/v/o, gate/up/down, lm_head) and, per
step, trains on a batch of B sequences × T tokens with a summed cross-entropy, then takes one AdamW
step. One *step* = every tenant does forward_backward + optim_step. Modes:

* ``fused``      - our backend: one `forward_backward_many` over all tenants (one base GEMM per
                   layer, LoRA per row segment), then each tenant's optim_step;
* ``sequential`` - our backend: tenant by tenant, forward_backward + optim_step;
* ``peft-mixed`` - peft: one PeftModel with one adapter per tenant, the eval-mode mixed batch with
                   ``adapter_names`` (shared/docs/environment.md §5), per-sample losses summed, one
                   backward, one AdamW per adapter;
* ``bare-torch`` - a plain single-tenant peft training loop (train mode, one adapter, one AdamW),
                   run once per tenant one after the other: the floor any system is compared with.

Reported per (model, tenants, mode): aggregate tokens/s (tenants × B × T per step / mean step
time), per-tenant step latency p50/p95 (fused and peft-mixed: every tenant waits for the whole step;
sequential and bare-torch: time from the start of the step until that tenant's optimizer step
finished), and tokens/s relative to ``sequential`` and to ``bare-torch``. Runs on CUDA if available.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from engine.backends.train_transformers import TransformersTrainingBackend  # noqa: E402  (needs the sys.path insert above)
from engine.errors import EngineError  # noqa: E402  (needs the sys.path insert above)
from engine.protocol import AdamParams, DatumInput, ForwardBackwardInput, LoraSpec  # noqa: E402  (needs the sys.path insert above)

MODES = ("fused", "sequential", "peft-mixed", "bare-torch")
RANK = 8
ALPHA = 16.0
LR = 1e-4
LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
]
#: per model: default (B sequences, T tokens) per tenant per step
DEFAULT_SHAPE = {"tiny": (8, 128), "medium": (2, 128), "qwen2.5-0.5b": (4, 512)}
#: Qwen/Qwen2.5-0.5B-Instruct's architecture (its config.json), built with random weights where
#: no hub is reachable (the GPU device): the real model's shapes and FLOPs, not its outputs
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
MEDIUM_DIR_NAME = "medium-qwen2-h512-l8-v2048-seed0"


# ------------------------------------------------------------------------------------- models


def cache_root() -> Path:
    base = os.environ.get("TWINKLE_DATA_DIR")
    return (
        Path(base) / "bench-models"
        if base
        else Path(tempfile.gettempdir()) / "twinkle-bench-models"
    )


def _atomic_build(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        fill(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process finished first
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_medium(out_dir: Path) -> Path:
    """The ~25 M-parameter Qwen2 of shared/docs/environment.md §4 (random init, seed 0)."""

    def fill(tmp: Path) -> None:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=2048,
            tie_word_embeddings=True,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)

    return _atomic_build(out_dir, fill)


def build_from_config(out_dir: Path, fields: dict) -> Path:
    """A Qwen2 with ``fields`` and random weights (seed 0), saved in bfloat16 (half the disk; a
    benchmark loads it in the dtype it measures)."""

    def fill(tmp: Path) -> None:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(Qwen2Config(**fields)).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)

    return _atomic_build(out_dir, fill)


def model_dir(name: str) -> Path:
    root = cache_root()
    if name == "tiny":
        from engine.base_models.tiny import build_tiny

        return build_tiny(root / "tiny-chat")
    if name == "medium":
        return build_medium(root / MEDIUM_DIR_NAME)
    if name == "qwen2.5-0.5b":
        return build_from_config(root / "qwen2.5-0.5b-random-seed0", QWEN25_05B)
    raise SystemExit(f"unknown model {name!r} (known: tiny, medium, qwen2.5-0.5b)")


# ------------------------------------------------------------------------------------- device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"CUDA {torch.cuda.get_device_name(device)}"
    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {name} ({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"


def make_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ------------------------------------------------------------------------------------- data


@dataclass
class TenantBatch:
    ids: torch.Tensor  # int64 [B, T] on the device
    targets: torch.Tensor  # int64 [B, T] on the device
    request: ForwardBackwardInput  # the same data for our backend


def make_batches(
    n_steps: int, tenants: int, b: int, t: int, vocab: int, device: torch.device, seed: int = 0
) -> list[list[TenantBatch]]:
    """batches[step][tenant]; the same data for every mode."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        row = []
        for _ in range(tenants):
            seq = rng.integers(0, vocab, (b, t + 1))
            ids, tgt = seq[:, :-1], seq[:, 1:]
            req = ForwardBackwardInput(
                data=[
                    DatumInput(
                        tokens=ids[i].tolist(), loss_fn_inputs={"target_tokens": tgt[i].copy()}
                    )
                    for i in range(b)
                ],
                loss_fn="cross_entropy",
            )
            row.append(
                TenantBatch(
                    ids=torch.from_numpy(ids.copy()).to(device),
                    targets=torch.from_numpy(tgt.copy()).to(device),
                    request=req,
                )
            )
        out.append(row)
    return out


# ------------------------------------------------------------------------------------- modes

#: a step function returns, per tenant, the seconds from step start until its work finished
StepFn = Callable[[list[TenantBatch]], list[float]]


def _check(results) -> None:
    for r in results:
        if isinstance(r, EngineError):
            raise r


def backend_steps(backend: TransformersTrainingBackend, tenants: int, fused: bool, sync) -> StepFn:
    tag = "f" if fused else "s"
    ids = [f"bench-{tag}{tenants}-{i}" for i in range(tenants)]
    for i, aid in enumerate(ids):
        backend.create_adapter(aid, LoraSpec(rank=RANK, alpha=ALPHA, seed=i))
    adam = AdamParams(learning_rate=LR)

    def fused_step(batches: list[TenantBatch]) -> list[float]:
        t0 = time.perf_counter()
        pairs = [(aid, b.request) for aid, b in zip(ids, batches, strict=True)]
        _check(backend.forward_backward_many(pairs))
        for aid in ids:
            backend.optim_step(aid, adam)
        sync()
        return [time.perf_counter() - t0] * tenants

    def sequential_step(batches: list[TenantBatch]) -> list[float]:
        t0 = time.perf_counter()
        lat = []
        for aid, b in zip(ids, batches, strict=True):
            backend.forward_backward(aid, b.request)
            backend.optim_step(aid, adam)
            sync()
            lat.append(time.perf_counter() - t0)
        return lat

    step = fused_step if fused else sequential_step
    step.cleanup = lambda: [backend.delete_adapter(a) for a in ids]  # type: ignore[attr-defined]
    return step


def _peft_model(
    path: Path, device: torch.device, names: list[str], dtype: torch.dtype = torch.float32
):
    """The base in ``dtype`` with peft adapters (peft keeps them float32 on a bf16 base, as our
    engine does)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=LORA_TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, cfg, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, cfg)
    return model


def _adapter_params(model, name: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


def peft_mixed_steps(
    path: Path, device: torch.device, tenants: int, sync, dtype: torch.dtype = torch.float32
) -> StepFn:
    names = [f"t{i}" for i in range(tenants)]
    model = _peft_model(path, device, names, dtype)
    model.eval()  # training mode refuses adapter_names
    for n, p in model.named_parameters():  # after add_adapter / set_adapter: all adapters trainable
        p.requires_grad_("lora_" in n)
    opts = [torch.optim.AdamW(_adapter_params(model, n), lr=LR) for n in names]
    assert all(o.param_groups[0]["params"] for o in opts)

    def step(batches: list[TenantBatch]) -> list[float]:
        t0 = time.perf_counter()
        ids = torch.cat([b.ids for b in batches])
        tgt = torch.cat([b.targets for b in batches])
        adapter_names = [
            n for n, b in zip(names, batches, strict=True) for _ in range(b.ids.shape[0])
        ]
        logits = model(input_ids=ids, adapter_names=adapter_names, use_cache=False).logits
        # per-sample losses, summed (= the sum over all tokens of the batch)
        loss = _ce_sum(logits, tgt)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        sync()
        return [time.perf_counter() - t0] * tenants

    step.cleanup = lambda: None  # type: ignore[attr-defined]
    step.model = model  # type: ignore[attr-defined]  # kept alive until the mode is done
    return step


def bare_torch_steps(
    path: Path, device: torch.device, tenants: int, sync, dtype: torch.dtype = torch.float32
) -> StepFn:
    model = _peft_model(path, device, ["default"], dtype)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step(batches: list[TenantBatch]) -> list[float]:
        t0 = time.perf_counter()
        lat = []
        for b in batches:  # the single-tenant loop, once per tenant
            logits = model(input_ids=b.ids, use_cache=False).logits
            _ce_sum(logits, b.targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            lat.append(time.perf_counter() - t0)
        return lat

    step.cleanup = lambda: None  # type: ignore[attr-defined]
    step.model = model  # type: ignore[attr-defined]
    return step


# ------------------------------------------------------------------------------------- runner


@dataclass
class Row:
    model: str
    tenants: int
    mode: str
    batch: int
    seq_len: int
    steps: int
    tokens_per_s: float
    step_s_mean: float
    latency_p50_s: float
    latency_p95_s: float
    step_times_s: list[float] = field(default_factory=list)
    #: CPU cores used by other processes during the timed steps (None: not measurable)
    other_load: float | None = None
    #: timed attempts (> 1: earlier ones were disturbed by other processes)
    attempts: int = 1
    vs_sequential: float | None = None
    vs_bare_torch: float | None = None


class OtherLoad:
    """CPU used by *other* processes while a block runs, in cores (Linux /proc/stat; None
    elsewhere). On a small shared machine a concurrent job skews every number, so each timed
    block is checked and, if disturbed, rerun (see --retries)."""

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @classmethod
    def _busy_s(cls) -> float | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        except OSError:
            return None
        v = [int(x) for x in fields]  # user nice system idle iowait irq softirq steal
        return (sum(v) - v[3] - v[4]) / cls.HZ

    def __enter__(self) -> Self:
        self.cores: float | None = None
        self._busy0, self._own0, self._t0 = self._busy_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy1 = self._busy_s()
        wall = time.perf_counter() - self._t0
        if self._busy0 is not None and busy1 is not None and wall > 0:
            other = (busy1 - self._busy0) - (_own_cpu_s() - self._own0)
            self.cores = max(0.0, other / wall)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def wait_until_quiet(max_load: float, timeout_s: float = 120.0, window_s: float = 2.0) -> None:
    """Sleep until other processes use at most ``max_load`` cores over ``window_s`` (or timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with OtherLoad() as load:
            time.sleep(window_s)
        if load.cores is None or load.cores <= max_load:
            return


def run_mode(step: StepFn, batches: list[list[TenantBatch]], sync):
    """One untimed warm-up step, then the timed steps: (step times, per-tenant latencies, load)."""
    step(batches[0])
    step_times, lat = [], []
    with OtherLoad() as load:
        for row in batches[1:]:
            sync()
            t0 = time.perf_counter()
            lat += step(row)
            step_times.append(time.perf_counter() - t0)
    return step_times, lat, load.cores


def bench_model(
    name: str,
    tenants_list: list[int],
    modes: list[str],
    steps: int,
    b: int,
    t: int,
    device: torch.device,
    log,
    retries: int = 0,
    max_other_load: float = 0.15,
    dtype: torch.dtype = torch.float32,
) -> list[Row]:
    path = model_dir(name)
    sync = make_sync(device)
    backend = TransformersTrainingBackend(str(path), max_lora_rank=RANK, device=device, dtype=dtype)
    vocab = backend.vocab_size
    rows: list[Row] = []
    for tenants in tenants_list:
        batches = make_batches(steps + 1, tenants, b, t, vocab, device)
        tokens_per_step = tenants * b * t
        for mode in modes:
            if mode in ("fused", "sequential"):
                step = backend_steps(backend, tenants, mode == "fused", sync)
            elif mode == "peft-mixed":
                step = peft_mixed_steps(path, device, tenants, sync, dtype)
            else:
                step = bare_torch_steps(path, device, tenants, sync, dtype)
            try:
                for attempt in range(1, retries + 2):
                    times, lat, load = run_mode(step, batches, sync)
                    if load is None or load <= max_other_load or attempt > retries:
                        break
                    log(
                        f"  {name} tenants={tenants} {mode}: other processes used {load:.2f} "
                        f"cores, retrying ({attempt}/{retries})"
                    )
                    wait_until_quiet(max_other_load)
            finally:
                step.cleanup()  # type: ignore[attr-defined]
                del step
                gc.collect()
            mean = statistics.fmean(times)
            tps = tokens_per_step / mean
            p50, p95 = (float(np.percentile(lat, q)) for q in (50, 95))
            rows.append(
                Row(name, tenants, mode, b, t, steps, tps, mean, p50, p95, times, load, attempt)
            )
            log(
                f"  {name:6} tenants={tenants:<2} {mode:11} {tps:10.0f} tok/s  "
                f"step {mean:.3f}s  p50 {p50:.3f}s p95 {p95:.3f}s  others {_load(load)}"
            )
        by_mode = {r.mode: r for r in rows if r.tenants == tenants}
        for r in by_mode.values():
            if "sequential" in by_mode:
                r.vs_sequential = r.tokens_per_s / by_mode["sequential"].tokens_per_s
            if "bare-torch" in by_mode:
                r.vs_bare_torch = r.tokens_per_s / by_mode["bare-torch"].tokens_per_s
    del backend
    gc.collect()
    return rows


def _load(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_table(rows: list[Row]) -> str:
    head = [
        "model",
        "tenants",
        "B×T",
        "mode",
        "tokens/s",
        "step s",
        "p50 lat s",
        "p95 lat s",
        "vs sequential",
        "vs bare-torch",
        "other CPU",
    ]

    def ratio(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}×"

    body = [
        [
            r.model,
            str(r.tenants),
            f"{r.batch}×{r.seq_len}",
            r.mode,
            f"{r.tokens_per_s:,.0f}",
            f"{r.step_s_mean:.3f}",
            f"{r.latency_p50_s:.3f}",
            f"{r.latency_p95_s:.3f}",
            ratio(r.vs_sequential),
            ratio(r.vs_bare_torch),
            _load(r.other_load) + ("" if r.attempts == 1 else f" ({r.attempts} tries)"),
        ]
        for r in rows
    ]
    right = {1, 4, 5, 6, 7, 8, 9, 10}
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(head), sep, *(line(row) for row in body)])


def _quiet_libraries() -> None:
    """No weight-loading progress bars or known, harmless warnings between the log lines."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # peft: LoRA on a tied lm_head is fine for training (we never merge); transformers 5 warns
    # about a deprecated attribute peft reads.
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="tiny,medium",
        help="comma-separated: tiny, medium, qwen2.5-0.5b (random weights, the real shapes)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the base weights' dtype, ours and peft's (default: bfloat16 on CUDA, else float32)",
    )
    p.add_argument("--tenants", default="1,4,8", help="comma-separated tenant counts")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after 1 warm-up)")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES)
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per tenant per step (default: 8 for tiny, 2 for medium)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="rerun a mode's timed steps up to this many times when other processes used more "
        "than --max-other-load cores meanwhile (default 2)",
    )
    p.add_argument("--max-other-load", type=float, default=0.15, help="see --retries (cores)")
    p.add_argument("--quick", action="store_true", help="tiny only, tenants 1,4, 2 steps")
    p.add_argument("--json", metavar="OUT", help="also write the rows and metadata as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.tenants, args.steps = "tiny", "1,4", 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    tenants = _ints(args.tenants)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"unknown mode(s) {bad}")
    if args.steps < 1 or not tenants or min(tenants) < 1:
        p.error("--steps and every tenant count must be >= 1")

    torch.set_num_threads(args.threads)
    _quiet_libraries()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = _dt.datetime.now(_dt.UTC)
    meta = {
        "date": started.isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_before": os.getloadavg(),
        "args": vars(args),
    }
    meta["dtype"] = dtype_name
    print(f"device: {meta['device']}, base weights {dtype_name}")
    print(
        f"torch {torch.__version__}, load average before: "
        + ", ".join(f"{x:.2f}" for x in meta["load_avg_before"])
    )
    if args.retries > 0:
        wait_until_quiet(args.max_other_load)
    rows: list[Row] = []
    t_start = time.perf_counter()
    for m in models:
        b0, t0 = DEFAULT_SHAPE.get(m, (2, 128))
        rows += bench_model(
            m,
            tenants,
            modes,
            args.steps,
            args.batch or b0,
            args.seq_len or t0,
            device,
            log,
            args.retries,
            args.max_other_load,
            dtype,
        )
    meta["wall_s"] = time.perf_counter() - t_start
    meta["load_avg_after"] = os.getloadavg()
    print()
    print(format_table(rows))
    print(
        f"\n{args.steps} timed steps per mode after 1 warm-up; wall time {meta['wall_s']:.0f} s; "
        "load average after: " + ", ".join(f"{x:.2f}" for x in meta["load_avg_after"])
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Megatron backend vs Transformers backend, fused vs sequential, in one run. (Not named
megatron.py: run as a script, benchmarks/ is on sys.path and would shadow the megatron package.)

Usage (from the repository root):

    .venv/bin/python benchmarks/megatron_backend.py           # tiny + medium (25 M), 4 tenants
    .venv/bin/python benchmarks/megatron_backend.py --quick   # tiny only, 2 timed steps
    .venv/bin/python benchmarks/megatron_backend.py --models medium --tenants 1 4 --steps 5

Same workload as benchmarks/multi_tenant.py (whose models, data and step functions this reuses):
every tenant owns a rank-8 LoRA on all targets and per step trains on B sequences x T tokens
(summed cross-entropy) and takes one AdamW step. Backends: ``transformers``
(`TransformersTrainingBackend`) and ``megatron`` (`MegatronTrainingBackend` at one rank: the
frozen megatron-core GPTModel with our multi-LoRA hooks, through megatron's forward-backward
schedule). Modes: ``fused`` (one forward_backward_many over all tenants) and ``sequential``.
Reported: aggregate tokens/s, ratios to the Transformers backend in the same mode and to the same
backend's sequential mode, load time, and ``other CPU`` (cores other processes used during the
timed steps: on a small shared machine a concurrent job spoils the numbers). Float32 on CPU; on
CUDA, pass ``--bf16`` for bf16 base weights on the Megatron backend (the Transformers backend
keeps its own dtype).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from multi_tenant import (  # noqa: E402  (benchmarks/ on sys.path above)
    DEFAULT_SHAPE,
    backend_steps,
    device_name,
    make_batches,
    make_sync,
    model_dir,
    run_mode,
)

from engine.backends.train_transformers import TransformersTrainingBackend  # noqa: E402


def build(backend: str, path: Path, bf16: bool):
    if backend == "transformers":
        return TransformersTrainingBackend(str(path))
    from engine.backends.megatron.backend import MegatronTrainingBackend

    dtype = "bfloat16" if bf16 else "float32"
    return MegatronTrainingBackend(str(path), params_dtype=dtype)


def bench(models: list[str], tenants_list: list[int], steps: int, bf16: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = make_sync(device)
    rows = []
    for name in models:
        path = model_dir(name)
        b, t = DEFAULT_SHAPE[name]
        vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        for backend in ("transformers", "megatron"):
            t0 = time.perf_counter()
            be = build(backend, path, bf16)
            load_s = time.perf_counter() - t0
            for tenants in tenants_list:
                batches = make_batches(steps + 1, tenants, b, t, vocab, device)
                for mode in ("fused", "sequential"):
                    step = backend_steps(be, tenants, mode == "fused", sync)  # type: ignore[arg-type]
                    times, _, load = run_mode(step, batches, sync)
                    step.cleanup()  # type: ignore[attr-defined]
                    mean = statistics.mean(times)
                    rows.append(
                        {
                            "model": name,
                            "tenants": tenants,
                            "backend": backend,
                            "mode": mode,
                            "tok_s": tenants * b * t / mean,
                            "step_s": mean,
                            "load_s": load_s,
                            "other_load": load,
                        }
                    )
                    print(
                        f"  {name} x{tenants} {backend:12s} {mode:10s} "
                        f"{rows[-1]['tok_s']:9.0f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
            close = getattr(be, "close", None)
            if close:
                close()
            del be
            gc.collect()
    return rows


def _load(cores: float | None) -> str:
    return "n/a" if cores is None else f"{cores:.2f}"


def table(rows: list[dict]) -> str:
    def find(r: dict, **kw) -> dict:
        return next(x for x in rows if all(x[k] == v for k, v in {**r, **kw}.items()))

    head = (
        "| model | tenants | backend | mode | tokens/s | step s | vs transformers (same mode) "
        "| vs own sequential | load s | other CPU |"
    )
    out = [head, "|" + "---|" * 10]
    for r in rows:
        key = {"model": r["model"], "tenants": r["tenants"]}
        tf = find(key, backend="transformers", mode=r["mode"])
        seq = find(key, backend=r["backend"], mode="sequential")
        out.append(
            f"| {r['model']} | {r['tenants']} | {r['backend']} | {r['mode']} | "
            f"{r['tok_s']:.0f} | {r['step_s']:.3f} | {r['tok_s'] / tf['tok_s']:.2f}x | "
            f"{r['tok_s'] / seq['tok_s']:.2f}x | {r['load_s']:.1f} | {_load(r['other_load'])} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=["tiny", "medium"])
    p.add_argument("--tenants", nargs="+", type=int, default=[4])
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode (after 1 warm-up)")
    p.add_argument("--bf16", action="store_true", help="bf16 Megatron base weights (CUDA only)")
    p.add_argument("--quick", action="store_true", help="tiny only, 2 timed steps")
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.steps = ["tiny"], 2
    if a.bf16 and not torch.cuda.is_available():
        p.error("--bf16 needs CUDA (the Megatron backend refuses bfloat16 on CPU)")
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device_name(dev)}; rank-8 LoRA on all targets; shapes {DEFAULT_SHAPE}")
    print(table(bench(a.models, a.tenants, a.steps, a.bf16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

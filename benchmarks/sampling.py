"""Multi-tenant sampling throughput: batched `sample_many` vs one-by-one `sample` vs HF generate.

Usage (from the repository root):

    .venv/bin/python benchmarks/sampling.py                       # tiny model, 16 requests
    .venv/bin/python benchmarks/sampling.py --requests 1,4,16,64  # several concurrency levels
    .venv/bin/python benchmarks/sampling.py --model-dir /path/to/hf-folder --json out.json

N concurrent greedy requests (prompts of different lengths, 6 to ~30 tokens) spread round-robin
over 4 rank-8 LoRA adapters (all targets, random non-zero B, saved as PEFT checkpoints with
engine.backends.lora.save_adapter), max_tokens 32 each, EOS ignored so every request generates
exactly max_tokens. Modes, each timed as the wall time to finish all N requests:

* ``batched``    - `TorchSamplingBackend.sample_many(all N)`: one decode loop, rows routed to
                   their adapter by LoRA segments, one shared KV cache;
* ``one-by-one`` - `TorchSamplingBackend.sample` per request, one after the other;
* ``hf-generate``- plain ``model.generate`` (greedy, KV cache) per request, one after the other,
                   on a peft-merged copy of the request's adapter (merging happens before timing:
                   this is the fastest plain-HF single-adapter path, with no LoRA overhead; a
                   tied lm_head is untied first, else merging its LoRA would also change the
                   input embeddings);
* ``service``    - the `Sampler` service: N concurrent ``await sample()`` calls, which its worker
                   coalesces into batches (includes the queueing and thread hand-off).

Reported: aggregate generated tokens/s (N x max_tokens / median wall time over --repeats timed
runs after one warm-up), ratios vs one-by-one, and whether every mode produced the same tokens as
one-by-one. Each timed run also measures the CPU that *other* processes used meanwhile
("other load", in cores; Linux only): on a small shared machine that number says whether the
timings can be trusted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Self

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from engine.backends.lora import adapter_parameters, add_adapter, inject_multi_lora, save_adapter  # noqa: E402  (needs the sys.path insert above)
from engine.backends.sample_torch import TorchSamplingBackend  # noqa: E402  (needs the sys.path insert above)
from engine.protocol import LoraSpec, SampleInput, SampleOutput, SamplingParams  # noqa: E402  (needs the sys.path insert above)
from engine.sampler import Sampler  # noqa: E402  (needs the sys.path insert above)

MODES = ("batched", "one-by-one", "hf-generate", "service")
PROMPTS = [
    "User: what is 12 plus 13? Assistant:",
    "User: hi",
    "User: describe Alice's pet. Assistant:",
    "User: what is the capital of France? Assistant: The capital of France is",
    (
        "User: tell me a long story about a red cat that likes to sleep in the sun, please. "
        "Assistant: Once upon a time"
    ),
    "Alice has a",
    "User: what is 7 times 6? Assistant:",
    "User: name three colours. Assistant: Red,",
]


# ------------------------------------------------------------------------------------- setup


def device_name() -> str:
    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {name} ({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inject_multi_lora(model)
    dirs = []
    for i in range(count):
        spec = LoraSpec(rank=rank, alpha=2.0 * rank, seed=100 + i)
        add_adapter(model, f"a{i}", spec)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for k, p in adapter_parameters(model, f"a{i}").items():
                if "lora_B" in k:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        d = out / f"adapter-{i}"
        d.mkdir(parents=True)
        save_adapter(model, f"a{i}", spec, d)
        dirs.append(d)
    return dirs


def make_requests(tok, adapters: list[Path], n: int, max_tokens: int) -> list[SampleInput]:
    return [
        SampleInput(
            prompt_tokens=tok(PROMPTS[i % len(PROMPTS)])["input_ids"],
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_at_eos=False),
            adapter_dir=str(adapters[i % len(adapters)]),
        )
        for i in range(n)
    ]


def merged_models(model_dir: Path, adapters: list[Path]) -> dict[str, torch.nn.Module]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}
    for d in adapters:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        head, emb = base.get_output_embeddings(), base.get_input_embeddings()
        if head is not None and head.weight is emb.weight:
            # merging an lm_head LoRA into a tied head would also change the input embeddings
            head.weight = torch.nn.Parameter(emb.weight.detach().clone())
            base.config.tie_word_embeddings = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = PeftModel.from_pretrained(base, str(d)).merge_and_unload().eval()
        m.generation_config.eos_token_id = None  # like stop_at_eos=False: always max_tokens
        m.generation_config.pad_token_id = 0
        models[str(d)] = m
    return models


# ------------------------------------------------------------------------------------- timing


class OtherLoad:
    """CPU used by other processes while a block runs, in cores (Linux /proc/stat; else None)."""

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @classmethod
    def _busy_s(cls) -> float | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        except OSError:
            return None
        v = [int(x) for x in fields]
        return (sum(v) - v[3] - v[4]) / cls.HZ

    def __enter__(self) -> Self:
        self.cores: float | None = None
        t = os.times()
        self._own0, self._busy0, self._t0 = t.user + t.system, self._busy_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy1, wall = self._busy_s(), time.perf_counter() - self._t0
        t = os.times()
        if self._busy0 is not None and busy1 is not None and wall > 0:
            other = (busy1 - self._busy0) - (t.user + t.system - self._own0)
            self.cores = max(0.0, other / wall)


def timed(fn: Callable[[], list[list[int]]], repeats: int):
    fn()  # warm-up
    times, loads, tokens = [], [], None
    for _ in range(repeats):
        with OtherLoad() as load:
            t0 = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - t0)
        loads.append(load.cores)
    return times, loads, tokens


def _tokens(outs: list[SampleOutput]) -> list[list[int]]:
    return [o.sequences[0].tokens for o in outs]


def run_mode(
    mode: str,
    model_dir: str,
    adapters: list[str],
    ns: list[int],
    max_tokens: int,
    repeats: int,
    threads: int,
) -> dict[int, dict]:
    """Time one mode for every N, in this (fresh) process: {N: times, loads, tokens[, stats]}."""
    if threads:
        torch.set_num_threads(threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    paths = [Path(a) for a in adapters]
    svc: Sampler | None = None
    backend = merged = None
    if mode == "service":
        # built by the service's own worker thread, as in production: this process's main thread
        # runs no torch op (a second thread with its own OpenMP team would slow the worker down)
        svc = Sampler({"name": "bench", "path": model_dir}, "")
    elif mode == "hf-generate":
        merged = merged_models(Path(model_dir), paths)
    else:
        backend = TorchSamplingBackend(model_dir)
    out: dict[int, dict] = {}
    try:
        for n in ns:
            reqs = make_requests(tok, paths, n, max_tokens)

            async def _service_all(reqs=reqs):
                return await asyncio.gather(*(svc.sample(r) for r in reqs))

            def hf_generate(reqs=reqs) -> list[list[int]]:
                res = []
                for r in reqs:
                    ids = torch.tensor([r.prompt_tokens])
                    with torch.no_grad():
                        g = merged[r.adapter_dir].generate(
                            input_ids=ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=r.params.max_tokens,
                            do_sample=False,
                        )
                    res.append(g[0, ids.shape[1] :].tolist())
                return res

            fn = {
                "batched": lambda reqs=reqs: _tokens(backend.sample_many(reqs)),
                "one-by-one": lambda reqs=reqs: _tokens([backend.sample(r) for r in reqs]),
                "hf-generate": hf_generate,
                "service": lambda: _tokens(asyncio.run(_service_all())),
            }[mode]
            before = asyncio.run(svc.stats()) if svc else None
            times, loads, tokens = timed(fn, repeats)
            out[n] = {"times_s": times, "other_load_cores": loads, "tokens": tokens}
            if svc is not None:
                after = asyncio.run(svc.stats())
                batches = after["batches"] - before["batches"]
                out[n]["stats"] = {
                    "batches": batches,
                    "runs": repeats + 1,
                    "mean_batch_rows": (after["rows"] - before["rows"]) / max(1, batches),
                }
    finally:
        if svc is not None:
            svc.close()
    return out


def run_mode_isolated(*args) -> dict[int, dict]:
    """`run_mode` in a fresh spawned process, so modes do not share torch thread pools."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(run_mode, *args).result()


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", help="local HF model folder (default: the tiny model)")
    ap.add_argument("--requests", default="16", help="comma-separated N values (default 16)")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    if "one-by-one" not in modes:
        modes.append("one-by-one")  # the reference of the ratios
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)} (known: {', '.join(MODES)})")

    with tempfile.TemporaryDirectory(prefix="twinkle-sampling-bench-") as tmp:
        if args.model_dir:
            model_dir, model_name = Path(args.model_dir), Path(args.model_dir).name
        else:
            from engine.base_models.tiny import build_tiny

            model_dir, model_name = build_tiny(Path(tmp) / "tiny-chat"), "tiny-chat"
        adapters = make_adapters(model_dir, Path(tmp) / "adapters", args.adapters, args.rank)
        ns = [int(x) for x in args.requests.split(",")]
        by_mode = {
            mode: run_mode_isolated(
                mode,
                str(model_dir),
                [str(a) for a in adapters],
                ns,
                args.max_tokens,
                args.repeats,
                args.threads,
            )
            for mode in modes
        }
        rows, raw = [], []
        for n in ns:
            res = {mode: by_mode[mode][n] for mode in modes}
            ref = res["one-by-one"]
            ref_tps = n * args.max_tokens / statistics.median(ref["times_s"])
            for mode in modes:
                r = res[mode]
                med = statistics.median(r["times_s"])
                tps = n * args.max_tokens / med
                loads = [x for x in r["other_load_cores"] if x is not None]
                rows.append(
                    (
                        model_name,
                        n,
                        mode,
                        f"{med:.3f}",
                        f"{tps:,.0f}",
                        f"{tps / ref_tps:.2f}x",
                        "yes" if r["tokens"] == ref["tokens"] else "NO",
                        f"{max(loads):.2f}" if loads else "n/a",
                    )
                )
                raw.append(
                    {
                        "model": model_name,
                        "requests": n,
                        "mode": mode,
                        "times_s": r["times_s"],
                        "tokens_per_s": tps,
                        "vs_one_by_one": tps / ref_tps,
                        "same_tokens_as_one_by_one": r["tokens"] == ref["tokens"],
                        "other_load_cores": r["other_load_cores"],
                        **({"service_stats": r["stats"]} if "stats" in r else {}),
                    }
                )
    head = (
        "| model | N | mode | wall s (median) | gen tokens/s | vs one-by-one "
        "| same tokens | other load (cores, max) |"
    )
    print(
        f"\n{_dt.date.today().isoformat()} · {device_name()} · torch {torch.__version__} · "
        f"{args.adapters} adapters (rank {args.rank}) · max_tokens {args.max_tokens} · greedy · "
        f"median of {args.repeats}\n"
    )
    print(head)
    print("|" + "---|" * 8)
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    for r in raw:
        if "service_stats" in r:
            st = r["service_stats"]
            print(
                f"\nservice, N={r['requests']}: {st['batches']} batches over {st['runs']} runs, "
                f"mean {st['mean_batch_rows']:.1f} rows/batch",
                end="",
            )
    print()
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

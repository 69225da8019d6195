"""One rank of a Megatron Trainer replica: its stage of the frozen base, its adapter shards,
their AdamW states, and the passes, steps and checkpoints it runs in step with the other ranks.

Every rank runs the same public method with the same arguments (SPMD; engine/backends/megatron/
backend.py fans calls out), so every method either raises the same UserInputError on every
rank before any collective (validation is deterministic) or takes part in all collectives.

Passes go through megatron's own schedule (``get_forward_backward_func``: no pipelining, or
1F1B across stages) with ``calculate_per_token_loss=True`` and a loss function returning
``(loss_sum, n, {})``, so the schedule divides by nothing and Tinker's sum semantics hold. The
LoRA routing is set per micro-batch inside ``forward_step``. Log-probabilities come from the
vocab-parallel logits (``vocab_parallel_cross_entropy``; the full vocabulary is never gathered).
The losses (engine/backends/losses.py) run unchanged on the last stage, whose outputs are then
broadcast, so every rank returns the same result.

Gradients stay with the shards: the global norm sums squares of sharded tensors over the TP
group once per shard and replicated tensors once (TP rank 0), then over the pipeline stages.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch
from torch import nn

from engine.backends import custom_loss, losses
from engine.backends.megatron import compat
from engine.backends.megatron.arch import read_arch
from engine.backends.megatron.checkpoints import WorkerCheckpoints
from engine.backends.megatron.model import causal_mask, load_base
from engine.backends.megatron.multi_lora import MegatronMultiLora, Segment
from engine.backends.train_batching import micro_batches, pad_rows, validate_request
from engine.backends.train_common import (
    AdapterPass,
    TrainableAdapter,
    check_spec,
    device_fingerprint,
)
from engine.errors import UserInputError
from engine.protocol import (
    ForwardBackwardInput,
    LoraSpec,
)

Row = tuple[int, int]  # (job index, datum index)


@dataclass
class _MicroBatch:
    rows: list[Row]
    ids: torch.Tensor  # [B, T] right-padded
    targets: torch.Tensor  # [B, T, K]
    segments: list[Segment]


def _pad_id(model_dir: str) -> int:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    pad = cfg.get("pad_token_id")
    if pad is None:
        pad = cfg.get("eos_token_id")
    if isinstance(pad, list):
        pad = pad[0] if pad else 0
    return int(pad or 0)


class MegatronWorker(WorkerCheckpoints):
    """One rank (``rank`` of ``tp × pp``) of a Megatron Trainer replica."""

    def __init__(
        self,
        model_dir: str,
        *,
        tp: int = 1,
        pp: int = 1,
        rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        max_lora_rank: int = 64,
        base_model_name: str = "",
        micro_batch_tokens: int = 16384,
        params_dtype: str = "float32",
        recompute: str = "none",
        loss_limits: custom_loss.LossLimits | None = None,
    ) -> None:
        compat.require_megatron()
        self.loss_limits = loss_limits or custom_loss.LossLimits()
        self.arch = read_arch(model_dir, tp=tp, pp=pp)
        compat.init_parallel(
            tp, pp, rank=rank, world_size=tp * pp, master_addr=master_addr, master_port=master_port
        )
        from megatron.core import parallel_state as ps

        self._ps = ps
        self.tp, self.pp, self.rank, self.world_size = tp, pp, rank, tp * pp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.last_stage = self.pp_rank == pp - 1
        self.model = load_base(
            model_dir, self.arch, dtype=getattr(torch, params_dtype), recompute=recompute
        )
        self.device = next(self.model.parameters()).device
        self.lora = MegatronMultiLora(self.model, self.arch, pp_rank=self.pp_rank, pp=pp)
        self.vocab_size = self.arch.vocab_size
        self.max_positions = self.arch.max_positions
        self.max_lora_rank = int(max_lora_rank)
        self.base_model_name = base_model_name or str(model_dir)
        self.pad_id = _pad_id(model_dir)
        self.max_batch_tokens = int(micro_batch_tokens)
        self._adapters: dict[str, TrainableAdapter] = {}
        # Keeps a stage's output in the autograd graph when no adapter parameter of this stage
        # is (an lm_head-only adapter, disable_lora rows): megatron's backward needs a graph.
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        # The rank whose results every rank returns: the last stage's first TP rank (megatron
        # orders ranks tp-fastest: rank = pp_rank·tp + tp_rank).
        self.output_rank = (pp - 1) * tp

    # ------------------------------------------------------------------------------- adapters

    def _attach(self, adapter_id: str, spec: LoraSpec) -> dict[str, nn.Parameter]:
        self.lora.add_adapter(adapter_id, spec, device=self.device)
        return self.lora.parameters(adapter_id)

    def _detach(self, adapter_id: str) -> None:
        self.lora.remove_adapter(adapter_id)

    def _check_spec(self, spec: LoraSpec, error: type[Exception]) -> None:
        check_spec(spec, self.max_lora_rank, self.base_model_name, error)

    def device_fingerprint(self) -> dict:
        """This rank's device and numerics; the split (tp x pp) and the micro-batch size change
        a timing too (ranks are packed on one node, so rank 0 speaks for all)."""
        dtype = next(self.model.parameters()).dtype
        shape = f"{self.arch!r} tp={self.tp} pp={self.pp} micro={self.max_batch_tokens}"
        return {"backend": "megatron", **device_fingerprint(self.device, dtype, shape)}

    # ------------------------------------------------------------------------------- passes

    def _validate(self, inp: ForwardBackwardInput):
        req = validate_request(inp, self.vocab_size, self.max_positions, None, self.loss_limits)
        if req.loss.embedding:
            raise UserInputError(
                "loss_fn: embedding losses (task='embedding') are not supported by the "
                "Megatron backend; serve this model with backend 'transformers'"
            )
        return req

    def validate_input(self, inp: ForwardBackwardInput) -> list[int]:
        return custom_loss.extra_tokens(self._validate(inp))

    def _prepare(self, slot: int, adapter_id: str, inp: ForwardBackwardInput) -> AdapterPass:
        self._get(adapter_id)
        req = self._validate(inp)
        return AdapterPass(slot, adapter_id, req, outputs=[{} for _ in req.data])

    def _execute(self, jobs: list[AdapterPass], *, grad: bool) -> None:
        """Run ``jobs`` (distinct adapters) as micro-batches through megatron's schedule; with
        ``grad``, add each loss's gradient to its adapter's (all or nothing)."""
        units = [(j, u) for j, job in enumerate(jobs) for u in job.req.units]
        lengths = [[jobs[j].req.data[i].tokens.shape[0] for i in u] for j, u in units]
        batches = [
            [(j, i) for k in mb for j, i in ((units[k][0], i) for i in units[k][1])]
            for mb in micro_batches(lengths, self.max_batch_tokens)
        ]
        # A gradient pending from earlier calls is set aside and added back at the end, so a
        # failure half-way leaves it exactly as it was.
        stash = [(p, p.grad) for j in jobs for p in self._get(j.adapter_id).params.values()]
        if grad:
            for p, _ in stash:
                p.grad = None
        try:
            refs = self._reference_logprobs(jobs, batches)
            self._run(
                [self._micro_batch(jobs, rows, lora=True) for rows in batches],
                forward_only=not grad,
                on_logprobs=lambda mb, lp: self._losses(jobs, mb, lp, refs),
            )
            self._broadcast_results(jobs)
        except BaseException:
            if grad:
                for p, g in stash:
                    p.grad = g
            raise
        finally:
            self._anchor.grad = None
        if grad:
            with torch.no_grad():
                for p, g in stash:
                    if g is not None:
                        p.grad = g if p.grad is None else g.add_(p.grad)
            for j in jobs:
                self._get(j.adapter_id).has_grad = True

    def _micro_batch(self, jobs: list[AdapterPass], rows: list[Row], *, lora: bool) -> _MicroBatch:
        datums = [jobs[j].req.data[i] for j, i in rows]
        ids, _, targets = pad_rows(datums, self.pad_id, self.device)
        segments: list[Segment] = []
        start = 0
        for j, group in groupby(rows, key=lambda row: row[0]):
            n = len(list(group))
            if lora and not jobs[j].req.disable_lora:
                segments.append((jobs[j].adapter_id, start, start + n))
            start += n
        return _MicroBatch(rows, ids, targets, segments)

    def _reference_logprobs(self, jobs: list[AdapterPass], batches: list[list[Row]]):
        """The base model's logprobs of DPO rows without given ``ref_logprobs`` (no gradient;
        one forward-only pass of their own), by row; filled on the last stage only."""
        need = [
            (j, i)
            for rows in batches
            for j, i in rows
            if jobs[j].req.loss.paired and "ref_logprobs" not in jobs[j].req.data[i].inputs
        ]
        refs: dict[Row, torch.Tensor] = {}
        if not need:
            return refs
        lengths = [[jobs[j].req.data[i].tokens.shape[0]] for j, i in need]
        ref_batches = [
            [need[k] for k in mb] for mb in micro_batches(lengths, self.max_batch_tokens)
        ]

        def keep(mb: _MicroBatch, lp: torch.Tensor) -> torch.Tensor:
            for r, (j, i) in enumerate(mb.rows):
                refs[(j, i)] = lp[r, : jobs[j].req.data[i].tokens.shape[0], 0].detach()
            return lp.new_zeros(())

        with torch.no_grad():
            self._run(
                [self._micro_batch(jobs, rows, lora=False) for rows in ref_batches],
                forward_only=True,
                on_logprobs=keep,
            )
        return refs

    def _losses(
        self, jobs: list[AdapterPass], mb: _MicroBatch, lp: torch.Tensor, refs
    ) -> torch.Tensor:
        """Sum of the losses of the jobs' rows in ``mb`` (last stage), outputs written."""
        total = lp.new_zeros(())
        start = 0
        for j, group in groupby(mb.rows, key=lambda row: row[0]):
            idx = [i for _, i in group]
            job = jobs[j]
            lps = [
                lp[start + k, : d.targets.shape[0], : d.targets.shape[1]]
                for k, d in enumerate(job.req.data[i] for i in idx)
            ]
            ref = [refs.get((j, i)) for i in idx]
            run = custom_loss.request_loss if job.req.custom else losses.request_loss
            total = total + run(job.req, idx, lps, ref, job.outputs, job.metrics, self.device)
            start += len(idx)
        return total

    def _target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(targets) [B, T, K] from this rank's vocabulary slice of the logits."""
        if self.tp == 1:
            logits = logits.float()
            return logits.gather(-1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        K = targets.shape[-1]
        cols = [  # it subtracts the max in place: a copy per column when there are several
            -vocab_parallel_cross_entropy(
                (logits if K == 1 else logits.clone()).float(), targets[..., k]
            )
            for k in range(K)
        ]
        return torch.stack(cols, dim=-1)

    def _run(
        self,
        batches: list[_MicroBatch],
        *,
        forward_only: bool,
        on_logprobs: Callable[[_MicroBatch, torch.Tensor], torch.Tensor],
    ) -> None:
        """``batches`` through megatron's schedule; ``on_logprobs(mb, logprobs)`` on the last
        stage returns the micro-batch's loss (backpropagated unless ``forward_only``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not batches:
            return
        if self.pp > 1:  # p2p buffers have one shape per schedule: pad every micro-batch to it
            batches = self._uniform(batches)
        B, T = batches[0].ids.shape

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            b, t = mb.ids.shape
            pos = torch.arange(t, device=self.device)[None].expand(b, t)
            with self.lora.routing(mb.segments):
                out = model(
                    input_ids=mb.ids, position_ids=pos, attention_mask=causal_mask(t, self.device)
                )
            if not forward_only and not out.requires_grad:
                out = out + self._anchor

            def loss_func(logits: torch.Tensor):
                loss = on_logprobs(mb, self._target_logprobs(logits, mb.targets))
                if not forward_only and not loss.requires_grad:
                    loss = loss + self._anchor
                return loss, torch.ones((), dtype=torch.int), {}

            return out, loss_func

        with torch.set_grad_enabled(not forward_only):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[self.model],
                num_microbatches=len(batches),
                seq_length=T,
                micro_batch_size=B,
                forward_only=forward_only,
            )

    def _uniform(self, batches: list[_MicroBatch]) -> list[_MicroBatch]:
        B = max(mb.ids.shape[0] for mb in batches)
        T = max(mb.ids.shape[1] for mb in batches)
        K = max(mb.targets.shape[2] for mb in batches)
        out = []
        for mb in batches:
            b, t, k = mb.targets.shape
            ids = mb.ids.new_full((B, T), self.pad_id)
            ids[:b, :t] = mb.ids
            tgt = mb.targets.new_zeros((B, T, K))
            tgt[:b, :t, :k] = mb.targets
            out.append(_MicroBatch(mb.rows, ids, tgt, mb.segments))  # extra rows: no segment
        return out

    def _broadcast_results(self, jobs: list[AdapterPass]) -> None:
        """The last stage computed the outputs and metrics: every rank returns them."""
        if self.pp == 1:
            return
        payload = [[(job.outputs, job.metrics.parts) for job in jobs]]
        torch.distributed.broadcast_object_list(payload, src=self.output_rank)
        for job, (outputs, parts) in zip(jobs, payload[0], strict=True):
            job.outputs[:] = outputs
            job.metrics.parts = parts

    # ------------------------------------------------------------------------------- optimizer

    def _grad_norm(self, st: TrainableAdapter, grads: Sequence[torch.Tensor | None]) -> float:
        """Global L2 norm of the adapter's gradient over every rank: a sharded tensor's square
        sum is added by each TP rank (its own slice), a replicated one only by TP rank 0."""
        local = 0.0
        for name, g in zip(st.params, grads, strict=True):
            if g is None or (self.tp_rank != 0 and not self.lora.is_sharded(name)):
                continue
            local += float(g.double().pow(2).sum())
        if self.world_size > 1:
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(t, group=self._ps.get_model_parallel_group())
            local = float(t.item())
        return math.sqrt(local)

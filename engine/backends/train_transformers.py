"""Training backend on plain HF transformers + our multi-adapter LoRA (CPU or one GPU).

Owns one frozen float32 base model and, per adapter, its LoRA parameters, its own AdamW, its step
count and whether a gradient is pending; running requests (one adapter's, or several adapters'
fused into one padded batch: rows of all adapters, one base GEMM, `lora_routing` segments per
adapter, one backward of the sum of their losses), gradient accumulation across calls, AdamW steps
with optional clipping, and save/load of adapters. Input validation and padding live in
`batching`, the loss math in `losses`, the checkpoint layout in `checkpoint_io`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import cast

import torch
from torch import nn

from engine.backends import checkpoint_io as ckpt
from engine.backends import custom_loss, losses
from engine.backends.adapter_table import AdapterTable
from engine.backends.age_seal import export_sealer, plain
from engine.backends.base import TrainingBackend
from engine.backends.embedding_loss import embedding_loss
from engine.backends.lora import (
    adapter_parameters,
    add_adapter,
    inject_multi_lora,
    load_adapter_weights,
    lora_routing,
    remove_adapter,
    save_adapter,
)
from engine.backends.train_batching import micro_batches, pad_rows, validate_request
from engine.backends.train_common import (
    AdapterPass,
    TrainableAdapter,
    check_spec,
    device_fingerprint,
    finish_load,
    new_optimizer,
)
from engine.backends.train_rows import Datum
from engine.backends.vision import Vision, is_vision_model, load_base_model
from engine.errors import (
    CheckpointError,
    UserInputError,
)
from engine.protocol import (
    ForwardBackwardInput,
    LoraSpec,
)

log = logging.getLogger(__name__)
KNOWN_LOSSES = losses.KNOWN_LOSSES


class TransformersTrainingBackend(AdapterTable, TrainingBackend):
    """Many LoRA adapters over one frozen HF causal LM; one or several adapters per pass."""

    #: always known for this backend (the base class allows None)
    max_positions: int
    device: torch.device

    def __init__(
        self,
        model_dir: str,
        *,
        max_lora_rank: int = 64,
        base_model_name: str = "",
        max_batch_tokens: int = 16384,
        max_image_pixels: int = 4096 * 4096,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        loss_limits: custom_loss.LossLimits | None = None,
    ) -> None:
        # eval mode: no dropout, results need no RNG; adapters (float32) go on the same device
        self.model = load_base_model(model_dir, dtype, device)
        self.model.requires_grad_(False)
        inject_multi_lora(self.model)  # with a VL tower's blocks (used by train_vision adapters)
        config = self.model.config
        #: image handling of a vision-language base model; None for a text model
        self.vision = (
            Vision(model_dir, config, max_image_pixels=max_image_pixels)
            if is_vision_model(model_dir)
            else None
        )
        emb = self.model.get_input_embeddings()
        # torch types Module attributes as Tensor | Module; an embedding's row count is an int
        self.vocab_size = int(cast(int, emb.num_embeddings))
        self.max_lora_rank = int(max_lora_rank)
        text = config.get_text_config()  # a VL model's language model settings; else config
        self.max_positions = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)
        self.base_model_name = base_model_name or str(model_dir)
        pad = text.pad_token_id if text.pad_token_id is not None else text.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad[0] if pad else 0))
        #: padded tokens per forward pass; larger inputs are split into micro-batches
        self.max_batch_tokens = int(max_batch_tokens)
        #: budgets of a custom loss (engine/backends/custom_loss_run.py)
        self.loss_limits = loss_limits or custom_loss.LossLimits()
        weight = emb.weight
        assert isinstance(weight, torch.Tensor)  # the embedding matrix (a Parameter)
        self.device = weight.device
        self._adapters: dict[str, TrainableAdapter] = {}

    # ------------------------------------------------------------------------------- adapters

    def _check_spec(self, spec: LoraSpec, error: type[Exception]) -> None:
        check_spec(
            spec,
            self.max_lora_rank,
            self.base_model_name,
            error,
            has_vision=self.vision is not None,
        )

    def _attach(self, adapter_id: str, spec: LoraSpec) -> dict[str, nn.Parameter]:
        add_adapter(self.model, adapter_id, spec)
        return adapter_parameters(self.model, adapter_id)

    def _detach(self, adapter_id: str) -> None:
        remove_adapter(self.model, adapter_id)

    def _grad_norm(self, st: TrainableAdapter, grads: Sequence[torch.Tensor | None]) -> float:
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))

    def device_fingerprint(self) -> dict:
        weight = self.model.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)
        # the micro-batch size splits large passes, so it changes a timing too
        arch = self.model.config.to_json_string(use_diff=False) + f" micro={self.max_batch_tokens}"
        return {"backend": "transformers", **device_fingerprint(self.device, weight.dtype, arch)}

    # ------------------------------------------------------------------------------- forward

    def _prepare(self, slot: int, adapter_id: str, inp: ForwardBackwardInput) -> AdapterPass:
        self._get(adapter_id)
        req = self._validate(inp)
        return AdapterPass(slot, adapter_id, req, outputs=[{} for _ in req.data])

    def _validate(self, inp: ForwardBackwardInput):
        return validate_request(
            inp, self.vocab_size, self.max_positions, self.vision, self.loss_limits
        )

    def validate_input(self, inp: ForwardBackwardInput) -> list[int]:
        """Raise the UserInputError the request would fail with, without computing anything
        (the Trainer checks a whole request before running it in slices); each datum's loss
        cost in tokens beyond its own (a custom loss's work and memory)."""
        return custom_loss.extra_tokens(self._validate(inp))

    def _execute(self, jobs: list[AdapterPass], *, grad: bool) -> None:
        """Run ``jobs`` (distinct adapters) as padded micro-batches; with ``grad``, add each loss's
        gradient to its adapter's accumulated gradient (all or nothing)."""
        units = [(j, u) for j, job in enumerate(jobs) for u in job.req.units]
        lengths = [[jobs[j].req.data[i].tokens.shape[0] for i in u] for j, u in units]
        # A gradient pending from earlier calls is set aside and added back at the end, so a
        # failure half-way leaves it exactly as it was.
        stash = [(p, p.grad) for j in jobs for p in self._get(j.adapter_id).params.values()]
        if grad:
            for p, _ in stash:
                p.grad = None
        # An embedding request is one unit and runs alone (its own forward, no logits); token
        # units are packed into micro-batches under the token budget.
        emb = [k for k, (j, _) in enumerate(units) if jobs[j].req.loss.embedding]
        tok = [k for k, (j, _) in enumerate(units) if not jobs[j].req.loss.embedding]
        batches = [[k] for k in emb] + [
            [tok[m] for m in mb]
            for mb in micro_batches([lengths[k] for k in tok], self.max_batch_tokens)
        ]
        try:
            with torch.set_grad_enabled(grad):
                for mb in batches:
                    self._micro_batch(jobs, [units[k] for k in mb], grad)
        except BaseException:
            if grad:
                for p, g in stash:
                    p.grad = g
            raise
        if grad:
            with torch.no_grad():
                for p, g in stash:
                    if g is not None:
                        p.grad = g if p.grad is None else g.add_(p.grad)
            for j in jobs:
                self._get(j.adapter_id).has_grad = True

    def _logprobs(self, rows: list[Datum]) -> torch.Tensor:
        """log p(targets) [B, T, K] of right-padded rows, under the current LoRA routing."""
        ids, mask, tgt = pad_rows(rows, self.pad_id, self.device)
        extra = self.vision.batch_kwargs([d.vision for d in rows], ids) if self.vision else {}
        logits = self.model(
            input_ids=ids, attention_mask=mask, use_cache=False, **extra
        ).logits.float()
        return logits.gather(-1, tgt) - torch.logsumexp(logits, dim=-1, keepdim=True)

    def _embeddings(self, rows: list[Datum]) -> torch.Tensor:
        """L2-normalised sentence embeddings [B, H] of right-padded rows: the final hidden state
        (the lm_head input, after the final norm) at each row's last token."""
        ids, mask, _ = pad_rows(rows, self.pad_id, self.device)
        base = self.model.base_model  # the decoder stack without the lm_head
        hidden = base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        last = mask.sum(dim=1) - 1
        pooled = hidden[torch.arange(len(rows), device=self.device), last].float()
        return torch.nn.functional.normalize(pooled, p=2, dim=-1)

    def _embedding_batch(self, job: AdapterPass, idx: list[int], grad: bool) -> None:
        segments = [] if job.req.disable_lora else [(job.adapter_id, 0, len(idx))]
        with lora_routing(self.model, segments):
            emb = self._embeddings([job.req.data[i] for i in idx])
        loss = embedding_loss(job.req, idx, emb, job.outputs, job.metrics)
        if grad and loss.requires_grad:
            loss.backward()

    def _micro_batch(self, jobs: list[AdapterPass], units: list[tuple[int, list[int]]], grad: bool):
        if len(units) == 1 and jobs[units[0][0]].req.loss.embedding:
            self._embedding_batch(jobs[units[0][0]], units[0][1], grad)
            return
        rows = [(j, i) for j, u in units for i in u]  # rows of one job are contiguous
        datums = [jobs[j].req.data[i] for j, i in rows]
        ref: dict[int, torch.Tensor] = {}
        need_ref = [
            r
            for r, (j, i) in enumerate(rows)
            if jobs[j].req.loss.paired and "ref_logprobs" not in datums[r].inputs
        ]
        if need_ref:  # DPO without given reference logprobs: the base model's, no gradient
            with torch.no_grad(), lora_routing(self.model, []):
                base = self._logprobs([datums[r] for r in need_ref])
            ref = {r: base[s, : datums[r].tokens.shape[0], 0] for s, r in enumerate(need_ref)}
        segments, start = [], 0
        for j, group in groupby(rows, key=lambda row: row[0]):
            n = len(list(group))
            if not jobs[j].req.disable_lora:
                segments.append((jobs[j].adapter_id, start, start + n))
            start += n
        patches = (
            [0 if d.vision is None else d.vision.pixel_values.shape[0] for d in datums]
            if self.vision
            else ()
        )
        with lora_routing(self.model, segments, patches):
            logp = self._logprobs(datums)
        total: torch.Tensor | None = None
        start = 0
        for j, group in groupby(rows, key=lambda row: row[0]):
            idx = [i for _, i in group]
            lps = [
                logp[start + k, : d.targets.shape[0], : d.targets.shape[1]]
                for k, d in enumerate(jobs[j].req.data[i] for i in idx)
            ]
            refs = [ref.get(start + k) for k in range(len(idx))]
            job = jobs[j]
            run = custom_loss.request_loss if job.req.custom else losses.request_loss
            loss = run(job.req, idx, lps, refs, job.outputs, job.metrics, self.device)
            total = loss if total is None else total + loss
            start += len(idx)
        if grad and total is not None and total.requires_grad:
            total.backward()

    # ------------------------------------------------------------------------------- checkpoints

    def save_state(
        self,
        adapter_id: str,
        directory: str,
        *,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        st = self._get(adapter_id)
        seal = export_sealer(age_recipients)
        if include_optimizer and seal is not plain:
            raise UserInputError("age_encryption_recipients: exports hold no optimizer state")

        def fill(tmp: Path) -> None:
            save_adapter(self.model, adapter_id, st.spec, tmp, self.base_model_name, seal)
            ckpt.write_state(tmp, st.spec, st.step, include_optimizer, self.base_model_name, seal)
            if include_optimizer:
                state = ckpt.optimizer_state_by_name(list(st.params), st.optimizer)
                torch.save(state, tmp / ckpt.OPTIMIZER_FILE)

        return ckpt.write_checkpoint_dir(Path(directory), fill)

    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        path = Path(directory)
        files = ckpt.verify_manifest(path)
        spec, step = ckpt.read_state(path)
        saved_opt = ckpt.read_optimizer(path, files, self.device) if include_optimizer else None
        st, created = self._for_load(adapter_id, spec, path)
        try:
            # Everything that can fail on a bad file runs before the adapter is modified.
            optimizer = new_optimizer(st.params)
            if saved_opt is not None:
                try:
                    optimizer.load_state_dict(
                        ckpt.optimizer_state_by_index(list(st.params), saved_opt, path)
                    )
                except (ValueError, RuntimeError) as e:
                    raise CheckpointError(f"checkpoint {path}: bad optimizer state: {e}") from None
            load_adapter_weights(self.model, adapter_id, path)
            for p in st.params.values():
                p.grad = None
            finish_load(st, optimizer, step, saved_opt is not None)
        except BaseException:
            if created:
                self.delete_adapter(adapter_id)
            raise
        return st.spec

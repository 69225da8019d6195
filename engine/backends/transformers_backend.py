"""Training backend on plain HF transformers + our multi-adapter LoRA (CPU or one GPU).

Owns one frozen float32 base model and, per adapter, its LoRA parameters, its own AdamW, its step
count and whether a gradient is pending. Implements Tinker's cross_entropy loss (sum, not mean),
gradient accumulation across forward_backward calls, AdamW steps with optional clipping, and
atomic checkpoints (PEFT files + optimizer state + a sha256 manifest).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.backends.base import TrainingBackend
from engine.backends.lora import (
    adapter_parameters,
    add_adapter,
    inject_multi_lora,
    load_adapter_weights,
    lora_routing,
    remove_adapter,
    save_adapter,
)
from engine.errors import AdapterNotFoundError, CheckpointError, UserInputError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)

KNOWN_LOSSES = ("cross_entropy",)
STATE_FILE = "twinkle_state.json"
OPTIMIZER_FILE = "optimizer.pt"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FORMAT = 1


@dataclass
class _Adapter:
    spec: LoraSpec
    params: dict[str, nn.Parameter]  # PEFT name → parameter, in optimizer order
    optimizer: torch.optim.AdamW
    step: int = 0
    has_grad: bool = False


@dataclass
class _Datum:
    tokens: np.ndarray  # int64 [N]
    targets: np.ndarray  # int64 [N, K]
    weights: np.ndarray  # float32 [N, K]
    two_d: bool  # target_tokens came as [N, K]: logprobs are returned as [N, K] too


def _new_optimizer(params: dict[str, nn.Parameter]) -> torch.optim.AdamW:
    # foreach=False: the single-tensor path gives bit-reproducible results across runs.
    return torch.optim.AdamW(list(params.values()), lr=1e-4, foreach=False)


def _shape(spec: LoraSpec) -> tuple:
    return (spec.rank, spec.alpha, spec.train_attn, spec.train_mlp, spec.train_unembed)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _as_int_array(value, field: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
        integral = (
            arr.size == 0
            or arr.dtype.kind in "iu"
            or (arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)))
        )
    except (TypeError, ValueError):  # ragged or non-numeric input
        integral = False
    if not integral:
        raise UserInputError(f"{field}: must be an array of integer token ids")
    return arr.astype(np.int64)


class TransformersTrainingBackend(TrainingBackend):
    """Many LoRA adapters over one frozen HF causal LM; one adapter per call."""

    def __init__(
        self,
        model_dir: str,
        *,
        max_lora_rank: int = 64,
        base_model_name: str = "",
        max_batch_tokens: int = 16384,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # no dropout: results must not depend on RNG
        self.model.requires_grad_(False)
        inject_multi_lora(self.model)
        config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.max_lora_rank = int(max_lora_rank)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.base_model_name = base_model_name or str(model_dir)
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad[0] if pad else 0))
        #: padded tokens per forward pass; larger inputs are split into micro-batches
        self.max_batch_tokens = int(max_batch_tokens)
        self.device = self.model.get_input_embeddings().weight.device
        self._adapters: dict[str, _Adapter] = {}

    # ------------------------------------------------------------------------------- adapters

    def _check_spec(self, spec: LoraSpec, error: type[Exception]) -> None:
        r = spec.rank
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or r & (r - 1):
            raise error(f"lora_config.rank {r!r} must be a power of 2 (1, 2, 4, ...)")
        if r > self.max_lora_rank:
            raise error(
                f"lora_config.rank {r} exceeds max LoRA rank {self.max_lora_rank} "
                f"for model {self.base_model_name}"
            )
        a = spec.alpha
        if not (isinstance(a, (int, float)) and math.isfinite(a) and a > 0):
            raise error(f"lora_config.alpha {a!r} must be a positive finite number")
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise error("lora_config: one of train_attn, train_mlp, train_unembed must be true")

    def _get(self, adapter_id: str) -> _Adapter:
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} is not loaded") from None

    def _create(self, adapter_id: str, spec: LoraSpec) -> _Adapter:
        add_adapter(self.model, adapter_id, spec)
        params = adapter_parameters(self.model, adapter_id)
        st = _Adapter(spec=spec, params=params, optimizer=_new_optimizer(params))
        self._adapters[adapter_id] = st
        return st

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        if not isinstance(adapter_id, str) or not adapter_id:
            raise UserInputError("adapter_id: must be a non-empty string")
        if adapter_id in self._adapters:
            raise UserInputError(
                f"adapter_id {adapter_id!r}: an adapter with this id exists already"
            )
        self._check_spec(spec, UserInputError)
        self._create(adapter_id, spec)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def delete_adapter(self, adapter_id: str) -> None:
        if self._adapters.pop(adapter_id, None) is not None:
            remove_adapter(self.model, adapter_id)

    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        return self._get(adapter_id).spec

    # ------------------------------------------------------------------------------- loss

    def _validate(self, inp: ForwardBackwardInput) -> list[_Datum]:
        if inp.loss_fn not in KNOWN_LOSSES:
            raise UserInputError(
                f"unknown loss_fn {inp.loss_fn!r}; known: {', '.join(KNOWN_LOSSES)}"
            )
        if not inp.data:
            raise UserInputError("data: must contain at least one datum")
        out: list[_Datum] = []
        V = self.vocab_size
        for i, d in enumerate(inp.data):
            f = f"data[{i}]"
            toks = _as_int_array(d.tokens, f"{f}.model_input")
            n = toks.shape[0] if toks.ndim == 1 else 0
            if toks.ndim != 1 or n == 0:
                raise UserInputError(f"{f}.model_input: must contain at least one token")
            if n > self.max_positions:
                raise UserInputError(
                    f"{f}.model_input: length {n} exceeds the model's maximum sequence length "
                    f"{self.max_positions}"
                )
            self._check_range(toks, V, f"{f}.model_input")
            lfi = d.loss_fn_inputs or {}
            if "target_tokens" not in lfi:
                raise UserInputError(
                    f"{f}.loss_fn_inputs.target_tokens: required by loss_fn {inp.loss_fn!r}"
                )
            tgt = _as_int_array(lfi["target_tokens"], f"{f}.loss_fn_inputs.target_tokens")
            if tgt.ndim not in (1, 2) or tgt.shape[0] != n or (tgt.ndim == 2 and tgt.shape[1] == 0):
                raise UserInputError(
                    f"{f}.loss_fn_inputs.target_tokens: shape {list(tgt.shape)} must be [{n}] or "
                    f"[{n}, K], one row per input token (len(tokens) = {n})"
                )
            self._check_range(tgt, V, f"{f}.loss_fn_inputs.target_tokens")
            w = lfi.get("weights")  # absent: plain next-token loss on every position
            try:
                wa = np.ones(tgt.shape) if w is None else np.asarray(w, dtype=np.float64)
            except (TypeError, ValueError):
                raise UserInputError(
                    f"{f}.loss_fn_inputs.weights: must be an array of numbers"
                ) from None
            if wa.shape != tgt.shape:
                raise UserInputError(
                    f"{f}.loss_fn_inputs.weights: shape {list(wa.shape)} must equal the shape of "
                    f"target_tokens {list(tgt.shape)} (len(tokens) = {n})"
                )
            if not np.all(np.isfinite(wa)):
                j = int(np.argwhere(~np.isfinite(wa))[0][0])
                raise UserInputError(f"{f}.loss_fn_inputs.weights: must be finite (position {j})")
            wa = wa.reshape(n, -1).astype(np.float32)
            out.append(_Datum(toks, tgt.reshape(n, -1), wa, two_d=tgt.ndim == 2))
        return out

    @staticmethod
    def _check_range(arr: np.ndarray, vocab: int, field: str) -> None:
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            j = tuple(int(x) for x in np.argwhere(bad)[0])
            pos = j[0] if len(j) == 1 else list(j)
            raise UserInputError(
                f"{field}: token id {int(arr[j])} at position {pos} is out of range [0, {vocab}) (the vocab size)"
            )

    def _micro_batches(self, data: list[_Datum]) -> list[list[int]]:
        batches: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i, d in enumerate(data):
            n = d.tokens.shape[0]
            if cur and max(longest, n) * (len(cur) + 1) > self.max_batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        batches.append(cur)
        return batches

    def _cross_entropy(self, adapter_id: str, data: list[_Datum], idx: list[int], backward: bool):
        """Loss of one micro-batch (right-padded); returns (loss value, per-datum outputs)."""
        rows = [data[i] for i in idx]
        B, T = len(rows), max(d.tokens.shape[0] for d in rows)
        K = max(d.targets.shape[1] for d in rows)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        tgt = torch.zeros((B, T, K), dtype=torch.long)
        wts = torch.zeros((B, T, K), dtype=torch.float32)  # padding: zero weight, no loss/grad
        for r, d in enumerate(rows):
            n, k = d.targets.shape
            ids[r, :n] = torch.from_numpy(d.tokens)
            mask[r, :n] = 1
            tgt[r, :n, :k] = torch.from_numpy(d.targets)
            wts[r, :n, :k] = torch.from_numpy(d.weights)
        ids, mask, tgt, wts = (t.to(self.device) for t in (ids, mask, tgt, wts))
        with lora_routing(self.model, [(adapter_id, 0, B)]):
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt)  # [B, T, K]
        per_token = -logp * wts
        loss = per_token.sum()
        if backward:
            loss.backward()
        outs = []
        lp, el = logp.detach().cpu(), per_token.detach().sum(-1).cpu()
        for r, d in enumerate(rows):
            n, k = d.targets.shape
            lpr = lp[r, :n, :k].numpy().astype(np.float32)
            outs.append(
                {
                    "logprobs": lpr if d.two_d else lpr[:, 0].copy(),
                    "elementwise_loss": el[r, :n].numpy().astype(np.float32),
                }
            )
        return float(loss.detach()), outs

    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        st = self._get(adapter_id)
        data = self._validate(inp)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        with torch.set_grad_enabled(not inp.forward_only):
            for idx in self._micro_batches(data):
                loss, outs = self._cross_entropy(
                    adapter_id, data, idx, backward=not inp.forward_only
                )
                total += loss
                for i, o in zip(idx, outs, strict=True):
                    outputs[i] = o
        if not inp.forward_only:
            st.has_grad = True
        return ForwardBackwardOutput(outputs=outputs, metrics={"loss:sum": total})

    # ------------------------------------------------------------------------------- optimizer

    @staticmethod
    def _check_adam(p: AdamParams) -> None:
        in_01 = (lambda v: 0 <= v < 1, "in [0, 1)")
        non_neg = (lambda v: v >= 0, ">= 0")
        rules = {
            "learning_rate": non_neg,
            "beta1": in_01,
            "beta2": in_01,
            "eps": (lambda v: v > 0, "> 0"),
            "weight_decay": non_neg,
            "grad_clip_norm": non_neg,
        }
        for name, (ok, rule) in rules.items():
            v = getattr(p, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and ok(v)):
                raise UserInputError(f"adam_params.{name} {v!r} must be a finite number {rule}")

    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        st = self._get(adapter_id)
        self._check_adam(params)
        if not st.has_grad:
            raise UserInputError(
                "optim_step: no gradient accumulated since the last optim_step; "
                "call forward_backward first"
            )
        plist = list(st.params.values())
        for p in plist:  # a parameter unused in the graph gets a zero gradient, not a skipped step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in plist))
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                coef = params.grad_clip_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
                for p in plist:
                    p.grad.mul_(coef)
        for group in st.optimizer.param_groups:
            group["lr"] = float(params.learning_rate)
            group["betas"] = (float(params.beta1), float(params.beta2))
            group["eps"] = float(params.eps)
            group["weight_decay"] = float(params.weight_decay)
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        st.has_grad = False
        return OptimStepOutput(
            metrics={
                "grad_norm": norm,
                "learning_rate": float(params.learning_rate),
                "step": float(st.step),
            }
        )

    # ------------------------------------------------------------------------------- checkpoints

    @staticmethod
    def _optimizer_state_by_name(st: _Adapter) -> dict:
        names = list(st.params)
        sd = st.optimizer.state_dict()
        return {
            "format": CHECKPOINT_FORMAT,
            "state": {names[i]: v for i, v in sd["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
            ],
        }

    @staticmethod
    def _optimizer_state_by_index(st: _Adapter, saved: dict, path: Path) -> dict:
        index = {name: i for i, name in enumerate(st.params)}
        try:
            groups = saved["param_groups"]
            names = [n for g in groups for n in g["params"]]
            if sorted(names) != sorted(index) or not set(saved["state"]) <= set(index):
                raise CheckpointError(
                    f"{path}: optimizer state does not match the adapter's parameters"
                )
            return {
                "state": {index[n]: v for n, v in saved["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
            }
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: malformed optimizer state") from None

    def save_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> int:
        st = self._get(adapter_id)
        target = Path(directory)
        if target.exists():
            raise CheckpointError(f"checkpoint directory {target} already exists")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            save_adapter(self.model, adapter_id, st.spec, tmp, self.base_model_name)
            state = {
                "format": CHECKPOINT_FORMAT,
                "spec": asdict(st.spec),
                "step": st.step,
                "has_optimizer": bool(include_optimizer),
                "base_model": self.base_model_name,
            }
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
            if include_optimizer:
                torch.save(self._optimizer_state_by_name(st), tmp / OPTIMIZER_FILE)
            files = {
                p.name: {"sha256": _sha256(p), "size": p.stat().st_size}
                for p in sorted(tmp.iterdir())
            }
            manifest = {"format": CHECKPOINT_FORMAT, "files": files}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            total = sum(p.stat().st_size for p in tmp.iterdir())
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; samplers may run as another user
            try:
                os.rename(tmp, target)  # atomic: readers see no checkpoint or a complete one
            except OSError:
                raise CheckpointError(f"checkpoint directory {target} already exists") from None
            return total
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _verify_manifest(path: Path) -> dict:
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} not found")
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError):
            raise CheckpointError(
                f"checkpoint {path}: missing or unreadable {MANIFEST_FILE}"
            ) from None
        for required in ("adapter_model.safetensors", "adapter_config.json", STATE_FILE):
            if required not in files:
                raise CheckpointError(f"checkpoint {path}: manifest does not list {required}")
        for name, meta in files.items():
            f = path / name
            if Path(name).name != name or not f.is_file():
                raise CheckpointError(f"checkpoint {path}: file {name} is missing")
            if f.stat().st_size != meta.get("size") or _sha256(f) != meta.get("sha256"):
                raise CheckpointError(
                    f"checkpoint {path}: {name} does not match its sha256 in the manifest"
                )
        return files

    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        path = Path(directory)
        files = self._verify_manifest(path)
        try:
            state = json.loads((path / STATE_FILE).read_text())
            known = {f.name for f in fields(LoraSpec)}
            spec = LoraSpec(**{k: v for k, v in state["spec"].items() if k in known})
            step = int(state["step"])
        except (OSError, ValueError, KeyError, TypeError):
            raise CheckpointError(f"checkpoint {path}: unreadable {STATE_FILE}") from None
        saved_opt = None
        if include_optimizer:
            if OPTIMIZER_FILE not in files:
                raise CheckpointError(
                    f"checkpoint {path} has no optimizer state (saved weights only)"
                )
            try:
                saved_opt = torch.load(
                    path / OPTIMIZER_FILE, map_location=self.device, weights_only=True
                )
            except Exception as e:
                raise CheckpointError(
                    f"checkpoint {path}: cannot read {OPTIMIZER_FILE}: {e}"
                ) from None
        created = adapter_id not in self._adapters
        if created:
            self._check_spec(spec, CheckpointError)
            st = self._create(adapter_id, spec)
        else:
            st = self._adapters[adapter_id]
            if _shape(st.spec) != _shape(spec):  # the seed may differ: it only matters at init
                raise CheckpointError(
                    f"checkpoint {path} (rank {spec.rank}, alpha {spec.alpha}) does not match "
                    f"adapter {adapter_id!r} (rank {st.spec.rank}, alpha {st.spec.alpha}) or its "
                    "target modules"
                )
        try:
            # Everything that can fail on a bad file runs before the adapter is modified.
            optimizer = _new_optimizer(st.params)
            if saved_opt is not None:
                try:
                    optimizer.load_state_dict(self._optimizer_state_by_index(st, saved_opt, path))
                except (ValueError, RuntimeError) as e:
                    raise CheckpointError(f"checkpoint {path}: bad optimizer state: {e}") from None
            load_adapter_weights(self.model, adapter_id, path)
            for p in st.params.values():
                p.grad = None
            st.optimizer = optimizer
            # A weights-only load starts a fresh optimizer, so its step count restarts too.
            st.step = step if saved_opt is not None else 0
            st.has_grad = False
        except BaseException:
            if created:
                self.delete_adapter(adapter_id)
            raise
        return st.spec

"""The ``mock`` training backend and its toy model: deterministic, cheap, torch-free. FOR
ROUTING TESTS ONLY.

Config ``backend: mock`` (engine/backends/registry.py; ``sampler_type: mock`` is its sampling
half, engine/backends/mock_sampling.py). The pair implements the whole `TrainingBackend` /
`SamplingBackend` contract (validation, per-adapter gradients and AdamW
state, atomic checkpoints as real files, sampling from checkpoint directories) over a toy model, so
tests of scheduling, routing, ordering, quotas and persistence run in milliseconds without torch.
Its numbers are NOT a language model's: never use it where numbers are tested against the real
backend.

The toy model: an adapter is a float64 vector ``w`` of `DIM` entries (zero at creation, as LoRA's
B = 0; ``a`` holds its seed's draw, saved but unused, so the seed shows in checkpoints). The
log-probability of target token t after input token x is
``base(x, t) + w[t % DIM]`` with ``base = -log(vocab) - ((7 x + 3 t) % 11) / 11``. Every loss is
``-sum(coef * logprob)`` with ``coef`` the datum's ``weights``, else its ``advantages``, else 1;
so gradients and AdamW steps are exact and cheap. The embedding loss ``infonce`` (same groups and
formula as the real backend, engine/backends/losses.py) runs on the toy embedding
``e = u(tokens) + w`` (``u``: a fixed unit vector from the token ids; not normalised again), with
its exact gradient. Checkpoints use the real layout
(engine/backends/checkpoint_io.py: manifest, ``twinkle_state.json``) with the weights in
``adapter_model.safetensors`` (safetensors' numpy API). Sampling is a hash of (adapter weights file
contents, prompt, seed, sample index, position): engine/backends/mock_sampling.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.backends import checkpoint_io as ckpt
from engine.backends.adapter_cache import WEIGHTS_FILE
from engine.backends.age_seal import export_sealer
from engine.backends.base import (
    GradOp,
    TrainingBackend,
    check_grad_op,
)
from engine.backends.sample_checks import is_int
from engine.errors import AdapterNotFoundError, CheckpointError, UserInputError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)
from engine.rules import EMBEDDING_LOSS_FNS

#: entries of an adapter's toy weight vector
DIM = 16
#: default vocabulary: 256 byte tokens, EOS, and room for clients' random ids
VOCAB_SIZE = 512
EOS_ID = 256
#: the losses the real backend knows (engine/backends/losses.py KNOWN_LOSSES; a test pins it)
MOCK_LOSSES = (
    "cispo",
    "cross_entropy",
    "dpo",
    "dro",
    "gspo",
    "importance_sampling",
    "ppo",
    "stable_reinforce",
)
#: the embedding losses it knows (engine/backends/losses.py EMBEDDING_LOSSES; a test pins it)
MOCK_EMBEDDING_LOSSES = EMBEDDING_LOSS_FNS
OPTIMIZER_FILE = "mock_optimizer.safetensors"


def _spec_error(spec: LoraSpec, max_rank: int) -> str | None:
    r, a = spec.rank, spec.alpha
    if not is_int(r) or r < 1 or r & (r - 1):
        return f"lora_config.rank {r!r} must be a power of 2 (1, 2, 4, ...)"
    if r > max_rank:
        return f"lora_config.rank {r} exceeds max LoRA rank {max_rank}"
    if not (isinstance(a, (int, float)) and math.isfinite(a) and a > 0):
        return f"lora_config.alpha {a!r} must be a positive finite number"
    if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
        return "lora_config: one of train_attn, train_mlp, train_unembed must be true"
    return None


@dataclass
class _Adapter:
    spec: LoraSpec
    w: np.ndarray
    a: np.ndarray
    grad: np.ndarray | None = None
    m: np.ndarray | None = None  # AdamW first and second moments
    v: np.ndarray | None = None
    step: int = 0

    def fresh_optimizer(self) -> None:
        self.m, self.v, self.step = np.zeros(DIM), np.zeros(DIM), 0


class MockTrainingBackend(TrainingBackend):
    """The toy-model training backend (see the module docstring). Routing tests only."""

    #: always known for this backend (the base class allows None)
    max_positions: int

    def __init__(
        self,
        *,
        vocab_size: int = VOCAB_SIZE,
        max_lora_rank: int = 64,
        max_positions: int | None = None,
        base_model_name: str = "mock",
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.max_lora_rank = int(max_lora_rank)
        self.max_positions = int(max_positions) if max_positions else 2048
        self.base_model_name = base_model_name
        self._adapters: dict[str, _Adapter] = {}

    # -- adapters ------------------------------------------------------------------------------
    def _get(self, adapter_id: str) -> _Adapter:
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} is not loaded") from None

    def _new(self, spec: LoraSpec) -> _Adapter:
        a = np.random.default_rng(int(spec.seed) % (1 << 63)).standard_normal(DIM)
        st = _Adapter(spec=spec, w=np.zeros(DIM), a=a)
        st.fresh_optimizer()
        return st

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        if not isinstance(adapter_id, str) or not adapter_id:
            raise UserInputError("adapter_id: must be a non-empty string")
        if adapter_id in self._adapters:
            raise UserInputError(
                f"adapter_id {adapter_id!r}: an adapter with this id exists already"
            )
        err = _spec_error(spec, self.max_lora_rank)
        if err:
            raise UserInputError(err)
        self._adapters[adapter_id] = self._new(spec)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def delete_adapter(self, adapter_id: str) -> None:
        self._adapters.pop(adapter_id, None)

    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        return self._get(adapter_id).spec

    # -- passes --------------------------------------------------------------------------------
    def _datum(self, i: int, d) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [N], targets [N] or [N, K], coef like targets) of ``data[i]``, validated."""
        f = f"data[{i}]"
        tokens = np.asarray(d.tokens)
        n = len(tokens)
        if tokens.ndim != 1 or n == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise UserInputError(f"{f}.tokens: must be a non-empty list of token ids")
        if n > self.max_positions:
            raise UserInputError(f"{f}.tokens: length {n} exceeds {self.max_positions}")
        inputs = d.loss_fn_inputs or {}
        if "target_tokens" not in inputs:
            raise UserInputError(f"{f}.loss_fn_inputs.target_tokens: required")
        targets = np.asarray(inputs["target_tokens"])
        if targets.ndim not in (1, 2) or targets.shape[0] != n:
            raise UserInputError(f"{f}.loss_fn_inputs.target_tokens: first dimension must be {n}")
        if not np.issubdtype(targets.dtype, np.integer):
            raise UserInputError(f"{f}.loss_fn_inputs.target_tokens: must hold token ids")
        for name, arr in (("tokens", tokens), ("loss_fn_inputs.target_tokens", targets)):
            if ((arr < 0) | (arr >= self.vocab_size)).any():
                raise UserInputError(f"{f}.{name}: ids must be in [0, {self.vocab_size})")
        key = next((k for k in ("weights", "advantages") if k in inputs), None)
        coef = np.ones(targets.shape) if key is None else np.asarray(inputs[key], np.float64)
        if coef.shape != targets.shape or not np.isfinite(coef).all():
            raise UserInputError(f"{f}.loss_fn_inputs.{key}: must be finite, shaped like targets")
        return tokens.astype(np.int64), targets.astype(np.int64), coef

    def _embedding_request(self, inp: ForwardBackwardInput) -> tuple[list, float, bool]:
        """(rows as (tokens, is_anchor), temperature, use_batch), validated."""
        cfg = {"temperature": 0.1, "use_batch": 1.0}
        for key, value in (inp.loss_fn_config or {}).items():
            if key not in cfg:
                raise UserInputError(f"loss_fn_config.{key}: unknown key for loss_fn 'infonce'")
            cfg[key] = float(value)
        if not cfg["temperature"] > 0 or cfg["use_batch"] not in (0.0, 1.0):
            raise UserInputError("loss_fn_config: temperature must be > 0, use_batch 1 or 0")
        if not inp.data:
            raise UserInputError("data: must contain at least one datum")
        rows = []
        for i, d in enumerate(inp.data):
            tokens = np.asarray(d.tokens)
            if tokens.ndim != 1 or len(tokens) == 0 or len(tokens) > self.max_positions:
                raise UserInputError(f"data[{i}].tokens: must be 1 to {self.max_positions} ids")
            if ((tokens < 0) | (tokens >= self.vocab_size)).any():
                raise UserInputError(f"data[{i}].tokens: ids must be in [0, {self.vocab_size})")
            a = np.asarray((d.loss_fn_inputs or {}).get("anchor", [np.nan]), np.float64)
            if a.size != 1 or a.reshape(-1)[0] not in (0.0, 1.0):
                raise UserInputError(f"data[{i}].loss_fn_inputs.anchor: must be one value, 1 or 0")
            rows.append((tokens.astype(np.int64), bool(a.reshape(-1)[0])))
        anchor = [a for _, a in rows]
        if not anchor[0] or any(
            a and (i + 1 == len(anchor) or anchor[i + 1]) for i, a in enumerate(anchor)
        ):
            raise UserInputError(
                "data: loss_fn_inputs.anchor: rows come in groups anchor (1), positive (0), "
                "negatives (0)..., starting with an anchor"
            )
        return rows, cfg["temperature"], bool(cfg["use_batch"])

    def _infonce(self, w: np.ndarray, inp: ForwardBackwardInput):
        """(outputs, loss, d loss / d w) of the toy InfoNCE (module doc)."""
        rows, temp, use_batch = self._embedding_request(inp)
        u = np.stack(
            [np.cos(0.37 * np.outer(np.arange(1, DIM + 1), t + 1)).sum(1) for t, _ in rows]
        )
        u /= np.linalg.norm(u, axis=1, keepdims=True) + 1e-12
        e = u + w
        starts = [i for i, (_, a) in enumerate(rows) if a]
        groups = list(zip(starts, [*starts[1:], len(rows)], strict=True))
        loss, grad = 0.0, np.zeros(DIM)
        for s, end in groups:
            docs = (
                [j for a, b in groups for j in range(a + 1, b)] if use_batch
                else list(range(s + 1, end))
            )  # fmt: skip
            z = e[docs] @ e[s] / temp
            p = np.exp(z - z.max())
            p /= p.sum()
            k = docs.index(s + 1)
            loss += float(np.log(np.exp(z - z.max()).sum()) + z.max() - z[k])
            dz = p.copy()
            dz[k] -= 1.0  # d loss / d z; z_j = e_s . e_j / T and d e / d w = I
            grad += (dz @ e[docs] + dz.sum() * e[s]) / temp
        n = len(groups)
        outputs = [{"embedding": row.astype(np.float32)} for row in e]
        return outputs, loss / n, grad / n

    def _request(self, inp: ForwardBackwardInput) -> list[tuple]:
        if inp.loss_fn in MOCK_EMBEDDING_LOSSES:
            self._embedding_request(inp)
            return []
        if inp.loss_fn not in MOCK_LOSSES:
            raise UserInputError(f"loss_fn {inp.loss_fn!r}: known: {', '.join(MOCK_LOSSES)}")
        if not inp.data:
            raise UserInputError("data: must contain at least one datum")
        return [self._datum(i, d) for i, d in enumerate(inp.data)]

    def validate_input(self, inp: ForwardBackwardInput) -> None:
        self._request(inp)

    def _logprobs(self, w: np.ndarray, tokens: np.ndarray, targets: np.ndarray) -> np.ndarray:
        x = tokens if targets.ndim == 1 else tokens[:, None]
        base = -math.log(self.vocab_size) - ((7 * x + 3 * targets) % 11) / 11.0
        return base + w[targets % DIM]

    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        st = self._get(adapter_id)
        if inp.loss_fn in MOCK_EMBEDDING_LOSSES:
            outputs, loss, grad = self._infonce(st.w, inp)
            if not inp.forward_only:
                st.grad = grad if st.grad is None else st.grad + grad
            return ForwardBackwardOutput(outputs=outputs, metrics={"loss:sum": loss})
        data = self._request(inp)  # all checks before any state changes
        outputs, total, grad = [], 0.0, np.zeros(DIM)
        for tokens, targets, coef in data:
            lp = self._logprobs(st.w, tokens, targets)
            loss = -coef * lp
            total += float(loss.sum())
            np.add.at(grad, (targets % DIM).ravel(), -coef.ravel())  # d loss / d w
            outputs.append(
                {"logprobs": lp.astype(np.float32), "elementwise_loss": loss.astype(np.float32)}
            )
        if not inp.forward_only:
            st.grad = grad if st.grad is None else st.grad + grad
        return ForwardBackwardOutput(outputs=outputs, metrics={"loss:sum": total})

    # -- gradients and optimizer ---------------------------------------------------------------
    def has_pending_grad(self, adapter_id: str) -> bool:
        st = self._adapters.get(adapter_id)
        return st is not None and st.grad is not None

    def adapter_grad(self, adapter_id: str, op: GradOp) -> float | None:
        check_grad_op(op)
        st = self._get(adapter_id)
        if op == "norm":
            return 0.0 if st.grad is None else float(np.sqrt((st.grad**2).sum()))
        st.grad = None
        return None

    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        st = self._get(adapter_id)
        for name, value in asdict(params).items():
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            if (
                not ok
                or (name in ("beta1", "beta2") and value >= 1)
                or (name == "eps" and not value)
            ):
                raise UserInputError(f"adam_params.{name} {value!r} is out of range")
        if st.grad is None:
            raise UserInputError(
                "optim_step: no gradient accumulated since the last optim_step; "
                "call forward_backward first"
            )
        g, norm = st.grad, float(np.sqrt((st.grad**2).sum()))
        if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
            g = g * (params.grad_clip_norm / (norm + 1e-6))  # as torch's clip_grad_norm_
        assert st.m is not None and st.v is not None
        b1, b2, lr = params.beta1, params.beta2, params.learning_rate
        st.step += 1
        st.m = b1 * st.m + (1 - b1) * g
        st.v = b2 * st.v + (1 - b2) * g * g
        m_hat, v_hat = st.m / (1 - b1**st.step), st.v / (1 - b2**st.step)
        st.w = st.w * (1 - lr * params.weight_decay) - lr * m_hat / (np.sqrt(v_hat) + params.eps)
        st.grad = None
        metrics = {"grad_norm": norm, "learning_rate": float(lr), "step": float(st.step)}
        return OptimStepOutput(metrics=metrics)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(
        self,
        adapter_id: str,
        directory: str,
        *,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        from safetensors.numpy import save, save_file

        st = self._get(adapter_id)
        seal = export_sealer(age_recipients)

        def fill(tmp: Path) -> None:
            config = {
                "peft_type": "LORA",
                "r": st.spec.rank,
                "lora_alpha": st.spec.alpha,
                "target_modules": ["mock"],
                "base_model_name_or_path": self.base_model_name,
            }
            for name, data in (
                (WEIGHTS_FILE, save({"mock.w": st.w, "mock.a": st.a})),
                ("adapter_config.json", (json.dumps(config, indent=2) + "\n").encode()),
            ):
                out_name, out = seal(name, data)
                (tmp / out_name).write_bytes(out)
            ckpt.write_state(tmp, st.spec, st.step, include_optimizer, self.base_model_name, seal)
            if include_optimizer:
                assert st.m is not None and st.v is not None  # set by fresh_optimizer()
                save_file({"m": st.m, "v": st.v}, str(tmp / OPTIMIZER_FILE))

        return ckpt.write_checkpoint_dir(Path(directory), fill)

    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        from safetensors.numpy import load_file

        path = Path(directory)
        files = ckpt.verify_manifest(path)
        spec, step = ckpt.read_state(path)
        if include_optimizer and OPTIMIZER_FILE not in files:
            raise CheckpointError(f"checkpoint {path} has no optimizer state (saved weights only)")
        try:
            weights = load_file(str(path / WEIGHTS_FILE))
            w, a = weights["mock.w"], weights["mock.a"]
            opt = load_file(str(path / OPTIMIZER_FILE)) if include_optimizer else None
        except Exception as e:  # noqa: BLE001 - safetensors raises several types on bad files
            raise CheckpointError(f"checkpoint {path}: not a mock checkpoint ({e})") from None
        old = self._adapters.get(adapter_id)
        if old is None:
            err = _spec_error(spec, self.max_lora_rank)
            if err:
                raise CheckpointError(f"checkpoint {path}: {err}")
        elif asdict(old.spec) | {"seed": 0} != asdict(spec) | {"seed": 0}:
            raise CheckpointError(f"checkpoint {path} does not match adapter {adapter_id!r}")
        st = _Adapter(spec=spec if old is None else old.spec, w=w.copy(), a=a.copy())
        st.fresh_optimizer()
        if opt is not None:
            st.m, st.v, st.step = opt["m"].copy(), opt["v"].copy(), step
        self._adapters[adapter_id] = st
        return st.spec

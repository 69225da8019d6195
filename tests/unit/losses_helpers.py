"""Shared by the loss tests (tests/unit/test_loss_*.py): the random seed, adapters of three ranks
with random B, the float64 reference (HF model with the adapter merged, then each loss's
formula in numpy) and random inputs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.backends.lora import adapter_parameters
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.protocol import (
    AdamParams,
    DatumInput,
    LoraSpec,
)


def make_backend(model_dir: Path, rng: np.random.Generator) -> TransformersTrainingBackend:
    """Three adapters of ranks 2, 4, 8 with random non-zero B (so LoRA changes the logprobs)."""
    b = TransformersTrainingBackend(str(model_dir))
    for k, (aid, r) in enumerate(zip(IDS, RANKS, strict=True)):
        b.create_adapter(aid, LoraSpec(rank=r, alpha=2.0 * r, seed=k))
        with torch.no_grad():
            for name, p in adapter_parameters(b.model, aid).items():
                if "lora_B" in name:
                    p.copy_(torch.from_numpy(rng.normal(0.0, 0.05, tuple(p.shape))))
    return b


SEED = int(os.environ.get("TWINKLE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


RANKS = (2, 4, 8)


IDS = tuple(f"r{r}" for r in RANKS)


VOCAB = 2048


TOKEN_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")


CLIP = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (0.8, 1.2)}


def merged_f64(model_dir: Path, be, aid: str | None) -> nn.Module:
    """float64 HF model, with adapter ``aid``'s delta W = B @ A * scaling merged (None: base)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())  # untie
    if aid is not None:
        spec = be.adapter_spec(aid)
        params = adapter_parameters(be.model, aid)
        with torch.no_grad():
            for key, a in params.items():
                if key.endswith("lora_A.weight"):
                    b = params[key.replace("lora_A", "lora_B")]
                    name = key[len("base_model.model.") : -len(".lora_A.weight")]
                    delta = (spec.alpha / spec.rank) * b.double() @ a.double()
                    ref.get_submodule(name).weight += delta
    return ref


def ref_logprobs(model: nn.Module, tokens: list[int], targets: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    return lp[torch.arange(len(tokens)), torch.from_numpy(targets)].numpy()


def away_from(delta: np.ndarray, rng, points: tuple[float, ...], width: float = 2e-3):
    """Redraw log-ratios within ``width`` of a clip point, so float32 vs float64 cannot flip a
    clipping branch."""
    for p in points:
        close = np.abs(delta - p) < width
        delta[close] += np.where(rng.random(close.sum()) < 0.5, -3 * width, 3 * width)
    return delta


def gspo_log_ratios(rng, log_ratio: np.ndarray, mask, lo: float, hi: float) -> np.ndarray:
    """Shift a datum's log-ratios so their mean over the mask (gspo's log sequence ratio) is not
    within 2e-3 of a clip point (float32 vs float64 cannot flip the branch)."""
    mean = np.array([log_ratio[mask != 0].mean()])
    return log_ratio + (away_from(mean.copy(), rng, (np.log(hi), np.log(lo))) - mean)[0]


def make_data(rng, loss: str, model: nn.Module, n_datums: int) -> tuple[list[DatumInput], list]:
    """Random datums for ``loss`` and their float64 learner logprobs under ``model``."""
    data, lps = [], []
    for _ in range(n_datums):
        n = int(rng.integers(5, 24))
        tokens = rng.integers(0, VOCAB, n).tolist()
        targets = rng.integers(0, VOCAB, n)
        lp = ref_logprobs(model, tokens, targets)
        lfi: dict[str, np.ndarray] = {"target_tokens": targets}
        lfi["weights"] = rng.normal(size=n).astype(np.float32)
        if loss == "dpo":
            lfi["weights"] = (rng.random(n) < 0.7).astype(np.float32)  # response-token mask
        if loss in TOKEN_LOSSES[1:]:
            lo, hi = CLIP.get(loss, (0.8, 1.2))
            spread = (-0.6, 1.6) if loss == "cispo" else (-0.4, 0.4)
            log_ratio = away_from(rng.uniform(*spread, n), rng, (np.log(hi), np.log(max(lo, 1e-9))))
            if loss == "gspo":  # a datum offset, so some sequences clip, and a random mask
                mask = (rng.random(n) < 0.6).astype(np.float32)
                mask[int(rng.integers(0, n))] = 1.0
                log_ratio = gspo_log_ratios(rng, rng.uniform(-0.5, 0.5) + log_ratio, mask, lo, hi)
                lfi["sequence_ratio_mask"] = mask
            lfi["logprobs"] = (lp - log_ratio).astype(np.float32)  # ratio = exp(lp - old)
            lfi["advantages"] = rng.normal(size=n).astype(np.float32)
        data.append(DatumInput(tokens=tokens, loss_fn_inputs=lfi))
        lps.append(lp)
    return data, lps


def reference(loss: str, data: list[DatumInput], lps: list, cfg: dict, base=None):
    """(per-datum elementwise loss or None, loss sum, extra metrics) in float64 numpy."""
    f64 = [{k: np.asarray(v, np.float64) for k, v in d.loss_fn_inputs.items()} for d in data]
    if loss == "dpo":
        beta, sft = cfg.get("beta", 0.1), cfg.get("sft_weight", 0.0)
        s = [np.sum(lp * x["weights"]) for lp, x in zip(lps, f64, strict=True)]
        r = [
            np.sum(x.get("ref_logprobs", b) * x["weights"])
            for x, b in zip(f64, base or [None] * len(data), strict=True)
        ]
        margins = np.array(
            [beta * ((s[i] - r[i]) - (s[i + 1] - r[i + 1])) for i in range(0, len(s), 2)]
        )
        nll = float(np.sum(np.logaddexp(0.0, -margins)))  # -logsigmoid
        total = nll + sft * float(sum(-s[i] for i in range(0, len(s), 2)))
        extra = {
            "dpo_accuracy:mean": float(np.mean(margins > 0)),
            "dpo_margin:mean": float(margins.mean()),
            "dpo_chosen_logps:mean": float(np.mean(s[0::2])),
            "dpo_rejected_logps:mean": float(np.mean(s[1::2])),
            "dpo_chosen_reward:mean": float(np.mean(beta * (np.array(s[0::2]) - r[0::2]))),
            "dpo_rejected_reward:mean": float(np.mean(beta * (np.array(s[1::2]) - r[1::2]))),
        }
        return None, total, extra
    per = []
    for lp, x in zip(lps, f64, strict=True):
        if loss == "cross_entropy":
            per.append(-lp * x["weights"])
            continue
        old, adv = x["logprobs"], x["advantages"]
        ratio = np.exp(lp - old)
        if loss == "importance_sampling":
            per.append(-ratio * adv)
        elif loss == "ppo":
            lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
            per.append(-np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv))
        elif loss == "cispo":
            lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
            per.append(-np.clip(ratio, lo, hi) * lp * adv)
        elif loss == "dro":
            beta = cfg.get("beta", 0.05)
            per.append(-(lp * adv - 0.5 * beta * (lp - old) ** 2))
        elif loss == "gspo":  # Tinker's docs: the sequence ratio over the mask, PPO's clipped min
            lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
            s = np.exp(np.mean((lp - old)[x["sequence_ratio_mask"] != 0]))
            per.append(-np.minimum(s * adv, np.clip(s, lo, hi) * adv))
    return per, float(sum(p.sum() for p in per)), {}


def close(actual: float, expected: float, scale: float, what: str) -> None:
    tol = 1e-5 * max(1.0, scale)
    assert abs(actual - expected) <= tol, f"{what}: {actual} vs {expected} (seed {SEED})"


def clear(be) -> None:
    """Drop pending gradients without changing parameters (AdamW with lr 0)."""
    for aid in IDS:
        if be.has_pending_grad(aid):
            be.optim_step(aid, AdamParams(learning_rate=0.0))


CONFIGS = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": "0.9", "clip_high_threshold": 1.1}),
    ("cispo", {}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": "1.05"}),
    ("dpo", {}),
    ("dpo", {"beta": 0.5, "sft_weight": 0.25}),
]


class _Zero(nn.Module):
    """Stand-in model for inputs whose logprobs do not matter (validation tests)."""

    def forward(self, ids):
        return type("Out", (), {"logits": torch.zeros(*ids.shape, VOCAB, dtype=torch.float64)})

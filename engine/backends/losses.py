"""Loss functions with Tinker semantics, and the registry that says what each one needs.

Owns the math of every built-in loss (shared/docs/tinker-protocol.md §11, plus the native ``dpo``),
as pure functions over torch tensors of ONE datum (or, for DPO, of a list of datums), so the
single-adapter and the fused multi-adapter paths compute exactly the same thing; the `LossSpec`
registry (required/optional ``loss_fn_inputs``, accepted ``loss_fn_config`` keys and defaults);
and the reduction of partial metrics across micro-batches. Parsing ``loss_fn_config`` against the
registry: engine/backends/loss_config.py.

Every loss is a SUM over tokens and datums, except ``dpo`` with ``mean_reduction`` (below).
Notation: ``lp`` = learner log p of target_tokens [N], ``old`` = ``loss_fn_inputs["logprobs"]``
(sampling logprobs), ``A`` = ``loss_fn_inputs["advantages"]``, ``ratio = exp(lp - old)``.

* ``cross_entropy``: ``-sum(lp * weights)``; ``[N, K]`` targets/weights sum over K too.
* ``importance_sampling``: ``-sum(ratio * A)``.
* ``ppo``: ``-sum(min(ratio * A, clamp(ratio, clip_low_threshold, clip_high_threshold) * A))``;
  defaults 0.8 / 1.2.
* ``cispo``: ``-sum(stopgrad(clamp(ratio, low, high)) * lp * A)``; defaults 0.0 / 4.0.
* ``dro``: ``-sum(lp * A - 0.5 * beta * (lp - old) ** 2)``; ``beta`` default 0.05.
* ``gspo`` (GSPO-token, Tinker's docs): per datum, ``s = exp(mean over M of (lp - old))`` where M
  is the tokens with ``sequence_ratio_mask != 0``; every token's ratio carries ``s``'s value and
  its own lp's gradient (``exp(log s + lp - stopgrad(lp))``, log s from stopgrad(lp)); then PPO's
  clipped min with A. Clip defaults 0.8 / 1.2 (Tinker's PPO values; its gspo page gives none).
  A datum whose mask marks no token is refused (the mean would be NaN).
* ``stable_reinforce`` (REINFORCE with masked importance weights against what the sampler
  recorded; see `stable_reinforce`): ``q`` = ``recorded_logprobs``, ``s`` = ``recorded_mask``
  (1 on sampled tokens; both filled in by the gateway from the datum's provenance spans),
  ``d = stopgrad(lp) - q``, ``r = exp(d)``; token keep ``k = s * [lo_t <= r <= hi_t]``; sequence
  keep ``K = [lo_s <= exp(sum(s * d) / sum(s)) <= hi_s]`` (the geometric-mean ratio over the
  datum's sampled tokens); per token ``-stopgrad(r * k * K) * lp * A``. Defaults
  ``token_mask_low`` 0.5, ``token_mask_high`` 2.0, ``seq_mask_low`` 0.9, ``seq_mask_high`` 1.1.
  Nonzero advantages on a position that is not a sampled token are refused. Metrics
  ``sr_masked_frac:mean`` (sampled tokens masked, by either rule), ``sr_seq_masked_frac:mean``
  (datums the sequence rule masked), ``sr_ratio:mean`` (mean r over sampled tokens),
  ``sr_kl:mean`` (k3 estimate of KL(sampler || learner), ``r - 1 - log r``) and
  ``sr_sampled_tokens:sum``.
* ``dpo``: datums are (chosen, rejected) pairs in batch order; ``s = sum(lp * weights)`` per datum,
  ``r`` the same with the reference logprobs (``loss_fn_inputs["ref_logprobs"]``, else the base
  model's). ``-sum_pairs logsigmoid(beta * ((s_c - r_c) - (s_r - r_r))) + sft_weight *
  sum_chosen(-s_c)``; ``beta`` default 0.1, ``sft_weight`` default 0.0. Extra metrics
  ``dpo_accuracy:mean`` (pairs with margin > 0) and ``dpo_margin:mean`` where the margin is
  ``beta * ((s_c - r_c) - (s_r - r_r))`` (TRL's "rewards/margins"), ``dpo_chosen_reward:mean`` /
  ``dpo_rejected_reward:mean`` (``beta * (s - r)``, TRL's "rewards/chosen|rejected") and
  ``dpo_chosen_logps:mean`` / ``dpo_rejected_logps:mean`` (``s``).
  ``mean_reduction`` c > 0 (default 0: the sums above) makes it upstream Twinkle's ``DPOLoss``
  reduction, times c: ``c * (mean_pairs(-logsigmoid(...)) + sft_weight * sum_chosen(-s_c) /
  sum_chosen(weights))`` (the SFT term is the token mean of the chosen datums' NLL; c = 1/k
  for a gradient-accumulation window of k calls). The counts are the whole request's, or
  ``num_pairs`` / ``num_chosen_tokens`` when given (the scheduler sets them on the slices of a
  sliced request).

Embedding losses (`engine.rules.EMBEDDING_LOSS_FNS`; upstream Twinkle's ``InfonceLoss`` with
``task='embedding'``, reached through the native API only) take no targets: each datum is one
sentence, ``loss_fn_inputs["anchor"]`` [1] is 1 for an anchor (which starts a group: anchor,
positive, then optional negatives) and 0 for the rows of its group. The backend pools each row to
``e`` = L2-normalised final hidden state (the lm_head input) at its last token.

* ``infonce``: with groups g = (anchor a_g, positive p_g, negatives ...) and temperature ``T``,
  ``mean_g CE(a_g · D_g^T / T, index of p_g in D_g)``: with ``use_batch`` 1 (default) ``D_g`` is
  every non-anchor row of the request (in-batch negatives: the other groups' positives and
  negatives), with ``use_batch`` 0 only g's own positive and negatives. A MEAN over groups, not a
  sum (upstream's value, so loss curves match); a request is never sliced or split into
  micro-batches. ``temperature`` default 0.1 (upstream's), must be > 0. Outputs: ``embedding``
  [H] per datum. The math: engine/backends/embedding_loss.py.

Every loss also accepts ``loss_fn_config["disable_lora"]`` (forward_only only): logprobs of the base
model, without the adapter.

Upstream Twinkle's Tinker DPO convention (its cookbook ``tinker/dpo.py``;
engine/backends/tinker_dpo.py):
``importance_sampling`` with ``dpo_*`` keys in ``loss_fn_config`` (``dpo_beta`` default 0.1,
``dpo_sft_weight`` default 0.0, ``dpo_loss_type`` 'sigmoid' only) and
``loss_fn_inputs["ref_logps"]`` on every datum runs as ``dpo`` with ``ref_logprobs = ref_logps``
and ``mean_reduction`` 1 (as upstream's server runs its ``DPOLoss``: ``loss:sum`` is then
upstream's loss value, the mean over pairs plus ``dpo_sft_weight`` times the chosen token mean).
Without ``dpo_*`` keys, ``importance_sampling`` is Tinker's, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.errors import UserInputError
from engine.rules import RECORDED_LOGPROBS, RECORDED_MASK, STABLE_REINFORCE

if TYPE_CHECKING:
    from engine.backends.train_rows import Request

#: accepted by every loss: forward through the base model only (reference logprobs)
DISABLE_LORA = "disable_lora"
#: dpo's loss_fn_config keys of the mean reduction (module doc)
MEAN_REDUCTION, NUM_PAIRS, NUM_CHOSEN_TOKENS = "mean_reduction", "num_pairs", "num_chosen_tokens"


# ----------------------------------------------------------------------------------- the math


def ratio_of(lp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Importance ratio ``exp(lp - old)`` (learner over sampler)."""
    return torch.exp(lp - old)


def cross_entropy(lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``-lp * weights``; for ``[N, K]`` inputs summed over K → [N]."""
    per = -lp * weights
    return per.sum(-1) if per.dim() == 2 else per


def importance_sampling(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Per-token ``-ratio * A``."""
    return -ratio_of(lp, old) * adv


def ppo(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Per-token ``-min(ratio * A, clamp(ratio, low, high) * A)``."""
    ratio = ratio_of(lp, old)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def cispo(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Per-token ``-stopgrad(clamp(ratio, low, high)) * lp * A``."""
    weight = ratio_of(lp, old).clamp(low, high).detach()
    return -weight * lp * adv


def dro(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token ``-(lp * A - 0.5 * beta * (lp - old) ** 2)``."""
    return -(lp * adv - 0.5 * beta * (lp - old) ** 2)


def gspo(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
) -> torch.Tensor:
    """Per-token GSPO-token loss of one datum: the sequence ratio over ``mask != 0`` for every
    token's value, each token's own gradient, PPO's clipped min with A."""
    log_s = (lp.detach() - old)[mask != 0].mean()
    ratio = torch.exp(log_s + lp - lp.detach())
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def stable_reinforce(
    lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> tuple[torch.Tensor, dict[str, tuple[float, int]]]:
    """Per-token loss of one datum and its partial metrics (``name -> (sum, count)``).

    Truncated importance weights against the sampler's recorded logprobs, with the tokens whose
    ratio leaves the trust band masked rather than clipped (a clipped token still pushes in the
    direction the stale sample says; a masked one does not), and the whole datum masked when its
    geometric-mean ratio says it was sampled from a different policy. The weight is detached, so
    the gradient of a kept token is ``-r * A * grad(lp)``, the importance-sampling gradient."""
    sampled = x[RECORDED_MASK] != 0
    d = lp.detach() - x[RECORDED_LOGPROBS]
    r = torch.exp(d)
    n = int(sampled.sum())
    keep = sampled & (r >= cfg["token_mask_low"]) & (r <= cfg["token_mask_high"])
    geo = torch.exp(d[sampled].mean()) if n else torch.ones((), dtype=d.dtype)
    seq_ok = bool(cfg["seq_mask_low"] <= float(geo) <= cfg["seq_mask_high"])
    if not seq_ok:
        keep = torch.zeros_like(keep)
    weight = torch.where(keep, r, torch.zeros_like(r))
    per = -weight * lp * x["advantages"]
    rs = r[sampled].double()
    metrics = {
        "sr_masked_frac:mean": (float(n - int(keep.sum())), n),
        "sr_seq_masked_frac:mean": (float(not seq_ok), 1 if n else 0),
        "sr_ratio:mean": (float(rs.sum()), n),
        "sr_kl:mean": (float((rs - 1 - torch.log(rs)).sum()), n),
        "sr_sampled_tokens:sum": (float(n), 1),
    }
    return per, metrics


def sequence_logprob(lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(lp * weights)``: log p of the weighted (response) tokens of one datum."""
    return (lp * weights).sum()


def dpo(
    seq: torch.Tensor,
    ref: torch.Tensor,
    beta: float,
    sft_weight: float,
    pair_scale: float = 1.0,
    sft_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO over pairs. ``seq`` / ``ref`` [2P]: policy / reference sequence logprobs in the order
    chosen_0, rejected_0, chosen_1, ... Loss ``pair_scale * sum_pairs(-logsigmoid(margin)) +
    sft_weight * sft_scale * sum_chosen(-s_c)`` (scales 1: the sum). Returns (loss, margins [P]
    detached)."""
    s_c, s_r, r_c, r_r = seq[0::2], seq[1::2], ref[0::2], ref[1::2]
    margin = beta * ((s_c - r_c) - (s_r - r_r))
    loss = pair_scale * -F.logsigmoid(margin).sum() + sft_weight * sft_scale * (-s_c).sum()
    return loss, margin.detach()


# ----------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class LossSpec:
    """What a loss needs. ``inputs``: float [N] ``loss_fn_inputs`` it requires (besides
    ``target_tokens``); ``optional``: ones it reads if present; ``config``: accepted
    ``loss_fn_config`` keys with their defaults (``disable_lora`` is accepted by all)."""

    name: str
    inputs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    config: Mapping[str, float] = field(default_factory=dict)
    #: (lp [N] or [N, K], float inputs by name, config) → per-token loss [N]; None for DPO
    per_token: Callable[..., torch.Tensor] | None = None
    top_k: bool = False  # accepts [N, K] target_tokens / weights
    paired: bool = False  # datums come in (chosen, rejected) pairs
    embedding: bool = False  # over pooled sentence embeddings; datums carry ``anchor``, no targets
    #: (float inputs of one datum, field prefix) → raises UserInputError; checks beyond shapes
    check: Callable[[Mapping[str, np.ndarray], str], None] | None = None
    #: (lp [N], float inputs, config) → (per-token loss [N], partial metrics ``name -> (sum,
    #: count)``); set instead of ``per_token`` by a loss that reports metrics of its own
    per_token_metrics: Callable[..., tuple[torch.Tensor, dict[str, tuple[float, int]]]] | None = (
        None
    )


def clip_range(cfg: Mapping[str, float]) -> tuple[float, float]:
    return cfg["clip_low_threshold"], cfg["clip_high_threshold"]


def _some_masked(x: Mapping[str, np.ndarray], field: str) -> None:
    if not np.any(x["sequence_ratio_mask"] != 0):
        raise UserInputError(
            f"{field}.sequence_ratio_mask: marks no token (all zeros); gspo's sequence ratio is "
            "the mean log-ratio over the marked tokens, usually the sampled ones"
        )


def _sampled_only(x: Mapping[str, np.ndarray], field: str) -> None:
    off = np.flatnonzero((x["advantages"] != 0) & (x[RECORDED_MASK] == 0))
    if off.size:
        raise UserInputError(
            f"{field}.advantages: nonzero at position {int(off[0])}, which no "
            "SampledProvenanceSpan of loss_fn_input_spans covers; stable_reinforce trains the "
            "sampled tokens only (its weights come from the sampler's recorded logprobs), so "
            "give prompt and other unsampled positions advantage 0"
        )


LOSSES: dict[str, LossSpec] = {
    s.name: s
    for s in (
        LossSpec(
            "cross_entropy",
            optional=("weights",),
            per_token=lambda lp, x, cfg: cross_entropy(lp, x["weights"]),
            top_k=True,
        ),
        LossSpec(
            "importance_sampling",
            inputs=("logprobs", "advantages"),
            per_token=lambda lp, x, cfg: importance_sampling(lp, x["logprobs"], x["advantages"]),
        ),
        LossSpec(
            "ppo",
            inputs=("logprobs", "advantages"),
            config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            per_token=lambda lp, x, cfg: ppo(lp, x["logprobs"], x["advantages"], *clip_range(cfg)),
        ),
        LossSpec(
            "cispo",
            inputs=("logprobs", "advantages"),
            config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            per_token=lambda lp, x, cfg: cispo(
                lp, x["logprobs"], x["advantages"], *clip_range(cfg)
            ),
        ),
        LossSpec(
            "dro",
            inputs=("logprobs", "advantages"),
            config={"beta": 0.05},
            per_token=lambda lp, x, cfg: dro(lp, x["logprobs"], x["advantages"], cfg["beta"]),
        ),
        LossSpec(
            "gspo",
            inputs=("logprobs", "advantages", "sequence_ratio_mask"),
            config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            per_token=lambda lp, x, cfg: gspo(
                lp, x["logprobs"], x["advantages"], x["sequence_ratio_mask"], *clip_range(cfg)
            ),
            check=_some_masked,
        ),
        LossSpec(
            STABLE_REINFORCE,
            inputs=("advantages", RECORDED_LOGPROBS, RECORDED_MASK),
            config={
                "token_mask_low": 0.5,
                "token_mask_high": 2.0,
                "seq_mask_low": 0.9,
                "seq_mask_high": 1.1,
            },
            per_token_metrics=stable_reinforce,
            check=_sampled_only,
        ),
        LossSpec(
            "dpo",
            optional=("weights", "ref_logprobs"),
            config={
                "beta": 0.1,
                "sft_weight": 0.0,
                MEAN_REDUCTION: 0.0,
                NUM_PAIRS: 0.0,
                NUM_CHOSEN_TOKENS: 0.0,
            },
            paired=True,
        ),
        LossSpec(
            "infonce",
            inputs=("anchor",),
            config={"temperature": 0.1, "use_batch": 1.0},
            embedding=True,
        ),
    )
}
#: the token losses: what Tinker's routes offer and what an unknown loss_fn error lists
KNOWN_LOSSES = tuple(sorted(n for n, s in LOSSES.items() if not s.embedding))
EMBEDDING_LOSSES = tuple(sorted(n for n, s in LOSSES.items() if s.embedding))


def get_loss(name: object) -> LossSpec:
    """The spec of ``name``; UserInputError listing the known losses otherwise (no fallback)."""
    spec = LOSSES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise UserInputError(f"unknown loss_fn {name!r}; known: {', '.join(KNOWN_LOSSES)}")
    return spec


# ----------------------------------------------------------------------------------- metrics


class MetricSums:
    """Partial metrics of one request, merged across micro-batches: ``name → (sum, count)``;
    ``:mean`` metrics reduce to sum / count, every other reduction to the sum."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {"loss:sum": [0.0, 0]}

    def add(self, name: str, total: float, count: int = 1) -> None:
        part = self.parts.setdefault(name, [0.0, 0])
        part[0] += float(total)
        part[1] += int(count)

    def result(self) -> dict[str, float]:
        return {k: (s / c if k.endswith(":mean") and c else s) for k, (s, c) in self.parts.items()}


# ----------------------------------------------------------------------------------- one request


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def dpo_scales(req: Request) -> tuple[float, float]:
    """(pair_scale, sft_scale) of `dpo` for ``req``: 1, 1 (sums) unless ``mean_reduction`` c > 0:
    c / pairs and c / chosen tokens (the weights' sum over the chosen datums, at least 1) of the
    whole request (``num_pairs`` / ``num_chosen_tokens`` when given: set by the slicer, so every
    slice divides by the whole request's counts)."""
    c = req.config.get(MEAN_REDUCTION, 0.0)
    if c <= 0:
        return 1.0, 1.0
    pairs = req.config.get(NUM_PAIRS) or len(req.data) // 2
    chosen = req.config.get(NUM_CHOSEN_TOKENS) or float(
        sum(float(d.weights[:, 0].sum()) for d in req.data[0::2])
    )
    return c / max(pairs, 1), c / max(chosen, 1.0)


def request_loss(
    req: Request,
    idx: Sequence[int],
    lps: Sequence[torch.Tensor],
    refs: Sequence[torch.Tensor | None],
    outputs: list[dict[str, np.ndarray]],
    metrics: MetricSums,
    device: torch.device,
) -> torch.Tensor:
    """Loss (a sum) of the datums ``idx`` of ``req`` (whole DPO pairs), given their learner
    logprobs ``lps`` ([N, K] each) and, for DPO rows without ``ref_logprobs``, the base model's
    logprobs in ``refs``. Writes ``outputs[i]`` for each datum and adds to ``metrics``."""
    spec, cfg = req.loss, req.config
    tensors = []
    for i in idx:
        d = req.data[i]
        x = {k: torch.from_numpy(v).to(device) for k, v in d.inputs.items()}
        x["weights"] = torch.from_numpy(d.weights).to(device)
        tensors.append(x)
    if spec.per_token is not None or spec.per_token_metrics is not None:
        parts = []
        for i, lp, x in zip(idx, lps, tensors, strict=True):
            if not spec.top_k:
                lp, x["weights"] = lp[:, 0], x["weights"][:, 0]
            with_metrics = spec.per_token_metrics
            if with_metrics is not None:
                per, partial = with_metrics(lp, x, cfg)
                for name, (total, count) in partial.items():
                    metrics.add(name, total, count)
            else:
                assert spec.per_token is not None
                per = spec.per_token(lp, x, cfg)
            lpo = _f32(lp)
            outputs[i] = {
                "logprobs": lpo if req.data[i].two_d or lpo.ndim == 1 else lpo[:, 0].copy(),
                "elementwise_loss": _f32(per),
            }
            parts.append(per.sum())
        loss = torch.stack(parts).sum()
    else:  # DPO: (chosen, rejected) pairs
        seq, ref_seq = [], []
        for i, lp, x, r in zip(idx, lps, tensors, refs, strict=True):
            lp, w = lp[:, 0], x["weights"][:, 0]
            seq.append(sequence_logprob(lp, w))
            ref_lp = x["ref_logprobs"] if r is None else r
            ref_seq.append(sequence_logprob(ref_lp.to(lp.dtype), w))
            outputs[i] = {"logprobs": _f32(lp)}
        s, r = torch.stack(seq), torch.stack(ref_seq)
        loss, margins = dpo(s, r, cfg["beta"], cfg["sft_weight"], *dpo_scales(req))
        pairs = int(margins.numel())
        metrics.add("dpo_accuracy:mean", float((margins > 0).sum()), pairs)
        metrics.add("dpo_margin:mean", float(margins.double().sum()), pairs)
        s, r = s.detach().double(), r.detach().double()
        for side, k in (("chosen", 0), ("rejected", 1)):
            metrics.add(f"dpo_{side}_logps:mean", float(s[k::2].sum()), pairs)
            reward = cfg["beta"] * (s[k::2] - r[k::2]).sum()
            metrics.add(f"dpo_{side}_reward:mean", float(reward), pairs)
    metrics.add("loss:sum", float(loss.detach()))
    return loss

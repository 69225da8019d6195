"""Metrics added with `MultiLoraTransformersModel.add_metric`: an allow-list of upstream Twinkle's
metric names (only the name is read; nothing is imported or instantiated).

* ``DPOMetric(beta=0.1)``: over (chosen, rejected) pairs in batch order, with the same keys as
  upstream's ``twinkle.metric.DPOMetric``: ``logps/chosen``, ``logps/rejected`` (mean over pairs of
  the sequence log-prob, the sum over trained positions) and, when the batch had reference
  log-probs (``ref_outputs`` / ``ref_logprobs``), ``logps/ref_chosen``, ``logps/ref_rejected``,
  ``rewards/chosen``, ``rewards/rejected`` (``beta * (policy - reference)``),
  ``rewards/margins`` (chosen - rejected) and ``rewards/accuracies`` (share of pairs with margin
  > 0). Values are floats (upstream formats strings; accuracies are a fraction in [0, 1], not a
  percentage).
* ``EmbeddingMetric`` (embedding training, ``task='embedding'``): upstream's
  ``twinkle.metric.EmbeddingMetric`` keys over the anchors (rows marked 1) and the row after each
  (its positive), from the pooled L2-normalised embeddings of every pass since the last report:
  ``pos_sim`` (mean anchor-positive cosine similarity), ``pos_sim_min``, ``pos_sim_max``, and
  ``neg_sim`` (mean similarity of each anchor with the OTHER anchors' positives of its pass; only
  from passes with at least 2 anchors). ``loss`` and ``grad_norm`` are in calculate_metric's
  result already (the loss is the mean over passes, as upstream's). Floats, not upstream's
  formatted strings. Passes without embeddings add nothing.
* ``LossMetric``, ``TrainMetric``: what they report (loss, grad_norm, lr, step) is always in
  calculate_metric's result; accepted so upstream scripts run, they add nothing.

No torch here (numpy only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import UserInputError
from engine.protocol import DatumInput

KNOWN_METRICS = ("DPOMetric", "EmbeddingMetric", "LossMetric", "TrainMetric")
_BUILT_IN = ("lossmetric", "trainmetric")
_NOT_YET = {
    "accuracy": "Accuracy needs the logits, which the engine does not return",
}


def _seq(lp: Any, d: DatumInput) -> float:
    """sum(lp * weights) over the datum's positions (first column of [N, K] inputs)."""
    a = np.asarray(lp, dtype=np.float64)
    a = a[:, 0] if a.ndim == 2 else a
    w = d.loss_fn_inputs.get("weights")
    w = np.ones(a.shape) if w is None else np.asarray(w, dtype=np.float64)
    w = w[:, 0] if w.ndim == 2 else w
    return float((a * w).sum())


@dataclass
class DPOMetric:
    beta: float = 0.1
    pairs: int = 0
    chosen: float = 0.0
    rejected: float = 0.0
    ref_pairs: int = 0
    ref_chosen: float = 0.0
    ref_rejected: float = 0.0
    margins: float = 0.0
    correct: int = 0

    name = "DPOMetric"

    def check(self, data: list[DatumInput]) -> None:
        """Before a pass: the batch must be pairs (raise before any compute)."""
        if len(data) % 2:
            raise UserInputError(
                f"inputs: DPOMetric takes (chosen, rejected) pairs in batch order, so an even "
                f"number of samples; got {len(data)}"
            )

    def record(self, data: list[DatumInput], res: dict[str, Any]) -> None:
        logprobs = res.get("logprobs")
        if logprobs is None or any(lp is None for lp in logprobs):
            return  # not a log-prob pass (task='embedding')
        seqs = [_seq(lp, d) for lp, d in zip(logprobs, data, strict=True)]
        has_ref = all("ref_logprobs" in d.loss_fn_inputs for d in data)
        refs = [_seq(d.loss_fn_inputs["ref_logprobs"], d) for d in data] if has_ref else []
        for p in range(len(seqs) // 2):
            c, r = seqs[2 * p], seqs[2 * p + 1]
            self.pairs += 1
            self.chosen += c
            self.rejected += r
            if has_ref:
                rc, rr = refs[2 * p], refs[2 * p + 1]
                margin = self.beta * ((c - rc) - (r - rr))
                self.ref_pairs += 1
                self.ref_chosen += rc
                self.ref_rejected += rr
                self.margins += margin
                self.correct += int(margin > 0)

    def summary(self) -> dict[str, float]:
        """The figures since the last call, then reset (empty before any pair)."""
        out: dict[str, float] = {}
        if self.pairs:
            out["logps/chosen"] = self.chosen / self.pairs
            out["logps/rejected"] = self.rejected / self.pairs
        if self.ref_pairs:
            n = self.ref_pairs
            out["logps/ref_chosen"] = self.ref_chosen / n
            out["logps/ref_rejected"] = self.ref_rejected / n
            out["rewards/chosen"] = self.beta * (self.chosen - self.ref_chosen) / n
            out["rewards/rejected"] = self.beta * (self.rejected - self.ref_rejected) / n
            out["rewards/margins"] = self.margins / n
            out["rewards/accuracies"] = self.correct / n
        self.__init__(beta=self.beta)  # type: ignore[misc]
        return out


@dataclass
class EmbeddingMetric:
    pos_sum: float = 0.0
    pos_min: float = math.inf
    pos_max: float = -math.inf
    pos_count: int = 0
    neg_sum: float = 0.0
    neg_count: int = 0

    name = "EmbeddingMetric"

    def check(self, data: list[DatumInput]) -> None:
        return None  # any batch: passes without embeddings add nothing

    def record(self, data: list[DatumInput], res: dict[str, Any]) -> None:
        emb = res.get("embeddings")
        if not emb or any(e is None for e in emb):
            return
        e = np.asarray(emb, dtype=np.float64)
        anchor = [
            i for i, d in enumerate(data) if float(np.asarray(d.loss_fn_inputs["anchor"]).flat[0])
        ]
        anchor = [i for i in anchor if i + 1 < len(data)]
        if not anchor:
            return
        a, p = e[anchor], e[[i + 1 for i in anchor]]
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(p, axis=1)
        cos = (a * p).sum(1) / np.maximum(norms, 1e-8)
        self.pos_sum += float(cos.sum())
        self.pos_min = min(self.pos_min, float(cos.min()))
        self.pos_max = max(self.pos_max, float(cos.max()))
        self.pos_count += len(anchor)
        if len(anchor) > 1:
            sim = a @ p.T
            off = ~np.eye(len(anchor), dtype=bool)
            self.neg_sum += float(sim[off].sum())
            self.neg_count += int(off.sum())

    def summary(self) -> dict[str, float]:
        """The figures since the last call, then reset (empty before any pass with anchors)."""
        out: dict[str, float] = {}
        if self.pos_count:
            out["pos_sim"] = self.pos_sum / self.pos_count
            out["pos_sim_min"] = self.pos_min
            out["pos_sim_max"] = self.pos_max
        if self.neg_count:
            out["neg_sim"] = self.neg_sum / self.neg_count
        self.__init__()  # type: ignore[misc]
        return out


def make_metric(metric_cls: Any, kwargs: dict[str, Any]) -> DPOMetric | EmbeddingMetric | None:
    """The metric for ``metric_cls`` (a name, class or instance); None for the built-in ones."""
    name = metric_cls if isinstance(metric_cls, str) else getattr(metric_cls, "__name__", None)
    if name is None:
        name = type(metric_cls).__name__
    norm = name.lower()
    if norm in _NOT_YET:
        raise UserInputError(f"metric_cls {name!r}: {_NOT_YET[norm]}")
    if norm in _BUILT_IN:
        return None
    if norm == "embeddingmetric":
        if kwargs:
            raise UserInputError(
                f"EmbeddingMetric: unsupported argument(s) {', '.join(sorted(kwargs))}"
            )
        return EmbeddingMetric()
    if norm != "dpometric":
        raise UserInputError(f"unknown metric_cls {name!r}; accepted: {', '.join(KNOWN_METRICS)}")
    kw = dict(kwargs)
    beta = kw.pop("beta", 0.1)
    if kw.pop("ignore_index", -100) != -100:
        raise UserInputError("DPOMetric: ignore_index must be -100")
    if kw:
        raise UserInputError(f"DPOMetric: unsupported argument(s) {', '.join(sorted(kw))}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
        raise UserInputError(f"DPOMetric: beta {beta!r} must be a finite number")
    return DPOMetric(beta=float(beta))

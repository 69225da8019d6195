"""InfoNCE (upstream Twinkle's ``InfonceLoss``, ``task='embedding'``) over pooled, L2-normalised
sentence embeddings: rows come in groups, an anchor followed by its positive and optional
negatives; with ``use_batch`` every non-anchor row of the request is a candidate for every
anchor (in-batch negatives). The loss is the mean over groups of the cross-entropy of the
anchor's similarities / ``temperature`` with its positive, upstream's value (engine/backends/
losses.py's registry holds its config; train_transformers.py pools the embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.backends.losses import MetricSums

if TYPE_CHECKING:
    from engine.backends.train_rows import Request


def groups_of(anchor: Sequence[bool]) -> list[tuple[int, int]]:
    """(start, end) row ranges of the groups: each anchor starts one, up to the next anchor."""
    starts = [i for i, a in enumerate(anchor) if a]
    return list(zip(starts, [*starts[1:], len(anchor)], strict=True))


def infonce(
    emb: torch.Tensor, anchor: Sequence[bool], temperature: float, use_batch: bool
) -> torch.Tensor:
    """InfoNCE over L2-normalised embeddings ``emb`` [B, H] (module doc): mean over groups of
    the cross-entropy of the anchor's similarities / ``temperature`` with its positive."""
    groups = groups_of(anchor)
    if use_batch:
        docs = [j for s, e in groups for j in range(s + 1, e)]
        where = {j: k for k, j in enumerate(docs)}
        q = emb[[s for s, _ in groups]]
        logits = q @ emb[docs].T / temperature
        target = torch.tensor([where[s + 1] for s, _ in groups], device=emb.device)
        return F.cross_entropy(logits, target)
    parts = []
    for s, e in groups:
        logits = (emb[s + 1 : e] @ emb[s]) / temperature
        parts.append(torch.logsumexp(logits, 0) - logits[0])
    return torch.stack(parts).mean()


def embedding_loss(
    req: Request,
    idx: Sequence[int],
    emb: torch.Tensor,
    outputs: list[dict[str, np.ndarray]],
    metrics: MetricSums,
) -> torch.Tensor:
    """Loss of an embedding request over all its datums ``idx`` (in order), given their pooled,
    L2-normalised embeddings ``emb`` [B, H]. Writes ``outputs[i]["embedding"]``."""
    anchor = [bool(req.data[i].inputs["anchor"][0]) for i in idx]
    cfg = req.config
    loss = infonce(emb, anchor, cfg["temperature"], bool(cfg["use_batch"]))
    e = emb.detach().cpu().numpy().astype(np.float32)
    for k, i in enumerate(idx):
        outputs[i] = {"embedding": e[k].copy()}
    metrics.add("loss:sum", float(loss.detach()))
    return loss

"""The batched decoding loop of the torch sampler: many requests, many adapters, one KV cache.

Owns the per-request decoding state (`RequestState`) and `decode_batch`, which runs every row of
every request (``num_samples`` rows each) through one left-padded prefill and one decode loop:

* rows are ordered by adapter (base-model rows first, in no LoRA segment), then by request, so each
  adapter's rows form one contiguous `lora_routing` segment at every step;
* the prefill runs one row per request (prompts left-padded, attention mask + position ids that
  count only real tokens); its KV cache is then gathered to the request's ``num_samples`` rows;
* each decode step feeds one token per live row with the attention mask grown by one column and
  each row's own next position; finished rows are dropped from the batch and from the cache;
* sampling is per request: greedy (temperature 0) is an argmax, otherwise top-k/top-p filtering and
  one ``torch.multinomial`` call over the request's live rows with the request's own generator, so
  the random stream a request consumes does not depend on what else is in the batch.

Results therefore equal decoding each request alone (up to float rounding of batched GEMMs: logprobs
agree to ~1e-6, greedy tokens are identical unless two logits tie to that precision).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.backends.lora import Segment, lora_routing
from engine.backends.vision import Vision, VisionInputs
from engine.protocol import (
    TOPK_MASK_LOGPROB,
    SampledSequence,
    SampleInput,
    SampleOutput,
    TopkLogprobs,
)


def filter_logits(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and outside the top-p nucleus, per row."""
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does (the most likely token is always kept)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x


@dataclass
class RequestState:
    """One validated request and what it has produced so far."""

    inp: SampleInput
    adapter: str | None  # internal adapter id, None for the base model
    prompt: list[int]
    stop_ids: set[int]
    generator: torch.Generator | None  # None: greedy
    #: for prompt_alt_tokens draws: separate from ``generator`` so that asking for alternatives
    #: does not change the sampled sequences
    alt_gen: torch.Generator | None = None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    topk_prompt: TopkLogprobs | None = None
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None
    target_prompt_logprobs: np.ndarray | None = None
    #: per sample, per generated token: the top-k (ids, logprobs), when topk_sample_logprobs > 0
    topk: list[list[tuple[list[int], list[float]]]] = field(default_factory=list)
    #: called as ``listener(sample_index, token, logprob)`` for each token as it is generated
    #: (on the decoding thread), for streaming; None when nobody listens
    listener: Callable[[int, int, float], None] | None = None
    #: the prompt's images, processed (VL models; ``prompt`` holds their image tokens)
    vision: VisionInputs | None = None

    def __post_init__(self) -> None:
        n = self.inp.num_samples
        self.tokens = [[] for _ in range(n)]
        self.logprobs = [[] for _ in range(n)]
        self.reasons = ["length"] * n
        self.topk = [[] for _ in range(n)]
        self.stops = list(self.inp.params.stop_strings)
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 1

    @property
    def num_samples(self) -> int:
        return self.inp.num_samples

    def output(self) -> SampleOutput:
        k = self.inp.topk_sample_logprobs
        seqs = []
        for r in range(self.num_samples):
            topk = None
            if k:
                n = len(self.topk[r])
                topk = TopkLogprobs(
                    np.array([ids for ids, _ in self.topk[r]], np.int32).reshape(n, k),
                    np.array([lps for _, lps in self.topk[r]], np.float32).reshape(n, k),
                )
            seqs.append(
                SampledSequence(self.tokens[r], self.logprobs[r], self.reasons[r], topk)  # type: ignore[arg-type]
            )
        return SampleOutput(
            sequences=seqs,
            prompt_logprobs=self.prompt_logprobs if self.inp.prompt_logprobs else None,
            topk_prompt=self.topk_prompt,
            prompt_alt_tokens=self.prompt_alt_tokens,
            target_prompt_logprobs=self.target_prompt_logprobs,
        )

    @property
    def wants_prompt_scores(self) -> bool:
        i = self.inp
        return bool(i.prompt_logprobs or i.prompt_alt_tokens_k or i.target_prompt_ids is not None)


def prompt_scores(
    r: RequestState, logits: torch.Tensor, targets: torch.Tensor, alt_gen: torch.Generator | None
) -> None:
    """Fill ``r``'s prompt logprobs, top-k rows, alternative draws and target logprobs from
    ``logits`` at prompt positions 0..L-2 (each predicting the next token) and ``targets`` =
    prompt tokens 1..L-1."""
    lp = torch.log_softmax(logits, dim=-1)
    length = lp.shape[0] + 1
    ids = r.inp.target_prompt_ids
    if ids is not None:
        t = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=lp.device)
        vals = lp.gather(-1, t.clamp(min=0)).masked_fill(t < 0, 0.0)
        r.target_prompt_logprobs = vals.cpu().numpy().astype(np.float32)
    k = r.inp.prompt_alt_tokens_k
    if k:
        temp = r.inp.params.temperature
        if temp == 0:  # greedy: every draw is the most likely token
            draws = lp.argmax(-1, keepdim=True).expand(-1, k)
        else:
            probs = torch.softmax(logits / temp, dim=-1)
            draws = torch.multinomial(probs, k, replacement=True, generator=alt_gen)
        r.prompt_alt_tokens = (
            draws.cpu().numpy().astype(np.int64),
            lp.gather(-1, draws).cpu().numpy().astype(np.float32),
        )
    if not r.inp.prompt_logprobs:
        return
    picked = lp.gather(-1, targets[:, None])[:, 0]
    vals = [math.nan] + [float(v) for v in picked.cpu()]
    skip = 0 if r.inp.prompt_logprobs_last_n is None else length - r.inp.prompt_logprobs_last_n
    vals[:skip] = [math.nan] * skip
    r.prompt_logprobs = vals
    k = r.inp.topk_prompt_logprobs
    if k:
        top = lp.topk(k, dim=-1)
        ids = np.zeros((length, k), np.int32)
        lps = np.full((length, k), TOPK_MASK_LOGPROB, np.float32)
        ids[1:] = top.indices.cpu().numpy()
        lps[1:] = top.values.cpu().numpy()
        ids[:skip], lps[:skip] = 0, TOPK_MASK_LOGPROB
        r.topk_prompt = TopkLogprobs(ids, lps)


def adapter_segments(row_adapters: list[str | None]) -> list[Segment]:
    """Contiguous runs of equal non-None adapter ids → routing segments (base rows: none)."""
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(row_adapters) + 1):
        if i == len(row_adapters) or row_adapters[i] != row_adapters[start]:
            if row_adapters[start] is not None:
                segments.append((row_adapters[start], start, i))  # type: ignore[arg-type]
            start = i
    return segments


def _runs(row_req: list[int]) -> list[tuple[int, int, int]]:
    """(request index, start, end) for each run of rows of one request (rows of a request are
    contiguous: they are ordered by request and dropping rows keeps the order)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(row_req) + 1):
        if i == len(row_req) or row_req[i] != row_req[start]:
            runs.append((row_req[start], start, i))
            start = i
    return runs


@dataclass
class _Rows:
    """The live decode rows: which request and sample each is, the KV cache and attention mask
    they share, and each row's next position."""

    req: list[int]
    sample: list[int]
    cache: Any
    mask: torch.Tensor
    next_pos: torch.Tensor

    def keep(self, keep: list[int], device: torch.device) -> torch.Tensor:
        """Drop the finished rows (all but ``keep``) from the batch and the cache; ``keep`` as a
        tensor, to select the same rows elsewhere."""
        idx = torch.tensor(keep, dtype=torch.long, device=device)
        self.cache.batch_select_indices(idx)
        self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
        self.req = [self.req[j] for j in keep]
        self.sample = [self.sample[j] for j in keep]
        return idx


def _prefill(
    model: nn.Module,
    reqs: list[RequestState],
    pad_id: int,
    device: torch.device,
    vision: Vision | None,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One left-padded row per request through the model (prompt scores where asked): the KV
    cache, each row's last logits, the attention mask and the M-RoPE position delta per row."""
    lengths = [len(r.prompt) for r in reqs]
    width = max(lengths)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - lengths[i] :] = torch.tensor(r.prompt, dtype=torch.long)
        mask[i, width - lengths[i] :] = 1
    ids, mask = ids.to(device), mask.to(device)
    # positions count real tokens only; padding gets 1 (any finite position: it is masked out)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    extra = vision.batch_kwargs([r.vision for r in reqs], ids) if vision is not None else {}
    delta = torch.zeros(len(reqs), dtype=torch.long, device=device)
    if extra:
        positions, delta = vision.rope_positions(model, ids, mask, extra)  # type: ignore[union-attr]
    want_prompt_lps = any(r.wants_prompt_scores for r in reqs)
    patches = [0 if r.vision is None else r.vision.pixel_values.shape[0] for r in reqs]
    with lora_routing(model, adapter_segments([r.adapter for r in reqs]), patches):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if want_prompt_lps else 1,
            **extra,
        )
    for i, r in enumerate(reqs):
        if r.wants_prompt_scores:
            lo = width - lengths[i]
            prompt_scores(r, out.logits[i, lo : width - 1].float(), ids[i, lo + 1 :], r.alt_gen)
    return out.cache, out.logits[:, -1, :].float(), mask, delta


def _expand(
    reqs: list[RequestState],
    cache: Any,
    last: torch.Tensor,
    mask: torch.Tensor,
    delta: torch.Tensor,
    device: torch.device,
) -> tuple[_Rows, torch.Tensor]:
    """The prefill's one row per request gathered to one row per sample; the rows' logits."""
    row_req = [i for i, r in enumerate(reqs) for _ in range(r.num_samples)]
    row_sample = [s for r in reqs for s in range(r.num_samples)]
    if len(row_req) != len(reqs):
        gather = torch.tensor(row_req, dtype=torch.long, device=device)
        cache.batch_select_indices(gather)
        last, mask, delta = last[gather], mask[gather], delta[gather]
    # M-RoPE rows continue from their shifted positions (delta 0 for text-only rows and models)
    lengths = torch.tensor([len(reqs[i].prompt) for i in row_req], dtype=torch.long, device=device)
    return _Rows(row_req, row_sample, cache, mask, lengths + delta), last


_Picked = tuple[torch.Tensor, torch.Tensor, list, list]


def _pick(logits: torch.Tensor, reqs: list[RequestState], row_req: list[int]) -> _Picked:
    """Each row's next token (argmax, or a draw from the request's own generator over its
    filtered distribution) and its logprob, plus the top-k logprobs when any request asks."""
    raw_lp = torch.log_softmax(logits, dim=-1)
    nxt = torch.argmax(logits, dim=-1)
    for i, start, end in _runs(row_req):
        r = reqs[i]
        if r.generator is None:
            continue
        p = r.inp.params
        x = filter_logits(logits[start:end] / p.temperature, p.top_k, p.top_p)
        draw = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=r.generator)
        nxt[start:end] = draw[:, 0]
    chosen = raw_lp.gather(-1, nxt[:, None])[:, 0]
    top_ids: list = []
    top_lps: list = []
    if top_k_max := max(r.inp.topk_sample_logprobs for r in reqs):
        top = raw_lp.topk(top_k_max, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return nxt, chosen, top_ids, top_lps


def _record(
    reqs: list[RequestState],
    rows: _Rows,
    picked: _Picked,
    hits_stop: Callable[[list[int], list[str], int], bool],
) -> list[int]:
    """Append each row's token to its request's state (and tell its listener); the rows that go
    on (neither stopped nor at max_tokens)."""
    nxt, chosen, top_ids, top_lps = picked
    keep: list[int] = []
    for j, (tok, lpv) in enumerate(zip(nxt.tolist(), chosen.tolist(), strict=True)):
        r = reqs[rows.req[j]]
        s = rows.sample[j]
        toks = r.tokens[s]
        toks.append(tok)
        r.logprobs[s].append(lpv)
        if k := r.inp.topk_sample_logprobs:
            r.topk[s].append((top_ids[j][:k], top_lps[j][:k]))
        if r.listener is not None:
            r.listener(s, tok, lpv)
        if tok in r.stop_ids or (r.stops and hits_stop(toks, r.stops, r.window)):
            r.reasons[s] = "stop"  # a finished row stops growing
        elif len(toks) < r.inp.params.max_tokens:
            keep.append(j)
    return keep


def _step(
    model: nn.Module, reqs: list[RequestState], rows: _Rows, nxt: torch.Tensor
) -> torch.Tensor:
    """Feed one token per live row (the mask grown by one column); the next logits."""
    rows.mask = torch.cat([rows.mask, rows.mask.new_ones((rows.mask.shape[0], 1))], dim=1)
    with lora_routing(model, adapter_segments([reqs[i].adapter for i in rows.req])):
        out = model(
            input_ids=nxt[:, None],
            attention_mask=rows.mask,
            position_ids=rows.next_pos[:, None],
            cache=rows.cache,
            use_cache=True,
        )
    rows.next_pos = rows.next_pos + 1
    rows.cache = out.cache
    return out.logits[:, -1, :].float()


@torch.no_grad()
def decode_batch(
    model: nn.Module,
    reqs: list[RequestState],
    *,
    pad_id: int,
    device: torch.device,
    hits_stop: Callable[[list[int], list[str], int], bool],
    vision: Vision | None = None,
) -> None:
    """Decode every request of ``reqs`` (already in adapter order) in one batch; fills their state.

    ``vision`` (VL models): rows with images get their pixels and M-RoPE positions (3-D on the
    image, then text positions shifted by the row's delta, also for every decoded token).

    ``hits_stop(tokens, stop_strings, window)`` says whether a row's text now contains a stop
    string. Raises only for unexpected (backend) failures.
    """
    if not reqs:
        return
    cache, last, mask, delta = _prefill(model, reqs, pad_id, device, vision)
    rows, logits = _expand(reqs, cache, last, mask, delta, device)
    while True:
        picked = _pick(logits, reqs, rows.req)
        keep = _record(reqs, rows, picked, hits_stop)
        if not keep:
            break
        nxt = picked[0]
        if len(keep) < len(rows.req):
            nxt = nxt[rows.keep(keep, device)]
        logits = _step(model, reqs, rows, nxt)

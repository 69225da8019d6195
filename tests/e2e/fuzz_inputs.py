"""Hostile inputs for the routes schemathesis cannot reach (tests/e2e/test_fuzz_api.py): the
Tinker protobuf bodies of forward / forward_backward, and the streaming sample routes.

`proto_bodies` yields (what, bytes): random bytes, truncated and bit-flipped valid messages, and
structurally valid messages with hostile contents (token ids out of range or negative, NaN / inf
in float tensors, shapes that do not match their bytes, sparse tensors that declare terabytes,
unknown dtypes, garbage images, unknown losses and configs, seq_ids at the int32 edges).
Among them: sparse tensors each under the per-tensor cap that sum past the request budget
(`SUMMED_SPARSE`, which must be a 413). `stream_bodies` yields JSON bodies for the OpenAI chat /
completion streams and the native sample_stream; `hostile_losses`, custom losses built to allocate
or to spin. Everything is drawn from one seeded generator, so a failure replays."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator

import numpy as np
import torch

from gateway.tinker_api.wire_pb import pb
from tests.factories import empty_sparse

VOCAB = 2048  # twinkle/tiny-chat


def _tensor(arr: np.ndarray, dtype: int, shape: list[int] | None = None) -> pb.Tensor:
    t = pb.Tensor(dtype=dtype, dense=arr.tobytes())
    t.shape.extend(list(arr.shape) if shape is None else shape)
    return t


def _datum(rng: random.Random, n: int, tokens: list[int] | None = None) -> pb.Datum:
    d = pb.Datum()
    toks = tokens if tokens is not None else [rng.randrange(VOCAB) for _ in range(n)]
    d.model_input.add().encoded_text.tokens = struct.pack(f"<{len(toks)}i", *toks)
    targets = np.array([rng.randrange(VOCAB) for _ in range(len(toks))], np.int64)
    d.loss_fn_inputs["target_tokens"].CopyFrom(_tensor(targets, pb.DTYPE_INT64))
    d.loss_fn_inputs["weights"].CopyFrom(_tensor(np.ones(len(toks), np.float32), pb.DTYPE_FLOAT32))
    return d


def _valid(rng: random.Random, model_id: str, seq_id: int) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    for _ in range(rng.randint(1, 3)):
        msg.data.append(_datum(rng, rng.randint(1, 12)))
    return msg


def _hostile(rng: random.Random, msg: pb.ForwardBackwardRequest) -> str:
    """Break one thing in ``msg`` (in place); what was broken."""
    d = msg.data[0]
    lfi = d.loss_fn_inputs
    n = len(lfi["target_tokens"].dense) // 8
    choice = rng.randrange(15)
    if choice == 0:
        d.model_input[0].encoded_text.tokens = struct.pack("<3i", -1, VOCAB, 2**31 - 1)
        return "token ids out of range"
    if choice == 1:
        lfi["weights"].dense = np.array([np.nan, np.inf] * n, np.float32)[:n].tobytes()
        return "NaN / inf weights"
    if choice == 2:
        del lfi["weights"].shape[:]
        lfi["weights"].shape.extend([n + 7])
        return "shape does not match the bytes"
    if choice == 3:
        sparse = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
        sparse.shape.extend([1, 2**40])
        sparse.sparse_csr.crow_indices = np.array([0, 0], np.int64).tobytes()
        lfi["weights"].CopyFrom(sparse)
        return "sparse tensor declaring 4 TB"
    if choice == 4:
        lfi["target_tokens"].dtype = 99
        return "unknown dtype"
    if choice == 5:
        img = d.model_input.add().image
        img.data, img.format = rng.randbytes(rng.randint(0, 64)), rng.choice(["png", "jpeg", "gif"])
        img.expected_tokens = rng.choice([0, 1, 2**31 - 1])
        return "garbage image"
    if choice == 6:
        msg.loss_fn = rng.choice(["", "nope", "custom", "stable_reinforce", "x" * 10000])
        return "unknown loss"
    if choice == 7:
        msg.loss_fn_config["clip_low_threshold"] = rng.choice([float("nan"), -1.0, 1e308])
        msg.loss_fn = "ppo"
        return "hostile loss config"
    if choice == 8:
        msg.seq_id = rng.choice([0, -1, 2**31 - 1, -(2**31)])
        return SEQ_EDGE
    if choice == 9:
        del msg.data[:]
        return "no data"
    if choice == 10:
        d.model_input[0].encoded_text.tokens = b"\x01\x02\x03"  # not a multiple of 4
        return "token bytes not int32"
    if choice == 11:
        big = np.zeros(0, np.int64)
        lfi["target_tokens"].CopyFrom(_tensor(big, pb.DTYPE_INT64, [2**62, 2]))
        return "dense tensor declaring a huge shape"
    if choice == 12:
        msg.loss_fn_config_v2["beta"].text = "\x00" * 100
        msg.loss_fn = "dro"
        return "text where a number belongs"
    if choice == 13:
        # each under the per-tensor cap (2**24 cells), together GiBs once dense: ~100 bytes each
        for extra in range(rng.randint(6, 12)):
            dd = msg.data.add() if extra else d
            if extra:
                dd.CopyFrom(_datum(rng, 3))
            dd.loss_fn_inputs["weights"].CopyFrom(empty_sparse(2**24 - rng.randrange(16)))
        return SUMMED_SPARSE
    msg.model_id = rng.choice(["", "x" * 5000, "../../etc/passwd", "s:train:99999"])
    return "unknown model id"


SEQ_EDGE = "seq_id at the int32 edges"
#: must be refused at the door (413), never expanded: the request's decoded size is summed
SUMMED_SPARSE = "sparse tensors summed past the request budget"


def _grow(rng: random.Random) -> tuple[str, Callable]:
    """One step of a hostile loss: an operation whose output or work outgrows its input."""
    k = rng.choice([1, 2, 3, 40])
    steps: list[tuple[str, Callable]] = [
        ("outer", lambda t: t.reshape(-1, 1) * t.reshape(1, -1)),
        ("index_select", lambda t: torch.index_select(t.reshape(1, -1), 0, t.long().abs())),
        ("take rows", lambda t: t.reshape(1, -1)[t.long().abs()]),
        ("nuc norm", lambda t: torch.norm(t.reshape(-1, 1) * t.reshape(1, -1), p="nuc")),
        (f"x{k} chain", lambda t: _chain(t, k)),
        (f"cat x{k}", lambda t: torch.cat([t] * k)),
        ("sort", lambda t: torch.sort(t.reshape(-1))[0]),
        ("cumsum", lambda t: torch.cumsum(t.reshape(-1), 0)),
    ]
    return rng.choice(steps)


def _chain(t, k: int):
    for _ in range(k):
        t = t * 1.0001
    return t


def hostile_losses(seed: int, count: int) -> Iterator[tuple[str, Callable, np.ndarray]]:
    """(what, loss function, its ``x`` input): losses built from steps that allocate or spin
    (outer products, K x K selections, nuclear norms, long chains, joins), over ``x`` of 16 to
    65,536 elements. Small ones may run; large ones must be refused fast, naming their node."""
    rng = random.Random(seed)
    for _ in range(count):
        picked = [_grow(rng) for _ in range(rng.randint(1, 3))]
        n = rng.choice([16, 256, 2048, 16384, 65536])
        x = np.zeros(n, np.float32) if rng.random() < 0.5 else np.ones(n, np.float32)

        yield f"{' -> '.join(w for w, _ in picked)} over {n}", _loss([f for _, f in picked]), x


def _loss(steps: list[Callable]) -> Callable:
    """A loss applying ``steps`` to its input ``x`` (every parameter after logprobs must name a
    loss input, so the steps are closed over, not defaulted)."""

    def loss(logprobs, x):
        t = x
        for step in steps:
            t = step(t)
        return t.sum() + 0 * logprobs.sum(), {}

    return loss


def proto_bodies(
    seed: int, model_id: str, count: int
) -> Iterator[tuple[str, bytes | pb.ForwardBackwardRequest]]:
    """(what, payload): bytes to send as they are, or a message whose ``seq_id`` the caller sets
    to the model's next one (except `SEQ_EDGE` ones), so it can reach the Trainer."""
    rng = random.Random(seed)
    for i in range(count):
        msg = _valid(rng, model_id, 1)
        kind = i % 4
        if kind == 0:
            yield "random bytes", rng.randbytes(rng.randint(0, 512))
            continue
        raw = msg.SerializeToString()
        if kind == 1:
            cut = rng.randrange(max(1, len(raw)))
            yield "truncated message", raw[:cut]
            continue
        if kind == 2:
            flipped = bytearray(raw)
            for _ in range(rng.randint(1, 8)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            yield "bit-flipped message", bytes(flipped)
            continue
        yield _hostile(rng, msg), msg


def stream_bodies(seed: int, model: str, count: int) -> Iterator[tuple[str, str, object]]:
    """(what, route, JSON body) for the streaming routes."""
    rng = random.Random(seed)
    junk: list[object] = [None, 0, -1, 2**64, "", "x" * 3000, [], {}, [1, "a"], {"a": None}, 1e308]
    for _ in range(count):
        which = rng.randrange(3)
        if which == 0:
            body: dict[str, object] = {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 4,
            }
            route = "/v1/chat/completions"
        elif which == 1:
            body = {"model": model, "prompt": "hello", "stream": True, "max_tokens": 4}
            route = "/v1/completions"
        else:
            body = {"inputs": [{"input_ids": [1, 2, 3]}], "sampling_params": {"max_tokens": 4}}
            route = f"/api/v1/sampler/{model}/twinkle/sample_stream"
        for _ in range(rng.randint(1, 3)):
            key = rng.choice([*body.keys(), "extra", "n", "logprobs", "stop", "temperature"])
            body[key] = rng.choice(junk)
        yield f"{route} {sorted(body)}", route, body

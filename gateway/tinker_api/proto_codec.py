"""Protobuf ↔ engine types for the two Tinker messages that travel as protobuf.

Uses the schema module shipped inside the `tinker` package (tinker_public_pb2), so our wire format
is the SDK's by construction. Decoding validates structure and names the offending field; value
checks that need the model (vocab size) happen in the engine.

A request is sized before anything in it is expanded (`check_decoded_size`): what its tokens,
tensors and images take once decoded, summed over the whole request, from the declared shapes
(a sparse tensor of a few bytes may declare millions of cells). Only the ``loss_fn_inputs`` the
loss reads are sized and decoded; the others are dropped unread.
"""

from __future__ import annotations

import math

import numpy as np

from engine.protocol import (
    DatumInput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    ImagePart,
    SampleOutput,
    TopkLogprobs,
)
from engine.rules import EMBEDDING_LOSS_FNS
from gateway.errors import InvalidRequestError, PayloadTooLargeError
from gateway.tinker_api.wire_pb import pb

#: a sparse tensor is expanded to dense here; its declared shape, not its bytes, sets the size, so
#: it is bounded: 2**24 elements (64 MiB of float32) is far above any real [N, K] input (a
#: 32k-token context with K = 64 is 2**21); a shape like [1, 2**40] would be a MemoryError (500).
MAX_SPARSE_ELEMENTS = 2**24

_DTYPES = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
}
#: bytes per element once decoded: int32 on the wire widens to int64 (`_tensor`)
_DECODED_ITEMSIZE = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_INT64: 8, pb.DTYPE_INT32: 8}
#: a token id is held as an int64-sized value (the engine's token arrays)
_TOKEN_BYTES = 8
#: the config key of the per-request decoded-size budget (named in its 413)
DECODED_BUDGET_KEY = "gateway.max_decoded_request_mb"


def decode_tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidRequestError(f"{where}.dtype: unsupported dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise InvalidRequestError(f"{where}.shape: {shape} has a negative dimension")
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise InvalidRequestError(f"{where}: sparse tensors must be 2-D, got shape {shape}")
        if shape[0] * shape[1] > MAX_SPARSE_ELEMENTS:
            raise InvalidRequestError(
                f"{where}.shape: a sparse tensor of shape {shape} would expand to more than "
                f"{MAX_SPARSE_ELEMENTS} elements"
            )
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if (
            len(crow) != shape[0] + 1
            or len(col) != len(values)
            or crow[0] != 0
            or crow[-1] != len(values)
            or (np.diff(crow) < 0).any()
        ):
            raise InvalidRequestError(f"{where}: inconsistent sparse CSR indices")
        if len(col) and (col.min() < 0 or col.max() >= shape[1]):
            raise InvalidRequestError(f"{where}: sparse column index out of range")
        dense = np.zeros(shape, dtype=dtype)
        # vectorised: a Python loop over 2**24 rows held the event loop for seconds
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
        return dense
    raw = msg.dense
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise InvalidRequestError(
            f"{where}: byte length {len(raw)} is not a multiple of {itemsize}"
        )
    arr = np.frombuffer(raw, dtype=dtype).copy()
    if shape:
        if math.prod(shape) != arr.size:
            raise InvalidRequestError(f"{where}: shape {shape} does not match {arr.size} elements")
        arr = arr.reshape(shape)
    if dtype is np.int32:
        arr = arr.astype(np.int64)
    return arr


def model_input_chunks(chunks, where: str) -> tuple[list[int], list[ImagePart]]:
    """Text tokens and image parts of a protobuf ``ModelInput``'s chunks. Images stay encoded:
    the engine decodes, checks and expands them (engine/backends/vision.py)."""
    tokens: list[int] = []
    images: list[ImagePart] = []
    for j, chunk in enumerate(chunks):
        which = chunk.WhichOneof("chunk")
        if which == "encoded_text":
            if len(chunk.encoded_text.tokens) % 4:
                raise InvalidRequestError(f"{where}.chunks[{j}].tokens: not int32 values")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        elif which == "image":
            img = chunk.image
            if img.HasField("override_dimensions"):
                raise InvalidRequestError(
                    f"{where}.chunks[{j}].override_dimensions: not supported; resize the image "
                    "before sending it"
                )
            expected = int(img.expected_tokens) if img.HasField("expected_tokens") else None
            if expected is not None and expected < 1:
                raise InvalidRequestError(f"{where}.chunks[{j}].expected_tokens: must be ≥ 1")
            images.append(
                ImagePart(
                    data=bytes(img.data),
                    format=img.format,
                    position=len(tokens),
                    expected_tokens=expected,
                    chunk_index=j,
                )
            )
        else:
            raise InvalidRequestError(
                f"{where}.chunks[{j}]: {which} chunks are not supported; send encoded_text "
                "or image chunks"
            )
    return tokens, images


def image_token_count(d: DatumInput) -> int:
    """Tokens a datum's images take, as the client sized them (``expected_tokens``; an image
    without it counts as one until the engine expands it): for metering before any decoding."""
    return sum(p.expected_tokens or 1 for p in d.images)


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The ForwardBackwardRequest message of ``body`` (still compact: nothing is expanded)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:
        raise InvalidRequestError(
            "body: not a valid tinker_public.ForwardBackwardRequest"
        ) from None
    return msg


def _declared_bytes(t: pb.Tensor) -> int:
    """Bytes ``t`` takes once decoded, allocating nothing: a sparse tensor by its declared shape
    (it is expanded to dense), a dense one by its payload (a shape that disagrees is refused when
    it is decoded). A tensor `_tensor` refuses (unknown dtype, negative shape) counts 0."""
    item = _DECODED_ITEMSIZE.get(t.dtype)
    if item is None or any(s < 0 for s in t.shape):
        return 0
    if t.HasField("sparse_csr"):
        return math.prod(int(s) for s in t.shape) * item
    return len(t.dense) // np.dtype(_DTYPES[t.dtype]).itemsize * item


def check_decoded_size(msg: pb.ForwardBackwardRequest, keep: frozenset[str], max_bytes: int) -> int:
    """The bytes ``msg`` decodes to (tokens, the ``keep`` loss_fn_inputs, image bytes, summed
    over every datum), or a `PayloadTooLargeError` over ``max_bytes`` naming the largest field
    and the limit's config key. Checked on the compact message, before any tensor is expanded."""
    total, largest, where = 0, -1, ""
    for i, d in enumerate(msg.data):
        sizes = [(f"data[{i}].model_input", 0)]
        for chunk in d.model_input:
            which = chunk.WhichOneof("chunk")
            if which == "encoded_text":
                n = len(chunk.encoded_text.tokens) // 4 * _TOKEN_BYTES
            else:
                n = len(chunk.image.data) if which == "image" else 0
            sizes[0] = (sizes[0][0], sizes[0][1] + n)
        sizes += [
            (f"data[{i}].loss_fn_inputs.{name}", _declared_bytes(t))
            for name, t in d.loss_fn_inputs.items()
            if name in keep
        ]
        for field, n in sizes:
            total += n
            if n > largest:
                largest, where = n, field
    if total > max_bytes:
        raise PayloadTooLargeError(
            f"{where}: this request decodes to {_mib(total)} in all ({where}: {_mib(largest)}), "
            f"over this server's limit of {_mib(max_bytes)} per request ({DECODED_BUDGET_KEY}; "
            "sparse tensors count at their dense shape); split the batch"
        )
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def decode_forward_backward(
    body: bytes | pb.ForwardBackwardRequest, keep: frozenset[str] | None = None
) -> tuple[str, int, ForwardBackwardInput]:
    """Decode a ForwardBackwardRequest (bytes or its parsed message); returns (model_id, seq_id,
    engine input). ``keep``: the loss_fn_inputs to decode (the loss's; others are dropped
    unread); None decodes every one."""
    msg = parse_forward_backward(body) if isinstance(body, bytes) else body
    if not msg.model_id:
        raise InvalidRequestError("model_id: required")
    if not msg.data:
        raise InvalidRequestError("data: must contain at least one datum")
    data: list[DatumInput] = []
    for i, d in enumerate(msg.data):
        tokens, images = model_input_chunks(d.model_input, f"data[{i}].model_input")
        inputs = {
            name: decode_tensor(t, f"data[{i}].loss_fn_inputs.{name}")
            for name, t in d.loss_fn_inputs.items()
            if keep is None or name in keep
        }
        data.append(DatumInput(tokens=tokens, loss_fn_inputs=inputs, images=images))
    config = loss_fn_config(msg)
    loss_fn = msg.loss_fn or "cross_entropy"
    if loss_fn in EMBEDDING_LOSS_FNS:  # the backend knows it, Tinker's API does not offer it
        raise InvalidRequestError(
            f"loss_fn: {loss_fn!r} is not a Tinker loss; embedding training is available through "
            "the Twinkle native API only (set_loss('InfonceLoss'), forward_backward(task="
            "'embedding'))"
        )
    inp = ForwardBackwardInput(
        data=data,
        loss_fn=loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
    )
    return msg.model_id, int(msg.seq_id), inp


def loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """A request's ``loss_fn_config`` (numbers, and the texts of ``loss_fn_config_v2``)."""
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, val in msg.loss_fn_config_v2.items():
        which = val.WhichOneof("value")
        config[key] = val.number if which == "number" else val.text
    return config


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(out.outputs)
    names = list(out.outputs[0]) if out.outputs else []
    for name in names:
        arrays = [np.asarray(o[name]) for o in out.outputs]
        is_float = np.issubdtype(arrays[0].dtype, np.floating)
        np_dtype = np.float32 if is_float else np.int64
        arrays = [a.astype(np_dtype, copy=False) for a in arrays]
        trailing = list(arrays[0].shape[1:])
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32 if is_float else pb.DTYPE_INT64
        bt.trailing_shape.extend(trailing)
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


def target_ids_from_wire(t: dict) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """``target_prompt_logprobs`` (TensorData JSON, dense or sparse CSR) → dense int64 ids with
    -1 where nothing is asked, plus the CSR (crow, col) indices to answer in the same layout."""
    where = "target_prompt_logprobs"
    if not isinstance(t, dict) or t.get("dtype") != "int64":
        raise InvalidRequestError(f"{where}: must be an int64 TensorData of token ids")
    shape = t.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape)):
        raise InvalidRequestError(f"{where}: shape must be [len(prompt) - 1, K]")
    if min(shape) < 0 or shape[0] * shape[1] > MAX_SPARSE_ELEMENTS:
        raise InvalidRequestError(
            f"{where}.shape: {shape} must be non-negative with at most {MAX_SPARSE_ELEMENTS} cells"
        )
    try:
        data = np.asarray(t.get("data"), dtype=np.int64).reshape(-1)
        crow, col = t.get("sparse_crow_indices"), t.get("sparse_col_indices")
        if crow is None and col is None:
            return data.reshape(shape), None
        crow_a = np.asarray(crow, dtype=np.int64)
        col_a = np.asarray(col, dtype=np.int64)
        dense = np.full(shape, -1, dtype=np.int64)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow_a))
        dense[rows, col_a] = data
        return dense, (crow_a, col_a)
    except (TypeError, ValueError, IndexError) as exc:
        raise InvalidRequestError(f"{where}: malformed tensor ({exc})") from None


def encode_sample_output(
    out: SampleOutput, target_csr: tuple[np.ndarray, np.ndarray] | None = None
) -> bytes:
    msg = pb.SampleResponse()
    for seq in out.sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk is not None:
            _encode_topk(s.topk_sampled_logprobs, seq.topk)
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(out.prompt_logprobs, dtype=np.float32).tobytes()
    if out.topk_prompt is not None:
        _encode_topk(msg.topk_prompt_logprobs, out.topk_prompt)
    if out.prompt_alt_tokens is not None:
        toks, lps = out.prompt_alt_tokens
        _dense(msg.prompt_alt_tokens.tokens, np.asarray(toks, np.int64), pb.DTYPE_INT64)
        _dense(msg.prompt_alt_tokens.logprobs, np.asarray(lps, np.float32), pb.DTYPE_FLOAT32)
    if out.target_prompt_logprobs is not None:
        vals = np.asarray(out.target_prompt_logprobs, np.float32)
        t = msg.target_prompt_logprobs
        if target_csr is None:
            _dense(t, vals, pb.DTYPE_FLOAT32)
        else:  # answer in the request's sparse layout: the values at the listed cells
            crow, col = target_csr
            rows = np.repeat(np.arange(vals.shape[0]), np.diff(crow))
            t.sparse_csr.values = np.ascontiguousarray(vals[rows, col]).tobytes()
            t.sparse_csr.crow_indices = crow.astype(np.int64).tobytes()
            t.sparse_csr.col_indices = col.astype(np.int64).tobytes()
            t.dtype = pb.DTYPE_FLOAT32
            t.shape.extend(vals.shape)
    return msg.SerializeToString()


def _dense(t: pb.Tensor, arr: np.ndarray, dtype: pb.DType.ValueType) -> None:
    t.dense = np.ascontiguousarray(arr).tobytes()
    t.dtype = dtype
    t.shape.extend(arr.shape)


def _encode_topk(msg: pb.TopkLogprobs, topk: TopkLogprobs) -> None:
    """Row-major [length, k] int32 ids and float32 logprobs (the SDK reads them back as such)."""
    ids = np.ascontiguousarray(topk.token_ids, dtype=np.int32)
    msg.token_ids = ids.tobytes()
    msg.logprobs = np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes()
    msg.length, msg.k = ids.shape

"""Our protobuf encoding round-trips through the tinker SDK's own decoders and encoders."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from engine.protocol import ForwardBackwardOutput, SampledSequence, SampleOutput
from gateway.errors import InvalidRequestError
from gateway.tinker_api.proto_codec import (
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_output,
)


def _sdk_request(data, loss_fn="cross_entropy", config=None, forward_only=False) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="sess-1:train:0",
        seq_id=3,
    )
    msg = (
        forward_backward_request_to_proto(req, forward_only=forward_only)
        if forward_only
        else forward_backward_request_to_proto(req)
    )
    return msg.SerializeToString() if hasattr(msg, "SerializeToString") else msg


def test_decode_sdk_forward_backward_request():
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.5, -1.0, 2.0]},
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([7, 8]),
            loss_fn_inputs={"target_tokens": [8, 9], "weights": [1.0, 1.0]},
        ),
    ]
    model_id, seq_id, inp = decode_forward_backward(_sdk_request(data, config={"beta": 0.1}))
    assert (model_id, seq_id, inp.loss_fn) == ("sess-1:train:0", 3, "cross_entropy")
    assert inp.data[0].tokens == [1, 2, 3] and inp.data[1].tokens == [7, 8]
    np.testing.assert_array_equal(inp.data[0].loss_fn_inputs["target_tokens"], [2, 3, 4])
    np.testing.assert_allclose(inp.data[0].loss_fn_inputs["weights"], [0.5, -1.0, 2.0])
    assert inp.loss_fn_config["beta"] == pytest.approx(0.1)


def test_garbage_body_is_a_400_naming_the_body():
    with pytest.raises(InvalidRequestError, match="body"):
        decode_forward_backward(b"\xff\xff\xff not a proto")


def test_forward_backward_output_decodes_in_sdk():
    out = ForwardBackwardOutput(
        outputs=[
            {"logprobs": np.array([-1.0, -2.0, -0.5], np.float32)},
            {"logprobs": np.array([-3.0], np.float32)},
        ],
        metrics={"loss:sum": 6.5},
    )
    sdk = deserialize_forward_backward_output(encode_forward_backward_output(out))
    assert sdk.metrics == {"loss:sum": 6.5}
    assert [d["logprobs"].tolist() for d in sdk.loss_fn_outputs] == [[-1.0, -2.0, -0.5], [-3.0]]


def test_sample_output_decodes_in_sdk():
    out = SampleOutput(
        sequences=[
            SampledSequence([5, 6], [-0.25, -1.5], "stop"),
            SampledSequence([7], [-2.0], "length"),
        ],
        prompt_logprobs=[float("nan"), -1.0, -2.0],
    )
    sdk = deserialize_sample_response(encode_sample_output(out))
    assert [s.tokens for s in sdk.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in sdk.sequences] == ["stop", "length"]
    assert sdk.sequences[0].logprobs == [-0.25, -1.5]
    assert sdk.prompt_logprobs[0] is None and sdk.prompt_logprobs[1:] == [-1.0, -2.0]


def _with_weights(tensor) -> bytes:
    from gateway.tinker_api.wire_pb import pb

    msg = pb.ForwardBackwardRequest(model_id="sess-1:train:0", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2], "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dtype=pb.DTYPE_INT64, dense=np.array([2, 3], np.int64).tobytes(), shape=[2])
    )
    d.loss_fn_inputs["weights"].CopyFrom(tensor)
    return msg.SerializeToString()


@pytest.mark.parametrize(
    ("shape", "sparse", "message"),
    [
        ([1, 2**40], True, "would expand to more than"),  # was a MemoryError: a 500 (fuzzing)
        ([-1, -2], False, "negative dimension"),  # was a numpy ValueError in reshape: a 500
    ],
)
def test_tensors_whose_shape_lies_are_a_400(shape, sparse, message):
    from gateway.tinker_api.wire_pb import pb

    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape)
    if sparse:
        t.sparse_csr.crow_indices = np.array([0, 0], np.int64).tobytes()
    else:
        t.dense = np.ones(2, np.float32).tobytes()
    with pytest.raises(InvalidRequestError, match=message) as err:
        decode_forward_backward(_with_weights(t))
    assert str(err.value).startswith("data[0].loss_fn_inputs.weights.shape")


def test_sdk_sparse_tensors_decode_to_their_dense_values():
    import torch

    rng = np.random.default_rng(0)
    dense = np.where(rng.random((7, 5)) < 0.3, rng.random((7, 5)), 0).astype(np.float32)
    dense[2] = 0  # an empty row
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(7))),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.ones((7, 5), np.int64)),
            "weights": types.TensorData.from_torch_sparse(torch.from_numpy(dense)),
        },
    )
    _, _, inp = decode_forward_backward(_sdk_request([datum]))
    np.testing.assert_array_equal(inp.data[0].loss_fn_inputs["weights"], dense)


def test_sparse_rows_that_run_backwards_are_a_400():
    from gateway.tinker_api.wire_pb import pb

    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3])
    t.sparse_csr.crow_indices = np.array([0, 2, 1], np.int64).tobytes()
    t.sparse_csr.col_indices = np.array([0], np.int64).tobytes()
    t.sparse_csr.values = np.ones(1, np.float32).tobytes()
    with pytest.raises(InvalidRequestError, match="inconsistent sparse CSR indices"):
        decode_forward_backward(_with_weights(t))


def test_only_the_kept_inputs_are_decoded_and_sized():
    from gateway.errors import PayloadTooLargeError
    from gateway.tinker_api.proto_codec import check_decoded_size, parse_forward_backward
    from gateway.tinker_api.wire_pb import pb

    junk = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, 2**24])
    junk.sparse_csr.crow_indices = np.array([0, 0], np.int64).tobytes()
    msg = parse_forward_backward(_with_weights(junk))
    keep = frozenset({"target_tokens"})
    assert check_decoded_size(msg, keep, 2**20) == 2 * 8 + 2 * 8  # tokens + targets
    _, _, inp = decode_forward_backward(msg, keep)
    assert set(inp.data[0].loss_fn_inputs) == {"target_tokens"}
    with pytest.raises(PayloadTooLargeError, match=r"weights.*128\.0 MiB.*max_decoded_request_mb"):
        check_decoded_size(msg, keep | {"weights"}, 2**20)

"""Embedding training over upstream Twinkle's native protocol, as its cookbook
``cookbook/client/twinkle/embedding.py`` drives it: ``set_loss('InfonceLoss')``,
``add_metric('EmbeddingMetric')``, ``forward_backward(task='embedding')`` on rows
``{input_ids, attention_mask, labels: [1] anchor / [0] positive, position_ids}``; the same
script through the real `twinkle_client` and in process gives equal losses and metrics; and
Tinker's routes still refuse the embedding loss."""

from __future__ import annotations

import numpy as np
import pytest

from engine.rules import EMBEDDING_LOSS_FNS
from gateway.errors import InvalidRequestError
from tests.gateway.test_native_protocol import LORA, M, User
from tests.twinkle_scripts import BASE, result


@pytest.fixture(scope="module")
def env(make_gateway):
    gw = make_gateway()
    return gw, User(gw.client, gw.key("alice"))


def _pairs(n: int = 3) -> list[dict]:
    """Interleaved [anchor_0, positive_0, anchor_1, ...] rows, as the cookbook builds them."""
    rows = []
    for i in range(n):
        for j, is_anchor in enumerate((True, False)):
            ids = [5 + i, 17 + j, 33 + 2 * i, 41, 52 + j, 60 + i][: 4 + (i + j) % 3]
            rows.append(
                {"input_ids": ids, "attention_mask": [1] * len(ids),
                 "labels": [1 if is_anchor else 0], "position_ids": list(range(len(ids)))}
            )  # fmt: skip
    return rows


def test_embedding_cookbook_flow(env):
    _, a = env
    a.post(f"{M}/create")
    a.post(f"{M}/add_adapter_to_model", {"adapter_name": "emb_adapter", "config": LORA,
           "gradient_accumulation_steps": 1})  # fmt: skip
    a.post(f"{M}/set_processor", {"processor_cls": "InputProcessor", "adapter_name": "emb_adapter"})
    a.post(f"{M}/set_loss", {"loss_cls": "InfonceLoss", "adapter_name": "emb_adapter",
           "temperature": 0.07, "use_batch": True, "hard_negatives": None})  # fmt: skip
    a.post(f"{M}/set_optimizer", {"optimizer_cls": "Adam", "adapter_name": "emb_adapter",
           "lr": 1e-4})  # fmt: skip
    a.post(f"{M}/add_metric", {"metric_cls": "EmbeddingMetric", "is_training": True,
           "adapter_name": "emb_adapter"})  # fmt: skip
    rows = _pairs()
    losses = []
    for _ in range(2):
        out = a.post(f"{M}/forward_backward", {"inputs": rows, "adapter_name": "emb_adapter",
                     "task": "embedding"})["result"]  # fmt: skip
        assert out["num_tokens"] == 0 and out["loss"] > 0
        assert len(out["embeddings"]) == len(rows) and len(out["embeddings"][0]) > 1
        losses.append(out["loss"])
        a.post(f"{M}/clip_grad_and_step", {"max_grad_norm": 1.0, "adapter_name": "emb_adapter"})
        metric = a.post(f"{M}/calculate_metric", {"is_training": True,
                        "adapter_name": "emb_adapter"})["result"]  # fmt: skip
        for key in ("pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "loss", "grad_norm"):
            assert isinstance(metric[key], float), (key, metric)
    assert losses[1] < losses[0]
    fo = a.post(f"{M}/forward_only", {"inputs": rows, "adapter_name": "emb_adapter",
                "task": "embedding"})["result"]  # fmt: skip
    assert len(fo["embeddings"]) == len(rows)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"task": "causal_lm"}, ["'InfonceLoss' trains embeddings", "task='embedding'"]),
        ({"task": "embedding", "inputs": [{"input_ids": [1, 2], "labels": [0]}]},
         ["first row must be an anchor"]),
        ({"task": "embedding", "inputs": [{"input_ids": [1, 2], "labels": [-100, 3]}]},
         ["inputs[0].labels", "one group marker per row"]),
    ],
)  # fmt: skip
def test_embedding_errors_are_400s_naming_the_rule(env, body, words):
    _, a = env
    a.post(f"{M}/create")
    a.post(f"{M}/add_adapter_to_model", {"adapter_name": "emb_err", "config": LORA})
    a.post(f"{M}/set_loss", {"loss_cls": "InfonceLoss", "adapter_name": "emb_err"})
    body = {"inputs": _pairs(1), "adapter_name": "emb_err", **body}
    r = a.post(f"{M}/forward_backward", body, ok=False)
    assert r.status_code == 400, r.text
    for w in words:
        assert w in r.text, r.text
    a.post(f"{M}/remove_adapter", {"adapter_name": "emb_err"})


def test_tinker_routes_do_not_offer_the_embedding_loss():
    from gateway.tinker_api.compat import json_forward_backward_to_proto
    from gateway.tinker_api.proto_codec import decode_forward_backward

    assert EMBEDDING_LOSS_FNS == ("infonce",)
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
             "loss_fn_inputs": {"anchor": {"data": [1.0], "dtype": "float32"}}}  # fmt: skip
    body = json_forward_backward_to_proto(
        {"model_id": "m", "forward_backward_input": {"data": [datum], "loss_fn": "infonce"}}
    )
    with pytest.raises(InvalidRequestError, match="'infonce' is not a Tinker loss"):
        decode_forward_backward(body)


def embedding_script(MultiLoraTransformersModel, model_id: str, rows: list[dict], **kw) -> dict:
    """Upstream's embedding cookbook, the model class a parameter (in process or remote)."""
    model = MultiLoraTransformersModel(model_id, **kw)
    name = "emb_adapter"
    lora = {"r": 8, "lora_alpha": 32, "target_modules": "all-linear", "seed": 5}
    model.add_adapter_to_model(name, lora)
    model.set_processor("InputProcessor", adapter_name=name)
    model.set_loss("InfonceLoss", temperature=0.07, use_batch=True, hard_negatives=None,
                   adapter_name=name)  # fmt: skip
    model.set_optimizer("Adam", lr=1e-3, adapter_name=name)
    model.add_metric("EmbeddingMetric", is_training=True, adapter_name=name)
    losses, metrics = [], []
    for _ in range(3):
        out = result(model.forward_backward(inputs=rows, task="embedding", adapter_name=name))
        losses.append(out["loss"])
        model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
        metrics.append(result(model.calculate_metric(is_training=True, adapter_name=name)))
    return {"losses": losses, "metrics": metrics, "embeddings": out["embeddings"]}


def test_same_script_in_process_and_remote(env, tmp_path):
    import twinkle_client
    from engine.base_models.registry import resolve_model_dir
    from engine.local.model import MultiLoraTransformersModel as LocalModel
    from tests.gateway.test_twinkle_api import _Transport
    from twinkle_client.model import MultiLoraTransformersModel as RemoteModel

    gw, _ = env
    client = twinkle_client.TwinkleClient(
        "http://testserver",
        gw.key("carol"),
        transport=_Transport(gw.client._transport),
        session_heartbeat_interval=None,
    )
    rows = _pairs(3)
    local = embedding_script(LocalModel, str(resolve_model_dir(BASE, gw.data)), rows,
                             data_dir=tmp_path)  # fmt: skip
    remote = embedding_script(RemoteModel, BASE, rows, client=client)
    np.testing.assert_allclose(remote["losses"], local["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(remote["embeddings"], local["embeddings"], atol=1e-5)
    assert remote["losses"][-1] < remote["losses"][0]
    for r, lo in zip(remote["metrics"], local["metrics"], strict=True):
        for key in ("pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "loss"):
            assert r[key] == pytest.approx(lo[key], rel=1e-5, abs=1e-6), key

"""Embedding training (upstream Twinkle's ``InfonceLoss`` + ``forward_backward(task='embedding')``
+ ``EmbeddingMetric``): the backend's InfoNCE against a float64 reference on the tiny model, its
gradient (Adam steps lower the loss), the native API's rows, results, metrics and errors, the
Trainer path (never sliced), and the mock backend's exact toy gradient."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import UserInputError
from engine.protocol import DatumInput, ForwardBackwardInput, LoraSpec
from tests.unit.losses_helpers import make_backend, merged_f64
from tests.unit.model_api_helpers import LORA, new_model

# groups: (anchor, positive), (anchor, positive, negative, negative), (anchor, positive)
ANCHOR = [1, 0, 1, 0, 0, 0, 1, 0]


def _token_rows(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 1500, size=int(rng.integers(3, 11))).tolist() for _ in range(n)]


def _datums(rows: list[list[int]], anchor: list[int]) -> list[DatumInput]:
    return [
        DatumInput(tokens=r, loss_fn_inputs={"anchor": np.array([float(a)], np.float32)})
        for r, a in zip(rows, anchor, strict=True)
    ]


def _upstream_rows(rows: list[list[int]], anchor: list[int]) -> list[dict]:
    """Rows as upstream's embedding cookbook builds them."""
    return [
        {
            "input_ids": r,
            "attention_mask": [1] * len(r),
            "labels": [a],
            "position_ids": list(range(len(r))),
        }
        for r, a in zip(rows, anchor, strict=True)
    ]


def reference_infonce(emb: np.ndarray, anchor: list[int], temp: float, use_batch: bool) -> float:
    """float64 InfoNCE as upstream's InfonceLoss: mean over groups of -log softmax(anchor . docs /
    T)[own positive]; docs = every non-anchor row (use_batch) or the group's own rows."""
    starts = [i for i, a in enumerate(anchor) if a]
    ends = [*starts[1:], len(anchor)]
    all_docs = [i for i, a in enumerate(anchor) if not a]
    losses = []
    for s, e in zip(starts, ends, strict=True):
        docs = all_docs if use_batch else list(range(s + 1, e))
        z = emb[docs] @ emb[s] / temp
        m = z.max()
        losses.append(m + np.log(np.exp(z - m).sum()) - z[docs.index(s + 1)])
    return float(np.mean(losses))


def reference_embeddings(model: torch.nn.Module, rows: list[list[int]]) -> np.ndarray:
    """Each row alone (no padding) through the float64 merged model: the normalised final hidden
    state (lm_head's input) at the last token."""
    out = []
    with torch.no_grad():
        for r in rows:
            h = model.model(torch.tensor([r])).last_hidden_state[0, -1]
            out.append((h / h.norm()).numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir: Path):
    return make_backend(tiny_model_dir, np.random.default_rng(7))


@pytest.mark.parametrize("use_batch", [True, False])
def test_infonce_equals_a_float64_reference(tiny_backend, tiny_model_dir, use_batch) -> None:
    be, aid, temp = tiny_backend, "r4", 0.07
    rows = _token_rows(len(ANCHOR))
    inp = ForwardBackwardInput(
        _datums(rows, ANCHOR),
        "infonce",
        {"temperature": temp, "use_batch": float(use_batch)},
        forward_only=True,
    )
    out = be.forward_backward(aid, inp)
    ref_emb = reference_embeddings(merged_f64(tiny_model_dir, be, aid), rows)
    got_emb = np.stack([o["embedding"] for o in out.outputs]).astype(np.float64)
    # float32 pass, rows padded to the longest: agreement to float32 rounding
    np.testing.assert_allclose(got_emb, ref_emb, atol=2e-6, rtol=0)
    ref = reference_infonce(ref_emb, ANCHOR, temp, use_batch)
    assert out.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert ref > 1e-3  # not vacuous: the similarities differ (pairs alone give 0 without use_batch)


def test_default_temperature_and_disable_lora(tiny_backend, tiny_model_dir) -> None:
    be = tiny_backend
    rows = _token_rows(len(ANCHOR), seed=3)
    base = be.forward_backward(
        "r8",
        ForwardBackwardInput(
            _datums(rows, ANCHOR), "infonce", {"disable_lora": True}, forward_only=True
        ),
    )
    ref_emb = reference_embeddings(merged_f64(tiny_model_dir, be, None), rows)
    ref = reference_infonce(ref_emb, ANCHOR, 0.1, True)  # upstream's default temperature
    assert base.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_backend_rejects_bad_groups(tiny_backend) -> None:
    be, rows = tiny_backend, _token_rows(4)
    cases = [
        ([0, 1, 1, 0], "data\\[0\\].loss_fn_inputs.anchor: the first row must be an anchor"),
        ([1, 0, 1, 1], "data\\[2\\].loss_fn_inputs.anchor: this anchor has no positive"),
        ([1, 0, 1, 2], "data\\[3\\].loss_fn_inputs.anchor: .* must be one value, 1 .* or 0"),
    ]
    for anchor, words in cases:
        with pytest.raises(UserInputError, match=words):
            be.forward_backward("r2", ForwardBackwardInput(_datums(rows, anchor), "infonce"))
    with pytest.raises(UserInputError, match="loss_fn_config.temperature: 0.0 must be > 0"):
        be.forward_backward(
            "r2", ForwardBackwardInput(_datums(rows, [1, 0, 1, 0]), "infonce", {"temperature": 0})
        )
    with pytest.raises(UserInputError, match="data\\[0\\].loss_fn_inputs.anchor: required"):
        be.forward_backward("r2", ForwardBackwardInput([DatumInput([1, 2], {})], "infonce"))
    assert not be.has_pending_grad("r2")


# ----------------------------------------------------------------------------------- native API


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return new_model(tiny_model_dir)


_names = iter(range(10**6))


def emb_adapter(m, metric: bool = True, **loss_kw) -> str:
    name = f"e{next(_names)}"
    m.add_adapter_to_model(name, LORA)
    m.set_processor("InputProcessor", adapter_name=name)
    kw = {"temperature": 0.07, "use_batch": True, "hard_negatives": None, **loss_kw}
    m.set_loss("InfonceLoss", adapter_name=name, **kw)
    m.set_optimizer("Adam", lr=1e-3, adapter_name=name)
    if metric:
        m.add_metric("EmbeddingMetric", is_training=True, adapter_name=name)
    return name


def test_training_loop_lowers_the_loss_and_reports_upstream_keys(model) -> None:
    name = emb_adapter(model)
    anchor = [1, 0] * 4
    batch = _upstream_rows(_token_rows(8, seed=11), anchor)
    losses, metrics = [], []
    for _ in range(5):
        out = model.forward_backward(inputs=batch, task="embedding", adapter_name=name)
        model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
        metrics.append(model.calculate_metric(is_training=True, adapter_name=name))
        losses.append(out["loss"])
    assert sorted(out) == ["embeddings", "loss", "loss_sum", "metrics", "num_tokens"]
    assert len(out["embeddings"]) == 8 and all(isinstance(v, float) for v in out["embeddings"][0])
    assert out["num_tokens"] == 0.0 and out["loss_sum"] == out["loss"]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.5 * losses[0], losses
    m = metrics[-1]
    for key in ("pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "loss", "grad_norm"):
        assert isinstance(m[key], float), (key, m)
    assert m["loss"] == pytest.approx(losses[-1])
    assert metrics[-1]["pos_sim"] > metrics[0]["pos_sim"]
    # the metric's figures from the pass's own embeddings (upstream's EmbeddingMetric formulas)
    e = np.asarray(out["embeddings"])
    a, p = e[0::2], e[1::2]
    cos = (a * p).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(p, axis=1))
    sim = a @ p.T
    assert m["pos_sim"] == pytest.approx(cos.mean(), abs=1e-6)
    assert m["pos_sim_min"] == pytest.approx(cos.min(), abs=1e-6)
    assert m["pos_sim_max"] == pytest.approx(cos.max(), abs=1e-6)
    assert m["neg_sim"] == pytest.approx(sim[~np.eye(4, dtype=bool)].mean(), abs=1e-6)
    assert "pos_sim" not in model.calculate_metric(is_training=True, adapter_name=name)  # reset


def test_forward_only_and_two_phase_match_forward_backward(model) -> None:
    name = emb_adapter(model, metric=False)
    batch = _upstream_rows(_token_rows(8, seed=5), ANCHOR)
    fo = model.forward_only(inputs=batch, task="embedding", adapter_name=name)
    fw = model.forward(inputs=batch, task="embedding", adapter_name=name)
    assert model.calculate_loss(adapter_name=name) == pytest.approx(fo["loss"])
    bw = model.backward(adapter_name=name)  # forward's cached rows and task
    assert bw["loss"] == pytest.approx(fo["loss"], rel=1e-6)
    np.testing.assert_allclose(fw["embeddings"], fo["embeddings"], atol=1e-6)
    assert model.clip_grad_norm(1.0, adapter_name=name) > 0
    # padding dropped by attention_mask; a batched row dict with labels [[1], [0], ...]
    padded = [
        {**r, "input_ids": r["input_ids"] + [0, 0], "attention_mask": r["attention_mask"] + [0, 0]}
        for r in batch
    ]
    assert model.forward_only(inputs=padded, task="embedding", adapter_name=name)[
        "loss"
    ] == pytest.approx(fo["loss"], rel=1e-6)
    same = [r["input_ids"] for r in batch[:4]]
    width = max(map(len, same))
    batched = {
        "input_ids": [s + [0] * (width - len(s)) for s in same],
        "attention_mask": [[1] * len(s) + [0] * (width - len(s)) for s in same],
        "labels": [[1], [0], [1], [0]],
    }
    rows4 = model.forward_only(inputs=batch[:4], task="embedding", adapter_name=name)
    got = model.forward_only(inputs=batched, task="embedding", adapter_name=name)
    assert got["loss"] == pytest.approx(rows4["loss"], rel=1e-6)


def test_task_and_loss_must_agree_and_bad_inputs_name_the_field(model) -> None:
    name = emb_adapter(model, metric=False)
    batch = _upstream_rows(_token_rows(4, seed=2), [1, 0, 1, 0])
    with pytest.raises(UserInputError, match="'InfonceLoss' trains embeddings; pass task="):
        model.forward_backward(inputs=batch, adapter_name=name)
    with pytest.raises(UserInputError, match="task: 'classify' is not supported"):
        model.forward_backward(inputs=batch, task="classify", adapter_name=name)
    with pytest.raises(UserInputError, match="advantages: not used by task='embedding'"):
        model.forward_backward(inputs=batch, task="embedding", advantages=[1.0] * 4,
                               adapter_name=name)  # fmt: skip
    bad = [{**batch[0], "labels": [-100, 5, 6]}, *batch[1:]]
    with pytest.raises(UserInputError, match="inputs\\[0\\].labels: task='embedding' takes one"):
        model.forward_backward(inputs=bad, task="embedding", adapter_name=name)
    nolab = [{k: v for k, v in batch[0].items() if k != "labels"}, *batch[1:]]
    with pytest.raises(UserInputError, match="inputs\\[0\\].labels: required by task='embedding'"):
        model.forward_backward(inputs=nolab, task="embedding", adapter_name=name)
    with pytest.raises(UserInputError, match="first row must be an anchor"):
        model.forward_backward(inputs=batch[1:], task="embedding", adapter_name=name)
    assert not model.backend.has_pending_grad(name)
    other = f"e{next(_names)}"
    model.add_adapter_to_model(other, LORA)  # cross-entropy by default
    with pytest.raises(UserInputError, match="task: 'embedding' needs an embedding loss"):
        model.forward_backward(inputs=batch, task="embedding", adapter_name=other)
    for kw, words in (
        ({"hard_negatives": 3}, "InfonceLoss: hard_negatives 3 is not supported"),
        ({"temperature": 0.0}, "InfonceLoss: temperature 0.0 must be a finite number > 0"),
        ({"include_qq": True}, "InfonceLoss: include_qq True is not supported"),
        ({"use_batch": "yes"}, "InfonceLoss: use_batch 'yes' must be true or false"),
    ):
        with pytest.raises(UserInputError, match=words):
            model.set_loss("InfonceLoss", adapter_name=other, **kw)
    model.set_loss("InfonceLoss", adapter_name=other, mask_fake_negative=False, include_dd=False)
    cfg = model.get_train_configs(adapter_name=other)["loss"]
    assert cfg["loss_fn"] == "infonce" and cfg["config"] == {}


# ----------------------------------------------------------------------------------- Trainer


def test_native_model_on_a_trainer_is_never_sliced(model, tiny_model_dir, tmp_path) -> None:
    from engine.config import ModelConfig
    from engine.trainer import Trainer

    batch = _upstream_rows(_token_rows(8, seed=21), ANCHOR)
    local = emb_adapter(model, metric=False)
    expect = model.forward_backward(inputs=batch, task="embedding", adapter_name=local)
    # 16-token slices would split this request: an embedding request must stay whole
    cfg = ModelConfig(
        name="twinkle/tiny-chat", path=str(tiny_model_dir), slice_tokens=16, execution="sequential"
    )
    tr = Trainer(cfg, str(tmp_path))

    async def main():
        await tr.native_create("m1", "t")

        async def call(method, **kw):
            return await tr.native_call("m1", "t", method, "emb", kw)

        await call("add_adapter_to_model", config=LORA)
        await call("set_loss", loss="InfonceLoss", temperature=0.07, use_batch=True)
        await call("set_optimizer", optimizer="Adam", lr=1e-3)
        await call("add_metric", metric_cls="EmbeddingMetric", is_training=True)
        out = await call("forward_backward", inputs=batch, task="embedding")
        await call("clip_grad_and_step", max_grad_norm=1.0)
        return out, await call("calculate_metric", is_training=True)

    out, metric = asyncio.run(main())
    assert out["loss"] == pytest.approx(expect["loss"], rel=1e-5)
    np.testing.assert_allclose(out["embeddings"], expect["embeddings"], atol=1e-5)
    assert {"pos_sim", "neg_sim", "loss", "grad_norm"} <= set(metric)


# ----------------------------------------------------------------------------------- mock


def test_mock_infonce_gradient_is_exact() -> None:
    from engine.backends.mock import MockTrainingBackend

    be = MockTrainingBackend()
    be.create_adapter("a", LoraSpec(rank=4))
    rng = np.random.default_rng(0)
    w = rng.normal(size=16) * 0.3
    rows = [rng.integers(0, 500, size=5).tolist() for _ in ANCHOR]
    for use_batch in (1.0, 0.0):
        inp = ForwardBackwardInput(_datums(rows, ANCHOR), "infonce", {"use_batch": use_batch})
        _, loss, grad = be._infonce(w, inp)
        num = np.zeros(16)
        for k in range(16):
            dw = np.zeros(16)
            dw[k] = 1e-6
            num[k] = (be._infonce(w + dw, inp)[1] - be._infonce(w - dw, inp)[1]) / 2e-6
        np.testing.assert_allclose(grad, num, atol=1e-7)
        assert loss > 0
    out = be.forward_backward("a", ForwardBackwardInput(_datums(rows, ANCHOR), "infonce"))
    assert out.outputs[0]["embedding"].shape == (16,) and be.has_pending_grad("a")
    with pytest.raises(UserInputError, match="anchor"):
        be.validate_input(ForwardBackwardInput(_datums(rows[:2], [0, 1]), "infonce"))


def test_embedding_requests_are_never_sliced() -> None:
    from engine.scheduling.slicing import slice_input

    rows = _token_rows(len(ANCHOR))
    inp = ForwardBackwardInput(_datums(rows, ANCHOR), "infonce")
    assert len(slice_input(inp, 4)) == 1
    ce = [DatumInput(r, {"target_tokens": np.array(r), "weights": np.ones(len(r))}) for r in rows]
    assert len(slice_input(ForwardBackwardInput(ce), 4)) == len(rows)  # token losses still are


def test_fused_with_token_losses_equals_separate_calls(tiny_backend) -> None:
    be = tiny_backend
    rows = _token_rows(len(ANCHOR), seed=9)
    emb = ForwardBackwardInput(_datums(rows, ANCHOR), "infonce", forward_only=True)
    ce = ForwardBackwardInput(
        [DatumInput(r[:-1], {"target_tokens": np.array(r[1:])}) for r in rows], forward_only=True
    )
    fused = be.forward_backward_many([("r2", emb), ("r4", ce), ("r8", emb)])
    for (aid, inp), got in zip([("r2", emb), ("r4", ce), ("r8", emb)], fused, strict=True):
        alone = be.forward_backward(aid, inp)
        assert not isinstance(got, Exception)
        assert got.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
    assert fused[0].metrics["loss:sum"] != pytest.approx(fused[2].metrics["loss:sum"])

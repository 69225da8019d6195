"""The Megatron backend (one rank) against the Transformers backend on the tiny model: same init,
same fused multi-tenant pass (mixed ranks, an attention-only adapter, a disable_lora item), same
gradients, same optimizer trajectory, and checkpoints that load across backends with optimizer
state and in peft."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from engine.backends.lora import adapter_parameters  # noqa: E402
from engine.backends.megatron.backend import MegatronTrainingBackend  # noqa: E402
from engine.backends.train_transformers import TransformersTrainingBackend  # noqa: E402
from engine.errors import AdapterNotFoundError, CheckpointError, UserInputError  # noqa: E402
from engine.protocol import (  # noqa: E402
    AdamParams,
    DatumInput,
    ForwardBackwardInput,
    LoraSpec,
)
from tests.unit.test_fused_step import request  # noqa: E402

SPECS = {
    "r2": LoraSpec(rank=2, alpha=16.0, seed=1),
    "r4": LoraSpec(rank=4, alpha=8.0, seed=2, train_mlp=False),  # attention only
    "r8": LoraSpec(rank=8, alpha=32.0, seed=3, train_unembed=True),
    "off": LoraSpec(rank=4, alpha=4.0, seed=4),  # used with disable_lora
}
LOSSES = {"r2": "cross_entropy", "r4": "ppo", "r8": "dpo"}
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=50.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path):
    """Both backends with the same four adapters and the same random non-zero B matrices."""
    tf = TransformersTrainingBackend(str(tiny_model_dir))
    mg = MegatronTrainingBackend(str(tiny_model_dir))
    gen = torch.Generator().manual_seed(7)
    for aid, spec in SPECS.items():
        tf.create_adapter(aid, spec)
        mg.create_adapter(aid, spec)
        full = {}
        for name, p in adapter_parameters(tf.model, aid).items():
            if "lora_B" in name:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            full[name] = p.detach().clone()
        worker = mg._local
        with torch.no_grad():
            for name, p in worker._adapters[aid].params.items():
                p.copy_(worker.lora.shard(name, full[name]))
    return tf, mg


def _items(seed: int):
    rng = np.random.default_rng(seed)
    return [(aid, request(rng, loss)) for aid, loss in LOSSES.items()]


def test_same_seed_gives_bit_identical_adapters(tiny_model_dir: Path, pair) -> None:
    _, mg = pair
    tf = TransformersTrainingBackend(str(tiny_model_dir))
    for k, (aid, spec) in enumerate(SPECS.items()):
        fresh = f"fresh{k}"
        tf.create_adapter(fresh, spec)
        mg.create_adapter(fresh, spec)
        want = adapter_parameters(tf.model, fresh)
        got = mg.export_adapter(fresh)
        assert list(got) == list(want), aid  # same PEFT names, same (HF module) order
        for name, p in want.items():
            assert np.array_equal(got[name], p.detach().numpy()), (aid, name)
        mg.delete_adapter(fresh)
        assert not mg.has_adapter(fresh)


def test_fused_forward_only_with_disable_lora_matches(pair) -> None:
    tf, mg = pair
    rng = np.random.default_rng(3)
    items = [(aid, copy.deepcopy(inp)) for aid, inp in _items(1)]
    for _, inp in items:
        inp.forward_only = True
    off = request(rng, "cross_entropy")
    off.forward_only, off.loss_fn_config = True, {"disable_lora": True}
    items.append(("off", off))
    want, got = tf.forward_backward_many(items), mg.forward_backward_many(items)
    worst = 0.0
    for w, g in zip(want, got, strict=True):
        assert not isinstance(w, Exception) and not isinstance(g, Exception), (w, g)
        for k, v in w.metrics.items():
            assert g.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
        for ow, og in zip(w.outputs, g.outputs, strict=True):
            worst = max(worst, float(np.abs(ow["logprobs"] - og["logprobs"]).max()))
    assert worst <= 1e-5, worst
    assert not mg.has_pending_grad("r2")


def test_fused_training_pass_gradients_and_steps_match(pair) -> None:
    tf, mg = pair
    items = _items(0)
    for step in range(5):
        want, got = tf.forward_backward_many(items), mg.forward_backward_many(items)
        for (aid, _), w, g in zip(items, want, got, strict=True):
            assert not isinstance(g, Exception), g
            loss = w.metrics["loss:sum"]  # type: ignore[union-attr]
            assert g.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5), (step, aid)
        if step == 0:
            for aid in LOSSES:
                ref = {k: p.grad for k, p in adapter_parameters(tf.model, aid).items()}
                mine = mg.export_adapter(aid, grad=True)
                worst = max(_rel(torch.from_numpy(mine[k]), g) for k, g in ref.items())
                assert worst <= 1e-5, (aid, worst)
                assert mg.adapter_grad(aid, "norm") == pytest.approx(
                    tf.adapter_grad(aid, "norm"), rel=1e-5
                )
        for aid in LOSSES:
            assert mg.has_pending_grad(aid)
            n_tf = tf.optim_step(aid, ADAM).metrics
            n_mg = mg.optim_step(aid, ADAM).metrics
            # float32 norms of differently ordered sums (1.3e-5 apart once in CI, another test)
            assert n_mg["grad_norm"] == pytest.approx(n_tf["grad_norm"], rel=1e-4), (step, aid)
            assert n_mg["step"] == n_tf["step"]


def test_bad_item_fails_alone_and_gradient_survives(pair) -> None:
    tf, mg = pair
    good = _items(5)[0]
    mg.forward_backward(*good)
    before = mg.export_adapter("r2", grad=True)
    bad = ForwardBackwardInput([DatumInput([1, 2, 3], {"target_tokens": np.array([1, 2, 10**6])})])
    emb = ForwardBackwardInput(
        [DatumInput([1, 2], {"anchor": np.array([1.0])}), DatumInput([3], {"anchor": [0.0]})],
        "infonce",
    )
    out = mg.forward_backward_many([("r4", bad), ("r8", emb), ("r2", good[1]), ("nope", bad)])
    assert isinstance(out[0], UserInputError) and "target_tokens" in str(out[0])
    assert isinstance(out[1], UserInputError) and "Megatron backend" in str(out[1])
    assert not isinstance(out[2], Exception)
    assert isinstance(out[3], AdapterNotFoundError)
    after = mg.export_adapter("r2", grad=True)
    for k, g in before.items():  # the same request twice: exactly twice the gradient
        np.testing.assert_allclose(after[k], 2 * g, rtol=1e-5, atol=1e-7)
    mg.adapter_grad("r2", "zero")
    assert not mg.has_pending_grad("r2")
    with pytest.raises(UserInputError, match="no gradient"):
        mg.optim_step("r2", ADAM)


def _continue(be, aid: str, items) -> tuple[float, float, float]:
    """One more step from a loaded state: (its loss, its grad norm, the loss after its Adam
    update, forward only). The last one depends on the restored moments and step count."""
    out = be.forward_backward(aid, items)
    norm = be.optim_step(aid, ADAM).metrics["grad_norm"]
    probe = copy.deepcopy(items)
    probe.forward_only = True
    return out.metrics["loss:sum"], norm, be.forward_backward(aid, probe).metrics["loss:sum"]


@pytest.mark.parametrize("direction", ["megatron->transformers", "transformers->megatron"])
def test_checkpoints_cross_backends_with_optimizer(
    pair, tiny_model_dir: Path, tmp_path: Path, direction: str
) -> None:
    tf, mg = pair
    src, dst = (mg, tf) if direction.startswith("megatron") else (tf, mg)
    aid, inp = _items(9)[0]
    src.forward_backward(aid, inp)
    src.optim_step(aid, ADAM)  # optimizer state with moments
    ck = tmp_path / "ck"
    assert src.save_state(aid, str(ck), include_optimizer=True) > 0
    fresh = TransformersTrainingBackend(str(tiny_model_dir)) if dst is tf else dst
    fresh_src = src
    spec = fresh.load_state("moved", str(ck), include_optimizer=True)
    assert spec.rank == SPECS[aid].rank
    # both continue from the same state: same loss and the same Adam update (moments, step)
    nxt = _items(11)[0][1]
    a = _continue(fresh_src, aid, nxt)
    b = _continue(fresh, "moved", nxt)
    assert b[0] == pytest.approx(a[0], rel=1e-5, abs=1e-5)
    # a float32 norm over the two backends' differently ordered sums: CI once measured 1.3e-5
    assert b[1] == pytest.approx(a[1], rel=1e-4)
    # the same Adam update: CI measured 1.4e-5 apart (Adam's m/sqrt(v) scales the gradients'
    # float32 noise up where they are tiny); without the optimizer state it is 78.6 vs 65.6
    assert b[2] == pytest.approx(a[2], rel=1e-3)
    fresh.delete_adapter("moved")


def test_checkpoint_errors_and_peft_load(pair, tiny_model_dir: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    _, mg = pair
    ck = tmp_path / "w"
    mg.save_state("r8", str(ck), include_optimizer=False)
    with pytest.raises(CheckpointError, match="already exists"):
        mg.save_state("r8", str(ck), include_optimizer=False)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        mg.load_state("x", str(ck), include_optimizer=True)
    assert not mg.has_adapter("x")
    with pytest.raises(CheckpointError, match="does not match"):
        mg.load_state("r2", str(ck), include_optimizer=False)  # rank 8 into rank 2
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, str(ck)).eval()
    rows = request(np.random.default_rng(4), "cross_entropy", n_datums=2)
    for row in rows.data:
        row.loss_fn_inputs["weights"] = np.ones(len(row.tokens), np.float32)
    rows.forward_only = True
    ours = mg.forward_backward("r8", rows)
    for row, out in zip(rows.data, ours.outputs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row.tokens])).logits[0].float()
        tgt = torch.as_tensor(row.loss_fn_inputs["target_tokens"])
        lp = logits.log_softmax(-1).gather(-1, tgt[:, None])[:, 0]
        assert float((lp - torch.from_numpy(out["logprobs"])).abs().max()) <= 1e-5


def test_custom_loss_and_encrypted_export_match_transformers(pair, tmp_path: Path) -> None:
    """A traced custom loss (the SDK's graph) fused with a built-in loss, on fresh adapters (same
    seed: identical): same loss, metrics and gradient as the Transformers backend; an
    age-encrypted save decrypts to the plain save, and writes no plaintext file."""
    import pyrage

    from tests.unit.test_custom_loss import PPO_RANKS, _data, _handle, ppo_variant

    tf, mg = pair
    for be in (tf, mg):
        be.create_adapter("c1", SPECS["r4"])
        be.create_adapter("c2", SPECS["r2"])
    _, wire = _handle(ppo_variant, PPO_RANKS)
    custom = ForwardBackwardInput(
        _data("ppo", np.random.default_rng(8)), "custom", {"loss_id": "x"}, custom_loss=wire
    )
    items = [("c1", custom), ("c2", _items(9)[0][1])]
    want, got = tf.forward_backward_many(items), mg.forward_backward_many(items)
    for w, g in zip(want, got, strict=True):
        assert not isinstance(w, Exception) and not isinstance(g, Exception), (w, g)
        for k, v in w.metrics.items():
            assert g.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
    ref = {k: p.grad for k, p in adapter_parameters(tf.model, "c1").items()}
    mine = mg.export_adapter("c1", grad=True)
    assert max(_rel(torch.from_numpy(mine[k]), g) for k, g in ref.items()) <= 1e-5
    identity = pyrage.x25519.Identity.generate()
    mg.save_state("c1", str(tmp_path / "plain"), include_optimizer=False)
    mg.save_state(
        "c1",
        str(tmp_path / "sealed"),
        include_optimizer=False,
        age_recipients=[str(identity.to_public())],
    )
    for name in ("adapter_model.safetensors", "adapter_config.json", "twinkle_state.json"):
        sealed = (tmp_path / "sealed" / f"{name}.age").read_bytes()
        assert pyrage.decrypt(sealed, [identity]) == (tmp_path / "plain" / name).read_bytes()
        assert not (tmp_path / "sealed" / name).exists()
    for be in (tf, mg):
        be.delete_adapter("c1")
        be.delete_adapter("c2")

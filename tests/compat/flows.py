"""Upstream Twinkle's cookbook flows, written by us, for a venv with upstream's `twinkle` package
and a `twinkle_client` (upstream's own, or ours swapped in: tests/compat/swap_venv.py).

The same calls upstream's cookbook scripts make (self_cognition, dpo, short_math_grpo, sample;
see shared docs twinkle-native-protocol.md), on our own small data, so that CI (which has no
upstream checkout) runs them with upstream's real client. Each flow prints one line
``RESULT <json>`` that tests/e2e/test_upstream_client.py checks and compares across clients.

    python flows.py {labels|sft|dpo|grpo|tinker_sft|tinker_dpo|embedding|ledger|tenant}
        [--other-key KEY]

Environment: TWINKLE_SERVER_URL, TWINKLE_SERVER_TOKEN, TWINKLE_MODEL_ID_ALIASES (maps
``ms://twinkle/tiny-chat`` to the tiny model's folder, so upstream's client-side Template loads
the same tokenizer as the server), COMPAT_DATA (tests/compat/data).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from peft import LoraConfig
from twinkle import init_twinkle_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta

import twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

BASE = "twinkle/tiny-chat"
MODEL_ID = f"ms://{BASE}"
DATA = Path(os.environ.get("COMPAT_DATA", Path(__file__).parent / "data"))
#: our twinkle_client exports its client class; upstream's exports only the init functions
OURS = hasattr(twinkle_client, "TwinkleClient")


def out(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def client():
    return init_twinkle_client(
        base_url=os.environ["TWINKLE_SERVER_URL"], api_key=os.environ["TWINKLE_SERVER_TOKEN"]
    )


def result(x):
    return getattr(x, "result", x)


def sft_rows(n: int = 8) -> Dataset:
    ds = Dataset(dataset_meta=DatasetMeta(str(DATA / "self_cognition.jsonl"), data_slice=range(n)))
    ds.set_template("Template", model_id=MODEL_ID, max_length=256)
    ds.map("SelfCognitionProcessor", init_args={"model_name": "Twinkle", "model_author": "Us"})
    ds.encode(batched=True)
    return ds


def _model(adapter: str, loss: str, lr: float, gas: int = 1, **loss_kw):
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    lora = LoraConfig(target_modules="all-linear", r=8, lora_alpha=32)
    model.add_adapter_to_model(adapter, lora, gradient_accumulation_steps=gas)
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss(loss, **loss_kw)
    model.set_optimizer("Adam", lr=lr)
    return model


def flow_labels() -> None:
    """An upstream-encoded batch: its loss through our native route vs upstream's own Tinker
    conversion (twinkle.server.common.datum.input_feature_to_datum) through our Tinker route,
    both on a fresh adapter (LoRA B = 0: the base model)."""
    client()
    rows = [dict(r) for r in sft_rows(4)]
    model = _model("labels", "CrossEntropyLoss", 1e-4)
    native = result(model.forward_only(inputs=rows))
    logps = native["logps"]
    native_sum = -sum(
        lp
        for row, lps in zip(rows, logps, strict=True)
        for lab, lp in zip(row["labels"], lps, strict=True)
        if lab != -100
    )
    from twinkle import init_tinker_client
    from twinkle.server.common.datum import input_feature_to_datum

    init_tinker_client()
    from tinker import ServiceClient

    service = ServiceClient(
        base_url=os.environ["TWINKLE_SERVER_URL"], api_key=os.environ["TWINKLE_SERVER_TOKEN"]
    )
    tc = service.create_lora_training_client(base_model=BASE, rank=8)
    datums = [input_feature_to_datum(r) for r in rows]
    fwd = tc.forward(datums, "cross_entropy").result()
    tinker_sum = 0.0
    for d, o in zip(datums, fwd.loss_fn_outputs, strict=True):
        w = d.loss_fn_inputs["weights"].to_numpy()
        lp = o["logprobs"].to_numpy()
        tinker_sum += float(-(lp * w).sum())
    n_tokens = sum(1 for r in rows for lab in r["labels"] if lab != -100)
    out(native_sum=native_sum, tinker_sum=tinker_sum, tokens=n_tokens, ours=OURS)


def flow_sft() -> None:
    c = client()
    names = [m.model_name for m in c.get_server_capabilities().supported_models]
    ds = sft_rows(8)
    loader = DataLoader(dataset=ds, batch_size=4)
    model = _model("default", "CrossEntropyLoss", 1e-3, gas=2)
    configs = model.get_train_configs().model_dump()
    losses, metrics = [], []
    for _epoch in range(3):
        for batch in loader:
            losses.append(result(model.forward_backward(inputs=batch))["loss"])
            model.clip_grad_and_step()
        metrics.append(result(model.calculate_metric(is_training=True)))
    saved = model.save(
        name="flow-sft", save_optimizer=True,
        consumed_train_samples=loader.get_state()["consumed_train_samples"],
    )  # fmt: skip
    runs = c.list_training_runs()
    run_ids = [r.training_run_id for r in runs]
    ckpts = [ck.twinkle_path for r in runs for ck in c.list_checkpoints(r.training_run_id)]
    resumed = _model("resumed", "CrossEntropyLoss", 1e-3, gas=2)
    progress = resumed.resume_from_checkpoint(saved.twinkle_path)
    out(
        models=names, losses=losses, metrics=metrics, path=saved.twinkle_path,
        checkpoint_dir=saved.checkpoint_dir, listed=saved.twinkle_path in ckpts,
        runs=len(run_ids), progress=progress, configs=str(configs)[:200], ours=OURS,
    )  # fmt: skip


def _pairs() -> list[dict]:
    """(chosen, rejected) trajectories from our DPO data, interleaved as upstream's dpo.py."""
    rows = [json.loads(x) for x in (DATA / "dpo_pairs.jsonl").read_text().splitlines() if x]
    trajs = []
    for r in rows[:2]:
        user = {"role": "user", "content": r["prompt"]}
        trajs.append({"messages": [user, {"role": "assistant", "content": r["answer_en"]}]})
        trajs.append({"messages": [user, {"role": "assistant", "content": r["answer_zh"]}]})
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"compat-dpo-{os.getpid()}.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in trajs))
    ds = Dataset(dataset_meta=DatasetMeta(str(path)))
    ds.set_template("Template", model_id=MODEL_ID, max_length=256)
    ds.encode(batched=True)
    return [dict(r) for r in ds]


def flow_dpo() -> None:
    client()
    rows = _pairs()
    model = _model("default", "DPOLoss", 2e-3, beta=0.1, loss_type="sigmoid",
                   reference_free=False, sft_weight=1.0)  # fmt: skip
    model.add_metric("DPOMetric", beta=0.1)
    losses, metrics = [], []
    for _ in range(4):
        ref = model.forward_only(inputs=rows, disable_lora=True)
        losses.append(result(model.forward_backward(inputs=rows, ref_outputs=result(ref)))["loss"])
        model.clip_grad_and_step()
        metrics.append(result(model.calculate_metric(is_training=True)))
    out(losses=losses, metrics=metrics, ours=OURS)


def flow_grpo() -> None:
    client()
    model = _model("default", "GRPOLoss", 1e-3, epsilon=0.2, beta=0.0)
    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Qwen3_5Template", model_id=MODEL_ID)
    prompts = [
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]},
        {"messages": [{"role": "user", "content": "Name a colour."}]},
    ]
    params = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.95, "num_samples": 4,
              "logprobs": 1, "seed": 11}  # fmt: skip
    steps = []
    for _ in range(3):
        uri = model.save(name="grpo-sampler-weights", save_optimizer=False, is_sampler=True)
        responses = sampler.sample(
            inputs=prompts, sampling_params=params, adapter_uri=uri.twinkle_path
        )
        feats, old, adv = [], [], []
        for res in responses:
            rewards = [len(s.decoded or "") + 0.01 * j for j, s in enumerate(res.sequences)]
            mean = sum(rewards) / len(rewards)
            std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 or 1.0
            for s, r in zip(res.sequences, rewards, strict=True):
                feats.append(s.new_input_feature)
                old.append([lp[0][1] for lp in s.logprobs])
                adv.append((r - mean) / std)
        fb = result(model.forward_backward(inputs=feats, advantages=adv, old_logps=old))
        model.clip_grad_and_step()
        metric = result(model.calculate_metric(is_training=True))
        steps.append({"loss": fb["loss"], "grad_norm": metric.get("grad_norm"),
                      "n": len(feats), "last": feats[-1]["messages"][-1]["role"]})  # fmt: skip
    out(steps=steps, ours=OURS)


def flow_tinker_dpo() -> None:
    """Upstream's Tinker DPO convention through its patched tinker 0.16.1 (cookbook
    tinker/dpo.py): reference logprobs from forward(disable_lora) attached as ``ref_logps``, then
    forward_backward('importance_sampling', loss_fn_config={'dpo_beta', 'dpo_sft_weight'})."""
    from tinker import types
    from twinkle import init_tinker_client
    from twinkle.server.common.datum import input_feature_to_datum

    init_tinker_client()
    from tinker import ServiceClient

    service = ServiceClient(
        base_url=os.environ["TWINKLE_SERVER_URL"], api_key=os.environ["TWINKLE_SERVER_TOKEN"]
    )
    tc = service.create_lora_training_client(base_model=BASE, rank=8)
    rows = _pairs()
    losses, metrics = [], []
    for _ in range(3):
        datums = [input_feature_to_datum(r) for r in rows]
        ref = tc.forward(datums, "cross_entropy", loss_fn_config={"disable_lora": True}).result()
        for d, o in zip(datums, ref.loss_fn_outputs, strict=True):
            d.loss_fn_inputs["ref_logps"] = types.TensorData.from_numpy(o["logprobs"].to_numpy())
        config = {"dpo_beta": 0.1, "dpo_sft_weight": 1.0}
        fb = tc.forward_backward(datums, "importance_sampling", loss_fn_config=config).result()
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
        losses.append(float(fb.metrics["loss:sum"]))
        metrics.append({k: float(v) for k, v in fb.metrics.items()})
    out(losses=losses, metrics=metrics)


def flow_tinker_sft() -> None:
    """upstream's tinker/self_cognition.py + sample.py through its patched tinker 0.16.1
    (init_tinker_client): upstream-converted datums, cross_entropy + optim_step, save_state, a
    sampling client from the twinkle:// path, the REST client's run list."""
    from tinker import types
    from twinkle import init_tinker_client
    from twinkle.server.common.datum import input_feature_to_datum

    init_tinker_client()
    from tinker import ServiceClient

    service = ServiceClient(
        base_url=os.environ["TWINKLE_SERVER_URL"], api_key=os.environ["TWINKLE_SERVER_TOKEN"]
    )
    tc = service.create_lora_training_client(base_model=BASE, rank=16)
    datums = [input_feature_to_datum(dict(r)) for r in sft_rows(8)]
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(datums, "cross_entropy").result()
        n = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in datums)
        lp = [o["logprobs"].to_numpy() for o in fb.loss_fn_outputs]
        losses.append(float(fb.metrics["loss:sum"]) / n)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("twinkle-lora-0").result().path
    sampler_path = tc.save_weights_for_sampler("twinkle-lora-0-s").result().path
    sc = service.create_sampling_client(
        model_path=sampler_path.replace("tinker://", "twinkle://"), base_model=BASE
    )
    prompt = types.ModelInput.from_ints(datums[0].model_input.to_ints()[:6])
    res = sc.sample(
        prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8, temperature=0.2)
    ).result()
    runs = service.create_rest_client().list_training_runs(limit=50).result().training_runs
    out(losses=losses, path=path, n_logprobs=len(lp), sequences=len(res.sequences),
        runs=len(runs))  # fmt: skip


PAIRS = [
    ("What is the capital of France?", "Paris is the capital city of France."),
    ("How do plants make food?", "Plants use photosynthesis to make food from sunlight."),
    ("Who wrote Hamlet?", "William Shakespeare wrote the tragedy Hamlet."),
]


def flow_embedding() -> None:
    """upstream's embedding.py: InfoNCE on interleaved (anchor, positive) rows, task='embedding'."""
    from twinkle.template import Template

    client()
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("emb_adapter", LoraConfig(target_modules="all-linear"))
    model.set_template("Qwen3_5Template", model_id=MODEL_ID)
    model.set_processor("InputProcessor")
    model.set_loss("InfonceLoss", temperature=0.07, use_batch=True, hard_negatives=None)
    model.set_optimizer("Adam", lr=1e-3)
    model.add_metric("EmbeddingMetric", is_training=True)
    tok = Template(model_id=MODEL_ID, max_length=512).tokenizer
    rows = []
    for anchor, positive in PAIRS:
        for text, is_anchor in ((anchor, True), (positive, False)):
            ids = list(tok.encode(text, add_special_tokens=True))
            n, label = len(ids), [1 if is_anchor else 0]
            rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": label,
                         "position_ids": list(range(n))})  # fmt: skip
    losses, metrics = [], []
    for _ in range(4):
        losses.append(result(model.forward_backward(inputs=rows, task="embedding"))["loss"])
        model.clip_grad_and_step(max_grad_norm=1.0)
        metrics.append(result(model.calculate_metric(is_training=True)))
    out(losses=losses, metrics=metrics)


def flow_ledger() -> None:
    """One of each metered operation (tests/gateway/test_ledger_parity.py): an adapter, one
    trained batch, one checkpoint save, one sample; prints the tokens trained and the session."""
    c = client()
    rows = [dict(r) for r in sft_rows(2)]
    model = _model("default", "CrossEntropyLoss", 1e-4)
    model.forward_backward(inputs=rows)
    model.save(name="ledger", save_optimizer=False)
    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Qwen3_5Template", model_id=MODEL_ID)
    sampler.sample(
        inputs=[{"messages": [{"role": "user", "content": "Name a colour."}]}],
        sampling_params={"max_tokens": 3, "temperature": 0.0},
    )
    if OURS:
        session = c.session_id
    else:
        from twinkle_client.http.utils import get_session_id

        session = get_session_id()
    out(tokens=sum(len(r["input_ids"]) for r in rows), session=session, ours=OURS)


def _status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None) or getattr(exc, "status_code", None)


def _expect_404(fn) -> str:
    try:
        fn()
    except Exception as exc:  # upstream: requests.HTTPError; ours: NotFoundError
        if _status(exc) == 404:
            return "404"
        return f"{type(exc).__name__} {_status(exc)}: {exc}"[:300]
    return "no error"


def flow_tenant(other_key: str) -> None:
    """Owner A saves; user B (other key) cannot load, sample from, or use A's session."""
    a = client()
    model = _model("mine", "CrossEntropyLoss", 1e-4)
    path = model.save(name="private", save_optimizer=False, is_sampler=True).twinkle_path
    if OURS:
        a_session = a.session_id
    else:
        from twinkle_client.http.utils import get_session_id

        a_session = get_session_id()
    b = init_twinkle_client(base_url=os.environ["TWINKLE_SERVER_URL"], api_key=other_key)
    b_model = _model("mine", "CrossEntropyLoss", 1e-4)  # B's own adapter of the same name
    results = {
        "load": _expect_404(lambda: b_model.load(path, load_optimizer=False)),
        "resume": _expect_404(lambda: b_model.resume_from_checkpoint(path)),
        "sample": _expect_404(
            lambda: vLLMSampler(model_id=MODEL_ID).sample(
                inputs=[{"messages": [{"role": "user", "content": "hi"}]}],
                sampling_params={"max_tokens": 2},
                adapter_uri=path,
            )
        ),  # fmt: skip
    }
    if OURS:
        b._http.headers["X-Twinkle-Session-Id"] = a_session
    else:
        from twinkle_client.http.utils import set_session_id

        set_session_id(a_session)
    results["session"] = _expect_404(lambda: MultiLoraTransformersModel(model_id=MODEL_ID))
    out(results=results, ours=OURS)


if __name__ == "__main__":
    name = sys.argv[1]
    if name == "tenant":
        flow_tenant(sys.argv[sys.argv.index("--other-key") + 1])
    else:
        flows = {"labels": flow_labels, "sft": flow_sft, "dpo": flow_dpo, "grpo": flow_grpo}
        flows.update(tinker_dpo=flow_tinker_dpo, tinker_sft=flow_tinker_sft)
        flows.update(embedding=flow_embedding, ledger=flow_ledger)
        flows[name]()

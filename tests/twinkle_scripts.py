"""Training scripts written once against the upstream-Twinkle model API and run both in process
(``engine.local.model.MultiLoraTransformersModel``) and remotely (``twinkle_client.model``): the
model class is a parameter, exactly what changing the import does. Used by tests/gateway and
tests/e2e.

No torch or engine import here, so a torch-free venv can run them too.
"""

from __future__ import annotations

BASE = "twinkle/tiny-chat"
TEXTS = [
    "User: what is 12 plus 13? Assistant: 25.",
    "The small model reads every line of the corpus slowly and then it rests.",
    "def compute_batch(batch, token=None):\n    return batch + token",
    "User: what is the capital of France? Assistant: The capital of France is Paris.",
]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "seed": 3}
MICRO_STEPS, SAVE_AFTER, GAS, MICRO_BATCH = 8, 4, 2, 2


def hf_data(model_dir) -> list[dict]:
    """TEXTS as HF-style features (first 3 labels ignored), tokenized with the model's own
    tokenizer.json (the `tokenizers` library, no torch)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    out = []
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False).ids
        out.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return out


def _setup(model) -> None:
    model.add_adapter_to_model("default", dict(LORA), gradient_accumulation_steps=GAS)
    model.set_template("Template")
    model.set_processor("InputProcessor")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01)
    model.set_lr_scheduler("cosine", warmup_steps=1, total_steps=MICRO_STEPS // GAS)


def _micro(data: list[dict], i: int) -> list[dict]:
    k = (i * MICRO_BATCH) % len(data)
    return data[k : k + MICRO_BATCH]


def sft_script(MultiLoraTransformersModel, model_id: str, data: list[dict], **model_kwargs) -> dict:
    """SFT with CrossEntropyLoss, gradient accumulation and a cosine LR schedule; saves at an
    accumulation boundary, then a fresh model resumes from that checkpoint and runs the rest."""
    model = MultiLoraTransformersModel(model_id, **model_kwargs)
    _setup(model)
    model.forward_backward(
        inputs=data[:1], label_format="hf"
    )  # a probe whose gradient is dropped again
    probe_norm = model.clip_grad_norm(max_grad_norm=0.0)
    model.zero_grad()
    losses, norms, ckpt = [], [], None
    for i in range(MICRO_STEPS):
        losses.append(model.forward_backward(inputs=_micro(data, i), label_format="hf")["loss"])
        norms.append(model.clip_grad_and_step(max_grad_norm=1.0))
        if i + 1 == SAVE_AFTER:
            ckpt = model.save(
                "sft-ckpt", save_optimizer=True, consumed_train_samples=(i + 1) * MICRO_BATCH
            )
    metric = model.calculate_metric(is_training=True)

    resumed_model = MultiLoraTransformersModel(model_id, **model_kwargs)
    _setup(resumed_model)
    info = resumed_model.resume_from_checkpoint(ckpt)
    start = info["consumed_train_samples"] // MICRO_BATCH
    resumed = []
    for i in range(start, MICRO_STEPS):
        resumed.append(
            resumed_model.forward_backward(inputs=_micro(data, i), label_format="hf")["loss"]
        )
        resumed_model.clip_grad_and_step(max_grad_norm=1.0)
    return {
        "losses": losses,
        "norms": norms,
        "probe_norm": probe_norm,
        "resumed": resumed,
        "resume_info": info,
        "metric": metric,
        "ckpt": ckpt,
    }


def dpo_step(MultiLoraTransformersModel, model_id: str, data: list[dict], **model_kwargs) -> dict:
    """One DPO step: reference log-probs from the base model (forward_only, disable_lora), then
    DPOLoss on (chosen, rejected) pairs."""
    model = MultiLoraTransformersModel(model_id, **model_kwargs)
    model.add_adapter_to_model("dpo", {"r": 4, "seed": 1})
    model.set_loss("DPOLoss", beta=0.1, adapter_name="dpo")
    model.set_optimizer("AdamW", lr=1e-3, adapter_name="dpo")
    pairs = [data[0], data[1], data[3], data[2]]  # (chosen, rejected) x 2
    ref = model.forward_only(
        inputs=pairs, adapter_name="dpo", disable_lora=True, label_format="hf"
    )["logprobs"]
    batch = [dict(d, ref_logprobs=[float(x) for x in lp]) for d, lp in zip(pairs, ref, strict=True)]
    out = model.forward_backward(inputs=batch, adapter_name="dpo", label_format="hf")
    step = model.step(adapter_name="dpo")
    return {"loss": out["loss"], "step": step, "metrics": out["metrics"]}


def grpo_step(MultiLoraTransformersModel, Sampler, model_id: str, **kwargs) -> dict:
    """One GRPO step from sampled completions: save sampler weights, sample 2 completions per
    prompt with that adapter, score them, group-relative advantages, GRPOLoss on each sequence's
    new_input_feature."""
    model = MultiLoraTransformersModel(model_id, **kwargs)
    model.add_adapter_to_model("grpo", {"r": 4, "seed": 5})
    model.set_loss("GRPOLoss", epsilon=0.2, adapter_name="grpo")
    model.set_optimizer("AdamW", lr=1e-3, adapter_name="grpo")
    path = model.save("grpo-sampler", is_sampler=True, adapter_name="grpo")
    sampler = Sampler(model_id, **kwargs)
    sampler.set_template("Template")
    prompts = [
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]},
        {"messages": [{"role": "user", "content": "Name a colour."}]},
    ]
    params = {"max_tokens": 8, "temperature": 1.0, "num_samples": 2, "seed": 7, "logprobs": 1}
    responses = sampler.sample(prompts, params, adapter_uri=path)
    features, texts = [], []
    for res in responses:
        # reward: longer answers win; the index breaks ties so each group has a spread
        rewards = [len(s.decoded) + 0.1 * j for j, s in enumerate(res.sequences)]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(res.sequences, rewards, strict=True):
            features.append(dict(s.new_input_feature, advantages=r - mean))
            texts.append(s.decoded or "<empty>")
    out = model.forward_backward(inputs=features, adapter_name="grpo", label_format="hf")
    step = model.step(adapter_name="grpo")
    return {"num_sequences": len(features), "texts": texts, "loss": out["loss"], "step": step}

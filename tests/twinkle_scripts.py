"""Training scripts written once against upstream Twinkle's model API and run both in process
(``engine.local.model.MultiLoraTransformersModel``) and remotely (``twinkle_client.model``,
upstream's native protocol): the model class is a parameter, exactly what changing the import
does. Remote calls return upstream's response objects (``.result``, ``SaveResponse``);
`result` / `path_of` read both. Used by tests/gateway and tests/e2e.

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
    tokenizer.json (the `tokenizers` library, no torch). The model classes take rolled labels
    by default (upstream's convention): pass `roll` of them."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    out = []
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False).ids
        out.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return out


def roll(rows: list[dict]) -> list[dict]:
    """HF-style rows (``labels[i]`` is the token at ``i``; the model shifts) → upstream's ROLLED
    labels (``labels[i]`` is the target of ``input_ids[i]``, the last -100): what upstream's
    templates write, and what the engine's class (in process and remote) takes by default;
    HF-style rows need ``label_format="hf"``."""
    return [dict(r, labels=list(r["labels"][1:]) + [-100]) for r in rows]


def result(out):
    """A call's value: ``.result`` of twinkle_client's response objects (upstream's protocol),
    the engine's plain return value as is."""
    return getattr(out, "result", out)


def path_of(saved) -> str:
    """A checkpoint from ``save``: twinkle_client's `SaveResponse` → its ``twinkle_path``; the
    engine's directory as is."""
    return str(getattr(saved, "twinkle_path", saved))


def _setup(model, adapter: str = "default") -> None:
    model.add_adapter_to_model(adapter, dict(LORA), gradient_accumulation_steps=GAS)
    model.set_template("Template", adapter_name=adapter)
    model.set_processor("InputProcessor", adapter_name=adapter)
    model.set_loss("CrossEntropyLoss", adapter_name=adapter)
    model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01, adapter_name=adapter)
    model.set_lr_scheduler(
        "cosine", warmup_steps=1, total_steps=MICRO_STEPS // GAS, adapter_name=adapter
    )


def _micro(data: list[dict], i: int) -> list[dict]:
    k = (i * MICRO_BATCH) % len(data)
    return data[k : k + MICRO_BATCH]


def sft_script(MultiLoraTransformersModel, model_id: str, data: list[dict], **model_kwargs) -> dict:
    """SFT with CrossEntropyLoss, gradient accumulation and a cosine LR schedule; saves at an
    accumulation boundary, then a fresh model (adapter "resumed") resumes from that checkpoint
    and runs the rest. Each step is upstream's spelled-out clip_grad_and_step (clip_grad_norm,
    step, zero_grad, lr_step), so the gradient norm is seen."""
    model = MultiLoraTransformersModel(model_id, **model_kwargs)
    _setup(model)
    model.forward_backward(inputs=data[:1])  # a probe whose gradient is dropped again
    probe_norm = float(result(model.clip_grad_norm(max_grad_norm=0.0)))
    model.zero_grad()
    losses, norms, ckpt = [], [], ""
    for i in range(MICRO_STEPS):
        losses.append(result(model.forward_backward(inputs=_micro(data, i)))["loss"])
        norms.append(float(result(model.clip_grad_norm(1.0))))
        model.step()
        model.zero_grad()
        model.lr_step()
        if i + 1 == SAVE_AFTER:
            ckpt = path_of(
                model.save(
                    "sft-ckpt", save_optimizer=True, consumed_train_samples=(i + 1) * MICRO_BATCH
                )
            )
    metric = result(model.calculate_metric(is_training=True))

    resumed_model = MultiLoraTransformersModel(model_id, **model_kwargs)
    _setup(resumed_model, "resumed")
    info = resumed_model.resume_from_checkpoint(ckpt, adapter_name="resumed")
    start = info["consumed_train_samples"] // MICRO_BATCH
    resumed = []
    for i in range(start, MICRO_STEPS):
        out = resumed_model.forward_backward(inputs=_micro(data, i), adapter_name="resumed")
        resumed.append(result(out)["loss"])
        resumed_model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="resumed")
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
    """One DPO step as upstream's cookbook takes it: reference outputs from the base model
    (forward_only with disable_lora), passed back as ``ref_outputs`` to forward_backward with
    DPOLoss on interleaved (chosen, rejected) pairs; DPOMetric added."""
    model = MultiLoraTransformersModel(model_id, **model_kwargs)
    model.add_adapter_to_model("dpo", {"r": 4, "seed": 1})
    model.set_loss("DPOLoss", beta=0.1, loss_type="sigmoid", reference_free=False, sft_weight=0.0)
    model.add_metric("DPOMetric", beta=0.1)
    model.set_optimizer("AdamW", lr=1e-3)
    pairs = [data[0], data[1], data[3], data[2]]  # (chosen, rejected) x 2
    ref_outputs = model.forward_only(inputs=pairs, disable_lora=True)
    out = model.forward_backward(inputs=pairs, ref_outputs=result(ref_outputs))
    model.clip_grad_and_step()
    metrics = result(model.calculate_metric(is_training=True))
    return {"loss": result(out)["loss"], "output": result(out), "metrics": metrics}


def grpo_step(MultiLoraTransformersModel, Sampler, model_id: str, **kwargs) -> dict:
    """One GRPO step as upstream's short_math_grpo takes it: save sampler weights, sample 2
    completions per prompt with that adapter (``adapter_uri``), score them, group-relative
    ``advantages`` and ``old_logps`` (``logprobs[i][0][1]``) into forward_backward with GRPOLoss
    on each sequence's new_input_feature."""
    model = MultiLoraTransformersModel(model_id, **kwargs)
    model.add_adapter_to_model("grpo", {"r": 4, "seed": 5})
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_optimizer("AdamW", lr=1e-3)
    path = path_of(model.save("grpo-sampler", save_optimizer=False, is_sampler=True))
    sampler = Sampler(model_id, **kwargs)
    sampler.set_template("Template", model_id=model_id)
    prompts = [
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]},
        {"messages": [{"role": "user", "content": "Name a colour."}]},
    ]
    params = {"max_tokens": 8, "temperature": 1.0, "num_samples": 2, "seed": 7, "logprobs": 1}
    responses = sampler.sample(inputs=prompts, sampling_params=params, adapter_uri=path)
    features, old_logps, advantages, texts = [], [], [], []
    for res in responses:
        # reward: longer answers win; the index breaks ties so each group has a spread
        rewards = [len(s.decoded or "") + 0.1 * j for j, s in enumerate(res.sequences)]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(res.sequences, rewards, strict=True):
            features.append(s.new_input_feature)
            old_logps.append([lp[0][1] for lp in s.logprobs])
            advantages.append(r - mean)
            texts.append(s.decoded or "<empty>")
    out = model.forward_backward(inputs=features, advantages=advantages, old_logps=old_logps)
    model.clip_grad_and_step()
    metrics = result(model.calculate_metric(is_training=True))
    return {
        "num_sequences": len(features),
        "texts": texts,
        "loss": result(out)["loss"],
        "metrics": metrics,
    }

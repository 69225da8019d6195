"""Self-cognition SFT against a Twinkle server with the native client (no torch needed).

    pip install ./client
    export TWINKLE_SERVER_URL=http://127.0.0.1:8000 TWINKLE_SERVER_TOKEN=tml-...
    python cookbook/client/twinkle/self_host/self_cognition.py [--resume twinkle://...]

Data: the local self_cognition.jsonl next to this file, through SelfCognitionProcessor, encoded
by the server's chat template. Training: LoRA, CrossEntropyLoss, gradient accumulation 2, cosine
LR schedule, a checkpoint that records how many samples were consumed (so --resume continues the
exact run). Prints one JSON line with the losses at the end.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from twinkle_client import init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.template import Template

MODEL_ID = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).with_name("self_cognition.jsonl")


def main(max_steps: int, resume: str | None) -> dict:
    client = init_twinkle_client()  # TWINKLE_SERVER_URL / TWINKLE_SERVER_TOKEN
    models = [m["model_name"] for m in client.get_server_capabilities()["supported_models"]]
    assert MODEL_ID in models, f"{MODEL_ID} is not served; served: {models}"

    template = Template(MODEL_ID, max_length=128)
    dataset = Dataset(DatasetMeta(str(DATA), data_slice=range(8)))
    dataset.map(
        "SelfCognitionProcessor",
        init_args={"model_name": "Twinkle", "model_author": "the Twinkle team"},
    )
    dataset.encode(template)
    loader = DataLoader(dataset, batch_size=2, shuffle=True, seed=0)

    model = MultiLoraTransformersModel(MODEL_ID)
    model.add_adapter_to_model(
        "default",
        {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        gradient_accumulation_steps=2,
    )
    model.set_template(template)
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=5e-3)
    model.set_lr_scheduler("cosine", warmup_steps=1, total_steps=max_steps // 2)
    consumed = 0
    if resume:
        info = model.resume_from_checkpoint(resume)
        consumed = info["consumed_train_samples"]
        loader.resume_from_checkpoint(consumed)

    losses, step = [], consumed // loader.batch_size
    while step < max_steps:
        for batch in loader:
            # the server's template encodes HF-aligned labels (labels[i] = input_ids[i])
            out = model.forward_backward(inputs=batch, label_format="hf")
            model.clip_grad_and_step(max_grad_norm=1.0)
            losses.append(out["loss"])
            consumed += len(batch)
            step += 1
            if step == max_steps:
                break
    metrics = model.calculate_metric(is_training=True)
    path = model.save("self-cognition-final", save_optimizer=True, consumed_train_samples=consumed)
    client.close()
    return {"losses": losses, "checkpoint": path, "metrics": metrics}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--resume", default=None, help="twinkle:// checkpoint path to continue from")
    a = p.parse_args()
    print(json.dumps(main(a.max_steps, a.resume)))

"""Self-cognition SFT against a Twinkle server with the native client (no torch needed).

    python cookbook/client/server/transformer/server.py       # terminal 1 (or megatron/)
    python cookbook/client/twinkle/self_host/self_cognition.py  # terminal 2, same directory

With nothing set it finds the local quick-start server (twinkle_client/local_server.py) and runs
in the repo's .venv; elsewhere: ``pip install ./client`` and export TWINKLE_SERVER_URL /
TWINKLE_SERVER_TOKEN. ``--resume twinkle://...`` continues a saved run.

Data: the local self_cognition.jsonl next to this file, through SelfCognitionProcessor, encoded
by the server's chat template. Training: LoRA, CrossEntropyLoss, gradient accumulation 2, cosine
LR schedule, a checkpoint that records how many samples were consumed (so --resume continues the
exact run). Prints one JSON line with the losses at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client",), install=False)  # a plain `python` in the repo: .venv

from twinkle_client import TwinkleClient, init_twinkle_client  # noqa: E402
from twinkle_client.dataloader import DataLoader  # noqa: E402
from twinkle_client.dataset import Dataset, DatasetMeta  # noqa: E402
from twinkle_client.model import MultiLoraTransformersModel  # noqa: E402

MODEL_ID = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).with_name("self_cognition.jsonl")


def main(max_steps: int, resume: str | None, client: TwinkleClient | None = None) -> dict:
    """Train and save. ``client``: the current client (made by `init_twinkle_client`, which the
    model and the data use) to use and leave open; default: a new one, closed at the end."""
    own = client is None
    # TWINKLE_SERVER_URL / _TOKEN, or the local quick start
    client = client or init_twinkle_client()
    models = [m.model_name for m in client.get_server_capabilities().supported_models]
    assert MODEL_ID in models, f"{MODEL_ID} is not served; served: {models}"

    dataset = Dataset(dataset_meta=DatasetMeta(str(DATA), data_slice=range(8)))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=128)
    dataset.map(
        "SelfCognitionProcessor",
        init_args={"model_name": "Twinkle", "model_author": "the Twinkle team"},
    )
    dataset.encode(batched=True)  # through the server: rolled labels, as upstream's Template
    loader = DataLoader(dataset=dataset, batch_size=2, shuffle=True, seed=0)

    model = MultiLoraTransformersModel(MODEL_ID)
    model.add_adapter_to_model(
        "default",
        {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        gradient_accumulation_steps=2,
    )
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=5e-3)
    model.set_lr_scheduler("cosine", warmup_steps=1, total_steps=max_steps // 2)
    if resume:
        progress = model.resume_from_checkpoint(resume)
        loader.resume_from_checkpoint(progress["consumed_train_samples"])

    losses, step = [], loader.get_state()["consumed_train_samples"] // loader.batch_size
    while step < max_steps:
        for batch in loader:
            out = model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=1.0)
            losses.append(out.result["loss"])
            step += 1
            if step == max_steps:
                break
    metrics = model.calculate_metric(is_training=True).result
    saved = model.save(
        "self-cognition-final",
        save_optimizer=True,
        consumed_train_samples=loader.get_state()["consumed_train_samples"],
    )
    if own:
        client.close()
    return {"losses": losses, "checkpoint": saved.twinkle_path, "metrics": metrics}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--resume", default=None, help="twinkle:// checkpoint path to continue from")
    a = p.parse_args()
    print(json.dumps(main(a.max_steps, a.resume)))

"""Vision-language LoRA SFT with the native client, then reading the images back by sampling.

    python cookbook/client/server/transformer/server.py      # terminal 1 (serves twinkle/tiny-vl)
    python cookbook/client/twinkle/self_host/multi_modal.py   # terminal 2, same directory

Upstream's twinkle/multi_modal.py (LaTeX OCR on Qwen3.5-VL) on a Twinkle server, offline: the
shipped OCR-style set (cookbook/client/data/ocr: short formulas drawn on 112x28 images, the text
the target) on the built-in tiny Qwen2-VL ``twinkle/tiny-vl`` (``TWINKLE_VL_MODEL_ID``). As
upstream, a preprocessor turns each row into a trajectory whose user message is ``<image>`` + the
question with the image in the message's ``images``; ``dataset.encode()`` renders it with the
server's template (``<image>`` → the model's vision tokens; the client sends the image as a
``data:`` URL, no image library or tokenizer needed here) and the server's image processor makes
the pixels when the rows are trained. Upstream processes images on the client instead (its
template needs the model's processor from a hub); the rows it sends, ``pixel_values`` included,
train here too.

``--max-steps`` optimizer steps over the whole set (a line per step), then it saves the adapter
and samples every image greedily through the native sampler. LoRA goes on the language model;
``--train-vision`` puts it on the vision tower's blocks too (opt-in, like naming their modules
``qkv``/``proj``/``fc1``/``fc2`` in ``target_modules``). One JSON line at the end: losses,
the checkpoint, and what each image was read as.
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
from twinkle_client.sampler import vLLMSampler  # noqa: E402

MODEL_ID = os.environ.get("TWINKLE_VL_MODEL_ID", "twinkle/tiny-vl")
OCR = Path(__file__).resolve().parents[2] / "data" / "ocr"
QUESTION = "Read the formula."


def ocr_trajectory(row: dict) -> dict:
    """upstream's LatexOCRProcessor: the image in the user message, its text the answer."""
    image = (OCR / row["image"]).read_bytes()
    return {
        "messages": [
            {"role": "user", "content": f"<image>{QUESTION}", "images": [image]},
            {"role": "assistant", "content": row["text"]},
        ]
    }


def main(
    max_steps: int, lr: float, client: TwinkleClient | None = None, train_vision: bool = False
) -> dict:
    """Train, save, read back. ``client``: use and leave open (default: a new one, closed)."""
    own = client is None
    client = client or init_twinkle_client()  # TWINKLE_SERVER_URL / _TOKEN, or the quick start
    rows = [json.loads(line) for line in (OCR / "labels.jsonl").read_text().splitlines()]
    dataset = Dataset(dataset_meta=DatasetMeta(str(OCR / "labels.jsonl")))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=128)
    dataset.map(ocr_trajectory)
    dataset.encode(batched=True)  # through the server: input_ids, rolled labels, the images
    loader = DataLoader(dataset=dataset, batch_size=len(rows))

    model = MultiLoraTransformersModel(MODEL_ID)
    # "all": attention, MLP and the output layer (Tinker's default). Upstream's "all-linear"
    # leaves the output layer out; on the tiny random model that trains 5x slower (measured:
    # loss 7.65 -> 6.6 in 40 steps, against 7.65 -> 0.8 with it).
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all", "train_vision": train_vision}
    model.add_adapter_to_model("default", lora)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=lr)
    losses: list[float] = []
    while len(losses) < max_steps:
        for batch in loader:
            out = model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=1.0)
            losses.append(out.result["loss"])
            print(f"step {len(losses)}/{max_steps}  loss {losses[-1]:.4f}", file=sys.stderr)
            if len(losses) == max_steps:
                break
    saved = model.save("multi-modal", save_optimizer=False)

    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, max_length=128)
    prompts = [{"messages": ocr_trajectory(r)["messages"][:1]} for r in rows]
    responses = sampler.sample(
        inputs=prompts,
        sampling_params={"max_tokens": 8, "temperature": 0.0, "num_samples": 1},
        adapter_uri=saved.twinkle_path,
    )
    read = []
    for r, res in zip(rows, responses, strict=True):
        got = (res.sequences[0].decoded or "").strip()
        read.append({"image": r["image"], "text": r["text"], "read": got})
        print(f"{r['image']}: {r['text']!r} read as {got!r}", file=sys.stderr)
    if own:
        client.close()
    return {
        "losses": losses,
        "checkpoint": saved.twinkle_path,
        "train_vision": train_vision,
        "read": read,
        "correct": sum(x["read"] == x["text"] for x in read),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--train-vision", action="store_true", help="LoRA on the vision tower too")
    a = p.parse_args()
    print(json.dumps(main(a.max_steps, a.lr, train_vision=a.train_vision)))

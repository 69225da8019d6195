"""DPO with the native client, the reference being the same model with LoRA disabled (upstream's
twinkle/dpo.py).

    python cookbook/client/twinkle/self_host/dpo.py [--max-steps 6]

Data: cookbook/client/data/dpo_pairs.jsonl (a prompt, an emoji answer preferred over a plain
one), as chat trajectories encoded on the server with the model's template. Each step: reference
outputs from ``forward_only(..., disable_lora=True)``, then ``forward_backward(...,
ref_outputs=...)`` with ``DPOLoss`` on interleaved ``[chosen_1, rejected_1, ...]`` pairs,
``clip_grad_and_step``, and ``DPOMetric`` (rewards/margins, accuracies). Server:
``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``, or with nothing set the local quick-start
server. A line per step, then one JSON line (losses, margins, the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client",), install=False)  # a plain `python` in the repo: .venv

from twinkle_client import TwinkleClient, init_twinkle_client  # noqa: E402
from twinkle_client.dataset import Dataset, DatasetMeta  # noqa: E402
from twinkle_client.model import MultiLoraTransformersModel  # noqa: E402

MODEL_ID = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).resolve().parents[2] / "data" / "dpo_pairs.jsonl"
SYSTEM = "You are a helpful assistant."


def encoded_pairs() -> list[dict]:
    """[chosen_1, rejected_1, chosen_2, ...] as encoded rows (input_ids, labels)."""
    trajectories = []
    for line in DATA.read_text().splitlines():
        r = json.loads(line)
        head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}]
        for answer in (r["answer_zh"], r["answer_en"]):  # chosen, rejected
            trajectories.append({"messages": [*head, {"role": "assistant", "content": answer}]})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dpo_trajectories.jsonl"
        path.write_text("".join(json.dumps(t) + "\n" for t in trajectories))
        ds = Dataset(dataset_meta=DatasetMeta(str(path)))
        ds.set_template("Template", model_id=MODEL_ID, max_length=256)
        ds.encode(batched=True)  # on the server: rolled labels, loss on the answer only
        return [dict(row) for row in ds]


def main(
    max_steps: int, pairs_per_step: int, lr: float, beta: float, client: TwinkleClient | None = None
) -> dict:
    """Train and save. ``client``: the current client (made by `init_twinkle_client`, which the
    model and the data use) to use and leave open; default: a new one, closed at the end."""
    own = client is None
    client = client or init_twinkle_client()
    rows = encoded_pairs()
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    lora = {"r": 8, "lora_alpha": 32, "target_modules": "all-linear"}
    model.add_adapter_to_model("default", lora)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("DPOLoss", beta=beta, loss_type="sigmoid", reference_free=False, sft_weight=1.0)
    model.add_metric("DPOMetric", beta=beta)
    model.set_optimizer("AdamW", lr=lr)
    losses, margins = [], []
    n_pairs = len(rows) // 2
    for step in range(max_steps):
        first = (step * pairs_per_step) % n_pairs
        idx = [(first + k) % n_pairs for k in range(pairs_per_step)]
        batch = [rows[2 * i + j] for i in idx for j in (0, 1)]
        ref = model.forward_only(inputs=batch, disable_lora=True)
        out = model.forward_backward(inputs=batch, ref_outputs=ref.result)
        model.clip_grad_and_step(max_grad_norm=1.0)
        metrics = model.calculate_metric(is_training=True).result
        losses.append(float(out.result["loss"]))
        margins.append(float(metrics.get("rewards/margins", float("nan"))))
        print(
            f"step {step + 1}/{max_steps}  loss {losses[-1]:.4f}  margin {margins[-1]:+.4f}  "
            f"accuracy {metrics.get('rewards/accuracies', float('nan')):.2f}",
            file=sys.stderr,
            flush=True,
        )
    saved = model.save(name="dpo-final", save_optimizer=True)
    if own:
        client.close()
    return {"losses": losses, "margins": margins, "checkpoint": saved.twinkle_path}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.1)
    a = p.parse_args()
    print(json.dumps(main(a.max_steps, a.pairs_per_step, a.lr, a.beta)))

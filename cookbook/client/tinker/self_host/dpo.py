"""DPO with the unmodified Tinker SDK, the reference being the same model with LoRA disabled
(upstream's tinker/dpo.py).

    python cookbook/client/tinker/self_host/dpo.py [--max-steps 8]

Data: cookbook/client/data/dpo_pairs.jsonl (a prompt, an emoji answer preferred over a plain one:
upstream's emoji DPO set, in miniature), in the model's chat template. Each step sends the pairs
interleaved ``[chosen_1, rejected_1, ...]`` with the loss on the answer tokens; the reference
log-probs come from ``forward(..., loss_fn_config={"disable_lora": True})`` and go back as
``ref_logps`` with ``importance_sampling`` + ``{"dpo_beta", "dpo_sft_weight"}``: upstream's Tinker
DPO convention, which the server runs as DPO. Server: ``TWINKLE_SERVER_URL`` /
``TWINKLE_SERVER_TOKEN``, or with nothing set the local quick-start server. A line per step, then
one JSON line (losses, margins, accuracies, the saved state).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

from twinkle_client import init_tinker_client  # noqa: E402

init_tinker_client()  # before the SDK is used

import tinker  # noqa: E402
from tinker import types  # noqa: E402

BASE_MODEL = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).resolve().parents[2] / "data" / "dpo_pairs.jsonl"
SYSTEM = "You are a helpful assistant."


def datum(tok, prompt: str, answer: str) -> types.Datum:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    p_ids = tok.encode(text, add_special_tokens=False)
    a_ids = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
    ids = p_ids + a_ids
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * (len(p_ids) - 1) + [1.0] * len(a_ids),
        },
    )


def main(max_steps: int, pairs_per_step: int, lr: float, beta: float, sft_weight: float) -> dict:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8)
    tok = training.get_tokenizer()
    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    history = []
    for step in range(max_steps):
        start = (step * pairs_per_step) % len(rows)
        batch = (rows + rows)[start : start + pairs_per_step]
        data = []
        for r in batch:  # interleaved pairs: chosen, rejected
            data += [datum(tok, r["prompt"], r[k]) for k in ("answer_zh", "answer_en")]
        ref = training.forward(data, "cross_entropy", loss_fn_config={"disable_lora": True})
        for d, out in zip(data, ref.result().loss_fn_outputs, strict=True):
            d.loss_fn_inputs["ref_logps"] = types.TensorData.from_numpy(out["logprobs"].to_numpy())
        config = {"dpo_beta": beta, "dpo_sft_weight": sft_weight}
        fb = training.forward_backward(data, "importance_sampling", loss_fn_config=config)
        opt = training.optim_step(types.AdamParams(learning_rate=lr))
        m, norm = fb.result().metrics, opt.result().metrics.get("grad_norm", float("nan"))
        history.append(
            {
                "loss": m["loss:sum"],
                "margin": m.get("dpo_margin:mean", float("nan")),
                "accuracy": m.get("dpo_accuracy:mean", float("nan")),
            }
        )
        h = history[-1]
        print(
            f"step {step + 1}/{max_steps}  loss {h['loss']:.4f}  margin {h['margin']:+.4f}  "
            f"accuracy {h['accuracy']:.2f}  grad_norm {norm:.3f}",
            file=sys.stderr,
            flush=True,
        )
    state = training.save_state("dpo-final").result().path
    service.close("success").result()  # the SDK closes asynchronously: finish before exiting
    return {
        "losses": [h["loss"] for h in history],
        "margins": [h["margin"] for h in history],
        "accuracies": [h["accuracy"] for h in history],
        "state": state,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weight", type=float, default=1.0)
    a = p.parse_args()
    print(json.dumps(main(a.max_steps, a.pairs_per_step, a.lr, a.beta, a.sft_weight)))

"""DPO with the unmodified Tinker SDK, the reference being the same model with LoRA disabled
(upstream's tinker/dpo.py).

    python cookbook/client/tinker/self_host/dpo.py [--max-steps 8] [--custom-loss server|client]

Data: cookbook/client/data/dpo_pairs.jsonl (a prompt, an emoji answer preferred over a plain one:
upstream's emoji DPO set, in miniature), in the model's chat template. Each step sends the pairs
interleaved ``[chosen_1, rejected_1, ...]`` with the loss on the answer tokens; the reference
log-probs come from ``forward(..., loss_fn_config={"disable_lora": True})`` and go back as
``ref_logps`` with ``importance_sampling`` + ``{"dpo_beta", "dpo_sft_weight"}``: upstream's Tinker
DPO convention, which the server runs as DPO.

``--custom-loss server`` writes the same DPO as a Tinker custom loss instead
(``ServiceClient.create_custom_loss``): each pair is packed into one datum (prompt, chosen answer,
prompt, rejected answer; a custom loss sees one datum at a time), the loss reads the reference
log-probs and the two answers' masks, and the server runs it in one ``forward_backward``.
``--custom-loss client`` runs that traced loss on the client instead (the SDK's own path: a
forward, the loss locally, then a cross-entropy pass with its gradient as weights).

Server: ``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``, or with nothing set the local
quick-start server. A line per step, then
one JSON line (losses, margins, accuracies, the saved state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

from twinkle_client import init_tinker_client  # noqa: E402

init_tinker_client()  # before the SDK is used

import numpy as np  # noqa: E402
import tinker  # noqa: E402
import torch.nn.functional as F  # noqa: E402
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


def packed_pair(tok, prompt: str, chosen: str, rejected: str) -> types.Datum:
    """One datum holding a pair: prompt, chosen answer, prompt, rejected answer, with masks over
    the two answers' target positions (the rejected answer sees the chosen one in its context)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    p_ids = tok.encode(text, add_special_tokens=False)
    c_ids, r_ids = (
        tok.encode(a + "<|im_end|>", add_special_tokens=False) for a in (chosen, rejected)
    )
    ids = p_ids + c_ids + p_ids + r_ids
    n = len(ids) - 1  # target position j predicts ids[j + 1]
    chosen_mask, rejected_mask = np.zeros(n, np.float32), np.zeros(n, np.float32)
    chosen_mask[len(p_ids) - 1 : len(p_ids) + len(c_ids) - 1] = 1.0
    rejected_mask[n - len(r_ids) :] = 1.0
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "chosen_mask": types.TensorData.from_numpy(chosen_mask),
            "rejected_mask": types.TensorData.from_numpy(rejected_mask),
        },
    )


def dpo_loss(beta: float):
    """DPO on one packed pair, with upstream's reduction: ``pair_weight`` = 1 / pairs,
    ``sft_scale`` = sft_weight / the batch's chosen tokens (both scalar inputs)."""

    def dpo_pair(logprobs, ref_logprobs, chosen_mask, rejected_mask, pair_weight, sft_scale):
        pol = logprobs - ref_logprobs
        margin = beta * ((pol * chosen_mask).sum() - (pol * rejected_mask).sum())
        sft = -(logprobs * chosen_mask).sum()
        loss = pair_weight * -F.logsigmoid(margin) + sft_scale * sft
        accuracy = (margin > 0).float()
        return loss, {
            "custom/dpo_margin:mean": margin.detach(),
            "custom/dpo_accuracy:mean": accuracy,
        }

    return dpo_pair


RANKS = {
    "logprobs": 1,
    "ref_logprobs": 1,
    "chosen_mask": 1,
    "rejected_mask": 1,
    "pair_weight": 0,
    "sft_scale": 0,
}


def custom_step(training, loss, tok, batch, sft_weight: float):
    """One packed-pair custom-loss step: reference log-probs, then forward_backward_custom."""
    data = [packed_pair(tok, r["prompt"], r["answer_zh"], r["answer_en"]) for r in batch]
    ref = training.forward(data, "cross_entropy", loss_fn_config={"disable_lora": True}).result()
    chosen = sum(float(d.loss_fn_inputs["chosen_mask"].to_numpy().sum()) for d in data)
    for d, out in zip(data, ref.loss_fn_outputs, strict=True):
        d.loss_fn_inputs["ref_logprobs"] = types.TensorData.from_numpy(out["logprobs"].to_numpy())
        d.loss_fn_inputs["pair_weight"] = types.TensorData.from_numpy(
            np.array(1.0 / len(data), np.float32)
        )
        d.loss_fn_inputs["sft_scale"] = types.TensorData.from_numpy(
            np.array(sft_weight / max(chosen, 1.0), np.float32)
        )
    return training.forward_backward_custom(data, loss)


def main(
    max_steps: int,
    pairs_per_step: int,
    lr: float,
    beta: float,
    sft_weight: float,
    custom_loss: str = "off",
) -> dict:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8)
    tok = training.get_tokenizer()
    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    loss = None
    if custom_loss != "off":
        loss = service.create_custom_loss(dpo_loss(beta), RANKS).result()
        if custom_loss == "server" and loss.loss_id is None:
            sys.exit("--custom-loss server: this server runs custom losses client-side only")
        if custom_loss == "client":  # the same traced loss, run by the SDK on this machine
            loss = dataclasses.replace(loss, loss_id=None)
    history = []
    for step in range(max_steps):
        start = (step * pairs_per_step) % len(rows)
        batch = (rows + rows)[start : start + pairs_per_step]
        if loss is not None:
            fb = custom_step(training, loss, tok, batch, sft_weight)
        else:
            data = []
            for r in batch:  # interleaved pairs: chosen, rejected
                data += [datum(tok, r["prompt"], r[k]) for k in ("answer_zh", "answer_en")]
            ref = training.forward(data, "cross_entropy", loss_fn_config={"disable_lora": True})
            for d, out in zip(data, ref.result().loss_fn_outputs, strict=True):
                lp = out["logprobs"].to_numpy()
                d.loss_fn_inputs["ref_logps"] = types.TensorData.from_numpy(lp)
            config = {"dpo_beta": beta, "dpo_sft_weight": sft_weight}
            fb = training.forward_backward(data, "importance_sampling", loss_fn_config=config)
        opt = training.optim_step(types.AdamParams(learning_rate=lr))
        m, norm = fb.result().metrics, opt.result().metrics.get("grad_norm", float("nan"))
        prefix = "custom/" if loss is not None else ""
        history.append(
            {
                "loss": m["loss:sum"],
                "margin": m.get(f"{prefix}dpo_margin:mean", float("nan")),
                "accuracy": m.get(f"{prefix}dpo_accuracy:mean", float("nan")),
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
        "custom_loss": custom_loss,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weight", type=float, default=1.0)
    p.add_argument(
        "--custom-loss",
        choices=("off", "server", "client"),
        default="off",
        help="write DPO as a traced custom loss, run by the server or by the SDK locally",
    )
    a = p.parse_args()
    out = main(a.max_steps, a.pairs_per_step, a.lr, a.beta, a.sft_weight, a.custom_loss)
    print(json.dumps(out))

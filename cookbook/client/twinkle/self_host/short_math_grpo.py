"""GRPO on math prompts with the native client: sample with the current policy, reward, train.

    export TWINKLE_SERVER_URL=http://127.0.0.1:8000 TWINKLE_SERVER_TOKEN=tml-...
    python cookbook/client/twinkle/self_host/short_math_grpo.py --steps 2

Each step saves the adapter for sampling (``save(..., is_sampler=True)``), samples
``--generations`` completions per prompt from it, scores them (exact final number, plus a small
brevity bonus), turns rewards into group-relative advantages, and trains GRPOLoss on each
sequence's ``new_input_feature`` (prompt + completion, completion-only labels) with the
sampler's log-probs as ``old_logps`` (upstream's short_math_grpo call). Prints one JSON line per
run. A group whose completions all score the same has zero advantages and adds no gradient
(GRPO's rule); ``--seed`` makes a run reproducible.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from twinkle_client import init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

MODEL_ID = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).with_name("math_prompts.jsonl")


def reward(text: str, truth: str | None) -> float:
    nums = re.findall(r"-?\d+", text)
    correct = 1.0 if truth is not None and nums and nums[-1] == truth else 0.0
    return correct - 0.01 * len(text)


def main(steps: int, generations: int, seed: int | None = None) -> dict:
    client = init_twinkle_client()
    prompts = Dataset(dataset_meta=DatasetMeta(str(DATA)))
    prompts.map("MathProcessor")  # {"messages", "ground_truth"}
    loader = DataLoader(dataset=prompts, batch_size=2, shuffle=True, seed=0)
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("default", {"r": 8, "target_modules": "all-linear"})
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_optimizer("AdamW", lr=1e-3)
    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, max_length=256)
    history = []
    for step in range(steps):
        batch = next(iter(loader), None) or next(iter(loader))
        policy = model.save(name=f"grpo-policy-{step}", save_optimizer=False, is_sampler=True)
        params = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "num_samples": generations}
        if seed is not None:  # reproducible runs: each step samples with its own seed
            params["seed"] = seed + step
        responses = sampler.sample(
            inputs=[{"messages": row["messages"]} for row in batch],
            sampling_params=params,
            adapter_uri=policy.twinkle_path,
        )
        features, old_logps, advantages, rewards = [], [], [], []
        for row, res in zip(batch, responses, strict=True):
            group = [reward(s.decoded or "", row["ground_truth"]) for s in res.sequences]
            mean = sum(group) / len(group)
            std = (sum((g - mean) ** 2 for g in group) / len(group)) ** 0.5 or 1.0
            for seq, g in zip(res.sequences, group, strict=True):
                features.append(seq.new_input_feature)
                old_logps.append([lp[0][1] for lp in seq.logprobs or []])
                advantages.append((g - mean) / std)
            rewards += group
        out = model.forward_backward(inputs=features, advantages=advantages, old_logps=old_logps)
        model.clip_grad_and_step()
        metrics = model.calculate_metric(is_training=True).result
        history.append(
            {"loss": out.result["loss"], "mean_reward": sum(rewards) / len(rewards), **metrics}
        )
    client.close()
    return {"steps": history}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    a = p.parse_args()
    print(json.dumps(main(a.steps, a.generations, a.seed)))

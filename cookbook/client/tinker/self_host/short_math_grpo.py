"""GRPO on short arithmetic word problems with the unmodified Tinker SDK: sample, reward, train.

    python cookbook/client/tinker/self_host/short_math_grpo.py [--max-steps 4 --reward exact]

Upstream's tinker/self_host/short_math_grpo.py (GSM8K), in miniature and on a Twinkle server,
written as the Tinker cookbook's RL loop. Data: cookbook/client/data/arithmetic.jsonl (a question,
an integer answer), asked in the model's chat template with the system prompt "Answer with a
number.". Each step takes ``--batch-size`` questions and:

1. ``save_weights_and_get_sampling_client``: a sampler of the current policy (the adapter so far);
2. samples ``--generations`` completions per question (``temperature=1.0, top_p=0.95``,
   ``--max-tokens``), with their per-token log-probs;
3. rewards each completion. ``--reward exact`` (default): 1.0 if the last integer in it equals the
   answer, else 0.0. ``--reward shaped`` adds partial credit for a near miss,
   ``0.5 / (1 + |last integer - answer|)``, and a brevity term, ``-0.01`` per character (as the
   native-client GRPO): a signal an untrained model can get, where ``exact`` is almost always 0;
4. advantages = reward - the group's mean (GRPO's group baseline). A group whose rewards are all
   equal has zero advantages and no gradient: it is skipped and reported as a "no signal" group;
5. one datum per remaining completion (prompt + completion, next-token targets) with
   ``loss_fn_inputs`` ``target_tokens``, ``logprobs`` (the sampler's, 0 on prompt positions) and
   ``advantages`` (the completion's advantage on its tokens, 0 on prompt positions), then
   ``forward_backward(datums, "importance_sampling")`` (``-sum(exp(lp - logprobs) * A)``) and
   ``optim_step``. A step where every group is "no signal" trains nothing. On-policy the ratio is
   1, so the loss value is ``-sum(A * completion length)``: ~0 when the completions are equally
   long (advantages sum to 0 per group); the gradient (``grad_norm``) is what moves the policy.

At the end it saves the training state ``arithmetic-grpo-final``. Server: ``TWINKLE_SERVER_URL`` /
``TWINKLE_SERVER_TOKEN``, or with nothing set the local quick-start server. A line per step on
stderr; one JSON line on stdout (per step: rewards, mean reward, the advantages trained, loss,
``kl_sample_train`` (sampler minus learner log-probs: ~0 on-policy), datums trained, no-signal
groups, grad norm; the final state's path). ``--seed`` fixes the data order and the sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

from twinkle_client import init_tinker_client  # noqa: E402

init_tinker_client()  # before the SDK is used: it reads the TWINKLE_* variables

import tinker  # noqa: E402
from tinker import types  # noqa: E402

BASE_MODEL = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).resolve().parents[2] / "data" / "arithmetic.jsonl"
SYSTEM = "Answer with a number."


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def reward(text: str, answer: int, kind: str) -> float:
    nums = re.findall(r"-?\d+", text)
    last = int(nums[-1]) if nums else None
    exact = 1.0 if last == answer else 0.0
    if kind == "exact":
        return exact
    near = 0.5 / (1 + abs(last - answer)) if last is not None else 0.0
    return exact + near - 0.01 * len(text)


def prompt_ids(tok, question: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], adv: float) -> types.Datum:
    """The Tinker cookbook's RL datum: input = prompt + completion minus the last token, targets
    shifted by one; the prompt's positions carry logprob 0 and advantage 0 (no loss there)."""
    n_prompt = len(prompt) - 1
    ids = prompt + tokens
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "logprobs": [0.0] * n_prompt + [float(x) for x in logprobs],
            "advantages": [0.0] * n_prompt + [float(adv)] * len(tokens),
        },
    )


def kl_sample_train(datums: list[types.Datum], outputs: list[dict], n_prompt: list[int]) -> float:
    """Mean of (sampler log-prob - learner log-prob) over the completion tokens (the Tinker
    cookbook's ``kl_sample_train``): ~0 when the sampler ran exactly the policy being trained,
    which is what makes the importance ratio ~1 on the first update."""
    diffs = []
    for d, out, start in zip(datums, outputs, n_prompt, strict=True):
        old, new = d.loss_fn_inputs["logprobs"].tolist(), out["logprobs"].tolist()
        diffs += [o - n for o, n in zip(old[start:], new[start:], strict=True)]
    return sum(diffs) / max(len(diffs), 1)


def main(
    max_steps: int,
    batch_size: int,
    generations: int,
    max_tokens: int,
    lr: float,
    seed: int | None,
    kind: str,
) -> dict:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
    tok = training.get_tokenizer()  # fetched from the server
    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    random.Random(seed).shuffle(rows)
    history = []
    for step in range(max_steps):
        batch = [rows[(step * batch_size + i) % len(rows)] for i in range(batch_size)]
        sampler = training.save_weights_and_get_sampling_client(f"arithmetic-grpo-{step}").result()
        prompts = [prompt_ids(tok, r["question"]) for r in batch]
        futures = []
        for i, p in enumerate(prompts):  # all groups in flight at once
            params = types.SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0,
                top_p=0.95,
                seed=None if seed is None else seed + step * batch_size + i,
            )
            futures.append(sampler.sample(types.ModelInput.from_ints(p), generations, params))
        datums, advantages, starts, rewards, no_signal, example = [], [], [], [], 0, ""
        for row, p, fut in zip(batch, prompts, futures, strict=True):
            seqs = fut.result().sequences
            texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in seqs]
            group = [reward(t, row["answer"], kind) for t in texts]
            rewards += group
            example = example or texts[0]
            mean = sum(group) / len(group)
            if max(group) - min(group) < 1e-9:  # all equal: zero advantages, nothing to learn
                no_signal += 1
                continue
            for s, g in zip(seqs, group, strict=True):
                datums.append(datum(p, list(s.tokens), list(s.logprobs), g - mean))
                advantages.append(g - mean)
                starts.append(len(p) - 1)  # where the completion's positions begin
        entry = {
            "step": step + 1,
            "rewards": rewards,
            "mean_reward": sum(rewards) / len(rewards),
            "no_signal_groups": no_signal,
            "trained_datums": len(datums),
            "advantages": advantages,
            "loss": None,
            "kl_sample_train": None,
            "grad_norm": None,
        }
        if datums:
            fb = training.forward_backward(datums, "importance_sampling")
            opt = training.optim_step(types.AdamParams(learning_rate=lr))
            out = fb.result()
            entry["loss"] = out.metrics["loss:sum"]
            entry["kl_sample_train"] = kl_sample_train(datums, out.loss_fn_outputs, starts)
            entry["grad_norm"] = (opt.result().metrics or {}).get("grad_norm")
        history.append(entry)
        loss = "-" if entry["loss"] is None else f"{entry['loss']:.4g}"
        log(
            f"step {step + 1}/{max_steps}  mean reward {entry['mean_reward']:.3f}  loss {loss}  "
            f"datums {len(datums)}  no-signal groups {no_signal}/{len(batch)}  "
            f"sample {example[:40]!r}"
        )
    state = training.save_state("arithmetic-grpo-final").result().path
    service.close("success").result()  # the SDK closes asynchronously: finish before exiting
    return {"reward": kind, "steps": history, "state": state}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2, help="questions per step")
    p.add_argument("--generations", type=int, default=4, help="completions per question")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=None, help="data order and sampling seed")
    p.add_argument("--reward", choices=("exact", "shaped"), default="exact")
    a = p.parse_args()
    args = (a.max_steps, a.batch_size, a.generations, a.max_tokens, a.lr, a.seed, a.reward)
    print(json.dumps(main(*args)))

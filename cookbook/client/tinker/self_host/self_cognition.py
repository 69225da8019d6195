"""Self-cognition SFT with the unmodified Tinker SDK, then sampling from the trained adapter.

    python cookbook/client/server/megatron/server.py          # terminal 1 (or transformer/)
    python cookbook/client/tinker/self_host/self_cognition.py  # terminal 2, same directory

Upstream's tinker/self_cognition.py, on a Twinkle server: `init_tinker_client()` points
`tinker.ServiceClient()` at the server (``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``, or with
nothing set the local quick-start server) and fetches the tokenizer from it (no model hub). Data:
self_cognition.jsonl from the twinkle/self_host folder with the placeholders filled, in the
model's chat template, loss on the answer only. Asks the base model "Who are you?" (greedy),
trains ``--max-steps`` steps (a line per step with loss and ETA), saves the state and sampler
weights, then asks the trained adapter the same (greedy, and two samples). Prints one JSON line at
the end (losses, checkpoint path, the answers before and after, samples). ``TWINKLE_MODEL_ID``
picks the served model (a real one: ``bash scripts/demo.sh --model smollm2-135m-instruct``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

from twinkle_client import init_tinker_client  # noqa: E402

init_tinker_client()  # before the SDK is used: it reads the TWINKLE_* variables

import tinker  # noqa: E402
from tinker import types  # noqa: E402

BASE_MODEL = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")
DATA = Path(__file__).resolve().parents[2] / "twinkle" / "self_host" / "self_cognition.jsonl"
NAME, AUTHOR = "Twinkle", "the Twinkle team"


def rows() -> list[tuple[str, str]]:
    out = []
    for line in DATA.read_text().splitlines():
        r = json.loads(line)
        fill = {"{{NAME}}": NAME, "{{AUTHOR}}": AUTHOR}
        q, a = r["query"], r["response"]
        for k, v in fill.items():
            q, a = q.replace(k, v), a.replace(k, v)
        out.append((q, a))
    return out


def prompt_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(text, add_special_tokens=False)


def datum(tok, question: str, answer: str) -> types.Datum:
    p_ids = prompt_ids(tok, question)
    a_ids = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
    ids = p_ids + a_ids
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * (len(p_ids) - 1) + [1.0] * len(a_ids),
        },
    )


def resolved(client):
    """tinker 0.38 hands out clients as futures (using one directly is deprecated: a warning on
    every call); older SDKs hand out the client itself."""
    return client.result() if hasattr(client, "result") else client


def ask(sampler, tok, question: str) -> str:
    """The greedy answer to ``question`` (up to 32 tokens)."""
    res = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt_ids(tok, question)),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=32, temperature=0.0),
    ).result()
    return tok.decode(res.sequences[0].tokens, skip_special_tokens=True).strip()


def main(max_steps: int, batch_size: int, lr: float) -> dict:
    service = tinker.ServiceClient()
    training = resolved(service.create_lora_training_client(base_model=BASE_MODEL, rank=16))
    tok = training.get_tokenizer()  # fetched from the server
    base = resolved(service.create_sampling_client(base_model=BASE_MODEL))
    before = ask(base, tok, "Who are you?")
    print(f"before training, {BASE_MODEL} answers 'Who are you?': {before!r}", file=sys.stderr)
    data = [datum(tok, q, a) for q, a in rows()]
    losses = []
    t0 = time.monotonic()
    for step in range(max_steps):
        start = (step * batch_size) % len(data)
        batch = (data + data)[start : start + batch_size]
        fb = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=lr))
        out, metrics = fb.result(), opt.result().metrics
        n = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        losses.append(out.metrics["loss:sum"] / n)
        eta = (time.monotonic() - t0) / (step + 1) * (max_steps - step - 1)
        print(
            f"step {step + 1}/{max_steps}  loss/token {losses[-1]:.4f}  "
            f"grad_norm {metrics.get('grad_norm', float('nan')):.3f}  eta {eta:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    state = training.save_state("self-cognition").result().path
    sampler_path = training.save_weights_for_sampler("self-cognition").result().path
    sampler = resolved(service.create_sampling_client(model_path=sampler_path))
    res = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt_ids(tok, "Who are you?")),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=24, temperature=0.2, seed=0),
    ).result()
    samples = [tok.decode(s.tokens, skip_special_tokens=True) for s in res.sequences]
    after = ask(sampler, tok, "Who are you?")
    print(f"after training, the adapter answers 'Who are you?': {after!r}", file=sys.stderr)
    service.close("success").result()  # the SDK closes asynchronously: finish before exiting
    return {
        "model": BASE_MODEL,
        "losses": losses,
        "state": state,
        "sampler_path": sampler_path,
        "before": before,
        "after": after,
        "samples": samples,
        "train_seconds": round(time.monotonic() - t0, 1),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    a = p.parse_args()
    print(json.dumps(main(a.max_steps, a.batch_size, a.lr)))

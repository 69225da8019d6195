"""LoRA SFT with the unmodified Tinker SDK: list runs, train, save each epoch, resume, publish.

    python cookbook/client/tinker/self_host/lora.py [--epochs 2 --max-steps 5]
    python cookbook/client/tinker/self_host/lora.py --resume-latest   # continue the newest state

Upstream's tinker/self_host/lora.py (the Pig-Latin toy), on a Twinkle server. It prints the
server's models (``get_server_capabilities``) and your training runs with their checkpoints
(``RestClient.list_training_runs`` / ``list_checkpoints``), then trains a LoRA adapter on
cookbook/client/data/pig_latin.jsonl (English in, Pig Latin out, in the model's chat template,
loss on the answer only): ``--epochs`` epochs of ``--max-steps`` steps, each step one
``forward_backward(..., "cross_entropy")`` on the whole set plus an ``optim_step``. After each epoch
it saves the training state (weights + optimizer) as ``pig-latin-lora-step-<global step>``; the
step in the name is how a resumed run knows where it is. ``--resume PATH`` (``tinker://`` or
``twinkle://``) or ``--resume-latest`` (your newest such state, found with the same listing)
continues it with ``create_training_client_from_state_with_optimizer``: the step count goes on
from the name, and the Adam moments and step counter come back from the state (the server's
``step`` optim metric, reported as ``optimizer_steps``, confirms it). Finally it publishes the
last state (``publish_checkpoint_from_tinker_path``: on Twinkle that makes the checkpoint public,
readable by every user of the server; upstream pushes to ModelScope), unless ``--no-publish``.

Server: ``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``, or with nothing set the local
quick-start server. A line per step and the listing go to stderr; one JSON line to stdout
(losses, start/final step, the saved states, the published path, models, runs listed).
"""

from __future__ import annotations

import argparse
import json
import os
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
DATA = Path(__file__).resolve().parents[2] / "data" / "pig_latin.jsonl"
STATE_PREFIX = "pig-latin-lora-step-"
STATE_RE = re.compile(re.escape(STATE_PREFIX) + r"(\d+)$")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step_of(path: str) -> int | None:
    """The global step in a state's name (``.../weights/pig-latin-lora-step-12`` → 12)."""
    m = STATE_RE.search(path)
    return int(m.group(1)) if m else None


def list_runs(rest) -> tuple[int, str | None]:
    """Print your runs and their checkpoints (upstream's listing); (runs listed, the newest
    ``pig-latin-lora-step-*`` training state's path or None)."""
    runs = rest.list_training_runs(limit=50).result().training_runs
    log(f"found {len(runs)} training runs")
    newest = None
    for run in runs:
        log(f"- {run.training_run_id}  base {run.base_model}  rank {run.lora_rank}")
        for c in rest.list_checkpoints(run.training_run_id).result().checkpoints:
            log(f"    {c.checkpoint_type:<8} {c.tinker_path}  public={c.public}")
            ours = c.checkpoint_type == "training" and step_of(c.checkpoint_id) is not None
            if ours and (newest is None or c.time > newest.time):
                newest = c
    return len(runs), newest.tinker_path if newest else None


def datum(tok, english: str, pig_latin: str) -> types.Datum:
    msgs = [{"role": "user", "content": f"Translate to Pig Latin: {english}"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    p_ids = tok.encode(text, add_special_tokens=False)
    a_ids = tok.encode(pig_latin + "<|im_end|>", add_special_tokens=False)
    ids = p_ids + a_ids
    return types.Datum(  # next-token targets; the loss counts the answer tokens only
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * (len(p_ids) - 1) + [1.0] * len(a_ids),
        },
    )


def main(
    epochs: int,
    max_steps: int,
    lr: float,
    resume: str | None,
    resume_latest: bool,
    publish: bool,
) -> dict:
    service = tinker.ServiceClient()
    rest = tinker.RestClient()  # upstream's service.create_rest_client(), deprecated in the SDK
    models = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
    log("available models: " + ", ".join(models))
    runs_listed, latest = list_runs(rest)
    if resume_latest and resume is None:
        if latest is None:
            raise SystemExit(f"--resume-latest: no {STATE_PREFIX}* state found; train first")
        resume = latest
    if resume:
        start_step = step_of(resume)
        if start_step is None:  # a state saved by something else: its step count is unknown
            log(f"{resume}: no {STATE_PREFIX}<n> in the name, counting steps from 0")
            start_step = 0
        log(f"resuming from {resume} at step {start_step}")
        training = service.create_training_client_from_state_with_optimizer(resume).result()
    else:
        start_step = 0
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
    tok = training.get_tokenizer()  # fetched from the server
    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    data = [datum(tok, r["input"], r["output"]) for r in rows]
    n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    step, losses, optimizer_steps, states = start_step, [], [], []
    for epoch in range(epochs):
        for _ in range(max_steps):
            fb = training.forward_backward(data, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=lr))
            out, metrics = fb.result(), opt.result().metrics or {}
            step += 1
            losses.append(out.metrics["loss:sum"] / n_tokens)
            if "step" in metrics:  # the server's optimizer step counter, restored on resume
                optimizer_steps.append(int(metrics["step"]))
            log(
                f"epoch {epoch + 1}/{epochs}  step {step}  loss/token {losses[-1]:.4f}  "
                f"grad_norm {metrics.get('grad_norm', float('nan')):.3f}"
            )
        states.append(training.save_state(f"{STATE_PREFIX}{step}").result().path)
        log(f"saved {states[-1]}")
    published = None
    if publish and states:
        rest.publish_checkpoint_from_tinker_path(states[-1]).result()
        published = states[-1]
        log(f"published {published}")
    service.close("success").result()  # the SDK closes asynchronously: finish before exiting
    return {
        "losses": losses,
        "start_step": start_step,
        "final_step": step,
        "optimizer_steps": optimizer_steps,
        "resumed_from": resume,
        "states": states,
        "published": published,
        "supported_models": models,
        "runs_listed": runs_listed,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=5, help="steps per epoch")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--resume", metavar="PATH", help="a tinker:// or twinkle:// training state")
    p.add_argument(
        "--resume-latest", action="store_true", help=f"resume your newest {STATE_PREFIX}* state"
    )
    p.add_argument("--no-publish", action="store_true", help="do not publish the last state")
    a = p.parse_args()
    result = main(a.epochs, a.max_steps, a.lr, a.resume, a.resume_latest, not a.no_publish)
    print(json.dumps(result))

"""Sample from a saved adapter with the native client (upstream's twinkle/sample.py).

    python cookbook/client/twinkle/self_host/self_cognition.py   # trains and saves an adapter
    python cookbook/client/twinkle/self_host/sample.py [--adapter twinkle://...]

Without ``--adapter`` it takes your newest checkpoint on this base model (``list_training_runs``
/ ``list_checkpoints``); with none it samples the base model and says so. Prompts are chat
trajectories, encoded on the server with the model's template; ``--prompts`` x ``--samples``
completions come back decoded. Server: ``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``, or with
nothing set the local quick-start server. Prints the completions, then one JSON line.
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

from twinkle_client import init_twinkle_client  # noqa: E402
from twinkle_client.sampler import vLLMSampler  # noqa: E402

MODEL_ID = os.environ.get("TWINKLE_MODEL_ID", "twinkle/tiny-chat")


def newest_checkpoint(client) -> str | None:
    """The caller's most recent checkpoint of ``MODEL_ID``'s runs, or None."""
    found = []
    for run in client.list_training_runs(limit=100):
        if run.base_model not in (None, MODEL_ID):
            continue
        found += client.list_checkpoints(run.training_run_id)
    found.sort(key=lambda c: c.time)
    return found[-1].twinkle_path if found else None


def main(adapter: str | None, prompts: int, samples: int, max_tokens: int) -> dict:
    client = init_twinkle_client()
    adapter = adapter or newest_checkpoint(client)
    print(f"sampling {adapter or f'the base model {MODEL_ID} (no checkpoint found)'}", flush=True)
    sampler = vLLMSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, max_length=256)
    trajectory = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who are you?"},
        ]
    }
    params = {"max_tokens": max_tokens, "temperature": 1.0, "num_samples": samples, "seed": 0}
    responses = sampler.sample(
        inputs=[trajectory] * prompts, sampling_params=params, adapter_uri=adapter
    )
    texts = []
    for p, res in enumerate(responses):
        for i, seq in enumerate(res.sequences):
            texts.append(seq.decoded or "")
            print(f"prompt {p} sample {i}: {texts[-1]!r} ({seq.stop_reason})", flush=True)
    client.close()
    return {"adapter": adapter, "samples": texts}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", help="twinkle:// checkpoint (default: your newest)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    print(json.dumps(main(a.adapter, a.prompts, a.samples, a.max_tokens)))

"""Sample from saved sampler weights with the unmodified Tinker SDK (upstream's tinker/sample.py).

    python cookbook/client/tinker/self_host/self_cognition.py   # trains, saves sampler weights
    python cookbook/client/tinker/self_host/sample.py [--model-path tinker://...]

Without ``--model-path`` it takes your newest sampler checkpoint (``RestClient
.list_user_checkpoints``); ``twinkle://`` paths work too. The prompt is a chat in the model's
template (the tokenizer comes from the server); it prints ``--samples`` completions with their
mean token log-prob, then one JSON line. Server: ``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``,
or with nothing set the local quick-start server.
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


def newest_sampler_path() -> str | None:
    listing = tinker.RestClient().list_user_checkpoints(limit=1000).result()
    found = [c for c in listing.checkpoints if c.checkpoint_type == "sampler"]
    found.sort(key=lambda c: c.time)
    return found[-1].tinker_path if found else None


def main(model_path: str | None, samples: int, max_tokens: int) -> dict:
    service = tinker.ServiceClient()
    model_path = model_path or newest_sampler_path()
    if model_path is None:
        raise SystemExit("no sampler checkpoint found: run self_cognition.py first, or pass one")
    print(f"sampling {model_path}", flush=True)
    sampler = service.create_sampling_client(model_path=model_path, base_model=BASE_MODEL)
    tok = sampler.get_tokenizer()
    messages = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Who are you?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = types.ModelInput.from_ints(tok.encode(text, add_special_tokens=False))
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=0)
    result = sampler.sample(prompt=prompt, sampling_params=params, num_samples=samples).result()
    out = []
    for i, seq in enumerate(result.sequences):
        reply = tok.decode(seq.tokens, skip_special_tokens=True)
        mean_lp = sum(seq.logprobs or [0.0]) / max(len(seq.logprobs or []), 1)
        print(f"{i}: {reply!r}  (mean logprob {mean_lp:.3f})", flush=True)
        out.append(reply)
    service.close("success").result()  # the SDK closes asynchronously: finish before exiting
    return {"model_path": model_path, "samples": out}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="tinker:// or twinkle:// sampler weights (default: newest)")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    print(json.dumps(main(a.model_path, a.samples, a.max_tokens)))

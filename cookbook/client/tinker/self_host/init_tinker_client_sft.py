"""Existing Tinker SDK code on a Twinkle server, with nothing but two environment variables.

    export TWINKLE_SERVER_URL=http://127.0.0.1:8000 TWINKLE_SERVER_TOKEN=tml-...
    python cookbook/client/tinker/self_host/init_tinker_client_sft.py

`init_tinker_client()` (from twinkle_client) points `tinker.ServiceClient()` at the server, lets
the SDK take `twinkle://` paths, and makes `get_tokenizer()` download the tokenizer from the
server (no model hub). Below it, the SFT loop is plain Tinker code. Prints one JSON line.
"""

from __future__ import annotations

import json

from twinkle_client import init_tinker_client

init_tinker_client()  # before the SDK is used: it reads the TWINKLE_* variables

import tinker  # noqa: E402
from tinker import types  # noqa: E402

BASE_MODEL = "twinkle/tiny-chat"


def datum(tok, question: str, answer: str) -> types.Datum:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    p_ids, a_ids = tok.encode(prompt), tok.encode(answer + "<|im_end|>")
    ids = p_ids + a_ids
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * (len(p_ids) - 1) + [1.0] * len(a_ids),
        },
    )


def main(steps: int = 6) -> dict:
    service = tinker.ServiceClient()  # base URL and key come from the TWINKLE_* variables
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
    tok = training.get_tokenizer()  # fetched from the Twinkle server
    data = [
        datum(tok, "What is the capital of France?", "Paris."),
        datum(tok, "What is 2 plus 2?", "4."),
    ]
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    path = training.save_weights_for_sampler("init-tinker-client").result().path
    twinkle_path = "twinkle://" + path.removeprefix("tinker://")
    sampler = service.create_sampling_client(model_path=twinkle_path).result()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 2?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = sampler.sample(
        prompt=types.ModelInput.from_ints(tok.encode(prompt)),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0),
    ).result()
    return {
        "losses": losses,
        "path": twinkle_path,
        "sample": tok.decode(out.sequences[0].tokens),
        "tokenizer_dir": str(tok.name_or_path),
    }


if __name__ == "__main__":
    print(json.dumps(main()))

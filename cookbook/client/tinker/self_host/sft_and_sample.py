"""SFT a LoRA on a self-hosted Twinkle server with the unmodified Tinker SDK, then sample from it.

Plain Tinker code: only `base_url` and the `tml-` key point at our server.

    TWINKLE_SERVER_URL=http://127.0.0.1:8000 TWINKLE_SERVER_TOKEN=tml-... \
        python sft_and_sample.py --tokenizer-dir .twinkle/models/tiny-chat --steps 60
"""

from __future__ import annotations

import argparse
import os
import time

import tinker
from tinker import types
from transformers import AutoTokenizer

BASE_MODEL = "twinkle/tiny-chat"


def build_datum(tok, question: str, answer: str) -> types.Datum:
    """ChatML prompt + answer; the loss is on the answer tokens only (weights 0 on the prompt)."""
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    p_ids = tok.encode(prompt)
    a_ids = tok.encode(answer + "<|im_end|>")
    ids = p_ids + a_ids
    weights = [0.0] * (len(p_ids) - 1) + [1.0] * len(a_ids)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--base-url", default=os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    )
    ap.add_argument("--api-key", default=os.environ.get("TWINKLE_SERVER_TOKEN"))
    ap.add_argument("--tokenizer-dir", required=True, help="folder of the base model's tokenizer")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-3)
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    data = [build_datum(tok, f"what is {i} plus {i + 1}?", f"{2 * i + 1}.") for i in range(8)]
    n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)

    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    training = service.create_lora_training_client(
        base_model=BASE_MODEL, rank=args.rank, seed=0
    ).result()
    print(f"training run {training.model_id} on {BASE_MODEL}, LoRA rank {args.rank}")
    t0 = time.monotonic()
    for step in range(args.steps):
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=args.lr))
        loss = fb.result().metrics["loss:sum"] / n_tokens
        opt.result()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss/token {loss:.4f}  ({time.monotonic() - t0:.1f}s)")

    state = training.save_state("final").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    print(f"saved {state}")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "what is 3 plus 4?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    result = sampler.sample(
        types.ModelInput.from_ints(tok.encode(prompt)),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=12, temperature=0.0, stop=["<|im_end|>"]),
    ).result()
    for i, seq in enumerate(result.sequences):
        print(f"sample {i}: {tok.decode(seq.tokens)!r}  (stop: {seq.stop_reason})")
    service.close("success").result()  # the SDK closes asynchronously: finish before exiting


if __name__ == "__main__":
    main()
